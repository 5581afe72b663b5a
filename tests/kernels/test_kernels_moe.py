"""The fused MoE (``kernels/moe/fused.py``, Triton; on CPU through the interpreter) against
its torch reference (``kernels/moe/ref.py``), and the reference against a naive
per-token loop written here from the definition.

Shapes are tiny and odd: 3-8 experts, top-1/2, hidden 40 and 72 (not multiples of
the 64-wide K tile; 72 loops twice), intermediate 24 and 70 (70 spans two N tiles),
T 1, 5 and 37. Tolerances: fp32 max abs error <= 1e-5 x max |reference| (observed
~1e-7: fp32 products, fp32 accumulators, sums in another order); bf16 <= 3e-2 x max
|reference| (the kernel keeps fp32 accumulators and rounds once, the reference
rounds each GEMM output to bf16). MXFP4 weights (random codes, exponents 2^-7..2^0)
are compared with the dense reference on ``dequantize_mxfp4`` of the same bytes
(itself checked against transformers in ``test_engine_models.py``).
"""

from __future__ import annotations

import pytest
import torch
import triton

from unikv.kernels.moe import fused as moe
from unikv.kernels.moe import ref as moe_ref
from unikv.kernels.moe.mxfp4_ref import dequantize_mxfp4
from unikv.models.moe import RoutedExperts

CASES = [  # activation, gate_up, experts, top_k, hidden, intermediate, tokens
    ("silu", "concat", 3, 1, 40, 24, 5),
    ("silu", "concat", 8, 2, 72, 70, 37),
    ("gpt_oss", "interleaved", 5, 2, 40, 24, 37),
    ("gpt_oss", "interleaved", 4, 1, 72, 70, 1),
    ("relu2", "concat", 6, 2, 40, 70, 5),
    ("silu", "interleaved", 3, 2, 40, 24, 1),
]


def _routing(g, t, e, k):
    logits = torch.randn(t, e, generator=g, device=g.device)
    weights, ids = torch.topk(logits.softmax(-1), k, dim=-1)
    return weights, ids


def _dense_case(act, gate_up, e, k, d, i, t, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n1 = i if act == "relu2" else 2 * i
    args = {
        "x": torch.randn(t, d, generator=g),
        "w1": torch.randn(e, n1, d, generator=g) * d**-0.5,
        "w2": torch.randn(e, d, i, generator=g) * i**-0.5,
    }
    if act == "gpt_oss":
        args["b1"] = torch.randn(e, n1, generator=g) * 0.1
        args["b2"] = torch.randn(e, d, generator=g) * 0.1
    args = {name: v.to(dtype) for name, v in args.items()}
    args["topk_weights"], args["topk_ids"] = _routing(g, t, e, k)
    return args, {"activation": act, "gate_up": gate_up}


def _close(out, ref, rel):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= rel * max(1.0, ref.float().abs().max().item()), err


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(case, dtype):
    args, kw = _dense_case(*case, dtype)
    ref = moe_ref.fused_moe(**args, **kw)
    _close(moe.fused_moe(**args, **kw), ref, 1e-5 if dtype == torch.float32 else 3e-2)


def _naive(x, topk_weights, topk_ids, w1, w2, b1=None, b2=None, *, activation, gate_up):
    """Token by token, slot by slot, from the definition (fp32)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w1[e] @ x[t] + (0 if b1 is None else b1[e])
            if activation == "relu2":
                a = torch.relu(h) ** 2
            else:
                gate, up = (h[0::2], h[1::2]) if gate_up == "interleaved" else h.chunk(2)
                if activation == "silu":
                    a = gate * torch.sigmoid(gate) * up
                else:
                    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                    a = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            out[t] += topk_weights[t, j] * (w2[e] @ a + (0 if b2 is None else b2[e]))
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dense_max_tokens", [0, 256])  # the sparse and the dense loop
def test_reference_matches_naive_loop(case, dense_max_tokens, monkeypatch):
    monkeypatch.setattr(moe_ref, "DENSE_MAX_TOKENS", dense_max_tokens)
    args, kw = _dense_case(*case, torch.float32)
    _close(moe_ref.fused_moe(**args, **kw), _naive(**args, **kw), 1e-5)


def _mxfp4(g, e, rows, cols):
    dev = g.device
    blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=g,
                           device=dev)  # fmt: skip
    scales = torch.randint(120, 128, (e, rows, cols // 32), dtype=torch.uint8, generator=g,
                           device=dev)  # fmt: skip
    return blocks, scales, dequantize_mxfp4(blocks, scales).transpose(1, 2)  # (E, rows, cols)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("e, k, d, i, t", [(4, 2, 64, 96, 7), (3, 1, 96, 32, 1)])
def test_mxfp4_kept_packed_matches_dequantised(dtype, e, k, d, i, t):
    packed, pkw, dense_args, kw = _packed_case(e, k, d, i, t, dtype, seed=1)
    dense = moe_ref.fused_moe(*dense_args, **kw)
    assert torch.equal(moe_ref.fused_moe(*packed, **pkw), dense)
    _close(moe.fused_moe(*packed, **pkw), dense, 1e-5 if dtype == torch.float32 else 3e-2)


def _every_code_and_scale(device="cpu"):
    """Blocks holding every byte value under every e8m0 scale 0..254 (one row each)."""
    blocks = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).expand(255, 16, 16)
    scales = torch.arange(255, dtype=torch.uint8)[:, None].expand(255, 16)
    return blocks.contiguous().to(device), scales.contiguous().to(device)


def test_decode_mxfp4_is_exact_for_every_code_and_scale():
    """The kernels' decode (``moe.decode_mxfp4``, the interpreter's Triton-op route)
    equals ``dequantize_mxfp4`` rounded to bf16 bit for bit: every code pair under every
    scale 0..254, the subnormal codes and scale 0 included."""
    blocks, scales = _every_code_and_scale()
    want = dequantize_mxfp4(blocks[None], scales[None])[0].t().bfloat16()  # (rows, K)
    got = moe.decode_mxfp4(blocks, scales)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_mxfp4_is_exact_for_every_code_and_scale():
    """The inline-PTX decode (prmt, shifts, two bf16x2 multiplies) on the GPU: bit for
    bit ``dequantize_mxfp4`` in bf16 for every code pair under every scale 0..254."""
    blocks, scales = _every_code_and_scale("cuda")
    want = dequantize_mxfp4(blocks[None].cpu(), scales[None].cpu())[0].t().bfloat16()
    got = moe.decode_mxfp4(blocks, scales).cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_permute_groups_puts_even_columns_first():
    """``permute_groups``: each group of 32 columns becomes its 16 even columns, then
    its 16 odd ones (a naive indexed gather). The kernels' ``perm_col`` / ``unperm_col``
    are checked through the fused MoE's outputs (the MXFP4 tests above and below)."""
    x = torch.randn(3, 96)
    order = [32 * g + 2 * i + h for g in range(3) for h in range(2) for i in range(16)]
    assert torch.equal(moe.permute_groups(x), x[:, order])


def test_decode_mxfp4_bad_input_raises():
    with pytest.raises(ValueError, match="uint8"):
        moe.decode_mxfp4(torch.zeros(2, 3, 16), torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales"):
        moe.decode_mxfp4(
            torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8)
        )


@pytest.mark.parametrize("swap", [False, True])
def test_mxfp4_scales_far_from_one_are_exact(swap):
    """The in-kernel decode (two halves; plain and swapped), at e8m0
    scales 2^-67 .. 2^63 with every code pair in the bytes: fp32, top-1 routing,
    each expert's scales in a band of its own, every token's output against the dense
    reference on ``dequantize_mxfp4`` of the same bytes, relative to that token."""
    g = torch.Generator().manual_seed(7)
    e, d, i, t = 3, 64, 32, 12
    w1, _, _ = _mxfp4(g, e, 2 * i, d)
    w2, _, _ = _mxfp4(g, e, d, i)
    assert set(w1.flatten().tolist()) == set(range(256))  # every code pair

    def band(centres, shape):  # per expert: its centre +- 3
        spread = torch.randint(-3, 4, shape, generator=g)
        return (torch.tensor(centres)[:, None, None] + spread).to(torch.uint8)

    s1 = band([100, 127, 150], (e, 2 * i, d // 32))
    s2 = band([63, 190, 127], (e, d, i // 32))
    x = torch.randn(t, d, generator=g)
    ids = (torch.arange(t) % e)[:, None]
    weights = torch.ones(t, 1)
    dense = moe_ref.fused_moe(x, weights, ids, dequantize_mxfp4(w1, s1).transpose(1, 2),
                              dequantize_mxfp4(w2, s2).transpose(1, 2))  # fmt: skip
    out = moe.fused_moe(x, weights, ids, w1, w2, w1_scales=s1, w2_scales=s2,
                        config=moe.Config(16, 32, 64, 1, 4, 1, swap))  # fmt: skip
    err = (out - dense).abs().amax(1) / dense.abs().amax(1)
    assert dense.abs().amax(1).max() / dense.abs().amax(1).min() > 2.0**100  # the span
    assert (err <= 1e-5).all(), err


@pytest.mark.parametrize("t, k, e, block_m", [(1, 1, 3, 16), (37, 2, 5, 16), (300, 2, 8, 64)])
@pytest.mark.parametrize("form", ["kernel", "torch"])
def test_align_groups_every_assignment_once(t, k, e, block_m, form):
    ids = torch.randint(0, e, (t, k), generator=torch.Generator().manual_seed(t))
    align = moe.align_by_expert if form == "kernel" else moe.align_by_expert_torch
    sorted_ids, block_experts = align(ids, e, block_m)
    m = t * k
    real = sorted_ids[sorted_ids < m].long()
    assert sorted(real.tolist()) == list(range(m))  # each (token, slot) exactly once
    assert sorted_ids.shape[0] == block_experts.shape[0] * block_m
    rows_expert = block_experts.long().repeat_interleave(block_m)
    placed = sorted_ids < m
    assert torch.equal(rows_expert[placed], ids.reshape(-1)[sorted_ids[placed].long()])
    used = int((block_experts >= 0).sum())
    want = sum(-(-int((ids == x).sum()) // block_m) for x in range(e))
    assert used == want and bool((block_experts[used:] == -1).all())


@pytest.mark.parametrize(
    "t, k, e, block_m",
    [(256, 4, 32, 32), (3, 4, 32, 16), (700, 2, 6, 16), (64, 8, 128, 16), (40, 4, 256, 16)],
)
def test_align_kernel_equals_the_torch_form(t, k, e, block_m):
    """The one-program Triton alignment against the torch form, element for element:
    several one-hot chunks, experts left unused, E not a power of two, 256 experts."""
    gen = torch.Generator().manual_seed(e + t)
    ids = torch.randint(0, e, (t, k), generator=gen, dtype=torch.int32)
    ids[: t // 2] = ids[: t // 2] % 3  # crowd a few experts: long runs, several blocks each
    assert t * k * triton.next_power_of_2(e) <= moe.ALIGN_KERNEL_MAX_WORK  # the kernel's
    got = moe.align_by_expert(ids, e, block_m)
    want = moe.align_by_expert_torch(ids, e, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_align_takes_the_torch_form_above_the_kernel_bound(monkeypatch):
    ids = torch.randint(0, 8, (20, 2), generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(moe, "ALIGN_KERNEL_MAX_WORK", 40 * 8 - 1)
    calls = []
    monkeypatch.setattr(moe, "align_by_expert_kernel", lambda *a: calls.append(a))
    got = moe.align_by_expert(ids, 8, 16)
    want = moe.align_by_expert_torch(ids, 8, 16)
    assert not calls and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bad_arguments_raise():
    args, kw = _dense_case("silu", "concat", 3, 1, 40, 24, 5, torch.float32)
    with pytest.raises(ValueError, match="activation"):
        moe.fused_moe(**args, activation="gelu")
    with pytest.raises(ValueError, match="w2"):
        moe_ref.fused_moe(**{**args, "w2": args["w2"][:, :, :-1]}, **kw)
    with pytest.raises(ValueError, match="MXFP4"):
        moe.fused_moe(**args, **kw, w1_scales=torch.zeros(3, 48, 1, dtype=torch.uint8))


def test_routed_experts_params_are_views_of_the_stack():
    """Writing an expert's parameter (as the loader does) lands in the stacked
    operand, after construction and after a dtype change and ``to_empty``."""
    experts = RoutedExperts(3, 40, 24, names=("w1", "w3", "w2"))
    experts = experts.to(torch.float64).to_empty(device="cpu")
    with torch.no_grad():
        for e, expert in enumerate(experts):
            expert.w1.weight.fill_(e + 1.0)
            expert.w3.weight.fill_(-(e + 1.0))
            expert.w2.weight.fill_(10.0 * e)
    assert experts.w1.dtype == torch.float64 and experts.w1.shape == (3, 48, 40)
    for e in range(3):
        assert bool((experts.w1[e, :24] == e + 1).all()) and bool(
            (experts.w1[e, 24:] == -e - 1).all()
        )
        assert bool((experts.w2[e] == 10.0 * e).all())
    assert experts.kernel is moe_ref.fused_moe  # built outside the loader: the torch backend's


ALL_CONFIGS = sorted(
    {c for cands in moe.CANDIDATES.values() for c in cands}
    | {moe.FP32_CONFIG}
    | {c for c in moe.TABLE.values() if c is not moe.LOOP}
)


def _packed_case(e, k, d, i, t, dtype, seed):
    """gpt-oss-style MXFP4 experts (biased), their dense copy, routing."""
    g = torch.Generator().manual_seed(seed)
    w1, s1, w1_dense = _mxfp4(g, e, 2 * i, d)
    w2, s2, w2_dense = _mxfp4(g, e, d, i)
    x = torch.randn(t, d, generator=g).to(dtype)
    weights, ids = _routing(g, t, e, k)
    b1, b2 = (torch.randn(e, n, generator=g).to(dtype) for n in (2 * i, d))
    kw = {"activation": "gpt_oss", "gate_up": "interleaved", "b1": b1, "b2": b2}
    dense = (x, weights, ids, w1_dense.to(dtype), w2_dense.to(dtype))
    return (x, weights, ids, w1, w2), {"w1_scales": s1, "w2_scales": s2, **kw}, dense, kw


@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_every_config_matches_reference(cfg):
    """Every config the table or the sweep can install, dense (E 5, k 2, d 48, I 40,
    T 17: odd, K and N below one tile) and MXFP4 (d 96, I 64, T 3: a partial K tile
    and a partial scale group row), fp32, against the torch reference."""
    args, kw = _dense_case("silu", "concat", 5, 2, 48, 40, 17, torch.float32)
    ref = moe_ref.fused_moe(**args, **kw)
    _close(moe.fused_moe(**args, **kw, config=cfg), ref, 1e-5)
    packed, pkw, dense, dkw = _packed_case(5, 2, 96, 64, 3, torch.float32, seed=2)
    _close(moe.fused_moe(*packed, **pkw, config=cfg), moe_ref.fused_moe(*dense, **dkw), 1e-5)


SPLIT_CONFIGS = [moe.Config(16, 16, 32, 2, 4, 1), moe.Config(0, 32, 32, 3, 4, 2)]


@pytest.mark.parametrize("cfg, t", [(SPLIT_CONFIGS[0], 1), (SPLIT_CONFIGS[0], 17),
                                    (SPLIT_CONFIGS[1], 3)], ids=["2-t1", "2-t17", "3-t3"])  # fmt: skip
@pytest.mark.parametrize("act, gate_up", [("silu", "concat"), ("gpt_oss", "interleaved"),
                                          ("relu2", "concat")])  # fmt: skip
def test_split_k_matches_reference(cfg, t, act, gate_up):
    """K split in 2 or 3 slices (d 48: the third slice is empty; I 40 over 32-wide
    K tiles), the activation and b1 applied in the down kernel's A tiles."""
    args, kw = _dense_case(act, gate_up, 5, 2, 48, 40, t, torch.float32, seed=t)
    if act == "gpt_oss":
        args["b1"] = args["b1"] * 10  # large enough that a lost or doubled bias shows
    _close(moe.fused_moe(**args, **kw, config=cfg), moe_ref.fused_moe(**args, **kw), 1e-5)


@pytest.mark.parametrize("dtype, t", [(torch.float32, 1), (torch.float32, 17), (torch.bfloat16, 3)])
def test_split_k_mxfp4_matches_dequantised(dtype, t):
    """MXFP4 with a 2-way K split: bf16 rounds the activation before the down dot,
    as the unsplit kernel does."""
    packed, pkw, dense, dkw = _packed_case(5, 2, 96, 64, t, dtype, seed=t + 10)
    out = moe.fused_moe(*packed, **pkw, config=moe.Config(16, 32, 64, 2, 4, 2))
    _close(out, moe_ref.fused_moe(*dense, **dkw), 1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize(
    "t, want", [(1, 1), (2, 8), (8, 8), (9, 16), (16, 16), (17, 64), (64, 64), (65, 256),
                (256, 256), (257, 2048), (2048, 2048), (2049, 8192), (8192, 8192),
                (40000, 8192)],
)  # fmt: skip
def test_plan_picks_the_table_entry(t, want):
    """``plan`` returns the entry of T's bucket (the smallest bucket >= T, else the
    largest), LOOP included; fp32 swaps a kernel entry for FP32_CONFIG."""
    table = {(b, f): moe.Config(16 * (1 + f), 16 * b, 32, 1, 4, 1) for b in moe.BUCKETS
             for f in (False, True)}  # fmt: skip
    table[want, False] = moe.LOOP
    assert moe.plan(t, True, torch.bfloat16, table) == table[want, True]
    assert moe.plan(t, False, torch.bfloat16, table) is moe.LOOP
    assert moe.plan(t, True, torch.float32, table) == moe.FP32_CONFIG
    table[want, True] = moe.LOOP
    with pytest.raises(AssertionError, match="MXFP4"):
        moe.plan(t, True, torch.bfloat16, table)


def test_mxfp4_never_goes_to_the_loop():
    assert all(cfg is not moe.LOOP for (_, mxfp4), cfg in moe.TABLE.items() if mxfp4)
    assert set(moe.TABLE) == {(b, f) for b in moe.BUCKETS for f in (False, True)}


@pytest.mark.parametrize("t", [1, 17])
def test_moe_dispatch_runs_what_the_plan_says(t, monkeypatch):
    """``moe`` (the CUDA MoE of every model) calls the dense loop exactly where the
    table says LOOP, and the kernel with the table's config elsewhere."""
    calls = []
    loop, kernel = moe_ref.fused_moe, moe.fused_moe
    monkeypatch.setattr(moe_ref, "fused_moe", lambda *a, **k: calls.append("loop") or loop(*a, **k))
    monkeypatch.setattr(
        moe, "fused_moe", lambda *a, config, **k: calls.append(config) or kernel(*a, **k)
    )
    table = {key: moe.Config(16, 32, 32, 1, 4, 1) for key in moe.TABLE}
    table[moe.bucket(t), False] = moe.LOOP
    monkeypatch.setattr(moe, "TABLE", table)
    args, kw = _dense_case("silu", "concat", 5, 2, 48, 40, t, torch.bfloat16)
    moe.moe(**args, **kw)
    packed, pkw, _, _ = _packed_case(5, 2, 96, 64, t, torch.bfloat16, seed=3)
    moe.moe(*packed, **pkw)
    assert calls == ["loop", table[moe.bucket(t), True]]


def test_models_run_the_dispatch_on_cuda():
    """The backend carries the MoE: Triton's (the table's dispatch) on the Triton
    backend, on CUDA or the interpreter alike; the reference on the torch backend."""
    from unikv.kernels.backend import Flags, _torch, _triton

    assert _triton(Flags(cuda=True)).moe is moe.moe and _triton(Flags()).moe is moe.moe
    assert _torch().moe is moe_ref.fused_moe


def test_bad_config_raises():
    args, kw = _dense_case("silu", "concat", 3, 1, 40, 24, 5, torch.float32)
    with pytest.raises(ValueError, match="Config"):
        moe.fused_moe(**args, **kw, config=moe.Config(16, 48, 64, 1, 4, 1))


@pytest.mark.gpu
def test_gpu_gpt_oss_shape_bf16_matches_reference():
    """gpt-oss's shape (32 experts, top-4, hidden/intermediate 2880) with MXFP4
    experts, bf16, 64 tokens: the Triton kernel against the reference."""
    g = torch.Generator().manual_seed(0)
    e, k, d, i, t = 32, 4, 2880, 2880, 64
    w1, s1, _ = _mxfp4(g, e, 2 * i, d)
    w2, s2, _ = _mxfp4(g, e, d, i)
    x = torch.randn(t, d, generator=g).bfloat16()
    weights, ids = _routing(g, t, e, k)
    args = [v.cuda() for v in (x, weights, ids, w1, w2)]
    kw = {"w1_scales": s1.cuda(), "w2_scales": s2.cuda(), "activation": "gpt_oss"}
    kw["gate_up"] = "interleaved"
    _close(moe.fused_moe(*args, **kw), moe_ref.fused_moe(*args, **kw), 3e-2)


GPU_MXFP4_CONFIGS = sorted(
    {c for (_, mx), c in moe.TABLE.items() if mx}
    | {moe.Config(64, 64, 128, 1, 4, 3), moe.Config(0, 64, 128, 1, 4, 3, True),
       moe.Config(64, 64, 256, 1, 4, 3), moe.Config(16, 128, 64, 1, 4, 3),
       moe.Config(64, 128, 128, 1, 8, 3), moe.Config(128, 64, 128, 1, 4, 3)}
)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cfg", GPU_MXFP4_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_gpu_mxfp4_configs_match_dequantised(cfg):
    """Compiled MXFP4 tiles (the table's and block_k 64-256, plain and swapped, 4 and 8
    warps: the register layouts the inline-PTX decode runs in differ between them) on
    K = 352 (11 groups: a partial K tile), 40 tokens, against the dense reference on
    ``dequantize_mxfp4`` of the same bytes."""
    packed, pkw, dense_args, kw = _packed_case(8, 2, 352, 288, 40, torch.bfloat16, seed=3)
    dense = moe_ref.fused_moe(*[a.cuda() for a in dense_args], **_cuda(kw))
    out = moe.fused_moe(*[a.cuda() for a in packed], **_cuda(pkw), config=cfg)
    _close(out, dense, 3e-2)


def _cuda(kw: dict) -> dict:
    return {n: v.cuda() if isinstance(v, torch.Tensor) else v for n, v in kw.items()}


def test_gpt_oss_mxfp4_experts_kept_packed(tmp_path):
    """A gpt-oss model holding MXFP4 experts packed (``mxfp4_experts``) gives the
    logits of the same model holding ``dequantize_mxfp4`` of those bytes."""
    import dataclasses

    from engine_fixtures import DenseAttention, save_tiny_model

    from unikv.models import load_model
    from unikv.models.llama import CausalLM

    save_tiny_model("gpt_oss", str(tmp_path))
    dense = load_model(str(tmp_path))
    extra = {**dense.config.extra, "mxfp4_experts": True}
    packed = CausalLM(dataclasses.replace(dense.config, extra=extra), 64)
    packed.model.rotary.build(torch.device("cpu"))
    params = dict(packed.named_parameters())
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in dense.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                e, cols, rows = p.shape  # (E, in, out)
                blocks, scales, _ = _mxfp4(g, e, rows, cols)
                params[name + "_blocks"].copy_(blocks)
                params[name + "_scales"].copy_(scales)
                p.copy_(dequantize_mxfp4(blocks, scales))
            else:
                params[name].copy_(p)
    assert params["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8
    tokens = torch.randint(0, 256, (12,), generator=g)
    attn = DenseAttention(dense.config.windows, dense.config.sm_scale)
    want = dense(tokens, torch.arange(12), attn)
    got = packed(tokens, torch.arange(12), attn)
    assert (got - want).abs().max() < 1e-4


GPU_DENSE_CASES = [  # the tiny gpt-oss of the engine tests (E 4, k 2, d = I = 64), others
    ("gpt_oss", "interleaved", 4, 2, 64, 64),
    ("silu", "concat", 8, 2, 96, 80),
    ("relu2", "concat", 5, 2, 48, 40),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", GPU_DENSE_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("t", [1, 3, 16, 17, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_unpacked_experts_match_reference(case, t, dtype):
    """Unpacked (dense) experts on the GPU through ``moe.moe`` (the table's pick for T,
    FP32_CONFIG in fp32) and through every config the table installs, against the
    torch reference: the path an fp32 / bf16 model's MoE layers take on CUDA."""
    act, gate_up, e, k, d, i = case
    args, kw = _dense_case(act, gate_up, e, k, d, i, t, dtype, seed=t)
    args = {n: v.cuda() for n, v in args.items()}
    ref = moe_ref.fused_moe(**args, **kw)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    _close(moe.moe(**args, **kw), ref, tol)
    if dtype == torch.bfloat16:
        for cfg in {c for c in moe.TABLE.values() if c is not moe.LOOP}:
            _close(moe.fused_moe(**args, **kw, config=cfg), ref, tol)
