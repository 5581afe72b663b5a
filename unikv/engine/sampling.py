"""Sampling parameters and the batched sampler.

Every request carries its own temperature, top-k, top-p and seed; one batched
call samples all rows with no Python loop over requests and no host sync.

Randomness is counter-based: the noise of vocabulary entry ``v`` at output
step ``n`` of a request with seed ``s`` is a hash of ``(s, n, v)``, turned
into Gumbel noise, and the sample is ``argmax(logits / T + gumbel)`` over the
allowed entries (the Gumbel-max trick: the argmax is distributed as
``softmax(logits / T)`` restricted to the top-k / top-p set). So a request's
tokens depend only on its own seed and logits, never on which other requests
share its batch or on preemption and recompute.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

MASK32 = 0xFFFFFFFF
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds (vLLM bounds them the same way)
MAX_INT_PARAM = 2**31 - 1  # top_k, max_tokens, min_tokens at most (int32 in any kernel)
_MIN_TEMPERATURE = 0.01  # vLLM's _MAX_TEMP floor for a positive temperature


def _check_range(name: str, value, low: float, high: float, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"{name} must be a number in [{low}, {high}] ({hint}), got {value!r}")


def _int_tuple(name: str, values) -> tuple[int, ...]:
    """``values`` (an iterable of ints) as a tuple; a clear error for anything else."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a list of int token ids, got {values!r}")
    values = tuple(values)
    bad = [
        v
        for v in values
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_INT_PARAM
    ]
    if bad:
        raise ValueError(
            f"{name} must hold int token ids in [0, {MAX_INT_PARAM}], got {bad[:4]} in {values!r:.200}"
        )
    return values


def _str_tuple(stop) -> tuple[str, ...]:
    stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    bad = [s for s in stop if not isinstance(s, str) or not s]
    if bad:
        raise ValueError(f"stop must be a non-empty str or a list of them, got {bad[:4]}")
    return stop


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request (vLLM's names and defaults: the default
    temperature is 1.0, i.e. sampling, as in vLLM and the OpenAI API; pass
    ``temperature=0`` for greedy decoding).

    n: completions of the prompt (n requests sharing it; seeds derived from ``seed``).
    temperature: 0 = greedy (argmax); > 0 scales the logits (default 1.0). A
        temperature in (0, 0.01) is raised to 0.01, as vLLM does (smaller ones
        overflow the scaled logits).
    top_k: 0 or -1 = off (vLLM's -1 is stored as 0); k keeps the k most likely tokens.
    top_p: 1.0 = off; p keeps the smallest set of most likely tokens whose
        probability reaches p.
    min_p: 0 = off; keeps tokens whose probability is >= min_p * the top one's.
    max_tokens: new tokens to generate at most (<= 2**31 - 1); None = up to the
        context's end.
    min_tokens: EOS and stop ids cannot end generation before this many tokens
        (they are masked out of the logits), nor can stop strings.
    seed: None = drawn from the engine's generator; an int in int64's range
        ([-2**63, 2**63 - 1], as vLLM) makes the request reproducible on its own.
    stop: strings that end generation; the text is cut before the first one
        (kept with ``include_stop_str_in_output``). The tokens are kept up to the
        one that completed it.
    stop_token_ids: generation stops after emitting one of these (it is kept
        in the output ids). The model's EOS ids are added unless ``ignore_eos``.
    logprobs: None = off; k returns the sampled token's log-probability and the
        k most likely tokens' (of the model's raw distribution), per token.
    prompt_logprobs: None = off; k returns each prompt token's log-probability
        given the tokens before it, and the k most likely tokens' there (the first
        prompt token has none). Such a request takes no prefix-cache hit: every
        prompt row is computed.
    structured: None, or a ``structured.StructuredOutputs`` (``compile_structured``:
        a JSON schema, any JSON object, a regex, a grammar or a choice) that the
        tokens must follow.
    presence_penalty, frequency_penalty: in [-2, 2], subtracted from the logits
        of tokens already generated (once / per occurrence).
    repetition_penalty: > 0, 1 = off; divides positive (multiplies negative)
        logits of tokens in the prompt or the output.
    skip_special_tokens: the text leaves special tokens out (the ids keep them).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] | str | None = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1 (completions per prompt), got {self.n!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 <= t < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if 0 < t < _MIN_TEMPERATURE:  # vLLM's floor: smaller ones overflow logits / T
            object.__setattr__(self, "temperature", _MIN_TEMPERATURE)
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or not -1 <= k <= MAX_INT_PARAM:
            raise ValueError(
                f"top_k must be an int in [-1, {MAX_INT_PARAM}] (0 or -1 = off), got {k!r}"
            )
        object.__setattr__(self, "top_k", max(k, 0))
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1 = off), got {p!r}")
        _check_range("min_p", self.min_p, 0.0, 1.0, "0 = off")
        self._check_lengths()
        seed = self.seed
        if seed is not None and (
            isinstance(seed, bool)
            or not isinstance(seed, int)
            or not INT64_MIN <= seed <= INT64_MAX
        ):
            raise ValueError(
                f"seed must be None or an int in [-2**63, 2**63 - 1] (int64), got {seed!r}"
            )
        object.__setattr__(self, "stop", _str_tuple(self.stop))
        object.__setattr__(
            self, "stop_token_ids", _int_tuple("stop_token_ids", self.stop_token_ids)
        )
        lp = self.logprobs
        if lp is not None and (
            isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 20
        ):
            raise ValueError(f"logprobs must be None or an int in [0, 20], got {lp!r}")
        plp = self.prompt_logprobs
        if plp is not None and (
            isinstance(plp, bool) or not isinstance(plp, int) or not 0 <= plp <= 20
        ):
            raise ValueError(f"prompt_logprobs must be None or an int in [0, 20], got {plp!r}")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "0 = off")
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "0 = off")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not 0 < rp < float("inf"):
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = off), got {rp!r}")

    def _check_lengths(self) -> None:
        mt = self.max_tokens
        if mt is not None and (
            isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt <= MAX_INT_PARAM
        ):
            raise ValueError(
                f"max_tokens must be None or an int in [1, {MAX_INT_PARAM}], got {mt!r}"
            )
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 0 or (mt is not None and m > mt):
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={mt}], got {m!r}")

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else to apply: the sampler is one argmax."""
        return (
            self.temperature == 0
            and not self.has_penalties
            and self.logprobs is None
            and self.prompt_logprobs is None
            and self.structured is None
            and self.min_tokens == 0
        )


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) int64, without int64 overflow."""
    lo = (x & 0xFFFF) * c
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (Wellons' lowbias32) of int64 values in [0, 2**32)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise (B, vocab) fp32, a pure function of (seed, step, token).

    seeds: (B,) int64 (any value; folded to 32 bits twice); steps: (B,) int64."""
    s = hash32(hash32(seeds & MASK32) ^ ((seeds >> 32) & MASK32))
    row = hash32(s ^ hash32(steps & MASK32))  # (B,)
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = hash32(row[:, None] ^ hash32(vocab + 0x9E3779B9)[None, :])  # (B, V)
    u = (bits.double() + 0.5) / 2.0**32  # uniform in (0, 1)
    return (-torch.log(-torch.log(u))).float()


def _allowed(
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, V) bool: tokens inside each row's top-k, top-p and min-p set (never empty)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    if min_p is not None:  # p >= min_p * p_max  <=>  logit >= max logit + log(min_p)
        floor = sorted_logits[:, :1] + torch.log(min_p)[:, None]
        keep &= sorted_logits >= floor
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability of the strictly better tokens
    keep &= (before < top_p[:, None]) | (rank == 0)
    return torch.zeros_like(keep).scatter(1, order, keep)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token of every row.

    logits: (B, V) fp32 (after any penalties or masks); temperature/top_p/min_p:
    (B,) fp32 (temperature 0 = greedy, min_p 0 = off); top_k: (B,) int64 (0 =
    off); seeds/steps: (B,) int64 (step = tokens already generated by the
    request). Returns (B,) int64 token ids.
    """
    greedy = logits.argmax(dim=-1)
    safe_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / safe_t[:, None]
    allowed = _allowed(scaled, top_k, top_p, min_p)
    noisy = (scaled + gumbel_noise(seeds, steps, logits.shape[-1])).masked_fill(
        ~allowed, float("-inf")
    )
    return torch.where(temperature > 0, noisy.argmax(dim=-1), greedy)
