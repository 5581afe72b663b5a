"""Fresh-prompt causal attention for Hopper in Gluon: TMA, wgmma, warp-specialised.

``extend_fresh``'s Triton kernel runs a fresh 16k prompt at 0.75x SDPA's cuDNN
attention on the H200: Triton 3.6's ``tl`` builds no warp-specialised schedule for
sm_90a, so its loads, its two MMAs and its softmax take turns. This kernel is the
FlashAttention-3 shape, written in Gluon:

    program (q block of 128 rows, q head, request), longest blocks launched first
    producer    1 warp: Q (two 64-row halves), then K and V tiles of BLOCK_N keys by
                TMA into rings of STAGES buffers, each with a ready and an empty barrier
    consumers   2 warpgroups, 64 query rows each, the same K/V stream:
                S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued together (async wgmma, Q and
                K from shared memory, P from registers), softmax of S_j while the PV MMA
                runs, then O rescaled; K_j's buffer is released once S_j is read, V's
                once its MMA is done

Only the diagonal block (the last) is masked. Keys past a request's rows are
masked by causality (a row's position bounds its keys), rows past it are not
stored; TMA reads rows past the tensor as zeros. ``runs_on`` says on which device
this path runs (sm_90, ``ENABLED``: decided once, by ``get_backend``), ``usable``
for which step (16-bit, D == Dv in (64, 128), no window / soft-cap; sinks allowed);
``extend_fresh`` takes it there. Gluon does not run in the interpreter: the CPU
tests compile it for sm_90a (``benchmarks/aot_sm90.py --extend``), the GPU tests
check it against SDPA.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from unikv.env import FLAGS
from unikv.kernels.runtime.checks import tma_ok

BLOCK_M = 128  # query rows a program: two consumer warpgroups of 64
BLOCK_N = 128  # keys a tile (the diagonal is one tile: BLOCK_N == BLOCK_M)
STAGES = 2  # K and V ring depth
CONSUMER_REGS = gl.constexpr(240)  # each consumer warpgroup's registers (setmaxnreg)
PRODUCER_REGS = gl.constexpr(24)
MAXNREG = 168  # the launch's: 12 warps x 168 <= 64k; the split above fits the same file
# the shortest prompt a step hands this kernel, by head dim; shorter steps keep the
# Triton kernel (H200, one lease, the kernels' device time, docs/perf.md, against Triton's
# installed tile): D 128 1.12-1.31x from 1 x 2048 to 16 x 1024 and 4 x 1000; D 64 1.06x at
# 1 x 8192 but 0.71-0.93x from 16 x 512 to 4 x 2048 (the softmax's exponentials, the same
# per tile at either D, outweigh half the MMA there)
MIN_Q_LEN = {128: 1024, 64: 8192}
# ``UNIKV_EXTEND_HOPPER=0`` keeps every fresh prompt on the Triton kernel (the A/B
# switch; fixed at import)
ENABLED = FLAGS.extend_hopper


@gluon.jit
def _softmax(s, m_i, l_i, rows, cols, qk_scale, MASKED: gl.constexpr):
    """One tile's online softmax (base 2): -> p, the rows' rescale alpha, m, l."""
    if MASKED:
        s = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _step(j, q, k_smem, v_smem, bars, acc, p16, m_i, l_i, rows, cols, qk_scale, zero_s,
          O_ROWS: gl.constexpr, P_LAYOUT: gl.constexpr, STAGES: gl.constexpr,
          BLOCK_N: gl.constexpr, MASKED: gl.constexpr):  # fmt: skip
    """Tile j: S_j = Q K_j^T and O += P_{j-1} V_{j-1} in flight together, S_j's softmax
    while the PV MMA runs, then O rescaled and P_j made."""
    _q_bar, k_ready, k_empty, v_ready, v_empty = bars
    sj = j % STAGES
    sp = (j - 1) % STAGES
    mbarrier.wait(k_ready.index(sj), (j // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(sj).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(sp), ((j - 1) // STAGES) & 1)
    acc = warpgroup_mma(p16, v_smem.index(sp), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=[s])
    mbarrier.arrive(k_empty.index(sj), count=1)
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, rows, cols + j * BLOCK_N, qk_scale, MASKED)
    acc, p16 = warpgroup_mma_wait(0, deps=[acc, p16])
    mbarrier.arrive(v_empty.index(sp), count=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, O_ROWS), 1)
    p16 = gl.convert_layout(p.to(p16.dtype), P_LAYOUT)
    return acc, p16, m_i, l_i


@gluon.jit
def _consumer(args, D: gl.constexpr, DV: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, HAS_SINKS: gl.constexpr, WG: gl.constexpr):  # fmt: skip
    """One warpgroup's 64 query rows over the block's keys; stores its output rows."""
    (q_desc, _k_desc, _v_desc, q_smem, k_smem, v_smem, bars, out, sinks, o_st, o_sh,
     q_start, q_len, m0, h, _kvh, n_blocks, qk_scale) = args  # fmt: skip
    q_bar, k_ready, k_empty, v_ready, _v_empty = bars
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16]
    )
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    row0 = m0 + WG * 64
    rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, S_LAYOUT))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    zero_s = gl.zeros([64, BLOCK_N], gl.float32, S_LAYOUT)
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, S_LAYOUT))
    q = q_smem.index(WG)
    mbarrier.wait(q_bar.index(0), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s])
    mbarrier.arrive(k_empty.index(0), count=1)
    if n_blocks == 1:
        p, _alpha, m_i, l_i = _softmax(s, m_i, l_i, rows, cols, qk_scale, True)
    else:
        p, _alpha, m_i, l_i = _softmax(s, m_i, l_i, rows, cols, qk_scale, False)
    acc = gl.zeros([64, DV], gl.float32, O_LAYOUT)
    p16 = gl.convert_layout(p.to(q_desc.dtype), P_LAYOUT)
    for j in range(1, n_blocks - 1):
        acc, p16, m_i, l_i = _step(
            j, q, k_smem, v_smem, bars, acc, p16, m_i, l_i, rows, cols, qk_scale, zero_s,
            O_ROWS, P_LAYOUT, STAGES, BLOCK_N, False,
        )  # fmt: skip
    if n_blocks > 1:
        acc, p16, m_i, l_i = _step(
            n_blocks - 1, q, k_smem, v_smem, bars, acc, p16, m_i, l_i, rows, cols, qk_scale,
            zero_s, O_ROWS, P_LAYOUT, STAGES, BLOCK_N, True,
        )  # fmt: skip
    last = n_blocks - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    acc = warpgroup_mma(p16, v_smem.index(last % STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    if HAS_SINKS:  # gpt-oss: a per-head logit in the denominator only
        l_i = l_i + gl.exp2(gl.load(sinks + h) * 1.4426950408889634 - m_i)
    res = acc / gl.expand_dims(gl.convert_layout(l_i, O_ROWS), 1)
    orow = row0 + gl.arange(0, 64, layout=O_ROWS)
    ocol = gl.arange(0, DV, layout=gl.SliceLayout(0, O_LAYOUT))
    tok = (q_start + orow).to(gl.int64)
    ptr = out + gl.expand_dims(tok * o_st + h * o_sh, 1) + gl.expand_dims(ocol, 0)
    gl.store(ptr, res.to(out.dtype.element_ty), mask=gl.expand_dims(orow < q_len, 1))


@gluon.jit
def _producer(args, D: gl.constexpr, DV: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, HAS_SINKS: gl.constexpr, WG: gl.constexpr):  # fmt: skip
    """Q's two halves, then every K and V tile of the block, by TMA."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, _out, _sinks, _o_st, _o_sh,
     q_start, _q_len, m0, h, kvh, n_blocks, _qk_scale) = args  # fmt: skip
    q_bar, k_ready, k_empty, v_ready, v_empty = bars
    mbarrier.expect(q_bar.index(0), 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_start + m0, h * D], q_bar.index(0), q_smem.index(0))
    tma.async_copy_global_to_shared(
        q_desc, [q_start + m0 + 64, h * D], q_bar.index(0), q_smem.index(1)
    )
    for j in range(n_blocks):
        s = j % STAGES
        phase = (j // STAGES) & 1
        key = q_start + j * BLOCK_N
        mbarrier.wait(k_empty.index(s), phase ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [key, kvh * D], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), phase ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [key, kvh * DV], v_ready.index(s), v_smem.index(s))


@gluon.jit
def fresh_kernel(q_desc, k_desc, v_desc, q_indptr, sinks, out, o_st, o_sh, qk_scale,
                 GROUP: gl.constexpr, D: gl.constexpr, DV: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_SINKS: gl.constexpr):  # fmt: skip
    mb = gl.num_programs(0) - 1 - gl.program_id(0)  # longest blocks first
    h = gl.program_id(1)
    b = gl.program_id(2)
    q_start = gl.load(q_indptr + b)
    q_len = gl.load(q_indptr + b + 1) - q_start
    m0 = mb * 128
    if m0 < q_len:
        n_blocks = (gl.minimum(m0 + 128, q_len) + BLOCK_N - 1) // BLOCK_N
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, 64, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, DV], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar.index(0), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
            mbarrier.init(v_empty.index(i), count=2)
        bars = (q_bar, k_ready, k_empty, v_ready, v_empty)
        args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, out, sinks, o_st, o_sh,
                q_start, q_len, m0, h, h // GROUP, n_blocks, qk_scale)  # fmt: skip
        gl.warp_specialize(
            [
                (_consumer, (args, D, DV, BLOCK_N, STAGES, HAS_SINKS, 0)),
                (_consumer, (args, D, DV, BLOCK_N, STAGES, HAS_SINKS, 1)),
                (_producer, (args, D, DV, BLOCK_N, STAGES, HAS_SINKS, 0)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )


@functools.cache
def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def runs_on(device: torch.device) -> bool:
    """Whether this path runs on ``device`` at all: an sm_90 GPU, ``ENABLED``. Asked
    once, where a backend is built (``get_backend``), or by a direct caller of
    ``extend_fresh.extend_attention_fresh`` that leaves ``hopper`` to it."""
    return ENABLED and _hopper(device)


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, soft_cap: float,
           max_q_len: int) -> bool:  # fmt: skip
    """Whether a fresh step's attention runs here, on a device ``runs_on`` (host ints
    and strides only): 16-bit q/k/v, D == Dv in (64, 128), no window or soft-cap, rows
    TMA can address, a prompt of at least ``MIN_Q_LEN[D]``."""
    return (
        max_q_len >= MIN_Q_LEN.get(q.shape[2], 1 << 62)
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[2] == k.shape[2] == v.shape[2]
        and q.shape[2] in (64, 128)
        and window <= 0
        and soft_cap <= 0
        and q.shape[0] > 0
        and all(tma_ok(x) for x in (q, k, v))
    )


@functools.cache
def _layout(rows: int, dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(
        [rows, dim], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    )


def _descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    tokens, heads, dim = x.shape
    layout = _layout(rows, dim, x.dtype)
    return TensorDescriptor(x, [tokens, heads * dim], [x.stride(0), 1], [rows, dim], layout)


def fresh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_indptr: torch.Tensor,
    out: torch.Tensor,
    *,
    max_q_len: int,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``extend_fresh.extend_attention_fresh``'s contract where ``usable`` holds (the
    caller checked the arguments): out (T, Hq, D) written in place and returned."""
    hq, dim = q.shape[1], q.shape[2]
    bsz = q_indptr.shape[0] - 1
    grid = ((max_q_len + BLOCK_M - 1) // BLOCK_M, hq, bsz)
    fresh_kernel[grid](
        _descriptor(q, 64), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), q_indptr,
        sinks if sinks is not None else q, out, out.stride(0), out.stride(1),
        sm_scale * 1.4426950408889634,
        GROUP=hq // k.shape[1], D=dim, DV=v.shape[2], BLOCK_N=BLOCK_N, STAGES=STAGES,
        HAS_SINKS=sinks is not None, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip
    return out
