"""The latent store inside MLA decode (``mla_decode.store_mla_attention``, Triton under
TRITON_INTERPRET=1 on CPU; GPU cases: ``-m gpu``) against the two ops it replaces.

Each request's last row is the decode token's: NaN before the call (never written), so
a program that read it from the pool rather than from the step's inputs would poison
its output. Three answers on the same NaN-poisoned pool (restored between them):
the torch reference (``mla_ref.store_mla`` then ``mla_ref.mla_attention``), Triton's
two launches (``store_mla`` then ``mla_attention``, same config and splits) and the one
launch. The pool's bytes after the one launch equal the reference's bit for bit (one
row written, where the store writes it, and nothing else); its output equals the two
launches' bit for bit (the same tiles, the new key taken from registers) and the
softmax written from the definition over the rows the test stored, within fp32
rounding. Rows of 26 and 30 elements (rank 20 / 24 + rope 6) and 32 (rank 24 + rope 8,
16-byte rows: TMA descriptors really run), pages 1 / 4 / 16, several requests of
different lengths (one with only the new key, one a whole number of tiles, so the
new key's tile is full), split-KV on with empty splits, every kernel variant (split
with one or two V parts, fused with tiles per key or per page, tma).
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_mla_decode import (
    FUSED,
    FUSED64,
    NARROW,
    SCALE,
    TMA,
    TWO_PART,
    WIDE,
    Case,
    definition,
    indptr,
    queries,
)

from unikv.kernels import get_backend
from unikv.kernels.mla import decode as mla_decode
from unikv.kernels.mla import decode_fused as mla_decode_fused
from unikv.kernels.mla import prefill as mla
from unikv.kernels.mla import ref as mla_ref

TORCH = get_backend("cpu", "torch")
LENS = [1, 32, 37, 50, 16, 9]  # 32, 16: the new key ends a full 16-key tile


class StoreCase(Case):
    """A ``Case`` whose last row per request is the step's: NaN in the pool, and the new
    (latent, rope) rows, their write ids (each request's last position's kernel id)."""

    def __init__(self, lens, rank, rope, page_size, dtype=torch.float32, device="cpu", seed=0):
        super().__init__(lens, rank, rope, page_size, dtype=dtype, device=device, seed=seed)
        gen = torch.Generator().manual_seed(seed + 11)
        last = torch.tensor(lens) - 1
        entries = self.block_table.cpu()[torch.arange(len(lens)), last // page_size].long()
        self.write_ids = (entries * page_size + last % page_size).to(device)
        self.cache[self.write_ids] = float("nan")  # never written before the step
        new = torch.randn(len(lens), rank + rope, generator=gen).to(dtype)
        self.latent, self.rope = new[:, :rank].to(device), new[:, rank:].to(device)
        for rows, row in zip(self.rows, new.float()):
            rows[-1] = row  # the oracle's rows: the new one in place

    def attend(self, fn, q_lat, q_rope, q_lens, store=True, q_indptr=None, **kw):
        """``fn`` = store_mla_attention (``store``) or mla_attention after the store;
        ``q_indptr``: made beforehand (a launch checked for host syncs or captured)."""
        q_indptr = indptr(q_lens, q_lat.device) if q_indptr is None else q_indptr
        args = (self.block_table, q_indptr, self.seq_lens)
        opts = {"max_q_len": max(q_lens), "page_size": self.page_size, "sm_scale": SCALE, **kw}
        if store:
            return fn(self.cache, self.write_ids, q_lat, q_rope, self.latent, self.rope, *args,
                      **opts)  # fmt: skip
        return fn(q_lat, q_rope, self.cache, *args, **opts)


def _three_ways(case, q_lat, q_rope, q_lens, **kw):
    """(reference, two Triton launches, one launch): each output and the pool's bytes
    after it, every run from the same pool bytes."""
    before = case.pool.buffer.clone()
    runs = []
    for run in ("reference", "two launches", "one launch"):
        case.pool.buffer.copy_(before)
        if run == "reference":
            out = case.attend(mla_ref.store_mla_attention, q_lat, q_rope, q_lens)
        elif run == "two launches":
            mla.store_mla(case.cache, case.write_ids, case.latent, case.rope)
            out = case.attend(mla_decode.mla_attention, q_lat, q_rope, q_lens, store=False, **kw)
        else:
            out = case.attend(mla_decode.store_mla_attention, q_lat, q_rope, q_lens, **kw)
        runs.append((out, case.pool.buffer.clone()))
    return runs


def _check(case, q_lat, q_rope, q_lens, atol=1e-5, **kw):
    (ref, ref_bytes), (two, two_bytes), (one, one_bytes) = _three_ways(case, q_lat, q_rope,
                                                                         q_lens, **kw)  # fmt: skip
    assert torch.equal(ref_bytes, two_bytes), "the two launches store as the reference does"
    assert torch.equal(one_bytes, ref_bytes), "the one launch writes the reference's bytes"
    assert torch.isfinite(one).all(), "a program read the new row's (NaN) bytes"
    assert torch.equal(one, two), "one launch: the two launches' output, bit for bit"
    torch.testing.assert_close(one, ref, atol=atol, rtol=atol)
    want = definition(case, q_lat, q_rope, q_lens)
    torch.testing.assert_close(one.float(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize(
    "heads,rank,rope,ps,config,splits",
    [
        (16, 24, 6, 1, NARROW, 3),  # row 30; split kernel, one V part; empty splits
        (20, 20, 6, 4, TWO_PART, 2),  # row 26; two V parts (both read the new row)
        (16, 24, 6, 16, WIDE, None),  # heuristic splits
        (20, 24, 6, 4, FUSED, 3),  # fused: tiles across pages
        (16, 20, 6, 16, FUSED, 2),  # fused: a tile is one page (one entry)
        (20, 24, 8, 16, TMA, 3),  # 128-byte rows: full tiles by TMA descriptors
        (20, 24, 6, 16, TMA, 2),  # 120-byte rows: tma runs as fused
        (128, 24, 6, 1, FUSED64, 2),  # two head blocks: one writes
        (1, 20, 6, 1, None, None),  # the CPU's own choice (fp32: the split kernel)
    ],
)
def test_one_launch_equals_store_then_decode(heads, rank, rope, ps, config, splits):
    case = StoreCase(LENS, rank, rope, ps, seed=heads + ps + rank)
    if config is TMA and rope == 8:  # the descriptor path really runs
        assert mla_decode_fused.tma_ok(case.cache, rank, ps, config[2])
    q_lat, q_rope = queries(len(LENS), heads, rank, rope, seed=rope + ps)
    _check(case, q_lat, q_rope, [1] * len(LENS), config=config, num_splits=splits)


@pytest.mark.parametrize("config", [TWO_PART, FUSED])
def test_lanes_without_a_token_store_nothing(config):
    """Lanes 0 and 2 have no new token (T = 2 < B = 4): the tokens' rows are those of
    lanes 1 and 3 (written), lanes 0 and 2's pages keep their bytes."""
    lens, q_lens = [9, 30, 5, 44], [0, 1, 0, 1]
    case = StoreCase(lens, 24, 6, 4, seed=4)  # (lanes 0 and 2's last rows: NaN, kept)
    case.latent, case.rope = case.latent[[1, 3]], case.rope[[1, 3]]
    case.write_ids = case.write_ids[[1, 3]]
    q_lat, q_rope = queries(2, 20, 24, 6, seed=1)
    _check(case, q_lat, q_rope, q_lens, config=config, num_splits=4)


@pytest.mark.parametrize("config,ps", [(NARROW, 4), (TWO_PART, 1), (FUSED, 4), (TMA, 16)])
def test_the_new_key_is_never_read_from_the_pool(config, ps):
    """The pool's row at each request's last position stays NaN and the write ids point
    at rows of a page no request reads: the output is still the definition's over the
    new rows (every program took the new key from the inputs; on the GPU, reading it
    from the pool would race with its one writer), and the rows land at the write ids."""
    lens = [1, 16, 37]
    case = StoreCase(lens, 24, 8, ps, seed=ps)
    sub = case.pool["mla"]
    used = set((case.block_table[:, :-1] // sub.blocks_per_page).flatten().tolist())
    free = [p for p in range(sub.first_page, sub.first_page + sub.usable_pages) if p not in used]
    if ps > 1:  # three rows of one free page
        case.write_ids = free[0] * sub.blocks_per_page * ps + torch.arange(3)
    else:  # the rows of three free pages
        case.write_ids = torch.tensor(free[:3]) * sub.blocks_per_page
    q_lat, q_rope = queries(3, 16, 24, 8, seed=5)
    before = case.pool.buffer.clone()
    case.attend(mla_ref.store_mla_attention, q_lat, q_rope, [1] * 3)
    want_bytes = case.pool.buffer.clone()
    case.pool.buffer.copy_(before)
    got = case.attend(mla_decode.store_mla_attention, q_lat, q_rope, [1] * 3, config=config,
                      num_splits=2)  # fmt: skip
    assert torch.equal(case.pool.buffer, want_bytes)
    want = definition(case, q_lat, q_rope, [1] * 3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_half_precision_bytes_and_output():
    """fp16 (Triton 3.6's interpreter computes bf16 dots wrongly; bf16 runs on the GPU):
    the stored bytes are the fp16 rows, the output the two launches' bit for bit."""
    case = StoreCase([17, 40, 3], 24, 6, 4, dtype=torch.float16, seed=2)
    q_lat, q_rope = queries(3, 16, 24, 6, dtype=torch.float16, seed=3)
    _check(case, q_lat, q_rope, [1] * 3, atol=2e-2, config=FUSED, num_splits=2)


def test_prefill_steps_store_then_attend():
    """max_q_len > 1 (a chunk over a cached prefix): the store, then the ragged kernel."""
    lens, q_lens = [12, 30], [3, 2]
    case = StoreCase(lens, 24, 6, 4, seed=6)
    last = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, q_lens)])
    lane = torch.repeat_interleave(torch.arange(2), torch.tensor(q_lens))
    entries = case.block_table[lane, last // 4].long()
    case.write_ids = entries * 4 + last % 4
    gen = torch.Generator().manual_seed(9)
    case.latent, case.rope = torch.randn(5, 24, generator=gen), torch.randn(5, 6, generator=gen)
    q_lat, q_rope = queries(5, 3, 24, 6, seed=2)
    before = case.pool.buffer.clone()
    want = case.attend(mla_ref.store_mla_attention, q_lat, q_rope, q_lens)
    want_bytes = case.pool.buffer.clone()
    case.pool.buffer.copy_(before)
    got = case.attend(mla_decode.store_mla_attention, q_lat, q_rope, q_lens)
    assert torch.equal(case.pool.buffer, want_bytes)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bad_arguments_raise():
    case = StoreCase([4, 7], 24, 6, 4)
    q_lat, q_rope = queries(2, 2, 24, 6)
    fn = mla_decode.store_mla_attention
    case.latent = case.latent.half()
    with pytest.raises(ValueError, match="cache's dtype"):
        case.attend(fn, q_lat, q_rope, [1, 1])
    case.latent = case.latent.float()
    case.write_ids = case.write_ids.float()
    with pytest.raises(ValueError, match="int32/int64"):
        case.attend(fn, q_lat, q_rope, [1, 1])
    case.write_ids = case.write_ids.long()
    case.rope = torch.randn(6, 2).T  # (2, 6), last stride 2
    with pytest.raises(ValueError, match="unit last stride"):
        case.attend(fn, q_lat, q_rope, [1, 1])
    case.rope = torch.randn(2, 5)
    with pytest.raises(ValueError, match="rank \\+ rope"):
        case.attend(fn, q_lat, q_rope, [1, 1])


def test_torch_backend_is_the_reference():
    """The torch backend's op is ``store_mla`` then ``mla_attention`` (the engine's CPU path)."""
    assert TORCH.store_mla_attention is mla_ref.store_mla_attention


# -- GPU: CUDA graphs, DeepSeek's widths and the odd rows -----------------------------

GPU_CASES = [  # (dtype, rank, rope, heads, page size, config name or None)
    (dt, rank, 6, heads, ps, None)
    for dt in ("bf16", "fp32")
    for rank in (20, 24)  # rows of 26 and 30 elements
    for heads in (16, 128)
    for ps in (1, 4, 16)
] + [
    ("bf16", 512, 64, heads, ps, name)
    for heads, names in ((16, ("narrow", "narrow90", "fused16n64")),
                         (128, ("wide128", "fused64n64", "tma64n64", "tma64")))
    for name in names
    for ps in (1, 16, 64)
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,rank,rope,heads,ps,config", GPU_CASES)
def test_gpu_graph_replay_equals_store_then_decode(dtype, rank, rope, heads, ps, config):
    """Planned splits into caller-owned out / workspace, no host sync while launched,
    replayed from a CUDA graph over new rows: the pool's bytes are the reference's and
    the output is within rounding of the fp32 reference over the stored rows."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    lens = [2000, 37, 1, 900, 4096]
    case = StoreCase(lens, rank, rope, ps, dtype=dtype, device="cuda", seed=ps + heads)
    q_lat, q_rope = queries(len(lens), heads, rank, rope, dtype=dtype, device="cuda", seed=heads)
    max_len = case.block_table.shape[1] * ps
    cfg, splits, numel = mla_decode.decode_plan(len(lens), heads, rank, max_len, dtype,
                                                q_lat.device, ps)  # fmt: skip
    if config:
        cfg = mla_decode.CONFIGS[config]
        splits = mla_decode.choose_num_splits(len(lens), heads, rank, max_len, cfg, 132)
        numel = mla_decode.workspace_numel(len(lens), heads, rank, splits)
    out = torch.empty(len(lens), heads, rank, device="cuda", dtype=dtype)
    kw = {"config": cfg, "num_splits": splits, "out": out,
          "workspace": torch.empty(max(numel, 1), device="cuda")}  # fmt: skip
    before = case.pool.buffer.clone()
    kw["q_indptr"] = indptr([1] * len(lens), "cuda")  # uploaded before the checked launches
    case.attend(mla_decode.store_mla_attention, q_lat, q_rope, [1] * len(lens), **kw)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        case.attend(mla_decode.store_mla_attention, q_lat, q_rope, [1] * len(lens), **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.attend(mla_decode.store_mla_attention, q_lat, q_rope, [1] * len(lens), **kw)
    gen = torch.Generator(device="cuda").manual_seed(7)  # the next step's rows, same buffers
    case.latent.copy_(torch.randn(case.latent.shape, device="cuda", generator=gen))
    case.rope.copy_(torch.randn(case.rope.shape, device="cuda", generator=gen))
    case.pool.buffer.copy_(before)
    graph.replay()
    got, got_bytes = out.clone(), case.pool.buffer.clone()
    case.pool.buffer.copy_(before)
    mla_ref.store_mla(case.cache, case.write_ids, case.latent, case.rope)
    assert torch.equal(got_bytes, case.pool.buffer), "the replay wrote the reference's bytes"
    want = mla_ref.mla_attention(
        q_lat.float(), q_rope.float(), case.cache.float(), case.block_table,
        indptr([1] * len(lens), "cuda"), case.seq_lens, max_q_len=1, page_size=ps,
        sm_scale=SCALE,
    )  # fmt: skip
    assert torch.isfinite(got).all()
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < (2e-5 if dtype == torch.float32 else 2e-2), err
