"""``LLM(speculative_config={...})`` / ``unikv serve --speculative-config '<json>'``.

vLLM's keys: ``method`` ("ngram", "draft_model", "mtp", "eagle3"),
``num_speculative_tokens`` (k), ``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram:
the n-gram sizes tried, longest first; one given sets the other, none gives 5 and 5
as vLLM does), ``model`` (draft_model / eagle3: a checkpoint path) and
``disable_by_batch_size`` (a step with more decoding requests than this does not
speculate; default 32 here, vLLM's default is off; also ``EngineConfig``'s
``speculative_disable_by_batch_size``, ``--speculative-disable-by-batch-size``).
unikv adds ``force_accept`` (benchmarks only: every draft is accepted, so the
outputs are NOT the model's; it measures the verify step at full acceptance) and
``pipeline`` (default false: plan each verify step while the last one runs,
betting on full acceptance, where ``ahead.py`` allows it; outputs unchanged). It is
refused everywhere (``LLM``, ``EngineConfig``, ``unikv serve``) except inside
``allow_forced_acceptance()``, which only benchmarks and GPU speed tests enter.

Built today: ``ngram``, ``draft_model`` (a full-attention draft of the same
vocabulary, its K/V in sub-pools of the same pool: ``draft.py``), ``mtp``
(the checkpoint's own MTP layer: DeepSeek-V3, MiMo-V2-Flash, Qwen3.5 dense and
MoE, Qwen3-Next) and ``eagle3`` (an
EAGLE-3 head from ``model``), the last two through ``mtp.py``; for attention and
recurrent models alike (Mamba-2 / Gated DeltaNet / KDA / short-conv layers: each
request holds k per-draft-position state slots, ``draft_state_slots``). Refused:
tensor parallelism.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "mtp", "eagle3")
BUILT = METHODS
KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "disable_by_batch_size",
    "force_accept",
    "pipeline",
)
MAX_SPECULATIVE_TOKENS = 64
DEFAULT_DISABLE_BY_BATCH_SIZE = 32
_FORCED_ACCEPTANCE = contextvars.ContextVar("unikv_forced_acceptance", default=False)


@contextlib.contextmanager
def allow_forced_acceptance():
    """Within this block (benchmarks only), ``force_accept: true`` is taken: engines
    built here accept every draft, so their tokens are NOT the model's."""
    token = _FORCED_ACCEPTANCE.set(True)
    try:
        yield
    finally:
        _FORCED_ACCEPTANCE.reset(token)


def _check_forced(config: SpeculativeConfig) -> SpeculativeConfig:
    if config.force_accept and not _FORCED_ACCEPTANCE.get():
        raise ValueError(
            "speculative_config['force_accept'] is a benchmark-only mode (every draft is "
            "accepted, so the outputs are not the model's); LLM, EngineConfig and `unikv "
            "serve` refuse it: drop the key (benchmarks build their engines inside "
            "unikv.engine.speculative.config.allow_forced_acceptance())"
        )
    return config


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative config (see the module docstring)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    force_accept: bool = False
    pipeline: bool = False


def _positive_int(key: str, value, hint: str, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config[{key!r}] must be an int >= 1 ({hint}), got {value!r}")
    if high is not None and value > high:
        raise ValueError(
            f"speculative_config[{key!r}] must be at most {high} ({hint}), got {value}"
        )
    return value


def speculative_config_of(value) -> SpeculativeConfig | None:
    """``value`` (None, a dict of vLLM's keys, its JSON text, or a SpeculativeConfig)
    validated; ValueError naming the key, what it got and what it takes."""
    if value is None:
        return value
    if isinstance(value, SpeculativeConfig):
        return _check_forced(value)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"speculative_config must be a JSON object, e.g. "
                f'\'{{"method": "ngram", "num_speculative_tokens": 3}}\'; got {value!r:.80} ({err})'
            ) from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict (vLLM's keys), got {value!r:.80}")  # noqa: TRY004
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown}; the keys are {list(KEYS)}")
    model = value.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"speculative_config['model'] must be a checkpoint path, got {model!r}")
    method = value.get("method", "draft_model" if model is not None else None)
    if method not in METHODS:
        raise ValueError(
            f"speculative_config['method'] must be one of {list(METHODS)}, got {method!r}"
        )
    if method in ("draft_model", "eagle3") and model is None:
        what = (
            "a small model of the same vocabulary" if method == "draft_model" else "an EAGLE-3 head"
        )
        raise ValueError(
            f"speculative_config: method {method!r} needs 'model', the draft checkpoint's "
            f"directory ({what})"
        )
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config needs 'num_speculative_tokens' (k, e.g. 3)")
    k = _positive_int(
        "num_speculative_tokens",
        value["num_speculative_tokens"],
        "draft tokens per step",
        MAX_SPECULATIVE_TOKENS,
    )
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
    lo = _positive_int("prompt_lookup_min", lo, "the shortest n-gram matched")
    hi = _positive_int("prompt_lookup_max", hi, "the longest n-gram matched")
    if lo > hi:
        raise ValueError(
            f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
        )
    limit = value.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
    limit = _positive_int("disable_by_batch_size", limit, "decoding requests a step speculates for")
    force = value.get("force_accept", False)
    if not isinstance(force, bool):
        raise ValueError(f"speculative_config['force_accept'] must be a bool, got {force!r}")  # noqa: TRY004
    pipeline = value.get("pipeline", False)
    if not isinstance(pipeline, bool):
        raise ValueError(f"speculative_config['pipeline'] must be a bool, got {pipeline!r}")  # noqa: TRY004
    return _check_forced(SpeculativeConfig(method, k, lo, hi, model, limit, force, pipeline))


def draft_state_slots(config: SpeculativeConfig | None, subpool_configs) -> int:
    """Per-draft-position state slots each request holds: k with speculation on a
    model with recurrent state (a Mamba sub-pool), else 0. A verify step writes the
    state after each draft there, and accepting j drafts selects slot j by index
    (``allocator/mamba.py``). Cost: ``k * spec.entry_bytes`` per request, from the
    same pool (admission asks for 1 + k slots). At k = 3, bf16 weights and fp32 state
    (the presets; one slot in brackets): Qwen3.5-27B 443 MiB (148), Qwen3.5-35B-A3B 186
    (62), Qwen3-Next-80B 223 (74), NemotronH-8B 294 (98), Nemotron-3-Nano-30B 141
    (47), Falcon-H1-7B 400 (133), Bamba-9B 354 (118), Granite-4.0-H-Small 439 (146),
    Kimi-Linear-48B 126 (42), LFM2-2.6B 0.8 (0.26)."""
    if config is None or not any(c.spec.kind == "mamba" for c in subpool_configs):
        return 0
    return config.num_speculative_tokens


def check_speculation(config: SpeculativeConfig | None, subpool_configs, tp_group) -> None:
    """Refuse what speculation cannot serve yet, once at start-up."""
    if config is None:
        return
    if tp_group is not None:
        raise ValueError("speculative_config does not yet combine with tp_group")
