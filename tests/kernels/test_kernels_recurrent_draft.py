"""Per-draft-position state slots of the recurrent ops (speculative verify steps).

With ``draft_slots`` (B, k), each op also writes the state after token j of lane b
(j < k, j < the lane's tokens - 1) into slot ``draft_slots[b, j]``. Checked for the
conv, Gated DeltaNet (per-head gates in the kernel, and KDA's per-channel decay) and
Mamba-2's scan, Triton (``TRITON_INTERPRET=1``) against the torch reference, and both
against an independent oracle: the reference run on lane b's first j + 1 tokens alone
(no draft slots), whose final state must be what slot ``draft_slots[b, j]`` holds.
Every slot no lane should write (unused draft slots included) keeps its bytes; the
lanes' outputs and final states equal a run without draft slots. The same checks run
on a CUDA GPU with ``-m gpu`` (the Triton kernels compiled).
"""

from __future__ import annotations

import pytest
import torch

from unikv import layout
from unikv.kernels.recurrent import ref as recurrent_ref
from unikv.kernels.recurrent import triton_ops as recurrent
from unikv.specs import MambaSpec, StatePart

LENS = [4, 1, 3, 4]  # lane 1: no draft (one token); the last lane is padding (the sink)
K = 3  # draft slots per lane: lane 0 writes 3 of them, lane 2 two, lane 1 none
NUM_SLOTS = 1 + len(LENS) * (1 + K)
TOL = {"atol": 2e-5, "rtol": 2e-5}


def _layout(seed: int = 0):
    """(slots (B,), draft_slots (B, K), q_indptr): a random permutation of the real
    slots over the live and draft slots; the padded lane's all 0 (the sink)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_SLOTS - 1, generator=gen) + 1
    slots = perm[: len(LENS)].clone()
    draft = perm[len(LENS) : len(LENS) * (1 + K)].view(len(LENS), K).clone()
    slots[-1], draft[-1] = 0, 0
    q_indptr = torch.zeros(len(LENS) + 1, dtype=torch.int32)
    q_indptr[1:] = torch.tensor(LENS).cumsum(0)
    return slots, draft, q_indptr


class Pool:
    """A one-layer MambaSpec buffer: random states in the live slots, NaN elsewhere."""

    def __init__(self, conv_shape, temporal_shape, live, seed):
        temporal = StatePart(temporal_shape) if temporal_shape else None
        self.spec = MambaSpec(1, (StatePart(conv_shape),), temporal)
        gen = torch.Generator().manual_seed(seed)
        self.buffer = torch.zeros(NUM_SLOTS * self.spec.entry_bytes, dtype=torch.uint8)
        for view in self.views(self.buffer):
            view.fill_(float("nan"))
            view[live] = torch.randn(view[live].shape, generator=gen)

    def views(self, buffer):
        views = layout.mamba_state_views(buffer, self.spec, NUM_SLOTS)
        return [views[n][0] for n in ("conv0", "temporal") if n in views]

    def part(self, op: str, buffer) -> torch.Tensor:
        """The (S, ...) view of the state ``op`` updates (the conv's, else temporal)."""
        views = self.views(buffer)
        return views[0] if op == "causal_conv1d" else views[1]

    def slot(self, buffer, s: int) -> torch.Tensor:
        """Slot s's bytes (every part)."""
        size = self.spec.entry_bytes
        return buffer[s * size : (s + 1) * size]


def _run(pool, impl, op, inputs, slots, q_indptr, buffer, draft=None, max_q_len=None):
    """op over ``inputs`` (per token rows, sliced by q_indptr) on ``buffer``."""
    state = pool.part(op, buffer)
    args, kwargs = inputs(state, slots, q_indptr)
    lens = (q_indptr[1:] - q_indptr[:-1]).tolist()
    return getattr(impl, op)(*args, max_q_len=max_q_len or max(lens), draft_slots=draft, **kwargs)


def _rows(tensors, start, end):
    return [t[start:end] if t is not None and t.dim() and t.shape[0] == sum(LENS) else t
            for t in tensors]  # fmt: skip


def _check(pool, op, make_inputs, device="cpu"):
    """The module docstring's checks of ``op`` on ``device`` (the pool copied there)."""
    slots, draft, q_indptr = (t.to(device) for t in _layout())
    live = slots[:-1].tolist()
    tensors, extra = make_inputs()
    tensors = [t.to(device) for t in tensors]
    extra = {n: tuple(t.to(device) for t in v) if n == "gating" else v for n, v in extra.items()}
    initial = pool.buffer.to(device)

    def inputs_of(rows):
        return lambda state, s, qi: op_args(op, rows, state, s, qi, extra)

    every = inputs_of(tensors)
    buffers = {n: initial.clone() for n in ("triton", "torch", "plain")}
    outs = {
        "triton": _run(pool, recurrent, op, every, slots, q_indptr, buffers["triton"], draft),
        "torch": _run(pool, recurrent_ref, op, every, slots, q_indptr, buffers["torch"], draft),
        "plain": _run(pool, recurrent_ref, op, every, slots, q_indptr, buffers["plain"]),
    }
    real = int(q_indptr[-2])  # the padded lane's rows read the sink: garbage
    torch.testing.assert_close(outs["triton"][:real], outs["torch"][:real], **TOL)
    torch.testing.assert_close(outs["torch"][:real], outs["plain"][:real], **TOL)
    written = set()
    for b, n in enumerate(LENS[:-1]):
        start = int(q_indptr[b])
        for s in [int(slots[b])]:  # the live slot: the state after every token
            for name in ("triton", "torch"):
                got = pool.slot(buffers[name], s).view(torch.float32)
                want = pool.slot(buffers["plain"], s).view(torch.float32)
                torch.testing.assert_close(got, want, **TOL)
        for j in range(min(n - 1, K)):  # the oracle: lane b's first j + 1 tokens alone
            alone = initial.clone()
            one = torch.tensor([0, j + 1], dtype=torch.int32, device=device)
            rows = _rows(tensors, start, start + j + 1)
            _run(pool, recurrent_ref, op, inputs_of(rows), slots[b : b + 1], one, alone)
            want = pool.part(op, alone)[int(slots[b])]
            target = int(draft[b, j])
            written.add(target)
            for name in ("triton", "torch"):
                got = pool.part(op, buffers[name])[target]
                torch.testing.assert_close(got, want, **TOL, msg=f"{name} lane {b} draft {j}")
    untouched = [s for s in range(1, NUM_SLOTS) if s not in written and s not in live]
    assert len(untouched) >= K + 2  # lane 1's draft slots, lane 2's last, the padded lane's
    for s in untouched:
        for name in ("triton", "torch"):
            assert torch.equal(pool.slot(buffers[name], s), pool.slot(initial, s)), (
                f"{name} wrote slot {s}, which no lane's draft position names"
            )


def op_args(op, rows, state, slots, q_indptr, extra):
    if op == "causal_conv1d":
        x, weight, bias = rows
        return (x, state, slots, q_indptr, weight, bias), {"activation": "silu"}
    if op == "gated_delta_rule":
        q, k, v, g, beta = rows
        return (q, k, v, g, beta, state, slots, q_indptr), extra
    x, dt, A, B, C, D, dt_bias = rows
    return (x, dt, A, B, C, D, dt_bias, state, slots, q_indptr), extra


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # cpu: the interpreter


@pytest.mark.parametrize("device", DEVICES)
def test_conv_draft_windows(device):
    channels, width, gen = 13, 4, torch.Generator().manual_seed(1)
    slots = _layout()[0][:-1].tolist()
    pool = Pool((channels, width), None, slots, seed=2)

    def inputs():
        return [_randn(gen, sum(LENS), channels), _randn(gen, channels, width),
                _randn(gen, channels)], {}  # fmt: skip

    _check(pool, "causal_conv1d", inputs, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gates", ["gating", "per_channel"])
def test_gated_delta_rule_draft_states(gates, device):
    heads, dim_k, dim_v, gen = 4, 5, 7, torch.Generator().manual_seed(3)
    slots = _layout()[0][:-1].tolist()
    pool = Pool((3, 2), (heads, dim_k, dim_v), slots, seed=4)
    t = sum(LENS)

    def inputs():
        q, k = (_randn(gen, t, heads // 2, dim_k) for _ in range(2))
        v = _randn(gen, t, heads, dim_v)
        extra = {"scale": dim_k**-0.5, "use_qk_l2norm": True}
        if gates == "gating":  # raw a, b and (A_log, dt_bias): the gates in the kernel
            g, beta = _randn(gen, t, heads) * 2, _randn(gen, t, heads)
            extra["gating"] = (_randn(gen, heads) * 0.5, _randn(gen, heads))
        else:  # KDA: a log decay per key channel, computed
            g, beta = (
                -torch.rand(t, heads, dim_k, generator=gen),
                torch.rand(t, heads, generator=gen),
            )
        return [q, k, v, g, beta], extra

    _check(pool, "gated_delta_rule", inputs, device)


@pytest.mark.parametrize("device", DEVICES)
def test_mamba2_ssd_draft_states(device):
    heads, groups, dim_p, dim_n, gen = 6, 3, 6, 5, torch.Generator().manual_seed(5)
    slots = _layout()[0][:-1].tolist()
    pool = Pool((3, 2), (heads, dim_p, dim_n), slots, seed=6)
    t = sum(LENS)

    def inputs():
        x, dt = _randn(gen, t, heads, dim_p), _randn(gen, t, heads)
        A = -torch.rand(heads, generator=gen) - 0.5
        B, C = (_randn(gen, t, groups, dim_n) for _ in range(2))
        D, dt_bias = _randn(gen, heads), _randn(gen, heads)
        return [x, dt, A, B, C, D, dt_bias], {"dt_softplus": True, "dt_limit": (0.0, 1e9)}

    _check(pool, "mamba2_ssd", inputs, device)


def test_bad_draft_slots_are_a_value_error():
    pool = Pool((13, 4), None, [3], seed=7)
    conv = pool.views(pool.buffer)[0]
    slots, q_indptr = torch.tensor([3]), torch.tensor([0, 2], dtype=torch.int32)
    x, w = torch.zeros(2, 13), torch.zeros(13, 4)
    for bad, match in ((torch.zeros(2, 3, dtype=torch.int64), r"\(B, k\) = \(1, k >= 1\)"),
                       (torch.zeros(1, 0, dtype=torch.int64), r"\(B, k\)"),
                       (torch.zeros(3, dtype=torch.int64), "2-D"),
                       (torch.zeros(1, 2), "int32/int64")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            recurrent.causal_conv1d(x, conv, slots, q_indptr, w, None, max_q_len=2,
                                    activation=None, draft_slots=bad)  # fmt: skip
