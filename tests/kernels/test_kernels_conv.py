"""The Triton causal conv (``kernels/recurrent/conv.py``, under TRITON_INTERPRET=1 on the
CPU) against its torch reference (``recurrent_ref.causal_conv1d``), over page-strided
slot views of a Mamba sub-pool whose entries interleave two conv parts and a temporal
state (so the conv view's slot stride is the entry, not its own size).

Cases: odd channel counts (one partial channel block, and several), widths 2-5, decode
batches of 1/3/7 lanes with one and several lanes per program (a partial lane block
included), varlen prefill with the requests cut into several chunks and tiles (block
sizes forced small), empty requests, and a window view that is not packed (stride 1
on channels). Every byte outside the batch's windows and the sink must be unchanged;
the windows and outputs must equal the reference's.
"""

from __future__ import annotations

import pytest
import torch

from unikv import layout
from unikv.kernels.recurrent import conv as conv_ops
from unikv.kernels.recurrent import ref as recurrent_ref
from unikv.specs import MambaSpec, StatePart

NUM_SLOTS, LAYER = 12, 1
TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


class Pool:
    """A 2-layer Mamba sub-pool (conv0 (C, K), conv1 (5, K), temporal (3,)) of random
    bytes, NaN in every slot not handed out; ``window(buffer)`` is layer 1's conv0."""

    def __init__(self, channels, width, dtype, used, seed):
        parts = (StatePart((channels, width), dtype), StatePart((5, width), dtype))
        self.spec = MambaSpec(2, parts, StatePart((3,)))
        gen = torch.Generator().manual_seed(seed)
        self.buffer = torch.randint(0, 256, (NUM_SLOTS * self.spec.entry_bytes,),
                                    dtype=torch.uint8, generator=gen)  # fmt: skip
        self.used = used
        unused = [s for s in range(NUM_SLOTS) if s not in used]
        for view in layout.mamba_state_views(self.buffer, self.spec, NUM_SLOTS).values():
            view[:, unused] = float("nan")
            view[LAYER, used] = torch.randn(view[LAYER, used].shape, generator=gen).to(view.dtype)

    def window(self, buffer):
        return layout.mamba_state_views(buffer, self.spec, NUM_SLOTS)["conv0"][LAYER]

    def masked(self, buffer):
        """A copy with the batch's windows and the sink zeroed (the rest must not change)."""
        copy = buffer.clone()
        self.window(copy)[self.used] = 0
        copy[: self.spec.entry_bytes] = 0
        return copy


def _inputs(lens, channels, width, dtype, has_bias, seed=3):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_SLOTS - 1, generator=gen)[: len(lens)] + 1
    q_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    q_indptr[1:] = torch.tensor(lens).cumsum(0)
    x = torch.randn(sum(lens), channels + 3, generator=gen).to(dtype)[:, 2:-1]  # row stride C + 3
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    bias = torch.randn(channels, generator=gen).to(dtype) if has_bias else None
    return slots, q_indptr, x, weight, bias


def _check(lens, channels, width, dtype, *, has_bias=True, activation="silu", config=None,
           view=None):  # fmt: skip
    """Run the Triton conv and the reference on two copies of one pool and compare;
    ``view`` maps the pool's window view to the one the ops get (default: itself)."""
    slots, q_indptr, x, weight, bias = _inputs(lens, channels, width, dtype, has_bias)
    pool = Pool(channels, width, dtype, slots.tolist(), seed=5)
    view = view or (lambda v: v)
    outs, buffers = {}, {}
    for name, op in (("triton", conv_ops.causal_conv1d), ("torch", recurrent_ref.causal_conv1d)):
        buffers[name] = pool.buffer.clone()
        kw = {"config": config} if name == "triton" else {}
        outs[name] = op(x, view(pool.window(buffers[name])), slots, q_indptr, weight, bias,
                        max_q_len=max(lens), activation=activation, **kw)  # fmt: skip
    tol = TOL[dtype]
    assert outs["triton"].dtype == dtype
    torch.testing.assert_close(outs["triton"], outs["torch"], **tol)
    got, want = pool.window(buffers["triton"]), pool.window(buffers["torch"])
    torch.testing.assert_close(got[slots], want[slots], **tol)
    assert torch.equal(pool.masked(buffers["triton"]), pool.masked(pool.buffer))
    before = pool.window(pool.buffer)
    for b, n in enumerate(lens):
        if n == 0:  # a request with no new tokens keeps its window, bit for bit
            assert torch.equal(got[slots[b]].view(torch.uint8), before[slots[b]].view(torch.uint8))


@pytest.mark.parametrize(
    ("batch", "channels", "width", "dtype", "config"),
    [
        (1, 37, 4, torch.float32, None),
        (3, 37, 2, torch.float32, {"lanes": 2}),  # a partial lane block
        (7, 300, 3, torch.bfloat16, {"lanes": 4, "block_c": 128}),  # 3 channel blocks
        (7, 300, 4, torch.float32, None),
        (3, 19, 4, torch.bfloat16, {"lanes": 8, "block_c": 16, "num_warps": 2}),  # lanes > B
        (3, 21, 5, torch.float32, None),  # a width past 4
    ],
)
def test_decode_matches_reference(batch, channels, width, dtype, config):
    _check([1] * batch, channels, width, dtype, config=config)


def test_decode_config_fills_the_grid_then_grows_tiles():
    """Lanes per program stay 1 until the grid has DECODE_MIN_PROGRAMS programs to spare."""
    assert conv_ops.decode_config(1, 8192) == (256, 1)
    assert conv_ops.decode_config(32, 8192) == (256, 1)  # 1024 programs: no room
    assert conv_ops.decode_config(256, 8192) == (256, 4)  # DECODE_MAX_LANES
    assert conv_ops.decode_config(64, 37) == (64, 1)
    for bsz in (1, 7, 64, 256, 1000):
        block_c, lanes = conv_ops.decode_config(bsz, 10240)
        programs = -(-10240 // block_c) * -(-bsz // lanes)
        assert lanes == 1 or programs >= conv_ops.DECODE_MIN_PROGRAMS


@pytest.mark.parametrize(
    ("lens", "channels", "width", "dtype", "config"),
    [
        ([3, 0, 6, 1], 37, 4, torch.float32, None),
        ([0, 1, 2, 9, 17, 5], 37, 4, torch.float32, {"block_t": 4, "chunk_t": 8}),  # cut
        ([2, 11, 1], 300, 3, torch.bfloat16, {"block_t": 4, "chunk_t": 4, "block_c": 128}),
        ([5, 1, 13], 21, 2, torch.float32, {"block_t": 2, "chunk_t": 4}),
        ([3, 7, 0, 12], 32, 4, torch.bfloat16, {"block_c": 16, "block_t": 4, "chunk_t": 8}),
        ([4, 9], 21, 5, torch.float32, {"block_t": 4, "chunk_t": 8}),  # a width past 4
    ],
)
def test_prefill_matches_reference(lens, channels, width, dtype, config):
    _check(lens, channels, width, dtype, config=config)


@pytest.mark.parametrize("lens", [[1, 1, 1], [4, 0, 7]], ids=["decode", "prefill"])
def test_no_bias_no_activation_and_an_unpacked_window(lens):
    """A window view and a weight with unit stride on channels (not packed (C, K) rows)
    take the general-stride path; no bias, no activation."""

    def transposed(view):  # same values, stored (S, K, C) in a scratch copy
        scratch = view.transpose(1, 2).contiguous().transpose(1, 2)
        transposed.scratch, transposed.pool_view = scratch, view
        return scratch

    slots, q_indptr, x, weight, _ = _inputs(lens, 13, 4, torch.float32, False)
    weight = weight.t().contiguous().t()  # unit stride on channels too
    pool = Pool(13, 4, torch.float32, slots.tolist(), seed=5)
    want_state = pool.window(pool.buffer.clone())
    want = recurrent_ref.causal_conv1d(x, want_state, slots, q_indptr, weight, None,
                                       max_q_len=max(lens), activation=None)  # fmt: skip
    state = transposed(pool.window(pool.buffer.clone()))
    assert state.stride(1) == 1
    got = conv_ops.causal_conv1d(x, state, slots, q_indptr, weight, None,
                                 max_q_len=max(lens), activation=None)  # fmt: skip
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(state[slots], want_state[slots], **TOL[torch.float32])


def test_prefill_then_decode_continues_the_window():
    """A prompt in two prefill chunks, then two decode steps, equals the reference's one
    pass over the same tokens (the window carries over between launches)."""
    lens, channels, width = [9, 4], 37, 4
    slots, q_indptr, x, weight, bias = _inputs([9 + 2, 4 + 2], channels, width,
                                               torch.float32, True)  # fmt: skip
    pool = Pool(channels, width, torch.float32, slots.tolist(), seed=5)
    ref_buf, got_buf = pool.buffer.clone(), pool.buffer.clone()
    want = recurrent_ref.causal_conv1d(x, pool.window(ref_buf), slots, q_indptr, weight, bias,
                                       max_q_len=11, activation="silu")  # fmt: skip
    rows = [torch.arange(q_indptr[b], q_indptr[b + 1]) for b in range(2)]
    steps = [[r[: n] for r, n in zip(rows, lens)]] + [[r[n + i : n + i + 1] for r, n in
             zip(rows, lens)] for i in range(2)]  # fmt: skip
    for step in steps:
        idx = torch.cat(step)
        indptr = torch.tensor([0, len(step[0]), len(idx)], dtype=torch.int32)
        out = conv_ops.causal_conv1d(x[idx], pool.window(got_buf), slots, indptr, weight, bias,
                                     max_q_len=max(len(s) for s in step), activation="silu",
                                     config={"block_t": 2, "chunk_t": 4})  # fmt: skip
        torch.testing.assert_close(out, want[idx], **TOL[torch.float32])
    torch.testing.assert_close(pool.window(got_buf)[slots], pool.window(ref_buf)[slots])
