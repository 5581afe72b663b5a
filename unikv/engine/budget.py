"""The pool's byte budget when the user gives none.

CUDA: ``memory_fraction`` of the memory free after the weights were loaded,
less a reserve for activations (a generous estimate from the step size).
CPU: enough for ``max_num_seqs`` requests of ``max_model_len`` tokens each
(a sliding-window sub-pool needs only its window), at most ``CPU_MAX_BYTES``.
"""

from __future__ import annotations

import gc

import torch

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
