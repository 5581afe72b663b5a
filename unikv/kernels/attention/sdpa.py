"""A fresh prompt's attention through torch's SDPA (cuDNN's fused attention on Hopper).

A step that holds one prompt and no cached prefix needs plain causal attention over
the prompt's own K/V rows, which the model just computed (``extend_fresh``'s case
with one request). There cuDNN's attention, torch SDPA's default dispatch on the
H200, ran 1.26x the Triton fresh kernel at 16k tokens (3.55 against 4.46 ms,
``extend_long_h200_5ff46ff.json``): it overlaps loads, both matmuls and the softmax
in warp-specialised pipelines, which Triton 3.6's ``tl`` does not compile for sm_90a
(its Gluon dialect can; no Gluon attention kernel exists here yet). So the
CUDA backend's ``extend_attention`` can hand such a step to SDPA, the way vLLM hands
prefill to FlashAttention; everything else keeps the Triton kernels:

    taken when   fresh_kv is given, one request (max_q_len == T), no config override,
                 16-bit q, no window / sinks / soft-cap, D == Dv in ``DIMS``,
                 at least ``MIN_TOKENS`` tokens
    else         ``extend.extend_attention`` (the Triton kernels)

All of it is host knowledge (dtypes, shapes, host ints): no sync. SDPA's fused
backends take 4-D inputs only: it gets (1, heads, T, D) views of the rows (3-D ones
ran its math path, 199 ms at 16k, docs/perf.md), with ``enable_gqa`` over the KV heads
(``REPEAT_KV``: repeated first instead).

**Off by default** (``UNIKV_EXTEND_SDPA=1`` turns it on; fixed at import). torch's
cuDNN attention builds and caches an execution graph per sequence length: 40-76 ms for
each new length on the H200 (``benchmarks/bench_extend_sdpa_lengths.py``,
``extend_sdpa_lengths_h200_5baf0e7.json``), and a server sees a new length with nearly
every prompt. ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` (torch's ragged path for this BSHD
layout) rounds lengths up to powers of two, one 47-56 ms build a bucket, but then runs
16k in 3.82-3.87 ms against 3.57-3.70 and 2k at 2.3-2.6x the Triton kernel's time. So
every step stays on Triton unless a deployment that sees few lengths turns it on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from unikv.env import FLAGS
from unikv.kernels.attention import extend
from unikv.kernels.attention import fresh as extend_fresh
from unikv.kernels.attention.tiles import check_attention_args
from unikv.kernels.runtime.checks import out_buffer

ENABLED = FLAGS.extend_sdpa
DIMS = (64, 128)  # head dims cuDNN's fused attention takes on sm_90 (and the engine's)
MIN_TOKENS = 1  # faster than the Triton kernel at both lengths benchmarked, 4k and 16k
# SDPA's enable_gqa over the KV heads as they are (cuDNN takes it), or the KV heads
# repeated over their query heads first (UNIKV_EXTEND_SDPA_GQA=repeat; fixed at import,
# the A/B switch): 3.55 against 3.62 ms at 16k, 0.257 against 0.330 at 4k (docs/perf.md)
REPEAT_KV = FLAGS.extend_sdpa_gqa == "repeat"


def takes_sdpa(q: torch.Tensor, fresh_kv, max_q_len: int, window: int, sinks, soft_cap: float,
               config) -> bool:  # fmt: skip
    """Whether the step is one fresh prompt SDPA computes exactly as asked (host only)."""
    if fresh_kv is None or config is not None or max_q_len != q.shape[0]:
        return False
    k, v = fresh_kv
    return (
        q.dtype in (torch.bfloat16, torch.float16)
        and window == 0
        and sinks is None
        and soft_cap == 0
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and q.shape[-1] in DIMS
        and q.shape[0] >= MIN_TOKENS
    )


def fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float,
                    out: torch.Tensor | None = None, repeat: bool | None = None) -> torch.Tensor:  # fmt: skip
    """Causal attention of one prompt over its own rows: q (T, Hq, D), k / v (T, H, D)
    with Hq a multiple of H -> out (T, Hq, D) in q's dtype (written into ``out`` when
    given). SDPA sees (1, heads, T, D) views of the token-major rows (its fused
    backends take 4-D inputs only); repeat (None: ``REPEAT_KV``): the KV heads
    repeated over their query heads first, else SDPA's ``enable_gqa``. Shapes are the
    caller's to check (``extend_attention`` here checks them as ``extend_fresh`` does)."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and (REPEAT_KV if repeat is None else repeat):
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(
        q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2),
        is_causal=True, scale=sm_scale, enable_gqa=q.shape[1] != k.shape[1],
    )  # fmt: skip
    o = o[0].transpose(0, 1)  # (T, Hq, D)
    if out is None:
        return o if o.is_contiguous() else o.contiguous()
    return out_buffer(out, tuple(o.shape), q).copy_(o)


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, q_indptr: torch.Tensor, seq_lens: torch.Tensor,
                     *, max_q_len: int, page_size: int, sm_scale: float, window: int = 0,
                     sinks: torch.Tensor | None = None, soft_cap: float = 0.0,
                     out: torch.Tensor | None = None, config: tuple | None = None,
                     fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                     hopper: bool = False, sdpa: bool | None = None) -> torch.Tensor:  # fmt: skip
    """``extend.extend_attention``, with a step of one fresh prompt through SDPA
    (``takes_sdpa``): the CUDA backend's op. Arguments and result as there. sdpa: the
    step's ``ExtendPlan`` says whether its length goes to SDPA (False: never; None, a
    direct caller: ``takes_sdpa`` alone decides)."""
    if sdpa is not False and takes_sdpa(q, fresh_kv, max_q_len, window, sinks, soft_cap, config):
        check_attention_args(q, k_cache, v_cache, block_table, seq_lens, sinks, page_size)
        extend_fresh.check_fresh(q, *fresh_kv, q_indptr, sinks)
        return fresh_attention(q, *fresh_kv, sm_scale=sm_scale, out=out)
    return extend.extend_attention(  # checks its arguments itself
        q, k_cache, v_cache, block_table, q_indptr, seq_lens, max_q_len=max_q_len,
        page_size=page_size, sm_scale=sm_scale, window=window, sinks=sinks, soft_cap=soft_cap,
        out=out, config=config, fresh_kv=fresh_kv, hopper=hopper,
    )  # fmt: skip
