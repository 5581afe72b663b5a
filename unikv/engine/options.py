"""Start-up checks of ``LLM``'s device, dtype and pool options: each bad value is
refused before any work, with what was expected and what to change."""

from __future__ import annotations

import dataclasses
import random

import torch

from unikv.models.loader import generation_eos_ids
from unikv.specs import MHASpec

COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_device(device) -> torch.device:
    """The engine's device (default: CUDA when available, else CPU)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "built without CUDA" if torch.version.cuda is None else "sees no CUDA GPU"
        raise ValueError(
            f"device {str(device)!r} was asked for, but this torch ({torch.__version__}) {why}; "
            "use device 'cpu' (--device cpu), or install a CUDA build of torch on a GPU machine"
        )
    if device.type == "cuda" and device.index is not None:
        count = torch.cuda.device_count()
        if device.index >= count:
            raise ValueError(f"device {str(device)!r}: only {count} CUDA devices are visible")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {str(device)!r}")
    return device


FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_dtypes(
    dtype, kv_cache_dtype: str, device: torch.device
) -> tuple[torch.dtype, torch.dtype | None]:
    """(the compute dtype: weights, activations, and the KV cache unless told
    otherwise; the attention KV cache's fp8 dtype, or None for ``auto``). Refuses fp8
    as the compute dtype and a KV dtype other than auto, the compute dtype or fp8."""
    from unikv.hf_config import parse_dtype

    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = parse_dtype(dtype)
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(
            f"dtype is the weights' and activations' dtype and must be bf16, fp16 or fp32, got "
            f"{dtype}; an fp8 KV cache is kv_cache_dtype='fp8' (--kv-cache-dtype)"
        )
    if kv_cache_dtype == "auto":
        return dtype, None
    kv = parse_dtype(kv_cache_dtype)  # a ValueError names the accepted names
    if kv == dtype:
        return dtype, None
    if kv not in FP8_KV_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be 'auto' (the model dtype, {dtype}), the model dtype or an "
            f"fp8 format ('fp8' = 'fp8_e4m3', 'fp8_e5m2'), got {kv_cache_dtype!r}"
        )
    return dtype, kv


def fp8_kv_configs(configs: list, kv_dtype: torch.dtype | None) -> list:
    """The sub-pool configs with every attention (full / sliding-window) sub-pool's
    K/V held in ``kv_dtype`` (None: unchanged); recurrent state keeps its dtypes.
    ValueError for an MLA sub-pool (its latent rows are not quantised yet)."""
    if kv_dtype is None:
        return configs
    mla = [c.name for c in configs if c.spec.kind == "mla"]
    if mla:
        raise ValueError(
            f"kv_cache_dtype {kv_dtype} holds attention K/V only; this model's MLA latent "
            f"sub-pool {mla} is not quantised by the engine; use kv_cache_dtype='auto'"
        )
    return [
        dataclasses.replace(c, spec=dataclasses.replace(c.spec, dtype=kv_dtype))
        if isinstance(c.spec, MHASpec)
        else c
        for c in configs
    ]


def check_kv_cache_bytes(kv_cache_bytes) -> None:
    if kv_cache_bytes is None:
        return
    if (
        isinstance(kv_cache_bytes, bool)
        or not isinstance(kv_cache_bytes, int)
        or kv_cache_bytes < 1
    ):
        raise ValueError(
            f"kv_cache_bytes must be None (size the pool from free memory) or an int > 0, "
            f"got {kv_cache_bytes!r}"
        )


ATTENTION_KINDS = ("full", "mla", "swa")
DEFAULT_CACHED_KINDS = ("full", "mla")  # a hit shares pages: no copy, no extra bytes

# Prefix caching's default per model family (``Family.name``, ``models/family.py``): the
# one place to flip once a same-run GPU A/B (``benchmarks/bench_prefix.py``, cache vs
# none at 1.25x the working set) shows the cache pays for that family. ``None``: by the
# pool's kinds (on where every sub-pool is full attention or MLA), for families whose
# configs come with and without windows or state (Mistral's ``sliding_window``, Granite's
# attention-only configs). ``False``, why:
# - windows (gpt-oss, Gemma, MiMo): window bindings that left every request's window stay
#   cached (evicted alone under pressure); not yet measured on the GPU against no cache;
# - recurrent hybrids: a hit needs a state checkpoint (a slot copy, and the slot's bytes
#   held), which lost at 1.25x the pool: 0.55x tok/s on the H100, hybrid chat (issue 41).
PREFIX_CACHING_DEFAULT: dict[str, bool | None] = {
    "llama": None,  # Llama, Qwen2/3: full attention; Mistral with a window: off
    "mixtral": None,
    "qwen3_moe": None,
    "deepseek": True,  # MLA
    "gpt_oss": False,  # windows
    "gemma": False,  # windows
    "mimo_v2": False,  # windows
    "qwen3_5": False,  # Gated DeltaNet state
    "qwen3_5_moe": False,
    "qwen3_next": False,
    "kimi_linear": False,  # KDA state
    "nemotron_h": False,  # Mamba-2 state
    "falcon_h1": False,
    "bamba": False,
    "zamba2": False,
    "jamba": False,
    "lfm2": False,  # conv state
    "granitemoehybrid": None,  # Mamba-2 state in the hybrid configs
}


def prefix_caching_for(enabled, configs, family: str | None = None) -> bool:
    """Whether prefix caching is on: ``enabled`` True or False as given; None (the
    default) reads ``PREFIX_CACHING_DEFAULT[family]`` (why each row is what it is: its
    comments), and where that row is None (or no family is named) it is on exactly
    where every sub-pool is full attention or MLA (a hit shares pages: no copy, no extra
    bytes). Pass True to cache the others anyway. True needs an attention sub-pool to
    share pages of; a model with none is refused."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(
            f"enable_prefix_caching must be True, False or None (the family's default, "
            f"engine/options.PREFIX_CACHING_DEFAULT), got {enabled!r}"
        )
    kinds = {c.name: c.spec.kind for c in configs}
    if enabled is None:
        if family is not None and family not in PREFIX_CACHING_DEFAULT:
            raise KeyError(
                f"family {family!r} has no prefix-caching default: add its row to "
                "PREFIX_CACHING_DEFAULT in unikv/engine/options.py"
            )
        default = PREFIX_CACHING_DEFAULT.get(family) if family is not None else None
        if default is not None:
            return default
        return all(k in DEFAULT_CACHED_KINDS for k in kinds.values())
    if enabled and not any(k in ATTENTION_KINDS for k in kinds.values()):
        raise ValueError(
            "enable_prefix_caching=True needs an attention sub-pool (full, MLA or sliding "
            f"window) to share pages of; this model has sub-pools {kinds} only; leave prefix "
            "caching off (enable_prefix_caching=False) for it"
        )
    return enabled


def check_prefix_host_bytes(host_bytes, caching: bool, configs) -> None:
    """``prefix_host_bytes``: an int >= 0 (0: off) that, with prefix caching on,
    holds at least one cached page's envelopes (every attention sub-pool) and, for
    recurrent hybrids, one state checkpoint (``io/prefix_host.host_slots``)."""
    from unikv.io.prefix_host_setup import host_slots

    if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < 0:
        raise ValueError(
            f"prefix_host_bytes must be an int >= 0 (host bytes behind the prefix cache; "
            f"0 turns the host tier off), got {host_bytes!r}"
        )
    if host_bytes and not caching:
        raise ValueError(
            f"prefix_host_bytes={host_bytes} is the host tier behind the prefix cache, which "
            "is off; pass enable_prefix_caching=True (--enable-prefix-caching) or leave "
            "prefix_host_bytes at 0"
        )
    if host_bytes:
        token = {c.name: c.spec.page_bytes(c.page_size) for c in configs if c.spec.kind != "mamba"}
        state = [c.spec.page_bytes(c.page_size) for c in configs if c.spec.kind == "mamba"]
        host_slots(token, state[0] if state else None, host_bytes)


def model_dir_of(model_dir: str | None, model: str | None) -> str:
    if (model_dir is None) == (model is None):
        raise ValueError(
            "give the checkpoint directory once: LLM(model_dir) or LLM(model=model_dir), got "
            f"model_dir={model_dir!r}, model={model!r}"
        )
    from unikv.models.hub import resolve_model  # a repo id: its snapshot in the HF cache

    return resolve_model(model_dir if model_dir is not None else model)


def derived_seed(seed: int, index: int) -> int:
    """Seed of completion ``index`` > 0 of a prompt seeded ``seed`` (63 bits)."""
    return random.Random(f"{seed}:{index}").getrandbits(63)


def merged_eos(config, model_dir: str, tokenizer) -> tuple[int, ...]:
    """The config's EOS ids, then generation_config.json's, then the tokenizer's."""
    ids = list(config.eos_token_ids) + list(generation_eos_ids(model_dir))
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(eos, int):
        ids.append(eos)
    return tuple(dict.fromkeys(int(i) for i in ids if 0 <= int(i) < config.vocab_size))


def check_swap(preemption, swap_host_bytes, configs, tp_group=None) -> None:
    """``preemption``: "auto" (swap to ``swap_host_bytes`` of host slots when the
    cost rule says so, else recompute), "swap" (swap whenever the host slots have
    room) or "recompute"; ``swap_host_bytes``: an int >= 0 (0: no swap) holding at
    least one page of every token sub-pool (and a state slot for hybrids)."""
    from unikv.io.prefix_host_setup import host_slots
    from unikv.io.swap import MODES

    if preemption not in MODES:
        raise ValueError(
            f"preemption must be one of {MODES} (auto: swap when cheaper than recomputing), "
            f"got {preemption!r}"
        )
    bad = isinstance(swap_host_bytes, bool) or not isinstance(swap_host_bytes, int)
    if bad or swap_host_bytes < 0:
        raise ValueError(f"swap_host_bytes must be an int >= 0 (0: off), got {swap_host_bytes!r}")
    if preemption == "swap" and not swap_host_bytes:
        raise ValueError(
            "preemption='swap' swaps preempted requests to host slots, but swap_host_bytes is "
            "0; give swap_host_bytes (--swap-host-bytes) or use preemption='auto'/'recompute'"
        )
    if swap_host_bytes and tp_group is not None:
        raise ValueError(
            "swap_host_bytes is not supported under tensor parallelism yet (every rank must "
            "make the same swap decisions); leave it at 0 with tp_group"
        )
    if swap_host_bytes:
        token = {c.name: c.spec.page_bytes(c.page_size) for c in configs if c.spec.kind != "mamba"}
        state = [c.spec.page_bytes(c.page_size) for c in configs if c.spec.kind == "mamba"]
        host_slots(token, state[0] if state else None, swap_host_bytes, "swap_host_bytes")
