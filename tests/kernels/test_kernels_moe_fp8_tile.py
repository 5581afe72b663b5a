"""The fused MoE over block-scaled FP8 experts dequantised per tile (``kernels/moe/fp8.py``,
the Triton backend's ``moe_fp8``), on CPU through the Triton interpreter.

Experts in the checkpoints' format: float8_e4m3fn with one fp32 multiplier per 128 x 128
block, gate and up each blocked on their own; the multipliers span 2^-15..2^-9, so a
tile scaled by a neighbouring block's multiplier is off by up to 64x. E 4, top-k 2,
hidden and intermediate multiples of 128 (and one intermediate of 192, whose up rows
start mid-block: up's scale rows begin at ceil(I / 128)), odd token counts.

Oracles:
- the torch reference (``fp8_gemm_ref.moe_fp8``: the experts dequantised by torch,
  then the 16-bit MoE reference). fp32: max error <= 1e-5 x max |reference| (the
  kernel's dequantised tile is the reference's element for element, the products are
  IEEE fp32; only the order of the fp32 sums differs, ~1e-7 observed). bf16: <= 3e-2
  x max |reference|: the reference rounds gate, up, silu(gate) * up, the down output
  and each weighted expert output to bf16 (five roundings of up to 2^-9 relative, the
  down sum over I products of rounded activations), the kernel keeps fp32 to the end
  and rounds the activation and the output once each (~0.8e-2 observed);
- the same kernel on the torch-dequantised 16-bit experts (``dequantize_experts`` in
  x's dtype), the same tiles: bit for bit, bf16 and fp32, since the per-tile
  dequantisation rounds each element once from its fp32 product, as torch does.
Configs: the table's (fp32: ``FP32_CONFIG``), a K tile of 256 spanning two scale blocks
(a multiplier per element), an N tile of 256 spanning two scale rows, split K,
swapped operands. The Triton backend's ``moe_fp8`` is this kernel and never
dequantises a whole expert (the reference's ``dequantize_experts`` is made to raise);
a model's ``RoutedExperts`` kept in FP8 on that backend runs it on the bytes it loaded.
"""

from __future__ import annotations

import pytest
import torch

from unikv.kernels.backend import get_backend
from unikv.kernels.linear import fp8_gemm_ref
from unikv.kernels.moe import fp8, fused

FP8_MAX = 448.0
BLOCK = (128, 128)
C = fused.Config
CONFIGS = {
    "table": None,
    "k-tile-spans-two-blocks": C(16, 64, 256, 1, 4, 3),
    "n-tile-spans-two-blocks": C(16, 256, 64, 1, 4, 3),
    "split-k": C(16, 32, 128, 2, 4, 3),
    "swap": C(0, 64, 64, 1, 4, 3, True),
}


def _gpu_operands(tokens: int):
    """The GPU tests' MoE on CUDA: E 8, top-2, d 1024, I 512, FP8 experts in BLOCK
    blocks -> (x, topk weights, topk ids, w1, s1, w2, s2), seeded by ``tokens``."""
    g = torch.Generator().manual_seed(tokens)
    e, k, d, inter = 8, 2, 1024, 512
    w1, s1 = (t.cuda() for t in _stack(e, inter, d, 2, g))
    w2, s2 = (t.cuda() for t in _stack(e, d, inter, 1, g))
    x = torch.randn(tokens, d, generator=g).bfloat16().cuda()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).cuda()
    weights = torch.rand(tokens, k, generator=g).bfloat16().cuda()
    return x, weights, ids, w1, s1, w2, s2


def _stack(e: int, rows: int, cols: int, parts: int, g) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 experts (E, parts * rows, cols) and scales (E, parts * ceil(rows / 128),
    ceil(cols / 128)): 2^-15..2^-9 per block."""
    w = (torch.randn(e, parts * rows, cols, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX)
    blocks = (parts * -(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    s = 2.0 ** torch.randint(-15, -8, (e, *blocks), generator=g).float()
    return w.to(torch.float8_e4m3fn), s


def _case(tokens: int, d: int, inter: int, activation: str = "silu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    e, k, parts = 4, 2, 1 if activation == "relu2" else 2
    w1, s1 = _stack(e, inter, d, parts, g)
    w2, s2 = _stack(e, d, inter, 1, g)
    x = torch.randn(tokens, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    return x, torch.rand(tokens, k, generator=g), ids, (w1, s1, w2, s2)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.dtype == want.dtype and got.shape == want.shape
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_per_tile_dequant_matches_the_reference_and_the_dequantised_kernel(name, dtype):
    x, weights, ids, experts = _case(5, 256, 128, seed=len(name))
    x, weights, cfg = x.to(dtype), weights.to(dtype), CONFIGS[name]
    got = fp8.moe_fp8(x, weights, ids, *experts, block=BLOCK, config=cfg)
    want = fp8_gemm_ref.moe_fp8(x, weights, ids, *experts, block=BLOCK)
    assert _rel(got, want) <= (1e-5 if dtype == torch.float32 else 3e-2)
    w1, s1, w2, s2 = experts
    dense1 = fp8_gemm_ref.dequantize_experts(w1, s1, 2, BLOCK, dtype)
    dense2 = fp8_gemm_ref.dequantize_experts(w2, s2, 1, BLOCK, dtype)
    same = cfg or fp8.plan(x.shape[0], dtype)
    assert torch.equal(got, fused.fused_moe(x, weights, ids, dense1, dense2, config=same))


@pytest.mark.parametrize(
    "tokens, d, inter, activation",
    [(1, 128, 256, "silu"), (17, 256, 192, "silu"), (7, 256, 128, "relu2")],
)  # fmt: skip
def test_shapes_activations_and_up_rows_starting_mid_block(tokens, d, inter, activation):
    """One token; 17 tokens over an intermediate of 192 (gate rows 0-191 in scale rows
    0-1, up's in 2-3); relu2 (one part). bf16, the table's tiles."""
    x, weights, ids, experts = _case(tokens, d, inter, activation, seed=tokens)
    x, weights = x.bfloat16(), weights.bfloat16()
    got = fp8.moe_fp8(x, weights, ids, *experts, block=BLOCK, activation=activation)
    want = fp8_gemm_ref.moe_fp8(x, weights, ids, *experts, block=BLOCK, activation=activation)
    assert _rel(got, want) <= 3e-2


def test_the_triton_backend_runs_the_per_tile_kernel_without_dequantising(monkeypatch):
    x, weights, ids, experts = _case(3, 256, 128, seed=9)
    want = fp8_gemm_ref.moe_fp8(x, weights, ids, *experts, block=BLOCK)

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path dequantised whole experts")

    monkeypatch.setattr(fp8_gemm_ref, "dequantize_experts", refuse)
    backend = get_backend("cpu", "triton")
    assert backend.moe_fp8 is fp8.moe_fp8
    got = backend.moe_fp8(x, weights, ids, *experts, block=BLOCK)
    assert _rel(got, want) <= 1e-5


def test_routed_experts_kept_in_fp8_run_the_per_tile_kernel():
    """A model's ``RoutedExperts`` built on the Triton backend, kept in FP8 and loaded
    expert by expert (as the loader writes them), runs this kernel: its output is the
    reference's on the stacks it holds."""
    from unikv.models.moe import RoutedExperts

    x, weights, ids, (w1, s1, w2, s2) = _case(5, 128, 128, seed=4)
    experts = RoutedExperts(4, 128, 128, ops=get_backend("cpu", "triton"))
    experts.keep_fp8(BLOCK)
    with torch.no_grad():
        for e, expert in enumerate(experts):
            for j, part in enumerate((expert.gate_proj, expert.up_proj)):
                part.weight.copy_(w1[e, j * 128 : (j + 1) * 128])
                part.weight_scale_inv.copy_(s1[e, j : j + 1])
            expert.down_proj.weight.copy_(w2[e])
            expert.down_proj.weight_scale_inv.copy_(s2[e])
    assert experts.kernel is fp8.moe_fp8
    assert torch.equal(experts.w1.view(torch.uint8), w1.view(torch.uint8))
    got = experts(x.bfloat16(), weights.bfloat16(), ids)
    want = fp8_gemm_ref.moe_fp8(x.bfloat16(), weights.bfloat16(), ids, w1, s1, w2, s2, block=BLOCK)
    assert _rel(got, want) <= 3e-2


def test_plan_takes_the_fp8_table_else_the_16_bit_one(monkeypatch):
    cfg = C(16, 64, 128, 1, 4, 3)
    monkeypatch.setattr(fp8, "TABLE", {(8, False): cfg})
    assert fp8.plan(5, torch.bfloat16) is cfg  # bucket 8
    assert fp8.plan(9, torch.bfloat16) == fused.TABLE[16, False]
    assert fp8.plan(5, torch.float32) is fused.FP32_CONFIG


def test_no_tokens_gives_an_empty_result():
    x, weights, ids, experts = _case(3, 128, 128)
    got = fp8.moe_fp8(x[:0], weights[:0], ids[:0], *experts, block=BLOCK)
    assert got.shape == (0, 128) and got.dtype == x.dtype


def test_bad_scales_and_16_bit_experts_are_refused():
    x, weights, ids, (w1, s1, w2, s2) = _case(3, 256, 128)
    with pytest.raises(ValueError, match=r"w1_scale must be fp32 \(4, 2, 2\)") as err:
        fp8.moe_fp8(x, weights, ids, w1, s1[:, :1], w2, s2, block=BLOCK)
    assert "(4, 1, 2)" in str(err.value)
    with pytest.raises(ValueError, match=r"w2_scale must be fp32 \(4, 2, 1\)"):
        fp8.moe_fp8(x, weights, ids, w1, s1, w2, s2.double(), block=BLOCK)
    with pytest.raises(ValueError, match="float8_e4m3fn") as err:
        fp8.moe_fp8(x, weights, ids, w1.float(), s1, w2, s2, block=BLOCK)
    assert "torch.float32" in str(err.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_gpu_per_tile_dequant_matches_the_dequantised_kernel(tokens):
    """Compiled (bf16 MMA, the table's tiles at decode and prefill buckets): E 8, top-2,
    d 1024, I 512, against the same kernel on the torch-dequantised bf16 experts (the
    same operands: equal up to the MMA's fp32 sums) and the reference. 16-bit
    activations at every T (``w8a8=False``: 300 rows would plan W8A8, tested in
    ``test_kernels_moe_w8a8.py``)."""
    x, weights, ids, w1, s1, w2, s2 = _gpu_operands(tokens)
    got = fp8.moe_fp8(x, weights, ids, w1, s1, w2, s2, block=BLOCK, w8a8=False)
    dense1 = fp8_gemm_ref.dequantize_experts(w1, s1, 2, BLOCK, torch.bfloat16)
    dense2 = fp8_gemm_ref.dequantize_experts(w2, s2, 1, BLOCK, torch.bfloat16)
    assert _rel(got, fused.fused_moe(x, weights, ids, dense1, dense2)) <= 1e-2
    assert _rel(got, fp8_gemm_ref.moe_fp8(x, weights, ids, w1, s1, w2, s2, block=BLOCK)) <= 3e-2
