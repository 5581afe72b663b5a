"""Recurrent-state kernels (Triton under TRITON_INTERPRET=1) against the torch reference
and against transformers' own functions, over real strided Mamba sub-pool views.

The pool is a MambaSpec buffer of random bytes with NaN in every slot not handed out
(the sink, slot 0, included); requests get a random permutation of slots, padded
lanes point at the sink. After each op the whole buffer must equal the reference's
buffer byte for byte, except the states of the batch's slots (compared numerically)
and the sink.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from transformers.models.nemotron_h import modeling_nemotron_h as hf_nemotron
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen

from unikv import layout
from unikv.kernels.recurrent import fla_prefill as recurrent_fla
from unikv.kernels.recurrent import ref as recurrent_ref
from unikv.kernels.recurrent import triton_ops as recurrent
from unikv.specs import MambaSpec, StatePart

LAYER, NUM_SLOTS = 1, 9
TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
DECODE_LENS = [1, 1, 1, 1]  # the last lane is padding (slot 0)
PREFILL_LENS = [3, 0, 6, 1, 0]  # lane 1 has no new tokens; the last lane is padding


class SlotPool:
    """One per-layer conv view (S, C, K) and temporal view (S, *shape) of a 2-layer pool."""

    def __init__(self, conv_shape, temporal_shape, conv_dtype, used, seed):
        self.spec = MambaSpec(2, (StatePart(conv_shape, conv_dtype),), StatePart(temporal_shape))
        gen = torch.Generator().manual_seed(seed)
        nbytes = NUM_SLOTS * self.spec.entry_bytes
        self.buffer = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        self.used = used
        unused = [s for s in range(NUM_SLOTS) if s not in used]
        for view in self.views().values():
            view[:, unused] = float("nan")
            view[LAYER, used] = torch.randn(view[LAYER, used].shape, generator=gen).to(view.dtype)

    def views(self, buffer=None):
        return layout.mamba_state_views(
            self.buffer if buffer is None else buffer, self.spec, NUM_SLOTS
        )

    def layer_views(self, buffer):
        views = self.views(buffer)
        return views["conv0"][LAYER], views["temporal"][LAYER]

    def masked(self, buffer):
        """A copy with the batch's states and the sink slot zeroed: must match byte for byte."""
        copy = buffer.clone()
        for view in self.views(copy).values():
            view[LAYER, self.used] = 0
        copy[: self.spec.entry_bytes] = 0
        return copy


def _batch(lens, seed):
    """slots (B,) int64: a random permutation of slots 1.. for real lanes, 0 for the last;
    q_indptr (B+1,) int32."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_SLOTS - 1, generator=gen)[: len(lens)] + 1
    slots[-1] = 0
    q_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    q_indptr[1:] = torch.tensor(lens).cumsum(0)
    return slots, q_indptr


def _run_both(pool, op, args_fn, lens, out_dtype):
    """Run the Triton op and the reference on two copies of the pool; compare everything."""
    slots, q_indptr = _batch(lens, seed=7)
    buffers = {"triton": pool.buffer.clone(), "torch": pool.buffer.clone()}
    outs = {}
    for name, impl in (("triton", recurrent), ("torch", recurrent_ref)):
        conv, temporal = pool.layer_views(buffers[name])
        args, kwargs = args_fn(conv, temporal, slots, q_indptr)
        outs[name] = getattr(impl, op)(*args, max_q_len=max(lens), **kwargs)
    real = q_indptr[-2].item()  # rows of the padded last lane are garbage (sink state)
    tol = TOL[out_dtype]
    assert outs["triton"].dtype == outs["torch"].dtype == out_dtype
    torch.testing.assert_close(outs["triton"][:real], outs["torch"][:real], **tol)
    for got, want in zip(pool.layer_views(buffers["triton"]), pool.layer_views(buffers["torch"])):
        torch.testing.assert_close(got[slots[:-1]], want[slots[:-1]], **tol)
    untouched = pool.masked(pool.buffer)  # no op may write outside the batch's states and the sink
    assert torch.equal(pool.masked(buffers["triton"]), untouched)
    assert torch.equal(pool.masked(buffers["torch"]), untouched)
    before = pool.layer_views(pool.buffer)
    for b, n in enumerate(lens[:-1]):
        if n == 0:  # a lane with no new tokens keeps its state, bit for bit
            for got, old in zip(pool.layer_views(buffers["triton"]), before):
                assert torch.equal(got[slots[b]].view(torch.uint8), old[slots[b]].view(torch.uint8))
    return outs["triton"]


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("lens", [DECODE_LENS, PREFILL_LENS], ids=["decode", "prefill"])
@pytest.mark.parametrize(
    ("width", "activation", "has_bias", "dtype"),
    [
        (4, "silu", True, torch.float32),
        (3, None, False, torch.float32),
        (4, "silu", True, torch.bfloat16),
    ],
)
def test_conv_matches_reference(lens, width, activation, has_bias, dtype):
    channels, gen = 13, torch.Generator().manual_seed(1)
    used = _batch(lens, seed=7)[0][:-1].tolist()
    pool = SlotPool((channels, width), (1,), dtype, used, seed=2)
    x = _randn(gen, sum(lens), channels, dtype=dtype)
    weight = _randn(gen, channels, width, dtype=dtype)
    bias = _randn(gen, channels, dtype=dtype) if has_bias else None

    def args(conv, temporal, slots, q_indptr):
        return (x, conv, slots, q_indptr, weight, bias), {"activation": activation}

    _run_both(pool, "causal_conv1d", args, lens, dtype)


def _gdn_inputs(gen, num_tokens, heads, dim_k, dim_v, dtype):
    q, k = (_randn(gen, num_tokens, heads, dim_k, dtype=dtype) for _ in range(2))
    v = _randn(gen, num_tokens, heads, dim_v, dtype=dtype)
    g = -torch.rand(num_tokens, heads, generator=gen)  # log decay <= 0, fp32
    beta = torch.rand(num_tokens, heads, generator=gen).to(dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("lens", [DECODE_LENS, PREFILL_LENS], ids=["decode", "prefill"])
@pytest.mark.parametrize(
    ("dtype", "use_qk_l2norm"),
    [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)],
)
def test_gated_delta_rule_matches_reference(lens, dtype, use_qk_l2norm):
    heads, dim_k, dim_v, gen = 3, 5, 7, torch.Generator().manual_seed(3)
    used = _batch(lens, seed=7)[0][:-1].tolist()
    pool = SlotPool((4, 2), (heads, dim_k, dim_v), torch.float32, used, seed=4)
    inputs = _gdn_inputs(gen, sum(lens), heads, dim_k, dim_v, dtype)

    def args(conv, temporal, slots, q_indptr):
        kwargs = {"scale": dim_k**-0.5, "use_qk_l2norm": use_qk_l2norm}
        return (*inputs, temporal, slots, q_indptr), kwargs

    _run_both(pool, "gated_delta_rule", args, lens, dtype)


@pytest.mark.parametrize("lens", [DECODE_LENS, PREFILL_LENS], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_rule_gates_and_gqa_in_the_kernel(lens, dtype):
    """``gating``: the kernel takes the raw a, b and (A_log, dt_bias), and q/k with
    half the value heads; the reference computes the gates and repeats the heads."""
    heads, dim_k, dim_v, gen = 4, 5, 7, torch.Generator().manual_seed(8)
    used = _batch(lens, seed=7)[0][:-1].tolist()
    pool = SlotPool((4, 2), (heads, dim_k, dim_v), torch.float32, used, seed=4)
    t = sum(lens)
    q, k = (_randn(gen, t, heads // 2, dim_k, dtype=dtype) for _ in range(2))
    v = _randn(gen, t, heads, dim_v, dtype=dtype)
    a = _randn(gen, t, heads, dtype=dtype) * 4
    a[0, 0] = 30.0  # softplus' identity branch (x > 20)
    b = _randn(gen, t, heads, dtype=dtype) * 2
    gating = (_randn(gen, heads) * 0.5, _randn(gen, heads, dtype=dtype))

    def args(conv, temporal, slots, q_indptr):
        kwargs = {"scale": dim_k**-0.5, "use_qk_l2norm": True, "gating": gating}
        return (q, k, v, a, b, temporal, slots, q_indptr), kwargs

    _run_both(pool, "gated_delta_rule", args, lens, dtype)


def _ssd_inputs(gen, num_tokens, heads, groups, dim_p, dim_n, dtype):
    x = _randn(gen, num_tokens, heads, dim_p, dtype=dtype)
    dt = _randn(gen, num_tokens, heads, dtype=dtype)
    A = -torch.rand(heads, generator=gen) - 0.5
    B, C = (_randn(gen, num_tokens, groups, dim_n, dtype=dtype) for _ in range(2))
    D, dt_bias = _randn(gen, heads, dtype=dtype), _randn(gen, heads, dtype=dtype)
    return x, dt, A, B, C, D, dt_bias


@pytest.mark.parametrize("lens", [DECODE_LENS, PREFILL_LENS], ids=["decode", "prefill"])
@pytest.mark.parametrize(
    ("dtype", "groups", "dt_softplus", "dt_limit"),
    [
        (torch.float32, 1, True, (0.0, math.inf)),
        (torch.float32, 3, False, (0.05, 0.8)),
        (torch.bfloat16, 3, True, (0.0, math.inf)),
    ],
)
def test_mamba2_ssd_matches_reference(lens, dtype, groups, dt_softplus, dt_limit):
    heads, dim_p, dim_n, gen = 6, 6, 5, torch.Generator().manual_seed(5)
    used = _batch(lens, seed=7)[0][:-1].tolist()
    pool = SlotPool((4, 2), (heads, dim_p, dim_n), torch.float32, used, seed=6)
    inputs = _ssd_inputs(gen, sum(lens), heads, groups, dim_p, dim_n, dtype)

    def args(conv, temporal, slots, q_indptr):
        return (*inputs, temporal, slots, q_indptr), {
            "dt_softplus": dt_softplus,
            "dt_limit": dt_limit,
        }

    _run_both(pool, "mamba2_ssd", args, lens, dtype)


def _one_request(lens_b):
    """A single lane on slot 3: (slots, q_indptr)."""
    return torch.tensor([3]), torch.tensor([0, lens_b], dtype=torch.int32)


@pytest.mark.parametrize("num_tokens", [1, 2, 6])
def test_conv_matches_transformers(num_tokens):
    """transformers' causal_conv1d_update on a (1, C, K) state is the second oracle."""
    channels, width, gen = 13, 4, torch.Generator().manual_seed(8)
    pool = SlotPool((channels, width), (1,), torch.float32, [3], seed=9)
    conv, _ = pool.layer_views(pool.buffer)
    hf_state = conv[3:4].clone()
    x = _randn(gen, num_tokens, channels)
    weight, bias = _randn(gen, channels, width), _randn(gen, channels)
    want = hf_qwen.causal_conv1d_update(x.t()[None], hf_state, weight, bias, "silu")[0].t()
    slots, q_indptr = _one_request(num_tokens)
    got = recurrent.causal_conv1d(
        x, conv, slots, q_indptr, weight, bias, max_q_len=num_tokens, activation="silu"
    )
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(conv[3], hf_state[0], **TOL[torch.float32])


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_gated_delta_rule_matches_transformers(num_tokens):
    heads, dim_k, dim_v, gen = 3, 5, 7, torch.Generator().manual_seed(10)
    pool = SlotPool((4, 2), (heads, dim_k, dim_v), torch.float32, [3], seed=11)
    _, state = pool.layer_views(pool.buffer)
    q, k, v, g, beta = _gdn_inputs(gen, num_tokens, heads, dim_k, dim_v, torch.float32)
    want, want_state = hf_qwen.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[3:4].clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    slots, q_indptr = _one_request(num_tokens)
    got = recurrent.gated_delta_rule(
        q, k, v, g, beta, state, slots, q_indptr,
        max_q_len=num_tokens, scale=dim_k**-0.5, use_qk_l2norm=True,
    )  # fmt: skip
    torch.testing.assert_close(got, want[0], **TOL[torch.float32])
    torch.testing.assert_close(state[3], want_state[0], **TOL[torch.float32])


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_mamba2_ssd_matches_transformers(num_tokens):
    """NemotronH's chunked torch scan (chunks of 4, so several chunks) with an initial state,
    and, for one token, its selective_state_update (per-(P) expanded parameters)."""
    heads, groups, dim_p, dim_n, gen = 6, 3, 6, 5, torch.Generator().manual_seed(12)
    pool = SlotPool((4, 2), (heads, dim_p, dim_n), torch.float32, [3], seed=13)
    _, state = pool.layer_views(pool.buffer)
    x, dt, A, B, C, D, dt_bias = _ssd_inputs(
        gen, num_tokens, heads, groups, dim_p, dim_n, torch.float32
    )
    initial = state[3:4].clone()
    want, want_state = hf_nemotron.mamba2_chunk_scan(
        x[None], dt[None], A, B[None], C[None], 4, D=D, dt_bias=dt_bias, initial_states=initial,
        dt_softplus=True, return_final_states=True,
    )  # fmt: skip
    if num_tokens == 1:
        step_state = initial.clone()
        step = hf_nemotron.mamba2_selective_state_update(
            step_state, x, dt[..., None].expand(-1, -1, dim_p),
            A[:, None, None].expand(-1, dim_p, dim_n), B, C, D[:, None].expand(-1, dim_p),
            dt_bias=dt_bias[:, None].expand(-1, dim_p), dt_softplus=True,
        )  # fmt: skip
        torch.testing.assert_close(step, want[0], **TOL[torch.float32])
        torch.testing.assert_close(step_state, want_state, **TOL[torch.float32])
    slots, q_indptr = _one_request(num_tokens)
    got = recurrent.mamba2_ssd(
        x, dt, A, B, C, D, dt_bias, state, slots, q_indptr,
        max_q_len=num_tokens, dt_softplus=True, dt_limit=(0.0, math.inf),
    )  # fmt: skip
    torch.testing.assert_close(got, want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[3], want_state[0], atol=1e-4, rtol=1e-4)


def test_prefill_then_decode_equals_one_prefill():
    """Splitting a request's tokens over a prefill and two decode steps (the state
    round-trips through the pool slot) gives the outputs and state of one prefill."""
    heads, dim_k, dim_v, gen = 3, 5, 7, torch.Generator().manual_seed(14)
    pool = SlotPool((4, 2), (heads, dim_k, dim_v), torch.float32, [3], seed=15)
    inputs = _gdn_inputs(gen, 6, heads, dim_k, dim_v, torch.float32)
    kw = {"scale": 0.4, "use_qk_l2norm": True}
    whole = pool.buffer.clone()
    _, state = pool.layer_views(whole)
    want = recurrent.gated_delta_rule(*inputs, state, *_one_request(6), max_q_len=6, **kw)
    split = pool.buffer.clone()
    _, state = pool.layer_views(split)
    got = [
        recurrent.gated_delta_rule(
            *(t[:4] for t in inputs), state, *_one_request(4), max_q_len=4, **kw
        )
    ]
    for i in (4, 5):
        step = (t[i : i + 1] for t in inputs)
        got.append(recurrent.gated_delta_rule(*step, state, *_one_request(1), max_q_len=1, **kw))
    torch.testing.assert_close(torch.cat(got), want, **TOL[torch.float32])
    assert torch.allclose(pool.layer_views(split)[1][3], pool.layer_views(whole)[1][3], atol=1e-5)


def test_bad_input_is_a_value_error():
    pool = SlotPool((13, 4), (3, 5, 7), torch.float32, [3], seed=16)
    conv, state = pool.layer_views(pool.buffer)
    slots, q_indptr = _one_request(2)
    x, w = torch.zeros(2, 13), torch.zeros(13, 4)
    with pytest.raises(ValueError, match="one token per lane"):
        recurrent.causal_conv1d(x, conv, slots, q_indptr, w, None, max_q_len=1, activation=None)
    with pytest.raises(ValueError, match="activation"):
        recurrent.causal_conv1d(x, conv, slots, q_indptr, w, None, max_q_len=2, activation="gelu")
    with pytest.raises(ValueError, match=r"weight must have shape \(13, 4\)"):
        recurrent.causal_conv1d(
            x, conv, slots, q_indptr, w[:, :3], None, max_q_len=2, activation=None
        )
    q = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match=r"v must have shape \(2, 3, 7\)"):
        recurrent.gated_delta_rule(
            q, q, q, torch.zeros(2, 3), torch.zeros(2, 3), state, slots, q_indptr,
            max_q_len=2, scale=1.0, use_qk_l2norm=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="unit stride"):
        recurrent.causal_conv1d(
            torch.zeros(13, 2).t(), conv, slots, q_indptr, w, None, max_q_len=2, activation=None
        )
    with pytest.raises(ValueError, match="q_indptr must have B"):
        recurrent.causal_conv1d(x, conv, slots, q_indptr[:1], w, None, max_q_len=2, activation=None)


def test_missing_fla_names_the_gpu_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # import fla -> ImportError
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)
    with pytest.raises(ImportError, match=r"pip install 'unikv\[gpu\]'"):
        recurrent_fla._fla()
    assert not recurrent_fla.use_fla(torch.device("cpu"))
