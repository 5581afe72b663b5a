"""Every environment variable unikv reads, in one place (the only reader of
``os.environ`` in the package; ``docs/env.md`` lists them).

``FLAGS`` holds the engine's and the kernels' switches, read once when unikv is
imported: each is an A/B switch of a tuned path (the default is the measured
winner; ``docs/history.md`` says where it was measured) or a
tuning override. Code reads ``env.FLAGS.<name>`` where it decides, once, at import
or at construction; no per-step code reads it. A test that needs another value
replaces ``env.FLAGS`` (``dataclasses.replace``) or runs a subprocess with the
variable set.

``serve_environ()`` is read when ``unikv serve`` starts: the API key and the
test-only engine-fault hook. ``hub_cache_dir()`` reads Hugging Face's cache
variables at each call, as ``huggingface_hub`` does (a process that sets them late
is honoured).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

MXFP4_DECODES = ("table", "halves", "interleave")
SDPA_GQA = ("native", "repeat")


def _on(default: str) -> Callable[[str | None], bool]:
    """'1' on, anything else off (``default`` when unset)."""
    return lambda raw: (default if raw is None else raw) == "1"


def _not_zero(raw: str | None) -> bool:
    """On unless '0'."""
    return raw != "0"


def _int(default: int) -> Callable[[str | None], int]:
    def parse(raw: str | None) -> int:
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"expected an integer, got {raw!r}") from None

    return parse


def _choice(options: tuple[str, ...]) -> Callable[[str | None], str]:
    def parse(raw: str | None) -> str:
        value = options[0] if raw is None else raw
        if value not in options:
            raise ValueError(f"expected one of {list(options)}, got {value!r}")
        return value

    return parse


def _text(raw: str | None) -> str | None:
    return raw or None


def _seconds(default: float) -> Callable[[str | None], float]:
    def parse(raw: str | None) -> float:
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(f"expected a number of seconds > 0, got {raw!r}")
        return value

    return parse


@dataclass(frozen=True)
class Flags:
    """The switches (field: environment variable, default, meaning)."""

    side_upload: bool = True  # UNIKV_SIDE_UPLOAD: the step tables' upload on a side stream
    graph_greedy_rows: int = 8  # UNIKV_GRAPH_GREEDY_ROWS: rows of the greedy-in-head graphs
    verify_graph_rows: int = 8  # UNIKV_VERIFY_GRAPH_ROWS: requests of captured verify steps
    gemv_table: str | None = None  # UNIKV_GEMV_TABLE: GEMV configs overriding the tuned table
    gemv_embed: bool = True  # UNIKV_GEMV_EMBED: the first GEMV gathers its embedding rows
    sandwich_norm: bool = True  # UNIKV_SANDWICH_NORM: post-norm + add + next pre-norm, one op
    fp8_norm_quant: bool = True  # UNIKV_FP8_NORM_QUANT: pre-norm + FP8 x quantisation, one op
    extend_hopper: bool = True  # UNIKV_EXTEND_HOPPER (0 off): sm_90 extend attention
    extend_sdpa: bool = False  # UNIKV_EXTEND_SDPA (1 on): torch SDPA for fresh prefills
    extend_sdpa_gqa: str = "native"  # UNIKV_EXTEND_SDPA_GQA: "native" or "repeat" K/V heads
    moe_hopper: bool = True  # UNIKV_MOE_HOPPER (0 off): sm_90 fused MoE
    mxfp4_decode: str = "table"  # UNIKV_MXFP4_DECODE: "table", "halves" or "interleave"
    pdl: bool = True  # UNIKV_PDL: programmatic dependent launch on sm_90
    pdl_trigger: bool = True  # UNIKV_PDL_TRIGGER: kernels trigger their dependents early
    decode_preload: bool = True  # UNIKV_DECODE_PRELOAD: decode loads before the PDL wait
    decode_merge_tile: int = 16384  # UNIKV_DECODE_MERGE_TILE: split-K merge tile
    triton_interpret: bool = False  # TRITON_INTERPRET: Triton's CPU interpreter is on
    tp_timeout_s: float = 300.0  # UNIKV_TP_TIMEOUT_S: launched TP ranks' start-up and collectives

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Flags:
        environ = os.environ if environ is None else environ
        values = {}
        for field in dataclasses.fields(cls):
            var, parse = PARSERS[field.name]
            try:
                values[field.name] = parse(environ.get(var))
            except ValueError as err:
                raise ValueError(f"environment variable {var}: {err}") from None
        return cls(**values)


PARSERS: dict[str, tuple[str, Callable]] = {
    "side_upload": ("UNIKV_SIDE_UPLOAD", _on("1")),
    "graph_greedy_rows": ("UNIKV_GRAPH_GREEDY_ROWS", _int(8)),
    "verify_graph_rows": ("UNIKV_VERIFY_GRAPH_ROWS", _int(8)),
    "gemv_table": ("UNIKV_GEMV_TABLE", _text),
    "gemv_embed": ("UNIKV_GEMV_EMBED", _on("1")),
    "sandwich_norm": ("UNIKV_SANDWICH_NORM", _on("1")),
    "fp8_norm_quant": ("UNIKV_FP8_NORM_QUANT", _on("1")),
    "extend_hopper": ("UNIKV_EXTEND_HOPPER", _not_zero),
    "extend_sdpa": ("UNIKV_EXTEND_SDPA", _on("0")),
    "extend_sdpa_gqa": ("UNIKV_EXTEND_SDPA_GQA", _choice(SDPA_GQA)),
    "moe_hopper": ("UNIKV_MOE_HOPPER", _not_zero),
    "mxfp4_decode": ("UNIKV_MXFP4_DECODE", _choice(MXFP4_DECODES)),
    "pdl": ("UNIKV_PDL", _on("1")),
    "pdl_trigger": ("UNIKV_PDL_TRIGGER", _on("1")),
    "decode_preload": ("UNIKV_DECODE_PRELOAD", _on("1")),
    "decode_merge_tile": ("UNIKV_DECODE_MERGE_TILE", _int(16384)),
    "triton_interpret": ("TRITON_INTERPRET", _on("0")),
    "tp_timeout_s": ("UNIKV_TP_TIMEOUT_S", _seconds(300.0)),
}

FLAGS = Flags.from_environ()

API_KEY_ENV = "UNIKV_API_KEY"
FAULT_ENV = "UNIKV_TEST_ENGINE_FAULT"  # test-only faults (docs/env.md)


@dataclass(frozen=True)
class ServeEnviron:
    """What ``unikv serve`` reads from the environment when it starts."""

    api_key: str | None = None  # UNIKV_API_KEY: the default of --api-key
    engine_fault: str | None = None  # UNIKV_TEST_ENGINE_FAULT (tests only)


def serve_environ(environ: Mapping[str, str] | None = None) -> ServeEnviron:
    environ = os.environ if environ is None else environ
    return ServeEnviron(
        api_key=environ.get(API_KEY_ENV) or None, engine_fault=environ.get(FAULT_ENV) or None
    )


HUB_CACHE_ENV = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """The Hugging Face hub cache directory: ``HF_HUB_CACHE`` (or the legacy
    ``HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub`` (``~/.cache`` by default)."""
    environ = os.environ if environ is None else environ
    for name in HUB_CACHE_ENV[:2]:
        if environ.get(name):
            return os.path.expanduser(environ[name])
    home = environ.get("HF_HOME") or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return os.path.join(os.path.expanduser(home), "hub")
