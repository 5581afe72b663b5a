"""The reference engine: continuous batching over the unified pool."""

from unikv.engine.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in the allocator, kernels and transformers: import it lazily.
    if name == "LLM":
        from unikv.engine import llm

        return llm.LLM
    if name == "EngineConfig":
        from unikv.engine import config

        return config.EngineConfig
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from unikv.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
