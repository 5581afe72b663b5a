"""What ``LLM.generate`` returns, shaped as vLLM's outputs.

``RequestOutput.outputs[i]`` is completion i of a prompt (``SamplingParams.n``
of them); the older flat fields (``output_ids``, ``text``, ``finish_reason``,
``num_preemptions``) read completion 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the model's raw distribution; ``rank`` 1 is
    the most likely token; ``decoded_token`` its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion: its token ids, text (None without a tokenizer), why it
    ended ("stop", "length" or "abort"), the stop string or stop id that ended it,
    and per token ``{token id: Logprob}`` (the sampled token and the top k) when
    ``SamplingParams.logprobs`` asked for them."""

    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one prompt: its token ids (and text, if it was given as
    text), its ``n`` completions, ``num_cached_tokens``: prompt tokens the
    prefix cache served to completion 0 (0 with prefix caching off), and
    ``prompt_logprobs`` when ``SamplingParams.prompt_logprobs`` asked: None for the
    first prompt token, then {token id: Logprob} (the token and the top k) each."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    # today's flat fields: completion 0
    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt_token_ids

    @property
    def output_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def num_preemptions(self) -> int:
        return self.outputs[0].num_preemptions
