"""Decode and extend attention, Triton (under TRITON_INTERPRET=1 on CPU) and the torch
reference, against an fp32 oracle computed from dense, un-paged K/V.

The K/V live in a real, NaN-poisoned UnifiedPool on randomly permuted pages and are
read through the pool's dense per-layer views of layer 1 (strided, offset views).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import PagedCase, oracle_attention, paged_decode, paged_extend, paged_oracle

from unikv.kernels import get_backend

BACKENDS = ["torch", "triton"]
DIM = 16


def _ops(name):
    return get_backend("cpu", backend=name)


def _decode_case(backend, lens, heads, group, ps, *, dim_v=None, dtype=torch.float16, seed=0, **kw):
    case = PagedCase(lens, heads, DIM, ps, dim_v=dim_v, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    q = torch.randn(len(lens), heads * group, DIM, generator=gen).to(dtype)
    got = paged_decode(_ops(backend), case, q, sm_scale=DIM**-0.5, **kw)
    kw.pop("num_splits", None)
    return got, paged_oracle(case, q, sm_scale=DIM**-0.5, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "ps,group,extra",
    [
        (1, 4, {}),
        (4, 3, {"num_splits": 3}),
        (3, 1, {"window": 6}),
        (8, 2, {"window": 11, "num_splits": 2}),
        (4, 4, {"sinks": "rand", "num_splits": 3}),
        (2, 2, {"soft_cap": 2.0}),
    ],
)
def test_decode_matches_dense_oracle(backend, ps, group, extra):
    kw = dict(extra)
    if backend == "torch":
        kw.pop("num_splits", None)
    if kw.get("sinks") == "rand":
        kw["sinks"] = torch.randn(2 * group, generator=torch.Generator().manual_seed(3))
    got, want = _decode_case(backend, [1, 37, 20], 2, group, ps, **kw)
    torch.testing.assert_close(got.float(), want, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("tile", [16384, 64])  # every split in one pass; 4 splits a pass
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_merge_passes_match_oracle(monkeypatch, tile, sinks):
    """The split merge, reading all 9 splits in one pass or 4 at a time (the last pass
    partly masked), against the dense oracle; splits past a short request's keys are
    empty (lse -inf)."""
    from unikv.kernels.attention import decode

    monkeypatch.setattr(decode, "MERGE_TILE", tile)
    launch = decode.merge_launch(9, DIM)
    assert (launch["CHUNK_S"] == launch["BLOCK_S"]) == (tile == 16384)
    kw = {"num_splits": 9}
    if sinks:
        kw["sinks"] = torch.randn(4, generator=torch.Generator().manual_seed(5))
    got, want = _decode_case("triton", [3, 70, 41], 2, 2, 4, dtype=torch.float32, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_fp32_asymmetric_heads(backend):
    """D != Dv: the dense views are strided with row stride H * max(D, Dv)."""
    got, want = _decode_case(backend, [9, 30], 2, 2, 4, dim_v=8, dtype=torch.float32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_empty_request_gives_zeros(backend):
    """A padded lane (seq_len 0) reads nothing (the pool is NaN-poisoned) and yields 0."""
    case = PagedCase([5, 3], 1, DIM, 4)
    lens = torch.tensor([5, 0], dtype=torch.int32)
    q = torch.randn(2, 2, DIM)
    out = _ops(backend).decode_attention(
        q, case.k_cache, case.v_cache, case.block_table, lens, page_size=4, sm_scale=0.25
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "ps,group,extra",
    [(1, 2, {}), (4, 4, {"window": 7}), (3, 1, {"sinks": "rand", "soft_cap": 3.0})],
)
def test_extend_matches_dense_oracle(backend, ps, group, extra):
    lens, new = [9, 40, 17], [3, 21, 17]  # a cached prefix, a long chunk, a fresh prompt
    kw = dict(extra)
    if kw.get("sinks") == "rand":
        kw["sinks"] = torch.randn(2 * group, generator=torch.Generator().manual_seed(5))
    case = PagedCase(lens, 2, DIM, ps, seed=2)
    q = torch.randn(sum(new), 2 * group, DIM, generator=torch.Generator().manual_seed(9)).half()
    config = {"config": (16, 16, 4, 1)} if backend == "triton" else {}
    got = paged_extend(_ops(backend), case, q, new, sm_scale=DIM**-0.5, **kw, **config)
    want = paged_oracle(case, q, new, sm_scale=DIM**-0.5, **kw)
    torch.testing.assert_close(got.float(), want, atol=3e-3, rtol=3e-3)


def test_triton_extend_default_tiles():
    """The default (large) tiles: rows past a request's end and a block-straddling diagonal."""
    lens, new = [150, 70], [130, 70]
    case = PagedCase(lens, 1, DIM, 16, dtype=torch.float32, seed=4)
    q = torch.randn(200, 2, DIM, generator=torch.Generator().manual_seed(1))
    got = paged_extend(_ops("triton"), case, q, new, sm_scale=DIM**-0.5)
    want = paged_oracle(case, q, new, sm_scale=DIM**-0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_rejects_bad_input(backend):
    case = PagedCase([4], 2, DIM, 4)
    ops = _ops(backend)
    q = torch.randn(1, 3, DIM)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="multiple"):
        paged_decode(ops, case, q, sm_scale=1.0)


def test_triton_rejects_uint8_cache_and_wrong_table_dtype():
    case = PagedCase([4], 2, DIM, 4)
    ops = _ops("triton")
    q = torch.randn(1, 2, DIM)
    raw = case.pool.buffer[: case.k_cache.shape[0] * 2 * DIM].view(-1, 2, DIM)
    with pytest.raises(ValueError, match="float dtype"):
        ops.decode_attention(
            q, raw, raw, case.block_table, case.seq_lens, page_size=4, sm_scale=1.0
        )
    with pytest.raises(ValueError, match="int32"):
        ops.decode_attention(
            q,
            case.k_cache,
            case.v_cache,
            case.block_table.long(),
            case.seq_lens,
            page_size=4,
            sm_scale=1.0,
        )


def _fused_qkv(num_tokens, hq, hkv, seed):
    """q, k, v as (T, heads, D) fp16 views of one fused projection output (token
    stride (hq + 2 hkv) D), the layout a model's QKV GEMM hands the attention."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn(num_tokens, (hq + 2 * hkv) * DIM, generator=gen).half()
    q = buf[:, : hq * DIM].view(num_tokens, hq, DIM)
    k = buf[:, hq * DIM : (hq + hkv) * DIM].view(num_tokens, hkv, DIM)
    v = buf[:, (hq + hkv) * DIM :].view(num_tokens, hkv, DIM)
    return q, k, v


@pytest.mark.parametrize(
    "config",
    [(16, 16, 4, 1, False), (16, 32, 4, 2, False), (16, 16, 4, 2, True), (32, 16, 4, 2, True)],
)
@pytest.mark.parametrize(
    "extra", [{}, {"window": 7}, {"sinks": "rand", "soft_cap": 3.0}], ids=["plain", "win", "sink"]
)
def test_triton_extend_fresh_matches_oracle(config, extra):
    """fresh_kv: a batch without cached prefix reads its own K/V (pointer or TMA
    loads), ragged requests straddling tiles, against the dense fp32 oracle."""
    new = [5, 37, 18]
    indptr = torch.tensor([0, 5, 42, 60], dtype=torch.int32)
    q, k, v = _fused_qkv(60, 4, 2, seed=11)
    kw = dict(extra)
    if kw.get("sinks") == "rand":
        kw["sinks"] = torch.randn(4, generator=torch.Generator().manual_seed(5))
    case = PagedCase(new, 2, DIM, 4, seed=2)  # a real (poisoned) pool the path must not read
    got = _ops("triton").extend_attention(
        q,
        case.k_cache,
        case.v_cache,
        case.block_table,
        indptr,
        case.seq_lens,
        max_q_len=37,
        page_size=4,
        sm_scale=DIM**-0.5,
        config=config,
        fresh_kv=(k, v),
        **kw,
    )
    want = torch.cat(
        [
            oracle_attention(
                q[s:e], k[s:e].float(), v[s:e].float(), list(range(e - s)), sm_scale=DIM**-0.5, **kw
            )
            for s, e in zip(indptr[:-1].tolist(), indptr[1:].tolist())
        ]
    )
    torch.testing.assert_close(got.float(), want, atol=3e-3, rtol=3e-3)


def test_triton_extend_paged_tile_wider_than_block():
    """BLOCK_N > BLOCK_M: the diagonal loop starts below the q block's first row."""
    lens, new = [70, 33], [40, 33]
    case = PagedCase(lens, 1, DIM, 16, dtype=torch.float32, seed=6)
    q = torch.randn(73, 2, DIM, generator=torch.Generator().manual_seed(2))
    got = paged_extend(_ops("triton"), case, q, new, sm_scale=DIM**-0.5, config=(16, 32, 4, 2))
    want = paged_oracle(case, q, new, sm_scale=DIM**-0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_triton_extend_fresh_rejects_bad_kv():
    from unikv.kernels.attention.fresh import extend_attention_fresh

    q, k, v = _fused_qkv(8, 2, 1, seed=1)
    indptr = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="rows of q"):
        extend_attention_fresh(q, k[:7], v[:7], indptr, max_q_len=8, sm_scale=1.0)
    with pytest.raises(ValueError, match="float16"):
        extend_attention_fresh(q, k.float(), v, indptr, max_q_len=8, sm_scale=1.0)
    head_major = torch.randn(1, 8, DIM).half().transpose(0, 1)  # stride(1) != D: no TMA
    with pytest.raises(ValueError, match="TMA"):
        extend_attention_fresh(
            q, head_major, head_major, indptr, max_q_len=8, sm_scale=1.0, config=(16, 16, 4, 1, 1)
        )
