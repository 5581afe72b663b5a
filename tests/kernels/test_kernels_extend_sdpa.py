"""A step of one fresh prompt through torch's SDPA (``kernels/attention/sdpa.py``, the CUDA
backend's ``extend_attention``), on CPU (SDPA's math path): the layout it hands SDPA
(token-major views, grouped KV heads, ``out``) against the dense fp32 oracle, and the
steps it must leave to the Triton kernels (several prompts, a window, sinks, soft-cap,
fp32, a tile override, another head dim), whose outputs are then the Triton kernel's
bytes. On the H200 the same op runs cuDNN (``test_kernels_gpu``)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import PagedCase, oracle_attention

from unikv.kernels import get_backend
from unikv.kernels.attention import extend
from unikv.kernels.attention import sdpa as extend_sdpa

DIM = 64  # a head dim the SDPA path takes
TRITON = get_backend("cpu", "triton")


def _step(num_tokens, hq, hkv, dtype, seed=0):
    """q, k, v as (T, heads, D) views of one fused projection output, and a real
    (poisoned) pool the fresh path must not read."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn(num_tokens, (hq + 2 * hkv) * DIM, generator=gen).to(dtype)
    q, k, v = buf.split([hq * DIM, hkv * DIM, hkv * DIM], dim=-1)
    q, k, v = (x.view(num_tokens, -1, DIM) for x in (q, k, v))
    return q, k, v, PagedCase([num_tokens], hkv, DIM, 4, dtype=dtype, seed=seed)


def _call(fn, q, k, v, case, indptr, max_q_len, **kw):
    return fn(q, case.k_cache, case.v_cache, case.block_table, indptr, case.seq_lens,
              max_q_len=max_q_len, page_size=4, sm_scale=DIM**-0.5, fresh_kv=(k, v), **kw)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
def test_one_fresh_prompt_matches_the_oracle(dtype, hq, hkv):
    q, k, v, case = _step(45, hq, hkv, dtype)
    indptr = torch.tensor([0, 45], dtype=torch.int32)
    assert extend_sdpa.takes_sdpa(q, (k, v), 45, 0, None, 0.0, None)
    got = _call(extend_sdpa.extend_attention, q, k, v, case, indptr, 45)
    want = oracle_attention(q, k.float(), v.float(), list(range(45)), sm_scale=DIM**-0.5)
    assert got.shape == (45, hq, DIM) and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    out = torch.full((45, hq, DIM), float("nan"), dtype=dtype)
    again = _call(extend_sdpa.extend_attention, q, k, v, case, indptr, 45, out=out)
    assert again.data_ptr() == out.data_ptr() and torch.equal(out, got)


@pytest.mark.parametrize(
    "why,kw",
    [
        ("two prompts", {"max_q_len": 30}),
        ("window", {"window": 7}),
        ("sinks", {"sinks": "rand"}),
        ("soft-cap", {"soft_cap": 3.0}),
        ("a tile override", {"config": (16, 16, 4, 1, False)}),
    ],
)
def test_other_steps_stay_on_triton(why, kw):
    """Each condition alone keeps the step on the Triton kernel: the same bytes."""
    q, k, v, case = _step(45, 8, 2, torch.float16, seed=1)
    kw = dict(kw)
    max_q_len = kw.pop("max_q_len", 45)
    indptr = torch.tensor([0, 15, 45] if max_q_len < 45 else [0, 45], dtype=torch.int32)
    if kw.get("sinks") == "rand":
        kw["sinks"] = torch.randn(8, generator=torch.Generator().manual_seed(2))
    assert not extend_sdpa.takes_sdpa(q, (k, v), max_q_len, kw.get("window", 0),
                                      kw.get("sinks"), kw.get("soft_cap", 0.0),
                                      kw.get("config")), why  # fmt: skip
    got = _call(extend_sdpa.extend_attention, q, k, v, case, indptr, max_q_len, **kw)
    want = _call(extend.extend_attention, q, k, v, case, indptr, max_q_len, **kw)
    assert torch.equal(got, want)


def test_fp32_and_other_head_dims_stay_on_triton():
    q, k, v, _ = _step(20, 4, 2, torch.float32)
    assert not extend_sdpa.takes_sdpa(q, (k, v), 20, 0, None, 0.0, None)
    wide = torch.zeros(20, 4, 256, dtype=torch.bfloat16)
    assert not extend_sdpa.takes_sdpa(wide, (wide[:, :2], wide[:, :2]), 20, 0, None, 0.0, None)
    assert not extend_sdpa.takes_sdpa(q.bfloat16(), None, 20, 0, None, 0.0, None)  # cached


def test_bad_fresh_rows_are_refused_before_sdpa():
    q, k, v, case = _step(12, 8, 2, torch.bfloat16)
    indptr = torch.tensor([0, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="fresh k/v"):
        _call(extend_sdpa.extend_attention, q, k[:5], v[:5], case, indptr, 12)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        _call(extend_sdpa.extend_attention, q[:, :7], k, v, case, indptr, 12)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_cuda_backend_routes_through_it_when_enabled(monkeypatch, enabled):
    """The Triton backend built for CUDA carries the SDPA op only with
    ``UNIKV_EXTEND_SDPA=1``; the one built for the CPU interpreter never does
    (``get_backend`` decides once, per device type)."""
    from unikv.kernels import backend

    monkeypatch.setattr(extend_sdpa, "ENABLED", enabled)
    monkeypatch.setattr(backend, "_sm90", lambda device: False)  # no Gluon attention
    want = extend_sdpa.extend_attention if enabled else extend.extend_attention
    assert backend._triton(backend.flags_for("cuda", "triton")).extend_attention is want
    assert backend._triton(backend.flags_for("cpu", "triton")).extend_attention is (
        extend.extend_attention
    )
    assert TRITON.extend_attention is extend.extend_attention
