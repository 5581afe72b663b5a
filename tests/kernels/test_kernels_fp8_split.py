"""The FP8 GEMM's split K reduced inside its one launch (``fp8_gemm``, ``fused_split``):
each split program stores its fp32 partial, counts its arrival on the tile's counter,
and the last to arrive sums the partials in split order, adds the bias, writes y and
resets the counter. On CPU through the Triton interpreter.

Oracles:
- the torch reference (``fp8_gemm_ref.fp8_linear``: the dequantised weight times x in
  fp32), at the kernel tests' tolerances, for split 1, 2, several, K not a multiple of
  the split, bias or none, fp32 / bf16 / fp16, weights held padded;
- the split order, bit for bit (fp32): each split's K range run as its own one-split
  GEMM on the sliced operands, the partials added in order 0..S-1 by torch, one add at
  a time, then the bias; with the interpreter's programs run in a shuffled order, so
  the last program to arrive at a tile is not always the last split;
- the former path (partials summed by torch after the launch): bit for bit where its
  ``sum(0)`` adds in split order (S <= 4: four interleaved accumulators, on CPU as
  measured here and in CUDA's reduction kernel), at tolerance past that;
- repeated calls give the same bytes and leave every counter at zero (a kernel that
  did not reset its counter would leave the next call's y unwritten).
GPU (``-m gpu``): replays of a CUDA graph against the reference on DeepSeek-V3's
small decode shapes, the same bytes every replay, and the workspace refused inside
a capture.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_kernels_fp8_gemm import operands, rel_err
from test_kernels_fp8_pad import held

from unikv.kernels.linear import fp8_gemm, fp8_gemm_ref
from unikv.kernels.runtime.private import triton_interpreter

P = fp8_gemm.Fp8Plan
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 8e-3}

# (m, n, k, block, cfg): split 1, 2, several, K not a multiple of the split (or of the
# K tile), odd blocks (per-element scales), M over one tile; cfg None: the plan's
CASES = [
    (3, 40, 256, (8, 64), P("w8a16", 16, 16, 32, 1, True, 4, 2)),  # one split
    (2, 40, 1100, (16, 32), None),  # the plan splits K in two
    (4, 24, 256, (8, 64), P("w8a16", 16, 16, 32, 3, True, 4, 2)),  # K 256 over 3 splits
    (5, 33, 300, (16, 32), P("w8a16", 16, 16, 32, 5, True, 4, 2)),  # K and N tails
    (4, 24, 256, (8, 48), P("w8a16", 16, 16, 32, 6, False, 4, 2)),  # odd blocks, 6 splits
    (20, 50, 416, (16, 32), P("w8a16", 16, 32, 32, 4, True, 4, 2)),  # 2 x 2 tiles, M tail
]


def k_ranges(k: int, cfg: fp8_gemm.Fp8Plan) -> list[tuple[int, int]]:
    """The K range of each split, as the launch cuts K: whole K tiles, the last short."""
    per = -(-k // cfg.split_k)
    per = -(-per // cfg.block_k) * cfg.block_k
    return [(lo, min(lo + per, k)) for lo in range(0, k, per)]


@pytest.mark.parametrize("m, n, k, block, cfg", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_split_matches_the_reference(m, n, k, block, cfg, dtype):
    x, w, s, b = operands(m, n, k, block, dtype, seed=m * n + k)
    plan = fp8_gemm.plan(m, n, k, block, dtype == torch.float32) if cfg is None else cfg
    assert plan.fused_split, "the plan's default reduces split K inside the launch"
    if cfg is None:
        assert plan.split_k == 2
    for bias in (None, b):
        want = fp8_gemm_ref.fp8_linear(x, w, s, bias, block=block)
        got = fp8_gemm.fp8_linear(x, w, s, bias, block=block, config=cfg)
        assert got.dtype == dtype and got.shape == (m, n)
        assert rel_err(got, want) <= TOL[dtype], bias is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_split_on_a_weight_held_padded(dtype):
    """``out_features`` < the held rows (576 in 640's pattern, small): the (M, N) view
    of the held rows' buffer; the pad rows (garbage here) are never read."""
    m, n, k, block = 3, 40, 600, (16, 32)
    x, w, s, b = operands(m, n, k, block, dtype, seed=7)
    hw, hs = held(w, s, 64, block)
    cfg = P("w8a16", 16, 16, 32, 4, True, 4, 2)
    for bias in (None, b):
        got = fp8_gemm.fp8_linear(x, hw, hs, bias, block=block, config=cfg, out_features=n)
        assert got.shape == (m, n) and got.stride(0) == 64
        assert rel_err(got, fp8_gemm_ref.fp8_linear(x, w, s, bias, block=block)) <= TOL[dtype]


@pytest.fixture
def shuffled_programs(monkeypatch):
    """The interpreter's programs run in a random order (it runs them one by one, in
    grid order, which would make split S - 1 always arrive last): returns the list of
    (tile, split) in the order they ran."""
    interp = triton_interpreter()
    builder = interp.interpreter_builder
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    rng = random.Random(11)
    state: dict = {"order": [], "ran": []}

    def grid_dim(nx, ny, nz):
        set_dim(nx, ny, nz)
        state["order"] = [(x, y, z) for x in range(nx) for y in range(ny) for z in range(nz)]
        rng.shuffle(state["order"])
        state["ran"] = []

    def grid_idx(x, y, z):
        coords = state["order"][len(state["ran"])]
        state["ran"].append(coords[:2])
        set_idx(*coords)

    monkeypatch.setattr(builder, "set_grid_dim", grid_dim)
    monkeypatch.setattr(builder, "set_grid_idx", grid_idx)
    return state


MID = (9, 70, 1000, (16, 64), P("w8a16", 16, 16, 64, 7, True, 4, 2))  # 5 tiles x 6 splits


@pytest.mark.parametrize("case", [CASES[3], CASES[5], MID], ids=["tails", "tiles", "mid"])
def test_fused_split_sums_in_split_order_whatever_arrives_last(case, shuffled_programs):
    """fp32 x: y is, bit for bit, the one-split GEMMs of each split's K range added
    in split order (then the bias), with the splits of a tile run in shuffled orders."""
    m, n, k, block, cfg = case
    x, w, s, b = operands(m, n, k, block, torch.float32, seed=m + n + k)
    got = fp8_gemm.fp8_linear(x, w, s, b, block=block, config=cfg)
    ran = list(shuffled_programs["ran"])
    splits = k_ranges(k, cfg)
    tiles = sorted({tile for tile, _ in ran})
    last = {tile: [sp for t, sp in ran if t == tile][-1] for tile in tiles}
    assert len(ran) == len(tiles) * len(splits)
    assert any(sp != len(splits) - 1 for sp in last.values()), "the order was not shuffled"
    one = cfg._replace(split_k=1)
    want = None
    for lo, hi in splits:
        assert lo % block[1] == 0  # the slice starts on a scale block
        cols = slice(lo // block[1], -(-hi // block[1]))
        part = fp8_gemm.fp8_linear(x[:, lo:hi], w[:, lo:hi], s[:, cols], block=block, config=one)
        want = part if want is None else want + part
    want = want + b
    assert torch.equal(got, want)


@pytest.mark.parametrize("case", CASES[1:], ids=["plan2", "s3", "s5", "odd6", "tiles4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_split_equals_the_torch_path(case, dtype):
    """The former path (``fused_split=False``) on the same partials: bit for bit where
    torch's ``sum(0)`` adds in split order (S <= 4), to rounding past that."""
    m, n, k, block, cfg = case
    cfg = cfg or fp8_gemm.plan(m, n, k, block, dtype == torch.float32)
    x, w, s, b = operands(m, n, k, block, dtype, seed=3 * m + n + k)
    for bias in (None, b):
        fused = fp8_gemm.fp8_linear(x, w, s, bias, block=block, config=cfg)
        old = fp8_gemm.fp8_linear(x, w, s, bias, block=block,
                                  config=cfg._replace(fused_split=False))  # fmt: skip
        if len(k_ranges(k, cfg)) <= 4:
            assert torch.equal(fused, old)
        else:
            assert rel_err(fused, old) <= TOL[dtype]


def test_counters_reset_themselves():
    """Many calls, two problems of one size class in turn: each result is its own,
    the same bytes every time, and every counter is zero after each call."""
    m, n, k, block = 5, 33, 300, (16, 32)
    cfg = CASES[3][4]
    x1, w, s, b = operands(m, n, k, block, torch.float32, seed=1)
    x2 = operands(m, n, k, block, torch.float32, seed=2)[0]
    first = {}
    for i in range(6):
        x = x1 if i % 2 == 0 else x2
        got = fp8_gemm.fp8_linear(x, w, s, b, block=block, config=cfg)
        key = i % 2
        if key not in first:
            first[key] = got
            assert rel_err(got, fp8_gemm_ref.fp8_linear(x, w, s, b, block=block)) <= 1e-5
        assert torch.equal(got, first[key]), i
        _, counters = fp8_gemm.split_buffers(1, x.device)
        assert int(counters.count_nonzero()) == 0, i
    assert not torch.equal(first[0], first[1])


def test_split_buffers_are_made_once_per_size_class():
    cpu = torch.device("cpu")
    small = fp8_gemm.split_buffers(1000, cpu)
    assert fp8_gemm.split_buffers(fp8_gemm.SPLIT_MIN_NUMEL, cpu)[0] is small[0]
    big = fp8_gemm.split_buffers(fp8_gemm.SPLIT_MIN_NUMEL + 1, cpu)
    assert big[0] is not small[0] and big[0].numel() == 2 * fp8_gemm.SPLIT_MIN_NUMEL
    assert big[0].dtype == torch.float32 and big[1].dtype == torch.int32
    # a split launch of the most tiles a size class can hold has a counter each
    assert big[1].numel() * 16 * 16 * 2 == big[0].numel()


# -- GPU ------------------------------------------------------------------------------

SMALL_DECODE = [("dsv3.kv_a_proj_with_mqa", 576, 7168), ("dsv3.q_a_proj", 1536, 7168),
                ("dsv3.qkv_a_proj", 2112, 7168)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("name, n, k", SMALL_DECODE)
def test_fused_split_under_cuda_graph_replay_gpu(m, name, n, k):
    """The plan's split-K launch captured in a CUDA graph (after one eager call, as the
    engine warms up) and replayed many times: every replay equals the reference and
    the first replay bit for bit (counters zero between launches, no memset), and
    equals the former torch path to rounding; with bias, bf16."""
    block = (128, 128)
    x, w, s, b = operands(m, n, k, block, torch.bfloat16, seed=m + n, device="cuda")
    cfg = fp8_gemm.plan(m, n, k, block, False)
    assert cfg.split_k > 1 and cfg.fused_split, cfg
    want = fp8_gemm_ref.fp8_linear(x, w, s, b, block=block)
    eager = fp8_gemm.fp8_linear(x, w, s, b, block=block)
    old = fp8_gemm.fp8_linear(x, w, s, b, block=block, config=cfg._replace(fused_split=False))
    assert rel_err(eager, want) <= 1e-2 and rel_err(eager, old) <= 8e-3, name
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_gemm.fp8_linear(x, w, s, b, block=block)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm.fp8_linear(x, w, s, b, block=block)
    graph.replay()
    first = out.clone()
    assert torch.equal(first, eager), name  # the same bytes as the eager launch
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first), name
    x.copy_(torch.randn_like(x))  # new input, same graph
    graph.replay()
    assert rel_err(out, fp8_gemm_ref.fp8_linear(x, w, s, b, block=block)) <= 1e-2, name
    counters = fp8_gemm.split_buffers(1, x.device)[1]
    assert int(counters.count_nonzero()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_split_buffers_refused_inside_a_capture_gpu():
    device = torch.device("cuda")
    need = 1 << 27  # a size class no launch has made (refused before any allocation)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="outside a CUDA graph capture"), torch.cuda.graph(graph):
        fp8_gemm.split_buffers(need, device)
