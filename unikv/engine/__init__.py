"""The reference engine: continuous batching over the unified pool."""

from unikv.engine.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in the allocator, kernels and transformers: import it lazily.
    if name in ("LLM", "RequestOutput"):
        from unikv.engine import llm

        return getattr(llm, name)
    raise AttributeError(name)
