"""A checkpoint inside a lane (``ckpt_at``, issue 41): the recurrent ops write the state
after row ``ckpt_at[b]`` of lane b (-1: its last) into ``ckpt_slots[b]``, so a prompt's
last chunk need not end at its page-aligned checkpoint point.

The oracle is independent of the feature: the torch reference run, without any
checkpoint, over exactly each lane's first ``ckpt_at[b] + 1`` tokens; its live slot
after that run is what the checkpoint slot must hold (the conv: the window ending at
that row). Outputs and live slots must equal a run without checkpoints, and no slot
that no lane names may change. Checked for the conv, Gated DeltaNet and Mamba-2's
scan, Triton (``TRITON_INTERPRET=1`` on CPU, compiled with ``-m gpu``) and the torch
reference, and for fla-core's two-call split (``fla_prefill._two_calls``) with fla's
chunked kernels replaced by per-token stand-ins of the same signature (CPU): the
split's index arrays, its second call's gathered tails and its scatter are what runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernels_recurrent_draft import NUM_SLOTS, Pool, _randn, op_args

from unikv.kernels.recurrent import fla_prefill
from unikv.kernels.recurrent import ref as recurrent_ref
from unikv.kernels.recurrent import triton_ops as recurrent

TOL = {"atol": 2e-5, "rtol": 2e-5}
LENS = [6, 3, 5, 4]  # the last lane: padding (the sink)
AT = [2, -1, 0, 3]  # lane 0 inside, lane 1 none (the sink), lane 2 after its first row
REAL = list(range(1, NUM_SLOTS))  # every slot but the sink holds a random state
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # cpu: the interpreter


def _layout(device):
    perm = torch.randperm(NUM_SLOTS - 1, generator=torch.Generator().manual_seed(4)) + 1
    slots = perm[:4].clone()
    slots[-1] = 0
    ckpt = torch.tensor([int(perm[4]), 0, int(perm[5]), 0])
    q_indptr = torch.zeros(5, dtype=torch.int32)
    q_indptr[1:] = torch.tensor(LENS).cumsum(0)
    at = torch.tensor(AT, dtype=torch.int64)
    return [t.to(device) for t in (slots, ckpt, q_indptr, at)]


def _truncated(rows, q_indptr, keep):
    """The per-token ``rows`` of each lane's first ``keep[b]`` tokens, and their q_indptr."""
    starts = q_indptr[:-1].tolist()
    index = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, keep)])
    cut = [r[index.to(r.device)] if r.dim() and r.shape[0] == sum(LENS) else r for r in rows]
    indptr = torch.zeros(len(keep) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(keep).cumsum(0)
    return cut, indptr.to(q_indptr.device)


def _oracle(op, rows, extra, pool, slots, q_indptr):
    """(S, ...) the op's state part after the reference ran each lane's first
    ``AT[b] + 1`` tokens (the lanes with a checkpoint; the others none)."""
    keep = [a + 1 if a >= 0 else 0 for a in AT]
    keep[1] = 0  # lane 1 names the sink: no checkpoint
    cut, indptr = _truncated(rows, q_indptr, keep)
    buffer = pool.buffer.to(slots.device).clone()
    args, kwargs = op_args(op, cut, pool.part(op, buffer), slots, indptr, extra)
    recurrent_ref.__dict__[op](*args, max_q_len=max(keep), **kwargs)
    return pool.part(op, buffer)


def _check(op, impl, pool, rows, extra, device):
    slots, ckpt, q_indptr, at = _layout(device)
    rows = [r.to(device) for r in rows]
    extra = {n: tuple(t.to(device) for t in v) if n == "gating" else v for n, v in extra.items()}
    want = _oracle(op, rows, extra, pool, slots, q_indptr)
    outs, parts = {}, {}
    for with_ckpt in (True, False):
        buffer = pool.buffer.to(device).clone()
        args, kwargs = op_args(op, rows, pool.part(op, buffer), slots, q_indptr, extra)
        if with_ckpt:
            kwargs = {**kwargs, "ckpt_slots": ckpt, "ckpt_at": at}
        outs[with_ckpt] = impl(op)(*args, max_q_len=max(LENS), **kwargs)
        parts[with_ckpt] = (pool.part(op, buffer), buffer)
    real = int(q_indptr[-2])  # the padded lane's rows read the sink: garbage
    assert torch.equal(outs[True][:real], outs[False][:real])
    got, plain = parts[True][0], parts[False][0]
    assert torch.equal(got[slots[:3]], plain[slots[:3]]), "the live slots: as without checkpoints"
    for b in (0, 2):  # the state after row AT[b]: the reference over exactly AT[b] + 1 tokens
        torch.testing.assert_close(got[ckpt[b]], want[slots[b]], **TOL)
        assert not torch.equal(got[ckpt[b]], got[slots[b]]), "a row inside the lane, not its end"
    named = set(slots.tolist()) | set(ckpt.tolist())
    for s in range(1, NUM_SLOTS):
        if s not in named:
            assert torch.equal(pool.slot(parts[True][1], s), pool.slot(pool.buffer.to(device), s))


def _conv_inputs():
    gen = torch.Generator().manual_seed(1)
    t, channels, width = sum(LENS), 13, 4
    rows = [_randn(gen, t, channels), _randn(gen, channels, width), _randn(gen, channels)]
    return Pool((channels, width), None, REAL, 2), rows, {}


def _gdn_inputs():
    heads, dim_k, dim_v, gen, t = 4, 5, 7, torch.Generator().manual_seed(3), sum(LENS)
    q, k = (_randn(gen, t, heads // 2, dim_k) for _ in range(2))
    rows = [q, k, _randn(gen, t, heads, dim_v), _randn(gen, t, heads) * 2, _randn(gen, t, heads)]
    extra = {"scale": dim_k**-0.5, "use_qk_l2norm": True}
    extra["gating"] = (_randn(gen, heads) * 0.5, _randn(gen, heads))
    return Pool((3, 2), (heads, dim_k, dim_v), REAL, 4), rows, extra


def _ssd_inputs():
    heads, groups, dim_p, dim_n, gen, t = 6, 3, 6, 5, torch.Generator().manual_seed(5), sum(LENS)
    rows = [_randn(gen, t, heads, dim_p), _randn(gen, t, heads), -torch.rand(heads, generator=gen)
            - 0.5, _randn(gen, t, groups, dim_n), _randn(gen, t, groups, dim_n),
            _randn(gen, heads), _randn(gen, heads)]  # fmt: skip
    extra = {"dt_softplus": True, "dt_limit": (0.0, 1e9)}
    return Pool((3, 2), (heads, dim_p, dim_n), REAL, 6), rows, extra


INPUTS = {"causal_conv1d": _conv_inputs, "gated_delta_rule": _gdn_inputs, "mamba2_ssd": _ssd_inputs}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("op", sorted(INPUTS))
def test_checkpoint_row_inside_the_lane_holds_the_state_after_that_row(op, impl, device):
    pool, rows, extra = INPUTS[op]()
    module = recurrent if impl == "triton" else recurrent_ref
    _check(op, lambda name: getattr(module, name), pool, rows, extra, device)


def _fake_gdn(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens,
              use_qk_l2norm_in_kernel, chunk_indices=None, chunk_size=None):  # fmt: skip
    """fla-core's ``chunk_gated_delta_rule`` over varlen sequences, per token (the torch
    reference over scratch slots); a given chunk list must be that of ``cu_seqlens``."""
    assert output_final_state and cu_seqlens.dtype == torch.int64
    if chunk_indices is not None:
        want = fla_prefill.chunk_indices(cu_seqlens.cpu().numpy(), chunk_size)
        assert np.array_equal(chunk_indices.cpu().numpy(), want)
    n = cu_seqlens.shape[0] - 1
    state = torch.zeros(n + 1, *initial_state.shape[1:])
    state[1:] = initial_state
    out = recurrent_ref.gated_delta_rule(
        q[0], k[0], v[0], g[0], beta[0], state, torch.arange(1, n + 1), cu_seqlens.int(),
        max_q_len=max(int(cu_seqlens.diff().max()), 1), scale=scale,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
    )  # fmt: skip
    return out[None], state[1:]


def _fake_gla(q, k, v, *, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens):
    """fla-core's ``chunk_simple_gla`` (state [V, K]) over varlen sequences, per token."""
    assert output_final_state and state_v_first
    out, final = torch.zeros(v.shape), initial_state.clone().float()
    bounds = cu_seqlens.tolist()
    for n in range(len(bounds) - 1):
        s = final[n]
        for t in range(bounds[n], bounds[n + 1]):
            s = s * g[0, t].exp()[:, None, None] + v[0, t].float()[:, :, None] * k[0, t][:, None]
            out[0, t] = (s * q[0, t][:, None, :]).sum(-1) * scale
        final[n] = s
    return out, final


@pytest.mark.parametrize("plan_split", [True, False])
@pytest.mark.parametrize("op", ["gated_delta_rule", "mamba2_ssd"])
def test_fla_two_calls_write_the_state_after_the_checkpoint_row(op, plan_split, monkeypatch):
    """fla-core's path (two varlen calls: heads and tails split at the checkpoint rows,
    then the tails from the heads' final states) with per-token stand-ins for its
    kernels: the same bytes as the reference over exactly the checkpoint's tokens.
    ``plan_split``: the split's arrays made on the host and uploaded (the planner's),
    else derived from the device."""
    monkeypatch.setattr(fla_prefill, "_fla", lambda: (_fake_gdn, _fake_gla))
    pool, rows, extra = INPUTS[op]()

    def impl(name):
        def call(*args, max_q_len, ckpt_slots=None, ckpt_at=None, **kwargs):
            if ckpt_at is not None and plan_split:
                q_indptr = args[7] if name == "gated_delta_rule" else args[9]
                arrays = fla_prefill.ckpt_split(q_indptr.numpy(), ckpt_at.numpy())
                kwargs["ckpt_split"] = fla_prefill.CkptSplit(*map(torch.from_numpy, arrays))
            return getattr(fla_prefill, name)(
                *args, ckpt_slots=ckpt_slots, ckpt_at=ckpt_at, **kwargs
            )

        return call

    _check(op, impl, pool, rows, extra, "cpu")


def test_ckpt_split_arrays_match_a_per_lane_description():
    """``ckpt_split`` against lanes written out by hand: lane 0 cut after row 2, lane 1
    not (-1), lane 2 empty, lane 3 cut after its first row, lane 4 at its last (no cut)."""
    q_indptr = np.array([0, 6, 9, 9, 14, 17])
    arrays = fla_prefill.ckpt_split(q_indptr, np.array([2, -1, 3, 0, 2]))
    split, _, heads, lanes, rows, tail_indptr, _, sources = arrays
    assert sources.tolist() == [0, 0, 1, 2, 3, 3, 4]  # each sequence's lane (a tail: its own)
    assert split.tolist() == [0, 3, 6, 9, 9, 10, 14, 17]
    assert heads.tolist() == [0, 2, 3, 4, 6]
    assert lanes.tolist() == [0, 3]
    assert rows.tolist() == [3, 4, 5, 10, 11, 12, 13]
    assert tail_indptr.tolist() == [0, 3, 7]
    assert fla_prefill.ckpt_split(q_indptr, np.array([-1, 2, 0, 4, -1])) is None


def test_ckpt_at_without_slots_or_misshapen_is_a_value_error():
    slots, q_indptr = torch.tensor([3]), torch.tensor([0, 2], dtype=torch.int32)
    x, w = torch.zeros(2, 13), torch.zeros(13, 4)
    conv = Pool((13, 4), None, [3], seed=7)
    view = conv.views(conv.buffer)[0]
    at = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="ckpt_at needs ckpt_slots"):
        recurrent.causal_conv1d(x, view, slots, q_indptr, w, None, max_q_len=2,
                                activation=None, ckpt_at=at)  # fmt: skip
    with pytest.raises(ValueError, match=r"ckpt_at must be \(B,\)"):
        recurrent.causal_conv1d(x, view, slots, q_indptr, w, None, max_q_len=2, activation=None,
                                ckpt_slots=slots, ckpt_at=torch.zeros(2, dtype=torch.int64))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("plan_split", [True, False])
@pytest.mark.parametrize("op", ["gated_delta_rule", "mamba2_ssd"])
def test_fla_checkpoint_rows_on_cuda(op, plan_split):
    """bf16 on CUDA: fla-core's chunked kernels (when installed; else the Triton ones)
    with checkpoint rows inside lanes longer than fla's chunk: each checkpoint slot
    holds what the same op leaves after exactly the lane's first ``at + 1`` tokens, the
    outputs and live slots those of a run without checkpoints (bf16 tolerances: the
    split's second call restarts fla's chunking at the checkpoint row)."""
    gen = torch.Generator().manual_seed(9)
    lens, at = [150, 3, 70, 2], [128, -1, 5, -1]  # the last lane: padding (the sink)
    perm = torch.randperm(NUM_SLOTS - 1, generator=gen) + 1
    slots = torch.cat([perm[:3], torch.zeros(1, dtype=torch.int64)]).cuda()
    ckpt = torch.tensor([int(perm[4]), 0, int(perm[5]), 0]).cuda()
    q_indptr = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32).cuda()
    ckpt_at = torch.tensor(at).cuda()
    t, heads = sum(lens), 4
    if op == "gated_delta_rule":
        pool = Pool((3, 2), (heads, 64, 64), REAL, 10)
        rows = [_randn(gen, t, 2, 64), _randn(gen, t, 2, 64), _randn(gen, t, heads, 64),
                _randn(gen, t, heads), _randn(gen, t, heads)]  # fmt: skip
        rows = [r.bfloat16() if i != 3 else r for i, r in enumerate(rows)]
        extra = {"scale": 0.125, "use_qk_l2norm": True,
                 "gating": (_randn(gen, heads).cuda() * 0.5, _randn(gen, heads).cuda())}  # fmt: skip
    else:
        pool = Pool((3, 2), (heads, 32, 64), REAL, 11)
        rows = [_randn(gen, t, heads, 32).bfloat16(), _randn(gen, t, heads),
                -torch.rand(heads, generator=gen) - 0.5, _randn(gen, t, 2, 64).bfloat16(),
                _randn(gen, t, 2, 64).bfloat16(), _randn(gen, heads), _randn(gen, heads)]  # fmt: skip
        extra = {"dt_softplus": True, "dt_limit": (0.0, 1e9)}
    rows = [r.cuda() for r in rows]
    tol = {"atol": 3e-2, "rtol": 3e-2}
    runs = {}
    for with_ckpt in (True, False):
        buffer = pool.buffer.clone().cuda()
        args, kwargs = op_args(op, rows, pool.part(op, buffer), slots, q_indptr, extra)
        if with_ckpt:
            kwargs = {**kwargs, "ckpt_slots": ckpt, "ckpt_at": ckpt_at}
            if plan_split:
                arrays = fla_prefill.ckpt_split(q_indptr.cpu().numpy(), np.array(at))
                split = fla_prefill.CkptSplit(*(torch.from_numpy(a).cuda() for a in arrays))
                kwargs["ckpt_split"] = split
        out = getattr(recurrent, op)(*args, max_q_len=max(lens), **kwargs)
        runs[with_ckpt] = (out, pool.part(op, buffer))
    real = sum(lens[:3])
    torch.testing.assert_close(runs[True][0][:real].float(), runs[False][0][:real].float(), **tol)
    got, plain = runs[True][1], runs[False][1]
    torch.testing.assert_close(got[slots[:3]], plain[slots[:3]], **tol)
    keep = [a + 1 for a in (at[0], 0, at[2])]
    keep[1] = 0
    starts = [0, lens[0], lens[0] + lens[1]]
    index = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, keep)]).cuda()
    cut = [r[index] if r.dim() and r.shape[0] == t else r for r in rows]
    indptr = torch.tensor([0, *np.cumsum(keep)], dtype=torch.int32).cuda()
    buffer = pool.buffer.clone().cuda()
    args, kwargs = op_args(op, cut, pool.part(op, buffer), slots[:3], indptr, extra)
    getattr(recurrent, op)(*args, max_q_len=max(keep), **kwargs)
    want = pool.part(op, buffer)
    for b in (0, 2):
        torch.testing.assert_close(got[ckpt[b]], want[slots[b]], **tol)
