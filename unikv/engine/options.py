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
DEFAULT_CACHED_KINDS = ("full", "mla")  # prefix caching on by default: a hit costs no copy


def prefix_caching_for(enabled, configs) -> bool:
    """Whether prefix caching is on: ``enabled`` True or False as given; None (the
    default) on for models whose every sub-pool is full attention or MLA (a hit shares
    pages: no copy, no extra bytes), off for the others, where caching costs memory:

    - sliding window: the cache keeps window bindings that left every request's
      window (evicted alone under pressure), and hits end where a chain's window
      suffix is still bound; not yet measured on the GPU against no cache (issue 41);
    - recurrent hybrids: a hit needs a state checkpoint (one envelope copy each,
      ``allocator/checkpoints.py``), which in a tight pool costs more than it saves
      (bench_prefix's hybrid chat on the H200: 0.77x the tokens/s without the cache at
      1.25x the pool it needs, 1.02x at 2x).

    Pass True to cache them anyway. True needs an attention sub-pool to share pages of;
    a model with none is refused."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(
            f"enable_prefix_caching must be True, False or None (on for full-attention and "
            f"MLA models), got {enabled!r}"
        )
    kinds = {c.name: c.spec.kind for c in configs}
    if enabled is None:
        return all(k in DEFAULT_CACHED_KINDS for k in kinds.values())
    if enabled and not any(k in ATTENTION_KINDS for k in kinds.values()):
        raise ValueError(
            "enable_prefix_caching=True needs an attention sub-pool (full, MLA or sliding "
            f"window) to share pages of; this model has sub-pools {kinds} only; leave prefix "
            "caching off (enable_prefix_caching=False) for it"
        )
    return enabled


def check_window_caching(pool, max_model_len: int, chunk_tokens: int = 1) -> None:
    """With prefix caching on, a windowed request holds the window bindings of the
    cached pages in its window only: those that slid out go to the cache, which evicts
    them alone under pressure (``allocator/prefix_evict.evict_windows``). So caching
    needs no more than a lone request does: its window plus the chunk being written
    (``placement.worst_case_pages``), which the pool must place."""
    from unikv.placement import worst_case_pages

    if not any(s.spec.kind == "swa" for s in pool.subpools.values()):
        return
    demand = {
        s.name: worst_case_pages(s.spec, s.page_size, max_model_len, chunk_tokens)
        for s in pool.subpools.values()
    }
    if not pool.fits(demand):
        raise ValueError(
            f"prefix caching on a sliding-window model: one request of max_model_len "
            f"{max_model_len} tokens needs pages {demand} (its window plus a chunk), which "
            f"the {pool.total_bytes}-byte pool cannot place; raise kv_cache_bytes or lower "
            "max_model_len"
        )


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
