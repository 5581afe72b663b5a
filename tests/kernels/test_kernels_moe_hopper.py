"""The Hopper MXFP4 MoE (``kernels/moe/hopper.py``) and its weight order (``mxfp4_frag``).

CPU: the fragment packing against a byte-by-byte description of the same order (each
byte's row, k and nibbles derived from the lane / byte index bits). GPU (sm_90): the
Gluon kernels against the torch reference on the checkpoint's packed experts
(``moe_ref.fused_moe``), at several shapes, tiles, activations and gate/up layouts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernels_moe import _close, _mxfp4, _routing

from unikv.kernels.moe import mxfp4_frag


def _naive_pack(blocks: torch.Tensor, scales: torch.Tensor):
    """The fragment order written out one byte at a time."""
    e, n, g, _ = blocks.shape
    s, kb = n // 16, g // 2
    w = torch.zeros(e, s, kb, 512, dtype=torch.uint8)
    sc = torch.zeros(e, s, kb, 32, dtype=torch.uint8)

    def code(ei, row, k):
        byte = int(blocks[ei, row, k // 32, (k % 32) // 2])
        return byte >> 4 if k % 2 else byte & 0x0F

    for ei in range(e):
        for si in range(s):
            for b in range(kb):
                for lane in range(32):
                    lq, lr = lane // 4, lane % 4
                    for i in range(16):
                        i0, i1, i2, i3 = i & 1, (i >> 1) & 1, (i >> 2) & 1, (i >> 3) & 1
                        row = 16 * si + 8 * i1 + lq
                        kk = i0 + 2 * lr + 8 * i2 + 16 * i3
                        lo, hi = code(ei, row, 64 * b + kk), code(ei, row, 64 * b + 32 + kk)
                        w[ei, si, b, 16 * lane + i] = lo | (hi << 4)
                    for j, (dr, grp) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
                        sc[ei, si, b, 4 * lq + j] = scales[ei, 16 * si + lq + dr, 2 * b + grp]
    return w, sc


def test_pack_fragments_matches_the_bytewise_description():
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (2, 32, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (2, 32, 4), dtype=torch.uint8, generator=g)
    w, sc = mxfp4_frag.pack_fragments(blocks, scales)
    w_ref, sc_ref = _naive_pack(blocks, scales)
    assert torch.equal(w, w_ref) and torch.equal(sc, sc_ref)
    # the row order is applied first: interleaved gate/up rows become [gate | up]
    order = mxfp4_frag.gate_up_row_order(32, interleaved=True)
    assert order.tolist() == list(range(0, 32, 2)) + list(range(1, 32, 2))
    w_perm, _ = mxfp4_frag.pack_fragments(blocks, scales, order)
    assert torch.equal(w_perm, _naive_pack(blocks[:, order], scales[:, order])[0])
    assert mxfp4_frag.gate_up_row_order(32, interleaved=False) is None


def test_pack_fragments_refuses_shapes_it_cannot_tile():
    blocks = torch.zeros(1, 24, 4, 16, dtype=torch.uint8)  # 24 rows: not whole slabs of 16
    with pytest.raises(ValueError, match="multiple of 16"):
        mxfp4_frag.pack_fragments(blocks, torch.zeros(1, 24, 4, dtype=torch.uint8))
    blocks = torch.zeros(1, 16, 3, 16, dtype=torch.uint8)  # K = 96: not whole blocks of 64
    with pytest.raises(ValueError, match="multiple of 64"):
        mxfp4_frag.pack_fragments(blocks, torch.zeros(1, 16, 3, dtype=torch.uint8))


def test_hopper_moe_refuses_bad_arguments():
    """Checked before any launch (so on the CPU too): the activations' dtype and width,
    the routing's shape, the activation."""
    from unikv.kernels.moe import hopper as moe_hopper

    g = torch.Generator().manual_seed(2)
    w1 = torch.randint(0, 256, (2, 128, 2, 16), dtype=torch.uint8, generator=g)
    w2 = torch.randint(0, 256, (2, 64, 2, 16), dtype=torch.uint8, generator=g)
    s1, s2 = (
        torch.full((2, 128, 2), 127, dtype=torch.uint8),
        torch.full((2, 64, 2), 127, dtype=torch.uint8),
    )
    frags = moe_hopper.pack_experts(w1, s1, w2, s2, "concat")
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    weights, ids = torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="bf16 activations"):
        moe_hopper.fused_moe_hopper(x.float(), weights, ids, frags)
    with pytest.raises(ValueError, match=r"\(T, 64\)"):
        moe_hopper.fused_moe_hopper(x[:, :32], weights, ids, frags)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_hopper.fused_moe_hopper(x, weights[:2], ids[:2], frags)
    with pytest.raises(ValueError, match="relu2"):
        moe_hopper.fused_moe_hopper(x, weights, ids, frags, activation="relu2")


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")


def _case(e, k, d, i, t, seed, scale_lo=120, scale_hi=128, bias=True):
    g = torch.Generator().manual_seed(seed)
    w1, s1, _ = _mxfp4(g, e, 2 * i, d)
    w2, s2, _ = _mxfp4(g, e, d, i)
    s1 = torch.randint(scale_lo, scale_hi, s1.shape, dtype=torch.uint8, generator=g)
    s2 = torch.randint(scale_lo, scale_hi, s2.shape, dtype=torch.uint8, generator=g)
    x = torch.randn(t, d, generator=g).bfloat16()
    weights, ids = _routing(g, t, e, k)
    b1 = (torch.randn(e, 2 * i, generator=g) * 0.1).bfloat16() if bias else None
    b2 = (torch.randn(e, d, generator=g) * 0.1).bfloat16() if bias else None
    cuda = lambda v: None if v is None else v.cuda()
    return [cuda(v) for v in (x, weights, ids, w1, s1, w2, s2, b1, b2)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "block_t, stages, half, warps",
    [(16, 3, False, 4), (64, 4, True, 4), (64, 4, True, 8), (128, 2, True, 8)],
)
@pytest.mark.parametrize("activation, gate_up", [("gpt_oss", "interleaved"), ("silu", "concat")])
@pytest.mark.parametrize("t", [1, 37, 300])
def test_hopper_moe_matches_the_reference(block_t, stages, half, warps, activation, gate_up, t):
    """I = 192 on 8 warps (128 features a program): the last tile half past the matrix."""
    from unikv.kernels.moe import hopper as moe_hopper
    from unikv.kernels.moe import ref as moe_ref

    x, weights, ids, w1, s1, w2, s2, b1, b2 = _case(6, 2, 128, 192, t, seed=t)
    kw = {"activation": activation, "gate_up": gate_up, "b1": b1, "b2": b2}
    ref = moe_ref.fused_moe(x, weights, ids, w1, w2, w1_scales=s1, w2_scales=s2, **kw)
    frags = moe_hopper.pack_experts(w1, s1, w2, s2, gate_up)
    assert frags.one_mul  # exponents 120..127
    for one_mul in (True, False):
        out = moe_hopper.fused_moe_hopper(x, weights, ids, frags, **kw, block_t=block_t,
                                          stages=stages, one_mul=one_mul, half=half,
                                          warps=warps)  # fmt: skip
        _close(out, ref, 3e-2)


@pytest.mark.gpu
@needs_hopper
def test_hopper_moe_two_multiply_decode_beyond_the_one_multiply_range():
    """Down-projection exponents up to 160 (2^126 times those scales overflows bf16):
    packing picks the two-multiply decode, which matches the reference."""
    from unikv.kernels.moe import hopper as moe_hopper
    from unikv.kernels.moe import ref as moe_ref

    x, weights, ids, w1, s1, w2, s2, _, _ = _case(2, 1, 64, 64, 5, seed=9, bias=False)
    s2.random_(100, 161)
    frags = moe_hopper.pack_experts(w1, s1, w2, s2, "concat")
    assert not frags.one_mul
    kw = {"activation": "silu", "gate_up": "concat"}
    ref = moe_ref.fused_moe(x, weights, ids, w1, w2, w1_scales=s1, w2_scales=s2, **kw)
    _close(moe_hopper.fused_moe_hopper(x, weights, ids, frags, **kw), ref, 3e-2)


@pytest.mark.gpu
@needs_hopper
def test_gpt_oss_mxfp4_checkpoint_on_the_hopper_kernel(tmp_path, monkeypatch):
    """A packed gpt-oss checkpoint loaded in bf16 on the H200: its experts, re-packed in
    place for the Hopper kernel, give what the same checkpoint's experts give on the
    Triton kernel (``UNIKV_MOE_HOPPER=0``, the checkpoint's layout), and refuse to move."""
    import json

    from engine_fixtures import pack_gpt_oss_experts, save_tiny_model

    from unikv.models.loader import load_model

    save_tiny_model("gpt_oss", str(tmp_path), hidden_size=128, intermediate_size=128,
                    head_dim=32)  # fmt: skip
    pack_gpt_oss_experts(str(tmp_path), seed=4, scales=(118, 124))
    g = torch.Generator().manual_seed(5)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hopper = load_model(str(tmp_path), device="cuda", dtype=torch.bfloat16)
    from unikv import env

    monkeypatch.setattr(env, "FLAGS", dataclasses.replace(env.FLAGS, moe_hopper=False))
    triton_model = load_model(str(tmp_path), device="cuda", dtype=torch.bfloat16)
    experts = [m for m in hopper.modules() if type(m).__name__ == "Experts"]
    assert experts and all(m.fragments is not None for m in experts)
    assert all(m.fragments is None for m in triton_model.modules() if type(m).__name__ == "Experts")
    # each layer's experts on the same routed tokens: the Hopper kernel on the re-packed
    # bytes against the Triton kernel on the checkpoint's
    pairs = [(a, b) for a, b in zip(hopper.modules(), triton_model.modules(), strict=True)
             if type(a).__name__ == "Experts"]  # fmt: skip
    assert len(pairs) == config["num_hidden_layers"]
    for t in (1, 37, 300):
        x = torch.randn(t, 128, generator=g).bfloat16().cuda()
        weights, ids = _routing(g, t, config["num_local_experts"], 2)
        weights, ids = weights.cuda().bfloat16(), ids.cuda()
        for a, b in pairs:
            with torch.no_grad():
                _close(a(x, weights, ids), b(x, weights, ids), 3e-2)
    with pytest.raises(RuntimeError, match="re-packed"):
        hopper.to("cpu")
