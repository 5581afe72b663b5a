"""The MLA decode kernel (``unikv/kernels/mla/decode.py``) against the torch reference
(``mla_ref``) and against softmax attention written from the definition over the rows
the test itself stored, under TRITON_INTERPRET=1 on CPU (GPU cases: ``-m gpu``).

Latent rows live in a NaN-poisoned UnifiedPool (MLA sub-pool of 2 layers, layer 1
read through its dense view) on randomly permuted pages; odd ranks and rope widths
(not multiples of any tile), heads 1 / 16 / 20, pages 1 / 3 / 16, split-KV on, both
V layouts (one program for all rank columns, or two programs of half each), and the
fused / tma variants (``mla_decode_fused``: logits once, tiles addressed per key,
per page, or by TMA descriptors).
"""

from __future__ import annotations

import math

import pytest
import torch

from unikv.kernels.mla import decode as mla_decode
from unikv.kernels.mla import decode_fused as mla_decode_fused
from unikv.kernels.mla import plan as mla_decode_plan
from unikv.kernels.mla import ref as mla_ref
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MLASpec

SCALE = 0.3
NARROW, TWO_PART, WIDE = (16, 1, 16, 4, 1), (16, 2, 16, 4, 1), (32, 2, 32, 4, 1)
FUSED, TMA = (16, 1, 16, 4, 1, 1, 32.0, "fused"), (16, 1, 16, 4, 1, 1, 32.0, "tma")
FUSED64 = (64, 1, 16, 8, 2, 1, 45.0, "fused", "fill")  # 128 heads in two blocks


class Case:
    """Requests of ``lens`` cached tokens on permuted pages of a poisoned MLA pool.

    rows[b]: (L_b, rank + rope) fp32, the stored values; block_table (B, max_pages + 1)
    int32 kernel page entries (a zero padding column, the sink page)."""

    def __init__(self, lens, rank, rope, page_size, dtype=torch.float32, device="cpu", seed=0):
        gen = torch.Generator().manual_seed(seed)
        spec = MLASpec(2, rank, rope, dtype=dtype)
        pages = [math.ceil(n / page_size) for n in lens]
        cfg = [SubPoolConfig("mla", spec, page_size=page_size)]
        pool = UnifiedPool(cfg, pool_bytes_for(cfg, {"mla": sum(pages) + 3}), device, poison=True)
        sub = pool["mla"]
        perm = torch.randperm(sub.usable_pages, generator=gen)[: sum(pages)] + sub.first_page
        table = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
        paged, cursor, self.rows = sub.paged_views[1], 0, []
        for b, (n, np_) in enumerate(zip(lens, pages)):
            phys = perm[cursor : cursor + np_]
            cursor += np_
            table[b, :np_] = (phys * sub.blocks_per_page).int()
            rows = torch.randn(n, rank + rope, generator=gen).to(dtype)
            pos = torch.arange(n)
            paged[phys[pos // page_size].to(device), (pos % page_size).to(device)] = rows.to(device)
            self.rows.append(rows.float())
        self.pool, self.cache = pool, sub.views[1]
        self.block_table = table.to(device)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        self.page_size, self.rank = page_size, rank


def queries(num, heads, rank, rope, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q_lat = torch.randn(num, heads, rank, generator=gen).to(dtype).to(device)
    q_rope = torch.randn(num, heads, rope, generator=gen).to(dtype).to(device)
    return q_lat, q_rope


def indptr(q_lens, device="cpu"):
    out = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(q_lens).cumsum(0)
    return out.to(device)


def run(fn, case, q_lat, q_rope, q_lens, **kw):
    return fn(
        q_lat, q_rope, case.cache, case.block_table, indptr(q_lens, q_lat.device), case.seq_lens,
        max_q_len=max(q_lens), page_size=case.page_size, sm_scale=SCALE, **kw,
    )  # fmt: skip


def definition(case, q_lat, q_rope, q_lens):
    """fp32 softmax attention of each lane's token over all its stored rows, per head."""
    outs, tok = [], 0
    for rows, q in zip(case.rows, q_lens):
        if q:
            logits = q_lat[tok].float() @ rows[:, : case.rank].T
            logits += q_rope[tok].float() @ rows[:, case.rank :].T
            outs.append(torch.softmax(logits * SCALE, dim=-1) @ rows[:, : case.rank])
            tok += 1
    return torch.stack(outs)


@pytest.mark.parametrize(
    "heads,rank,rope,ps,config,splits",
    [
        (1, 40, 8, 1, NARROW, None),
        (1, 33, 5, 3, TWO_PART, 3),
        (16, 40, 12, 16, NARROW, 3),
        (16, 24, 8, 3, TWO_PART, None),
        (16, 33, 12, 1, WIDE, 7),
        (20, 40, 8, 3, NARROW, 7),
        (20, 33, 8, 16, TWO_PART, 2),
        (20, 24, 5, 1, WIDE, None),
        (20, 40, 12, 16, None, None),
    ],
)
def test_decode_matches_reference_and_definition(heads, rank, rope, ps, config, splits):
    """Split counts larger than some lanes' key counts leave empty splits (lse -inf)."""
    lens = [1, 37, 20, 50]
    case = Case(lens, rank, rope, ps, seed=heads + ps)
    q_lat, q_rope = queries(len(lens), heads, rank, rope, seed=rank)
    _check_decode(case, q_lat, q_rope, config, splits)


def _check_decode(case, q_lat, q_rope, config, splits) -> None:
    """One token per lane through ``mla_decode`` against the torch reference and the
    definition."""
    ones = [1] * q_lat.shape[0]
    got = run(mla_decode.mla_attention, case, q_lat, q_rope, ones, config=config,
              num_splits=splits)  # fmt: skip
    ref = run(mla_ref.mla_attention, case, q_lat, q_rope, ones)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, definition(case, q_lat, q_rope, ones), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "heads,rank,rope,ps,config,splits",
    [
        (16, 40, 8, 1, FUSED, 3),  # a tile gathers rows of 16 pages
        (20, 33, 5, 3, FUSED, None),  # pages cut every tile; masked heads, odd widths
        (16, 40, 12, 16, FUSED, 2),  # a tile is one page: one block-table entry
        (20, 24, 8, 32, TMA, 3),  # full tiles by TMA descriptors, the tail by pointers
        (16, 40, 8, 16, TMA, None),
        (16, 40, 8, 3, TMA, 2),  # pages not a multiple of the tile: runs as fused
        (128, 24, 8, 16, FUSED64, None),
        (128, 24, 8, 1, FUSED64, 2),
    ],
)
def test_fused_variants_match_reference_and_definition(heads, rank, rope, ps, config, splits):
    """Ragged lengths (a full-tile-only lane, a lane shorter than a tile, partial last
    tiles whose page rows past seq_len are NaN poison), split counts > 1 (some empty)."""
    lens = [1, 32, 37, 50, 16]
    case = Case(lens, rank, rope, ps, seed=heads + ps + rank)
    if config is TMA and ps % 16 == 0:  # the descriptor path really runs
        assert mla_decode_fused.tma_ok(case.cache, rank, ps, config[2])
    q_lat, q_rope = queries(len(lens), heads, rank, rope, seed=rope)
    _check_decode(case, q_lat, q_rope, config, splits)


@pytest.mark.parametrize("config", [NARROW, TWO_PART, FUSED, TMA])
def test_lanes_without_a_token_and_caller_buffers(config):
    """Lanes 0 and 2 have no new token (T = 2 < B = 4): their rows are skipped and the
    merge reads only the two tokens' splits; out and workspace are the caller's and
    every element of out is written (it starts as NaN)."""
    lens, q_lens = [9, 30, 5, 44], [0, 1, 0, 1]
    case = Case(lens, 40, 8, 16 if config is TMA else 3, seed=4)
    q_lat, q_rope = queries(2, 20, 40, 8, seed=1)
    out = torch.full((2, 20, 40), float("nan"))
    workspace = torch.full((mla_decode.workspace_numel(2, 20, 40, 4),), float("nan"))
    got = run(mla_decode.mla_attention, case, q_lat, q_rope, q_lens, config=config,
              num_splits=4, out=out, workspace=workspace)  # fmt: skip
    assert got is out and torch.isfinite(out).all()
    torch.testing.assert_close(out, definition(case, q_lat, q_rope, q_lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", [TWO_PART, TMA])
def test_half_precision_within_rounding(config):
    """fp16: Triton 3.6's interpreter computes bf16 dots wrongly (bf16 runs on the GPU)."""
    lens = [17, 40, 3]
    case = Case(lens, 40, 8, 16, dtype=torch.float16, seed=2)
    q_lat, q_rope = queries(3, 16, 40, 8, dtype=torch.float16, seed=3)
    got = run(mla_decode.mla_attention, case, q_lat, q_rope, [1] * 3, config=config,
              num_splits=2)  # fmt: skip
    assert got.dtype == torch.float16
    want = definition(case, q_lat, q_rope, [1] * 3)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_prefill_steps_go_to_the_ragged_kernel():
    """max_q_len > 1 (a chunk over a cached prefix) gives the reference's causal answer."""
    lens, q_lens = [12, 30], [5, 3]
    case = Case(lens, 24, 8, 4, seed=6)
    q_lat, q_rope = queries(8, 3, 24, 8, seed=2)
    got = run(mla_decode.mla_attention, case, q_lat, q_rope, q_lens)
    want = run(mla_ref.mla_attention, case, q_lat, q_rope, q_lens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_plan_sizes_the_workspace():
    """decode_plan's workspace is enough for its split count; one element fewer is refused."""
    case = Case([700, 300], 24, 8, 16, seed=8)
    q_lat, q_rope = queries(2, 4, 24, 8, seed=5)
    max_len = case.block_table.shape[1] * 16
    config, splits, numel = mla_decode.decode_plan(2, 4, 24, max_len, torch.float32, q_lat.device)
    assert splits > 1 and numel == mla_decode.workspace_numel(2, 4, 24, splits)
    kw = {"config": config, "num_splits": splits}
    got = run(mla_decode.mla_attention, case, q_lat, q_rope, [1, 1], workspace=torch.empty(numel),
              **kw)  # fmt: skip
    torch.testing.assert_close(got, definition(case, q_lat, q_rope, [1, 1]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="workspace must be fp32"):
        run(mla_decode.mla_attention, case, q_lat, q_rope, [1, 1], workspace=torch.empty(numel - 1),
            **kw)  # fmt: skip


@pytest.mark.parametrize(
    "batch,heads,max_len",
    [(1, 128, 32768), (1, 16, 300), (1, 16, 511), (32, 16, 4096), (128, 128, 64), (3, 20, 10**6)],
)
def test_split_count_bounds(batch, heads, max_len):
    """Every config under both rules: 1 <= S <= MAX_SPLITS, and chunks of >=
    MIN_SPLIT_TOKENS when S > 1; ``fill`` gives every SM a program with the fewest
    splits, unless the chunk floor stops it first."""
    for config in mla_decode.CONFIGS.values():
        for rule in ("model", "fill"):
            cfg = config._replace(split_rule=rule)
            splits = mla_decode.choose_num_splits(batch, heads, 512, max_len, cfg, 132)
            assert 1 <= splits <= mla_decode.MAX_SPLITS
            assert splits == 1 or max_len / splits >= mla_decode.MIN_SPLIT_TOKENS
            if rule == "fill":
                parts = cfg.num_v if cfg.variant == "split" else 1
                programs = batch * -(-heads // cfg.block_h) * parts
                capped = (splits + 1) * mla_decode.MIN_SPLIT_TOKENS > max_len
                capped = capped or splits == mla_decode.MAX_SPLITS
                assert programs * splits >= 132 * cfg.ctas_per_sm or capped
                assert splits == 1 or programs * (splits - 1) < 132 * cfg.ctas_per_sm


def test_table_covers_every_bucket():
    """Every (heads bucket, page bucket) has a valid entry; the buckets of odd sizes."""
    for heads in (1, 16, 63, 64, 127, 128, 200):
        for ps in (1, 3, 16, 48, 64, 128):
            key = (mla_decode_plan.heads_bucket(heads), mla_decode_plan.page_bucket(ps))
            assert mla_decode_plan.check_config(mla_decode.TABLE[key]) == mla_decode.TABLE[key]
    assert mla_decode_plan.page_bucket(48) == 16 and mla_decode_plan.page_bucket(3) == 1


def test_bad_arguments_raise():
    case = Case([4], 24, 8, 4)
    q_lat, q_rope = queries(1, 2, 24, 8)
    with pytest.raises(ValueError, match="rank \\+ rope"):
        run(mla_decode.mla_attention, case, q_lat[..., :-1], q_rope, [1])
    with pytest.raises(ValueError, match="out must be"):
        run(mla_decode.mla_attention, case, q_lat, q_rope, [1], out=torch.empty(1, 2, 23))
    with pytest.raises(ValueError, match="num_v 1 or 2"):
        run(mla_decode.mla_attention, case, q_lat, q_rope, [1], config=(16, 3, 16, 4, 1))
    with pytest.raises(ValueError, match="1 for fused"):
        run(mla_decode.mla_attention, case, q_lat, q_rope, [1], config=(*TWO_PART, 1, 32.0, "tma"))
    with pytest.raises(ValueError, match="variant in"):
        run(mla_decode.mla_attention, case, q_lat, q_rope, [1], config=(*NARROW, 1, 32.0, "x"))


# -- H200 (DeepSeek shapes: rank 512, rope 64) ----------------------------------------

GPU_CASES = [
    (dtype, config, ps)
    for dtype in ("bf16", "fp32")
    for config in [None, *mla_decode.CONFIGS]
    for ps in (16,)
] + [(dtype, None, ps) for dtype in ("bf16", "fp32") for ps in (1, 64)]
GPU_CASES += [("bf16", config, ps) for config in ("fused64", "tma64", "fused64n64", "tma64n64",
                                                  "fused16n64") for ps in (1, 64)]  # fmt: skip


def _rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,config,ps", GPU_CASES)
@pytest.mark.parametrize("heads,lens", [(16, [1, 700, 4097, 33]), (64, [2049, 5]),
                                        (128, [1, 300, 1500])])  # fmt: skip
@pytest.mark.parametrize("splits", [None, 7])
def test_gpu_decode_matches_reference(dtype, config, ps, heads, lens, splits):
    """Every config of the table at every head count (16-bit tiles hold 16-bit
    queries only: fp32 ones would not fit in shared memory)."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    if dtype == torch.float32 and config not in (None, "fp32"):
        pytest.skip("16-bit tiles are sized for 16-bit queries")
    case = Case(lens, 512, 64, ps, dtype=dtype, device="cuda", seed=ps + heads)
    q_lat, q_rope = queries(len(lens), heads, 512, 64, dtype=dtype, device="cuda", seed=heads)
    cfg = mla_decode.CONFIGS[config] if config else None
    got = run(mla_decode.mla_attention, case, q_lat, q_rope, [1] * len(lens), config=cfg,
              num_splits=splits)  # fmt: skip
    want = mla_ref.mla_attention(
        q_lat.float(), q_rope.float(), case.cache.float(), case.block_table,
        indptr([1] * len(lens), "cuda"), case.seq_lens, max_q_len=1, page_size=ps, sm_scale=SCALE,
    )  # fmt: skip
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert _rel_err(got, want) < (2e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads,variant,ps", [(16, None, 16), (128, None, 16),
                                               (128, "fused64", 64), (128, "tma64", 64),
                                               (128, "fused64n64", 1), (128, "tma64n64", 64),
                                               (64, None, 64), (16, "fused16n64", 64),
                                               (16, "fused16n64", 1)])  # fmt: skip
def test_gpu_graph_replay_without_host_sync(heads, variant, ps):
    """Planned splits into caller-owned out / workspace: no host sync while launched, and
    a CUDA graph replayed after new lengths equals a fresh launch."""
    lens = [2000, 37, 900, 4000]
    case = Case(lens, 512, 64, ps, dtype=torch.bfloat16, device="cuda", seed=9)
    q_lat, q_rope = queries(4, heads, 512, 64, dtype=torch.bfloat16, device="cuda", seed=1)
    max_len = case.block_table.shape[1] * ps
    config, splits, numel = mla_decode.decode_plan(
        4, heads, 512, max_len, q_lat.dtype, q_lat.device, ps
    )
    if variant:  # a variant the table may not pick yet, split as it would be
        config = mla_decode.CONFIGS[variant]
        splits = mla_decode.choose_num_splits(4, heads, 512, max_len, config, 132)
        numel = mla_decode.workspace_numel(4, heads, 512, splits)
    args = (q_lat, q_rope, case.cache, case.block_table, indptr([1] * 4, "cuda"), case.seq_lens)
    opts = {"max_q_len": 1, "page_size": ps, "sm_scale": SCALE, "config": config,
            "num_splits": splits}  # fmt: skip
    out = torch.empty(4, heads, 512, device="cuda", dtype=torch.bfloat16)
    mine = {"out": out, "workspace": torch.empty(numel, device="cuda")}
    mla_decode.mla_attention(*args, **opts, **mine)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mla_decode.mla_attention(*args, **opts, **mine)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode.mla_attention(*args, **opts, **mine)
    case.seq_lens.copy_(torch.tensor([1999, 30, 899, 4000], dtype=torch.int32))  # <= rows written
    graph.replay()
    assert torch.equal(out, mla_decode.mla_attention(*args, **opts))
