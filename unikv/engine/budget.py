"""The pool's byte budget when the user gives none.

CUDA: ``memory_fraction`` of the memory free after the weights were loaded,
less a reserve for activations (a generous estimate from the step size).
CPU: enough for ``max_num_seqs`` requests of ``max_model_len`` tokens each
(a sliding-window sub-pool needs only its window), at most ``CPU_MAX_BYTES``.

Size after capture (an elastic pool, issue 44 item 2): start at
``one_request_bytes`` (the least pool one worst-case request runs in), load,
warm up and capture, then ``size_after_capture`` measures what is left.
"""

from __future__ import annotations

import gc

import torch

from unikv.layout import INT32_LIMIT, IdMap
from unikv.pool import pool_bytes_for, worst_case_pages

CPU_MAX_BYTES = 1 << 30
GIB = 1 << 30


def activation_reserve(model, chunk: int, max_num_seqs: int) -> int:
    """Bytes kept free for one step's activations and logits (an upper estimate)."""
    c = model.config
    itemsize = next(model.parameters()).element_size()
    width = 8 * c.hidden_size + 4 * c.intermediate_size + 4 * c.num_heads * c.head_dim
    return GIB + chunk * width * itemsize * 4 + max(chunk, max_num_seqs) * c.vocab_size * 12


def kv_budget_bytes(
    configs,
    model,
    device: torch.device,
    *,
    max_num_seqs: int,
    max_model_len: int,
    chunk: int,
    memory_fraction: float,
) -> int:
    """The default ``total_bytes`` of the unified pool (see the module docstring)."""
    if device.type == "cuda":
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        # Memory of engines no longer referenced (reference cycles, or blocks kept
        # by the caching allocator) counts as free: collect it first.
        gc.collect()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * memory_fraction) - activation_reserve(model, chunk, max_num_seqs)
        if budget <= 0:
            raise ValueError(
                f"no memory left for the KV pool: {free} bytes free after the weights; pass "
                "kv_cache_bytes, raise memory_fraction or use a smaller model"
            )
        return budget
    pages = {
        c.name: max_num_seqs * worst_case_pages(c.spec, c.page_size, max_model_len, chunk)
        for c in configs
    }
    return min(pool_bytes_for(configs, pages), CPU_MAX_BYTES)


def one_request_bytes(configs, max_model_len: int, chunk: int) -> int:
    """The least budget in which one request of ``max_model_len`` tokens runs
    alone (each sub-pool's worst case side by side, plus the sink; with prefix
    caching too: a windowed request holds its window's bindings only, so the
    pool's own lone-request check covers caching: no check of its own)."""
    pages = {c.name: worst_case_pages(c.spec, c.page_size, max_model_len, chunk) for c in configs}
    return pool_bytes_for(configs, pages)


def size_after_capture(pool, free: int, margin: int) -> int:
    """The elastic ``pool``'s size once ``free`` bytes are measured free (after the
    weights, the warm-up's cached activations and the CUDA graphs): its size plus
    ``free - margin``, rounded down to a chunk, within ``[total_bytes, max_bytes]``."""
    if not isinstance(margin, int) or margin < 0:
        raise ValueError(f"the KV cache margin must be a non-negative int, got {margin!r}")
    chunk = pool.backing.chunk
    grown = pool.total_bytes + max(0, free - margin) // chunk * chunk
    return min(grown, pool.max_bytes)


def addressable_bytes(configs) -> int:
    """The largest pool whose kernel ids fit int32 in every sub-pool (the most an
    elastic pool may reserve)."""
    return min(
        INT32_LIMIT // IdMap.of(c.spec, c.page_size).limit(1) * c.spec.page_bytes(c.page_size)
        for c in configs
    )
