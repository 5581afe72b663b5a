"""Page copy, block-table build and the FlashInfer export (Triton under
TRITON_INTERPRET=1, and the torch reference) against independent derivations:
the torch page copy on a whole seeded buffer, and brute-force Python loops."""

from __future__ import annotations

import pytest
import torch

from unikv.kernels import get_backend
from unikv.kernels.attention.ref import copy_pages as torch_copy_pages

BACKENDS = ["triton", "torch"]


def _ops(name):
    return get_backend("cpu", backend=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_bytes", [4096 + 8, 1000, 333])  # int64, int32/int16, uint8 words
def test_copy_pages_disjoint_matches_torch(backend, page_bytes):
    gen = torch.Generator().manual_seed(page_bytes)
    buf = torch.randint(0, 256, (12 * page_bytes + 5,), dtype=torch.uint8, generator=gen)
    want = buf.clone()
    perm = torch.randperm(11, generator=gen) + 1
    src, dst = perm[:4].int(), perm[4:8]
    torch_copy_pages(want, src, dst, page_bytes)
    kw = {"disjoint": True} if backend == "triton" else {}
    _ops(backend).copy_pages(buf, src, dst, page_bytes, **kw)
    assert torch.equal(buf, want)


def test_copy_pages_overlapping_reads_every_source_first():
    """A chain (1->2, 2->3, 3->1): the staged default equals the torch reference."""
    page_bytes = 256
    buf = torch.randint(0, 256, (6 * page_bytes,), dtype=torch.uint8)
    want = buf.clone()
    src, dst = torch.tensor([1, 2, 3]), torch.tensor([2, 3, 1])
    torch_copy_pages(want, src, dst, page_bytes)
    _ops("triton").copy_pages(buf, src, dst, page_bytes)
    assert torch.equal(buf, want)


def test_copy_pages_rejects_bad_input():
    buf = torch.zeros(1024, dtype=torch.uint8)
    ops = _ops("triton")
    with pytest.raises(ValueError, match="one length"):
        ops.copy_pages(buf, torch.tensor([1]), torch.tensor([1, 2]), 256)
    with pytest.raises(ValueError, match="uint8"):
        ops.copy_pages(buf.view(torch.int32), torch.tensor([1]), torch.tensor([2]), 256)


def _brute_block_table(r2t, slots, lens, v2p, ps, bpp, cols, window):
    out = torch.zeros(len(slots), cols, dtype=torch.int32)
    for b, (slot, n) in enumerate(zip(slots.tolist(), lens.tolist())):
        for j in range(cols):
            if j * ps >= n or (window and (j + 1) * ps <= n - window):
                continue
            tv = int(r2t[slot, j * ps])
            if tv < 0:
                continue
            phys = int(v2p[tv // ps])
            out[b, j] = phys * bpp if phys >= 0 else 0
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ps,window", [(1, 0), (1, 5), (4, 0), (3, 7)])
def test_block_table_matches_brute_force(backend, ps, window):
    gen = torch.Generator().manual_seed(ps * 10 + window)
    num_vpages, max_ctx = 30, 24
    backing = torch.randint(-1, 50, (num_vpages + 1,), dtype=torch.int32, generator=gen)
    backing[0] = 9999  # the element before v2p: a read of v2p[-1] (docs/lessons.md bug 1) shows up
    v2p = backing[1:]
    r2t = torch.randint(-1, num_vpages * ps, (5, max_ctx), dtype=torch.int32, generator=gen)
    r2t[:, 0] = -1  # padding at column 0 too
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    lens = torch.tensor([0, 13, 24], dtype=torch.int32)
    cols = -(-max_ctx // ps) + 2
    out = torch.full((3, cols), -7, dtype=torch.int32)  # stale contents must be overwritten
    _ops(backend).build_block_table(
        r2t, slots, lens, v2p, page_size=ps, blocks_per_page=6, out=out, window=window
    )
    assert torch.equal(out, _brute_block_table(r2t, slots, lens, v2p, ps, 6, cols, window))
    assert not (out == 9999 * 6).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_export_flashinfer_matches_loop(backend):
    table = torch.randint(0, 500, (4, 6), dtype=torch.int32)
    lens = torch.tensor([17, 0, 1, 96], dtype=torch.int32)
    ps = 16
    indptr, indices, last = _ops(backend).export_flashinfer(table, lens, page_size=ps)
    want_ptr, want_idx, want_last = [0], [], []
    for b, n in enumerate(lens.tolist()):
        pages = -(-n // ps)
        want_idx += table[b, :pages].tolist()
        want_ptr.append(want_ptr[-1] + pages)
        want_last.append(n - (pages - 1) * ps if pages else 0)
    assert indptr.tolist() == want_ptr
    assert indices[: want_ptr[-1]].tolist() == want_idx
    assert last.tolist() == want_last


def test_get_backend_picks_once_by_device():
    assert get_backend("cpu").name == "torch"
    assert get_backend("cpu", backend="triton").name == "triton"
    with pytest.raises(ValueError, match="backend"):
        get_backend("cpu", backend="cuda")
