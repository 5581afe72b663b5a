"""The Triton GEMV (``kernels/linear/gemv.py``, on CPU through the interpreter) against
``F.linear`` on the same operands: 1-4 rows, K a multiple of the K tile and not, N
not a multiple of the row tile, strided rows of x (a slice of a wider activation)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unikv.kernels.linear import gemv


@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("n, k, cfg", [(40, 64, (8, 32, 4, 2)), (37, 100, (16, 32, 4, 1)),
                                       (9, 256, (4, 128, 4, 3)), (5, 20, (4, 32, 4, 2))])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_linear(m, n, k, cfg, dtype):
    """Against F.linear in fp32: K tails, K shorter than a tile, strided x."""
    g = torch.Generator().manual_seed(m * n + k)
    wide = torch.randn(m, k + 24, generator=g).to(dtype)
    x = wide[:, 5 : 5 + k]  # row stride k + 24
    w = torch.randn(n, k, generator=g).to(dtype)
    want = F.linear(x.float(), w.float())
    got = gemv.gemv(x, w, config=cfg)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.float() - want).abs().max() <= tol * want.abs().max()


def test_gemv_refuses_what_it_cannot_take():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="F.linear"):
        gemv.gemv(torch.randn(5, 16), w)  # too many rows
    with pytest.raises(ValueError, match=r"\(N, K\)"):
        gemv.gemv(torch.randn(1, 12), w)
    with pytest.raises(ValueError, match="one dtype"):
        gemv.gemv(torch.randn(1, 16).bfloat16(), w)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_fused_silu_mul_and_bias_match_the_two_ops(m, bias):
    """SwiGLU fused into the GEMV's loads, with a bias: against the torch reference's
    ``F.linear(silu_mul(gate_up)) + b`` in bf16, and the fp32 case to 1e-5."""
    from unikv.kernels.linear import ref as elementwise_ref

    g = torch.Generator().manual_seed(m + 2 * bias)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        gu = (torch.randn(m, 2 * 72, generator=g) * 3).to(dtype)
        w = torch.randn(40, 72, generator=g).to(dtype)
        b = torch.randn(40, generator=g).to(dtype) if bias else None
        act = elementwise_ref.silu_mul(gu)
        want = F.linear(act.float(), w.float(), None if b is None else b.float())
        got = gemv.gemv(gu, w, b, (16, 32, 4, 2), silu_mul_input=True)
        assert (got.float() - want).abs().max() <= tol * want.abs().max()


def test_backend_linear_ops_route_by_rows():
    """The Triton backend's ``linear`` / ``silu_mul_linear`` equal the torch
    backend's at one row (the GEMV) and at more rows than ROUTE_ROWS (cuBLAS)."""
    from unikv.kernels.backend import get_backend

    tri, ref = get_backend("cpu", "triton"), get_backend("cpu", "torch")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 64, generator=g).bfloat16()
    for rows in (1, gemv.ROUTE_ROWS + 3):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        gu = torch.randn(rows, 128, generator=g).bfloat16()
        for op, arg in (("linear", x), ("silu_mul_linear", gu)):
            want = getattr(ref, op)(arg, w).float()
            got = getattr(tri, op)(arg, w).float()
            assert (got - want).abs().max() <= 1e-2 * want.abs().max(), (op, rows)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("w_fp32", [False, True])
def test_gemv_fused_norm_matches_norm_then_linear(m, residual, w_fp32):
    """The pre-norm inside the GEMV (``add_rms_norm_linear``'s kernel path): the
    product against the torch reference's add_rms_norm then F.linear (bf16 to 1e-2,
    fp32 to 1e-5); the summed residual it returns bit-equal to ``residual + x``, and
    x itself without a residual. K 100 (not a multiple of the K tile), 2 programs."""
    from unikv.kernels.linear import ref as elementwise_ref

    g = torch.Generator().manual_seed(m + 2 * residual + 4 * w_fp32)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        x = torch.randn(m, 100, generator=g).to(dtype)
        res = torch.randn(m, 100, generator=g).to(dtype) if residual else None
        nw = (1 + 0.1 * torch.randn(100, generator=g)).to(dtype)
        w = torch.randn(24, 100, generator=g).to(dtype)
        norm = (res, nw, 1e-5, 0.0)
        want, want_res = elementwise_ref.add_rms_norm_linear(
            x, None if res is None else res.clone(), nw, 1e-5, w, weight_in_fp32=w_fp32
        )
        got, got_res = gemv.gemv(x, w, config=(16, 32, 4, 2), norm=norm)
        assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
        assert torch.equal(got_res, want_res)
        assert (got_res is x) == (res is None)


@pytest.mark.parametrize("m", [1, 3])
def test_gemv_gathers_embedding_rows(m):
    """The embedding inside the first layer's GEMV (``gather``): the same bytes as the
    GEMV over the rows ``table[ids]`` gathered first, the rows returned bit-equal to
    them (a fresh buffer, not the table); K 100, 2 programs, a repeated id."""
    g = torch.Generator().manual_seed(m)
    table = torch.randn(50, 100, generator=g).bfloat16()
    ids = torch.tensor([7, 49, 7][:m])
    nw = (1 + 0.1 * torch.randn(100, generator=g)).bfloat16()
    w = torch.randn(24, 100, generator=g).bfloat16()
    norm = (None, nw, 1e-5, 0.0)
    want, _ = gemv.gemv(table[ids], w, config=(16, 32, 4, 2), norm=norm)
    got, rows = gemv.gemv(table, w, config=(16, 32, 4, 2), norm=norm, gather=ids)
    assert torch.equal(got, want)
    assert torch.equal(rows, table[ids]) and rows.data_ptr() != table.data_ptr()
    with pytest.raises(ValueError, match="without residual"):
        gemv.gemv(table, w, norm=(table[ids], nw, 1e-5, 0.0), gather=ids)
    with pytest.raises(ValueError, match="1..4 rows"):
        gemv.gemv(table, w, norm=norm, gather=torch.arange(5))


def test_gemv_gather_resolves_placeholders_from_the_feedback():
    """Placeholder ids -(1 + lane) in the gathering GEMV (``feedback``): the same bytes
    as the GEMV over ``table[ids]`` with each placeholder replaced by hand by
    ``feedback[lane]``; real ids pass through; the torch backend's op agrees."""
    from unikv.kernels.backend import get_backend

    g = torch.Generator().manual_seed(6)
    table = torch.randn(50, 100, generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(100, generator=g)).bfloat16()
    w = torch.randn(24, 100, generator=g).bfloat16()
    feedback = torch.tensor([31, 4, 49, 0])
    norm = (None, nw, 1e-5, 0.0)
    ids = torch.tensor([-3, 7, -1])  # lane 2, a real id, lane 0
    by_hand = torch.tensor([49, 7, 31])
    want, want_rows = gemv.gemv(table, w, config=(16, 32, 4, 2), norm=norm, gather=by_hand)
    got, rows = gemv.gemv(table, w, config=(16, 32, 4, 2), norm=norm, gather=ids,
                          feedback=feedback)  # fmt: skip
    assert torch.equal(got, want) and torch.equal(rows, want_rows)
    ref = get_backend("cpu", "torch").embed_rms_norm_linear
    ref_out, ref_rows = ref(ids, table, nw, 1e-5, w, feedback=feedback)
    assert torch.equal(ref_rows, table[by_hand])
    assert (ref_out.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    with pytest.raises(ValueError, match="int64 tokens"):
        gemv.gemv(table, w, norm=norm, gather=ids, feedback=feedback.int())


def test_backend_embed_op_routes_by_rows():
    """``embed_rms_norm_linear`` of the Triton backend against the torch backend's
    (F.embedding, then the norm and F.linear) at one token (the gathering GEMV) and at
    more than ROUTE_ROWS (the embedding, then ``add_rms_norm_linear``)."""
    from unikv.kernels.backend import get_backend

    tri, ref = get_backend("cpu", "triton"), get_backend("cpu", "torch")
    g = torch.Generator().manual_seed(4)
    table = torch.randn(30, 64, generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(64, generator=g)).bfloat16()
    w = torch.randn(24, 64, generator=g).bfloat16()
    for ids in (torch.tensor([5]), torch.tensor([5, 0, 29, 5])):
        want, want_rows = ref.embed_rms_norm_linear(ids, table, nw, 1e-5, w)
        got, got_rows = tri.embed_rms_norm_linear(ids, table, nw, 1e-5, w)
        assert torch.equal(got_rows, want_rows)
        assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()


def test_decoder_layer_fused_norms_match_the_unfused_layer(tmp_path):
    """A Llama decoder layer at one bf16 token with the Triton backend's ops (the
    pre-norms inside the qkv and gate/up GEMVs, SwiGLU inside down), first layer (no
    residual) and second, then the final norm inside lm_head: against the same model
    on the torch backend, within bf16 rounding, the residual stream too."""
    from engine_fixtures import DenseAttention, save_tiny_model

    from unikv.models import load_model

    save_tiny_model("llama", str(tmp_path))
    outs = []
    for name in ("torch", "triton"):  # the same checkpoint built on each backend
        model = load_model(str(tmp_path), kernels=name).to(torch.bfloat16)
        model.logits_dtype = None
        assert model.model.norm.ops.name == name
        assert all(layer.fuse_qkv and layer.fuse_mlp for layer in model.model.layers)
        attn = DenseAttention(model.config.windows, model.config.sm_scale)
        tokens, positions = torch.tensor([7]), torch.tensor([0])
        with torch.no_grad():
            h, residual = model.model.embed_tokens(tokens), None
            steps = []
            for layer in model.model.layers:
                h, residual = layer(h, residual, positions, attn)
                steps.append((h, residual.clone()))
            outs.append((steps, model(tokens, positions, attn)))
    (want_steps, want_logits), (got_steps, got_logits) = outs
    for (want, want_res), (got, got_res) in zip(want_steps, got_steps, strict=True):
        assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
        scale = want_res.float().abs().max()
        assert (got_res.float() - want_res.float()).abs().max() <= 2e-2 * scale
    err = (got_logits.float() - want_logits.float()).abs().max()
    assert err <= 3e-2 * want_logits.float().abs().max(), err


def test_gemv_table_from_the_environment(tmp_path):
    """``UNIKV_GEMV_TABLE`` (JSON, "N,K" -> config) replaces the per-shape table at
    import; shapes it does not name take CONFIG. In a subprocess: the table is fixed at
    import."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "UNIKV_GEMV_TABLE": json.dumps({"2048,8192": [4, 1024, 4, 3]})}
    code = ("from unikv.kernels.linear import gemv; "
            "print(gemv.config_for(2048, 8192), gemv.config_for(3072, 2048) == gemv.CONFIG)")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert run.stdout.split() == ["(4,", "1024,", "4,", "3)", "True"]
    for bad in ("not json", '{"2048": [4, 1024, 4, 3]}', '{"2048,8192": [4, 1024]}'):
        with pytest.raises(ValueError, match="UNIKV_GEMV_TABLE"):
            gemv._table_from(bad)


def _argmax_cases(g: torch.Generator, dtype: torch.dtype) -> list:
    """(x, w) pairs over 37 output rows (5 programs of 8, the last partial): random;
    equal maxima in different programs (rows 3 and 20); a -0.0 maximum before a +0.0
    one (rows 2 and 5, the rest negative); every logit negative with the maximum in
    the last partial program (row 36); one row per argument m."""
    cases = []
    for m in (1, 3):
        cases.append((torch.randn(m, 64, generator=g), torch.randn(37, 64, generator=g)))
    x, w = torch.ones(1, 64), torch.randn(37, 64, generator=g) - 3
    w[3], w[20] = 1.0, 1.0
    cases.append((x, w))
    w = torch.full((37, 64), -1.0)
    w[2], w[5] = -0.0, 0.0
    cases.append((x, w))
    w = torch.rand(37, 64, generator=g) + 1
    w[36] = 0.5
    cases.append((-x, w))
    return [(a.to(dtype), b.to(dtype)) for a, b in cases]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_argmax_is_the_first_maximum_of_the_logits(dtype):
    """The greedy argmax inside the GEMV (``argmax_out``): each row's token is
    ``torch.argmax`` of the logits the same call returned (the first maximal index),
    over ties across programs, signed zeros and all-negative rows; the key buffer is
    reset after each call (the cases run in sequence on one buffer, the last three
    maxima falling, 64 then 0 then -32: a stale key would win)."""
    g = torch.Generator().manual_seed(9)
    nw = torch.ones(64).to(dtype)
    for x, w in _argmax_cases(g, dtype):
        tokens = torch.full((x.shape[0],), -7, dtype=torch.int64)
        y, _ = gemv.gemv(x, w, config=(8, 32, 4, 2), norm=(None, nw, 1e-5, 0.0),
                         argmax_out=tokens)  # fmt: skip
        assert torch.equal(tokens, y.float().argmax(dim=-1)), (tokens, y)
    with pytest.raises(ValueError, match=r"\(1,\) int64"):
        gemv.gemv(x, w, argmax_out=torch.zeros(1, dtype=torch.int32))


def test_backend_norm_linear_argmax_routes_by_rows():
    """``add_rms_norm_linear_argmax`` of the Triton backend against the torch backend's
    (the norm, F.linear, then ``argmax``) at one row (the GEMV's epilogue) and at more
    than ROUTE_ROWS (``argmax.argmax`` after the product), with a residual."""
    from unikv.kernels.backend import get_backend

    tri, ref = get_backend("cpu", "triton"), get_backend("cpu", "torch")
    g = torch.Generator().manual_seed(5)
    nw = (1 + 0.1 * torch.randn(64, generator=g)).bfloat16()
    w = torch.randn(50, 64, generator=g).bfloat16()
    for rows in (1, gemv.ROUTE_ROWS + 2):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        res = torch.randn(rows, 64, generator=g).bfloat16()
        want, want_res, _ = ref.add_rms_norm_linear_argmax(x, res.clone(), nw, 1e-5, w)
        got, got_res, got_tok = tri.add_rms_norm_linear_argmax(x, res.clone(), nw, 1e-5, w)
        assert torch.equal(got_res, want_res)
        assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
        assert torch.equal(got_tok, got.float().argmax(dim=-1)), rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cfg", gemv.CANDIDATES)
def test_gemv_candidates_on_the_gpu(cfg):
    """Every candidate config, compiled for the GPU, at Llama-3.2-1B's qkv (with the
    pre-norm and residual) and down (SwiGLU inside) shapes against the torch
    references in fp32 arithmetic, bf16 operands."""
    from unikv.kernels.linear import ref as elementwise_ref

    g = torch.Generator().manual_seed(sum(cfg))
    x = torch.randn(1, 2048, generator=g).bfloat16().cuda()
    res = torch.randn(1, 2048, generator=g).bfloat16().cuda()
    nw = (1 + 0.1 * torch.randn(2048, generator=g)).bfloat16().cuda()
    w = (0.02 * torch.randn(3072, 2048, generator=g)).bfloat16().cuda()
    want, want_res = elementwise_ref.add_rms_norm_linear(x, res.clone(), nw, 1e-5, w)
    got, got_res = gemv.gemv(x, w, config=cfg, norm=(res, nw, 1e-5, 0.0))
    assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    assert torch.equal(got_res, want_res)
    gate_up = torch.randn(1, 16384, generator=g).bfloat16().cuda()
    wd = (0.02 * torch.randn(2048, 8192, generator=g)).bfloat16().cuda()
    want = elementwise_ref.silu_mul_linear(gate_up, wd)
    got = gemv.gemv(gate_up, wd, config=cfg, silu_mul_input=True)
    assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemv_gather_on_the_gpu():
    """The gathering GEMV on the GPU at Llama-3.2-1B's embedding and qkv shapes (PDL
    on): the same bytes as the GEMV over ``table[ids]``, the rows returned equal."""
    g = torch.Generator().manual_seed(11)
    table = torch.randn(128256, 2048, generator=g).bfloat16().cuda()
    nw = (1 + 0.1 * torch.randn(2048, generator=g)).bfloat16().cuda()
    w = (0.02 * torch.randn(3072, 2048, generator=g)).bfloat16().cuda()
    for token in (0, 128255, 90001):
        ids = torch.tensor([token], device="cuda")
        want, _ = gemv.gemv(table[ids], w, norm=(None, nw, 1e-5, 0.0))
        got, rows = gemv.gemv(table, w, norm=(None, nw, 1e-5, 0.0), gather=ids)
        assert torch.equal(got, want) and torch.equal(rows, table[ids])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemv_argmax_on_the_gpu():
    """The argmax inside the LM head's GEMV on the GPU (PDL on, the atomics racing) at
    Llama-3.2-1B's vocabulary: ``torch.argmax`` of the logits it returned, for random
    rows and for a maximum planted twice (the first copy wins) in programs far apart."""
    g = torch.Generator().manual_seed(12)
    w = (0.02 * torch.randn(128256, 2048, generator=g)).bfloat16().cuda()
    nw = (1 + 0.1 * torch.randn(2048, generator=g)).bfloat16().cuda()
    for trial in range(4):
        x = torch.randn(1, 2048, generator=g).bfloat16().cuda()
        if trial >= 2:  # a planted maximum in rows 100001 and 777 (trial 3: 5 and 100001)
            w[[777, 100001, 5]] = w[0].clone()
            first = 777 if trial == 2 else 5
            w[first] = w[100001] = x[0] * 4
        tokens = torch.empty(1, dtype=torch.int64, device="cuda")
        y, _ = gemv.gemv(x, w, norm=(None, nw, 1e-5, 0.0), argmax_out=tokens)
        assert torch.equal(tokens, y.float().argmax(dim=-1)), trial
        if trial >= 2:
            assert tokens.item() == (777 if trial == 2 else 5)
