"""A second destination of the final state (``ckpt_slots``, issue 41): a prefill chunk
that ends at a prefix-cache checkpoint writes its state into the checkpoint slot in
the same op, instead of a slot copy after the step.

For the conv, Gated DeltaNet and Mamba-2's scan, Triton (``TRITON_INTERPRET=1`` on
CPU, compiled with ``-m gpu``) and the torch reference, prefill-shaped and
decode-shaped steps: the outputs and live slots equal a run without ``ckpt_slots``;
each checkpoint slot holds exactly the bytes the lane's live slot holds after the op
(the second description: what the removed copy would have copied); every slot no lane
names (the lane without a checkpoint names the sink) keeps its bytes. fla-core's
scatter (GPU-only kernels) is checked on CPU over its own inputs.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_recurrent_draft import NUM_SLOTS, Pool, _randn, op_args

from unikv.kernels.recurrent import fla_prefill
from unikv.kernels.recurrent import ref as recurrent_ref
from unikv.kernels.recurrent import triton_ops as recurrent

TOL = {"atol": 2e-5, "rtol": 2e-5}
SHAPES = {"prefill": [5, 2, 3, 2], "decode": [1, 1, 1, 1]}  # the last lane: padding
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # cpu: the interpreter


def _layout(lens, seed=0):
    """(slots, ckpt_slots, q_indptr): lanes 0 and 2 name a checkpoint slot, lane 1 and
    the padded lane the sink; slots a random permutation of the real ones."""
    perm = torch.randperm(NUM_SLOTS - 1, generator=torch.Generator().manual_seed(seed)) + 1
    slots = perm[:4].clone()
    slots[-1] = 0
    ckpt = torch.tensor([int(perm[4]), 0, int(perm[5]), 0])
    q_indptr = torch.zeros(5, dtype=torch.int32)
    q_indptr[1:] = torch.tensor(lens).cumsum(0)
    return slots, ckpt, q_indptr


def _check(op, make_pool, make_inputs, shape, device):
    lens = SHAPES[shape]
    slots, ckpt, q_indptr = (t.to(device) for t in _layout(lens))
    pool = make_pool(slots[:-1].tolist())
    tensors, extra = make_inputs(sum(lens))
    tensors = [t.to(device) for t in tensors]
    extra = {n: tuple(t.to(device) for t in v) if n == "gating" else v for n, v in extra.items()}
    initial = pool.buffer.to(device)
    runs = {("triton", True): recurrent, ("torch", True): recurrent_ref}
    runs |= {("triton", False): recurrent, ("torch", False): recurrent_ref}
    buffers, outs = {}, {}
    for (name, with_ckpt), impl in runs.items():
        buffer = initial.clone()
        args, kwargs = op_args(op, tensors, pool.part(op, buffer), slots, q_indptr, extra)
        if with_ckpt:
            kwargs["ckpt_slots"] = ckpt
        outs[name, with_ckpt] = getattr(impl, op)(*args, max_q_len=max(lens), **kwargs)
        buffers[name, with_ckpt] = buffer
    real = int(q_indptr[-2])  # the padded lane's rows read the sink: garbage
    torch.testing.assert_close(outs["triton", True][:real], outs["torch", False][:real], **TOL)
    for name in ("triton", "torch"):
        assert torch.equal(outs[name, True][:real], outs[name, False][:real])
        got, plain = buffers[name, True], buffers[name, False]
        for b in range(3):  # the live slots: as without checkpoints
            s = int(slots[b])
            assert torch.equal(pool.slot(got, s), pool.slot(plain, s)), f"{name} lane {b}"
        for b in (0, 2):  # the checkpoint slot: the lane's live slot's bytes after the op
            part, before = pool.part(op, got), pool.part(op, initial)
            live, target = part[int(slots[b])], part[int(ckpt[b])]
            assert torch.equal(target, live), f"{name}: lane {b}'s checkpoint slot"
            assert not torch.equal(target, before[int(ckpt[b])])
        named = set(slots.tolist()) | set(ckpt.tolist())
        for s in range(1, NUM_SLOTS):
            if s not in named:
                assert torch.equal(pool.slot(got, s), pool.slot(initial, s)), (
                    f"{name} wrote slot {s}, which no lane names"
                )
    torch.testing.assert_close(
        pool.part(op, buffers["triton", True])[ckpt[[0, 2]]],
        pool.part(op, buffers["torch", False])[slots[[0, 2]]],
        **TOL,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_conv_writes_the_final_window_into_the_checkpoint_slot(shape, device):
    channels, width, gen = 13, 4, torch.Generator().manual_seed(1)

    def inputs(t):
        return [_randn(gen, t, channels), _randn(gen, channels, width), _randn(gen, channels)], {}

    _check("causal_conv1d", lambda live: Pool((channels, width), None, live, 2), inputs, shape,
           device)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gated_delta_rule_writes_the_final_state_into_the_checkpoint_slot(shape, device):
    heads, dim_k, dim_v, gen = 4, 5, 7, torch.Generator().manual_seed(3)

    def inputs(t):
        q, k = (_randn(gen, t, heads // 2, dim_k) for _ in range(2))
        v = _randn(gen, t, heads, dim_v)
        g, beta = _randn(gen, t, heads) * 2, _randn(gen, t, heads)
        extra = {"scale": dim_k**-0.5, "use_qk_l2norm": True}
        extra["gating"] = (_randn(gen, heads) * 0.5, _randn(gen, heads))
        return [q, k, v, g, beta], extra

    pool = lambda live: Pool((3, 2), (heads, dim_k, dim_v), live, 4)
    _check("gated_delta_rule", pool, inputs, shape, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_mamba2_ssd_writes_the_final_state_into_the_checkpoint_slot(shape, device):
    heads, groups, dim_p, dim_n, gen = 6, 3, 6, 5, torch.Generator().manual_seed(5)

    def inputs(t):
        x, dt = _randn(gen, t, heads, dim_p), _randn(gen, t, heads)
        A = -torch.rand(heads, generator=gen) - 0.5
        B, C = (_randn(gen, t, groups, dim_n) for _ in range(2))
        D, dt_bias = _randn(gen, heads), _randn(gen, heads)
        return [x, dt, A, B, C, D, dt_bias], {"dt_softplus": True, "dt_limit": (0.0, 1e9)}

    pool = lambda live: Pool((3, 2), (heads, dim_p, dim_n), live, 6)
    _check("mamba2_ssd", pool, inputs, shape, device)


def test_fla_scatter_writes_both_destinations_and_keeps_idle_lanes():
    """fla-core's path: the final states of lanes with tokens go to their slot and
    their checkpoint slot in one write; a lane without tokens keeps its initial state
    (in both); nothing else changes (a naive per-lane write is the oracle)."""
    gen = torch.Generator().manual_seed(8)
    state = torch.randn(9, 2, 3, generator=gen)
    slots, ckpt = torch.tensor([4, 2, 7]), torch.tensor([5, 0, 1])
    q_indptr = torch.tensor([0, 3, 3, 5], dtype=torch.int32)  # lane 1: no tokens
    initial, final = state[slots].clone(), torch.randn(3, 2, 3, generator=gen)
    want = state.clone()
    for b, (s, c) in enumerate(zip(slots.tolist(), ckpt.tolist())):
        value = final[b] if q_indptr[b + 1] > q_indptr[b] else initial[b]
        want[s] = value
        if c:
            want[c] = value
    got = state.clone()
    fla_prefill._scatter(got, slots, q_indptr, initial, final, ckpt)
    assert torch.equal(got[1:], want[1:])  # (slot 0: the sink, written by lane 1)


def test_bad_ckpt_slots_are_a_value_error():
    pool = Pool((13, 4), None, [3], seed=7)
    conv = pool.views(pool.buffer)[0]
    slots, q_indptr = torch.tensor([3]), torch.tensor([0, 2], dtype=torch.int32)
    x, w = torch.zeros(2, 13), torch.zeros(13, 4)
    for bad, match in ((torch.zeros(2, dtype=torch.int64), r"\(B,\) = \(1,\)"),
                       (torch.zeros(1, 1, dtype=torch.int64), "1-D"),
                       (torch.zeros(1), "int32/int64")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            recurrent.causal_conv1d(x, conv, slots, q_indptr, w, None, max_q_len=2,
                                    activation=None, ckpt_slots=bad)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", ["gated_delta_rule", "mamba2_ssd"])
def test_fla_chunked_prefill_writes_the_checkpoint_slot(op):
    """bf16 on CUDA: fla-core's chunked kernels (when installed) or the Triton ones; the
    checkpoint slots hold the lanes' live slots' bytes, the outputs and live slots are
    those of a run without ``ckpt_slots``."""
    gen = torch.Generator().manual_seed(9)
    lens = [37, 3, 64, 2]  # the last lane: padding (the sink)
    slots, ckpt, q_indptr = (t.cuda() for t in _layout(lens))
    t, heads = sum(lens), 4
    if op == "gated_delta_rule":
        pool = Pool((3, 2), (heads, 64, 64), slots[:-1].tolist(), 10)
        q, k = (_randn(gen, t, 2, 64).bfloat16() for _ in range(2))
        rows = [q, k, _randn(gen, t, heads, 64).bfloat16(), _randn(gen, t, heads),
                _randn(gen, t, heads).bfloat16()]  # fmt: skip
        extra = {"scale": 0.125, "use_qk_l2norm": True,
                 "gating": (_randn(gen, heads).cuda() * 0.5, _randn(gen, heads).cuda())}  # fmt: skip
    else:
        pool = Pool((3, 2), (heads, 32, 64), slots[:-1].tolist(), 11)
        rows = [_randn(gen, t, heads, 32).bfloat16(), _randn(gen, t, heads),
                -torch.rand(heads, generator=gen) - 0.5, _randn(gen, t, 2, 64).bfloat16(),
                _randn(gen, t, 2, 64).bfloat16(), _randn(gen, heads), _randn(gen, heads)]  # fmt: skip
        extra = {"dt_softplus": True, "dt_limit": (0.0, 1e9)}
    rows = [r.cuda() for r in rows]
    buffers, outs = {}, {}
    for with_ckpt in (True, False):
        buffer = pool.buffer.cuda()
        args, kwargs = op_args(op, rows, pool.part(op, buffer), slots, q_indptr, extra)
        if with_ckpt:
            kwargs["ckpt_slots"] = ckpt
        outs[with_ckpt] = getattr(recurrent, op)(*args, max_q_len=max(lens), **kwargs)
        buffers[with_ckpt] = buffer
    real = int(q_indptr[-2])
    assert torch.equal(outs[True][:real], outs[False][:real])
    part, plain = pool.part(op, buffers[True]), pool.part(op, buffers[False])
    assert torch.equal(part[slots[:3]], plain[slots[:3]])
    assert torch.equal(part[ckpt[[0, 2]]], part[slots[[0, 2]]])
