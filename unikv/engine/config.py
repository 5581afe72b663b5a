"""``EngineConfig``: every option that builds an engine, in one frozen, picklable value.

``LLM(model, **options)`` makes one (``EngineConfig.of``), ``unikv generate`` /
``unikv serve`` make one from their command line (``EngineConfig.from_cli``), and
``engine/build.py`` builds the engine from it. The tensor-parallel launcher and
``unikv serve``'s engine process send the config itself to the processes they start.

A config validates itself when made (``__post_init__``): each bad value raises a
ValueError (a TypeError where the type is wrong and today's ``LLM`` said so) naming
the field, what it takes, what it got and what to change, before any weight loads.
What needs the model (``max_model_len`` against its context, the host tiers against
its page sizes, speculation against its layers) is checked by ``build``.

CLI flags are the field names with dashes (``--max-num-seqs``), vLLM's where the
meaning is the same; the older names stay as aliases (``CLI_ALIASES``). One field
has a flag of another name: ``seed`` is ``--engine-seed`` (``CLI_DESTS``), since
``unikv generate --seed`` seeds its requests.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from unikv.engine.speculative.config import SpeculativeConfig

BACKENDS = (None, "torch", "triton")
PREEMPTION_MODES = ("auto", "swap", "recompute")  # io/swap.MODES (test_engine_config)
# old keyword names of ``LLM(...)`` -> the field they set
KWARG_ALIASES = {"model_dir": "model"}
# flag (besides ``--<field>``) -> field; the older unikv names and vLLM's
CLI_ALIASES = {
    "--chunk": "max_num_batched_tokens",
    "--kv-cache": "kv_cache_bytes",
    "--block-size": "page_size",  # vLLM's name for tokens per page
    "--gpu-memory-utilization": "memory_fraction",
    "-tp": "tensor_parallel_size",
}
# the fields whose flag is not ``--<field>``: ``unikv generate --seed`` seeds its requests
CLI_DESTS = {"seed": "engine_seed"}
# fields whose flag parses a byte size ("4GiB")
BYTE_FIELDS = ("kv_cache_bytes", "kv_cache_max_bytes", "kv_cache_margin_bytes",
               "prefix_host_bytes", "swap_host_bytes")  # fmt: skip


def _int(value, low: int | None = None) -> bool:
    """``value`` is an int (not a bool) of at least ``low``."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    return ok and (low is None or value >= low)


def _bad(name: str, expected: str, value, change: str = "") -> ValueError:
    hint = f"; {change}" if change else ""
    return ValueError(f"{name} must be {expected}, got {value!r:.80}{hint}")


@dataclass(frozen=True)
class EngineConfig:
    """An engine's options (``LLM``'s docstring says what each does).

    ``device`` and ``dtype`` are resolved when the config is made (None: CUDA when
    present, bf16 there and fp32 on the CPU); ``speculative_config`` is parsed
    (a dict or its JSON -> ``SpeculativeConfig``); everything else is kept as given.
    """

    model: str
    device: Any = None
    dtype: Any = None
    kv_cache_dtype: str = "auto"
    kv_cache_bytes: int | None = None
    kv_cache_max_bytes: int | None = None
    kv_cache_margin_bytes: int | None = None
    memory_fraction: float = 0.9
    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_prefill_tokens_decoding: int | None = None
    admission_window_ms: float = 0.0
    max_model_len: int | None = None
    cuda_graphs: bool | None = None
    prefill_graphs: bool = False
    prefill_graph_tokens: int | None = None
    backend: str | None = None
    seed: int = 0
    debug: bool = False
    tensor_parallel_size: int = 1
    static_split: Mapping[str, float] | None = field(default=None, hash=False)
    enable_prefix_caching: bool | None = None
    prefix_host_bytes: int = 0
    swap_host_bytes: int = 0
    preemption: str = "auto"
    speculative_config: Any = None
    speculative_disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        from unikv.engine.options import check_device, check_dtypes, check_kv_cache_bytes
        from unikv.engine.speculative.config import speculative_config_of

        if not isinstance(self.model, str) or not self.model:
            raise _bad("model", "a checkpoint directory or a Hugging Face repo id", self.model)
        device = check_device(self.device)
        dtype, _ = check_dtypes(self.dtype, self.kv_cache_dtype, device)
        check_kv_cache_bytes(self.kv_cache_bytes)
        for name in ("kv_cache_max_bytes", "kv_cache_margin_bytes"):
            value = getattr(self, name)
            if value is not None and not _int(value, 0 if "margin" in name else 1):
                low = ">= 0" if "margin" in name else "> 0"
                raise _bad(name, f"None or an int {low}", value)
        if self.kv_cache_margin_bytes is not None and (
            device.type != "cuda" or self.kv_cache_bytes is not None
        ):
            raise ValueError(
                "kv_cache_margin_bytes sizes the pool after capture: CUDA only, and "
                "without kv_cache_bytes"
            )
        fraction = self.memory_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not 0 < fraction <= 1
        ):
            raise _bad("memory_fraction", "a number in (0, 1] (the share of free memory the "
                       "pool may take)", fraction)  # fmt: skip
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            if not _int(getattr(self, name), 1):
                raise _bad(name, "a positive int", getattr(self, name))
        cap = self.max_prefill_tokens_decoding
        if cap is not None and not _int(cap, 1):
            raise _bad("max_prefill_tokens_decoding", "None (max_num_batched_tokens) or an int "
                       ">= 1 (prefill tokens per step while requests decode)", cap)  # fmt: skip
        window = self.admission_window_ms
        if (
            isinstance(window, bool)
            or not isinstance(window, int | float)
            or not 0 <= window <= 1000
        ):
            raise _bad("admission_window_ms", "a number of milliseconds in [0, 1000] (0: off)",
                       window)  # fmt: skip
        if self.max_model_len is not None and not _int(self.max_model_len, 2):
            raise _bad("max_model_len", "None (the model's context) or an int >= 2",
                       self.max_model_len)  # fmt: skip
        if self.cuda_graphs not in (None, True, False):
            raise _bad("cuda_graphs", "True, False or None (on with CUDA)", self.cuda_graphs)
        if not isinstance(self.prefill_graphs, bool):
            raise _bad("prefill_graphs", "True or False (extend steps under piecewise CUDA "
                       "graphs; plain calls of the same pieces on the CPU)", self.prefill_graphs)  # fmt: skip
        tokens = self.prefill_graph_tokens
        if tokens is not None and not _int(tokens, 1):
            raise _bad("prefill_graph_tokens", "None (capture up to max_num_batched_tokens) or an "
                       "int >= 1: extend steps of more token rows run eagerly", tokens)  # fmt: skip
        if not isinstance(self.debug, bool):
            raise _bad("debug", "True or False", self.debug)
        if self.backend not in BACKENDS:
            raise _bad("backend", "None (by device), 'torch' or 'triton'", self.backend)
        if not _int(self.seed):
            raise _bad("seed", "an int", self.seed)
        if not _int(self.tensor_parallel_size, 1):
            raise _bad("tensor_parallel_size", "an int >= 1", self.tensor_parallel_size)
        if self.static_split is not None and not isinstance(self.static_split, Mapping):
            raise TypeError(
                f"static_split must be None or a mapping {{sub-pool name: fraction}}, got "
                f"{self.static_split!r:.80}"
            )
        if self.enable_prefix_caching not in (None, True, False):
            raise TypeError(
                f"enable_prefix_caching must be True, False or None (on for full-attention and "
                f"MLA models), got {self.enable_prefix_caching!r}"
            )
        for name in ("prefix_host_bytes", "swap_host_bytes"):
            if not _int(getattr(self, name), 0):
                raise _bad(name, "an int >= 0 (0: off)", getattr(self, name))
        if self.preemption not in PREEMPTION_MODES:
            raise _bad("preemption", f"one of {PREEMPTION_MODES} (auto: swap when cheaper than "
                       "recomputing)", self.preemption)  # fmt: skip
        if self.preemption == "swap" and not self.swap_host_bytes:
            raise ValueError(
                "preemption='swap' swaps preempted requests to host slots, but swap_host_bytes "
                "is 0; give swap_host_bytes (--swap-host-bytes) or use preemption='auto'/"
                "'recompute'"
            )
        spec = speculative_config_of(self.speculative_config)
        limit = self.speculative_disable_by_batch_size
        if limit is not None:
            if not _int(limit, 1):
                raise _bad("speculative_disable_by_batch_size", "None or an int >= 1 (steps "
                           "with more decoding requests do not speculate)", limit)  # fmt: skip
            if spec is None:
                raise ValueError(
                    f"speculative_disable_by_batch_size ({limit}) applies to speculative "
                    "decoding: give speculative_config too, or drop it"
                )
            spec = dataclasses.replace(spec, disable_by_batch_size=limit)
        static = dict(self.static_split) if self.static_split is not None else None
        for name, value in (("device", device), ("dtype", dtype), ("speculative_config", spec),
                            ("static_split", static)):  # fmt: skip
            object.__setattr__(self, name, value)

    # -- making one ----------------------------------------------------------------------

    @classmethod
    def of(cls, model=None, /, **options) -> EngineConfig:
        """A config from ``LLM``'s arguments: ``model`` (or ``model_dir=``, once) and
        the fields by name; an unknown name raises a TypeError naming the fields."""
        for old, new in KWARG_ALIASES.items():
            if old in options:
                if model is not None or new in options:
                    raise ValueError(
                        "give the checkpoint directory once: LLM(model_dir) or "
                        f"LLM(model=model_dir), got model_dir={options[old]!r}, "
                        f"model={model if model is not None else options.get(new)!r}"
                    )
                options[new] = options.pop(old)
        if model is not None:
            if "model" in options:
                raise ValueError(
                    "give the checkpoint directory once: LLM(model_dir) or LLM(model=model_dir), "
                    f"got model_dir={model!r}, model={options['model']!r}"
                )
            options["model"] = model
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown engine options {unknown}; the options are {sorted(names)}")
        if options.get("model") is None:
            raise ValueError(
                "give the checkpoint directory once: LLM(model_dir) or LLM(model=model_dir), "
                "got neither"
            )
        return cls(**options)

    @classmethod
    def from_cli(cls, args) -> EngineConfig:
        """The config of ``add_cli_args``'s options (an argparse Namespace): each
        field from the flag of its name; byte sizes parse "4GiB"."""
        from unikv.inspect import parse_bytes

        values = {}
        for f in dataclasses.fields(cls):
            dest = CLI_DESTS.get(f.name, f.name)
            if not hasattr(args, dest):
                continue
            value = getattr(args, dest)
            if f.name in BYTE_FIELDS and isinstance(value, str):
                value = parse_bytes(value) if value.strip() != "0" else 0
            if f.name == "static_split" and isinstance(value, str):
                value = _json_object("static_split", value)
            if value is None and f.default is not None and f.default is not dataclasses.MISSING:
                continue  # a flag left unset: the field's default
            values[f.name] = value
        return cls(**values)

    def replace(self, **changes) -> EngineConfig:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


def _json_object(name: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{name} must be a JSON object, got {text!r:.80} ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {text!r:.80}")  # noqa: TRY004
    return value


def flag_of(name: str) -> str:
    """The CLI flag of field ``name``."""
    return "--" + CLI_DESTS.get(name, name).replace("_", "-")


__all__ = ["CLI_ALIASES", "EngineConfig", "SpeculativeConfig", "flag_of"]
