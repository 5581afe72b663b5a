"""The Hopper fresh-prompt attention (``kernels/attention/fresh_hopper.py``, Gluon).

On the CPU: where the path is taken (``runs_on``: the device and the switch;
``usable``: dtypes, head dims, window / soft-cap, strides a TMA descriptor can address) and that
``extend_attention_fresh`` keeps the Triton kernel everywhere else. The sm_90a
compile is in ``test_kernels_sm90_compile.py``. On the H200 (``-m gpu``): the kernel
against causal SDPA in fp32 on the same rows (ragged batches that end inside and on
tile edges, grouped heads, D 64 and 128, fp16 and bf16, sinks, rows strided as the
fused QKV GEMM leaves them), and against the Triton fresh kernel.
"""

from __future__ import annotations

import math

import pytest
import torch

from unikv.kernels.attention import fresh as extend_fresh
from unikv.kernels.attention import fresh_hopper as extend_hopper
from unikv.kernels.runtime.interpret import patch_interpreter

patch_interpreter()  # run-time loop bounds under TRITON_INTERPRET=1 (no-op otherwise)


def _rows(tokens, hq, hkv, dim, dtype, device, fused=True, seed=0):
    """q, k, v as views of one (T, (hq + 2 hkv) * dim) QKV output (fused) or contiguous."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if fused:
        qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, generator=g).to(device, dtype)
        q = qkv[:, : hq * dim].view(tokens, hq, dim)
        k = qkv[:, hq * dim : (hq + hkv) * dim].view(tokens, hkv, dim)
        v = qkv[:, (hq + hkv) * dim :].view(tokens, hkv, dim)
        return q, k, v
    return tuple(torch.randn(tokens, h, dim, generator=g).to(device, dtype) for h in (hq, hkv, hkv))


def _reference(q, k, v, lens, sm_scale, sinks=None):
    """Causal attention per request in fp32 (SDPA's math on head-repeated K/V), with
    gpt-oss's sinks as an extra logit in the softmax's denominator."""
    out, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lens:
        qs, ks, vs = (x[start : start + n].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        scores = qs @ ks.transpose(1, 2) * sm_scale
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(-1, 1, 1).expand(-1, n, 1)
            probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :n]
        else:
            probs = torch.softmax(scores, -1)
        out.append((probs @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


def _indptr(lens, device):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)  # fmt: skip


# ---------------------------------------------------------------- CPU: the choice


def test_usable_refuses_what_the_kernel_does_not_run(monkeypatch):
    """The CPU is never Hopper; on a faked sm_90 each excluded case is refused by
    its own reason, and the base case is taken."""
    q, k, v = _rows(16, 4, 2, 64, torch.bfloat16, "cpu")
    assert not extend_hopper.runs_on(q.device)  # not a GPU
    monkeypatch.setattr(extend_hopper, "_hopper", lambda device: True)
    assert extend_hopper.runs_on(q.device)
    assert extend_hopper.usable(q, k, v, 0, 0.0, 8192)
    assert not extend_hopper.usable(q.float(), k.float(), v.float(), 0, 0.0, 8192)
    assert not extend_hopper.usable(q, k, v, 8, 0.0, 8192)  # a window
    assert not extend_hopper.usable(q, k, v, 0, 30.0, 8192)  # soft-cap
    q96, k96, v96 = _rows(16, 4, 2, 96, torch.bfloat16, "cpu")
    assert not extend_hopper.usable(q96, k96, v96, 0, 0.0, 8192)  # D not 64 / 128
    kt = torch.randn(2, 16, 64, dtype=torch.bfloat16).transpose(0, 1)  # head-major rows
    assert not extend_hopper.usable(q, kt, kt, 0, 0.0, 8192)
    short = extend_hopper.MIN_Q_LEN[64] - 1  # a short step keeps the Triton kernel
    assert not extend_hopper.usable(q, k, v, 0, 0.0, short)
    monkeypatch.setattr(extend_hopper, "ENABLED", False)  # UNIKV_EXTEND_HOPPER=0, at import
    assert not extend_hopper.runs_on(q.device)


def test_fresh_attention_keeps_triton_with_a_config(monkeypatch):
    """An explicit tile config keeps the Triton kernel even where the Gluon one would
    run (a faked sm_90, 16-bit rows it takes): the call gives the oracle's values, and
    the Gluon launcher is never reached (Gluon has no interpreter)."""
    called = []
    monkeypatch.setattr(extend_hopper, "_hopper", lambda device: True)
    monkeypatch.setattr(extend_hopper, "fresh_attention", lambda *a, **kw: called.append(1))
    lens = [5, 9]
    q, k, v = _rows(
        sum(lens), 4, 2, 64, torch.float16, "cpu"
    )  # the interpreter's bf16 dots are not
    assert extend_hopper.usable(q, k, v, 0, 0.0, 8192)
    out = extend_fresh.extend_attention_fresh(
        q, k, v, _indptr(lens, "cpu"), max_q_len=9, sm_scale=0.125, config=(16, 16, 4, 1, False)
    )
    torch.testing.assert_close(out.float(), _reference(q, k, v, lens, 0.125), atol=2e-2, rtol=2e-2)
    assert not called


# ---------------------------------------------------------------- GPU: the kernel

gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="the Gluon kernel runs on sm_90 only",
)

CASES = [
    # lens, hq, hkv, dim, dtype, fused rows
    ([1, 63, 64, 65, 127, 128, 129, 300], 8, 2, 128, torch.bfloat16, True),
    ([1000, 17, 2049], 8, 8, 128, torch.float16, True),
    ([4096], 32, 8, 128, torch.bfloat16, False),
    ([5, 640, 1], 16, 2, 64, torch.bfloat16, True),
    ([333, 256], 4, 1, 64, torch.float16, False),
]


@gpu
@needs_hopper
@pytest.mark.parametrize("lens,hq,hkv,dim,dtype,fused", CASES)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_hopper_fresh_matches_reference(lens, hq, hkv, dim, dtype, fused, with_sinks):
    q, k, v = _rows(sum(lens), hq, hkv, dim, dtype, "cuda", fused)
    assert extend_hopper.usable(q, k, v, 0, 0.0, extend_hopper.MIN_Q_LEN[dim])
    sm_scale = 1 / math.sqrt(dim)
    sinks = torch.randn(hq, device="cuda") if with_sinks else None
    out = torch.full((sum(lens), hq, dim), float("nan"), dtype=dtype, device="cuda")
    extend_hopper.fresh_attention(
        q, k, v, _indptr(lens, "cuda"), out, max_q_len=max(lens), sm_scale=sm_scale, sinks=sinks
    )
    ref = _reference(q, k, v, lens, sm_scale, sinks)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    # the Triton fresh kernel on the same rows: the two agree to rounding
    tri = extend_fresh.extend_attention_fresh(
        q, k, v, _indptr(lens, "cuda"), max_q_len=max(lens), sm_scale=sm_scale, sinks=sinks,
        config=extend_fresh.CONFIGS[dim][:4] + (False,),
    )  # fmt: skip
    assert (out.float() - tri.float()).abs().max() < 2e-2


@gpu
@needs_hopper
def test_extend_attention_fresh_takes_the_hopper_kernel():
    """At the defaults on the H200 the public entry runs the Gluon kernel (its name in
    the profile) and gives the reference's values; a window keeps Triton."""
    lens = [2100, 300]
    q, k, v = _rows(sum(lens), 8, 2, 128, torch.bfloat16, "cuda")
    indptr = _indptr(lens, "cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = extend_fresh.extend_attention_fresh(q, k, v, indptr, max_q_len=2100, sm_scale=0.09)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("fresh_kernel" in n and "_fresh_kernel" not in n for n in names), names
    ref = _reference(q, k, v, lens, 0.09)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        extend_fresh.extend_attention_fresh(
            q, k, v, indptr, max_q_len=2100, sm_scale=0.09, window=64
        )
        torch.cuda.synchronize()
    assert any("_fresh_kernel" in e.name for e in prof.events())
