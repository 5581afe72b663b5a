"""Fused table writes and fused translation: Triton (interpreter on CPU) against
the torch references, and both against a naive per-element loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unikv.kernels.tables import ref as tables_ref
from unikv.kernels.tables import table_update as tu


def _case(rng: np.random.Generator, sizes: list[int], num_segments: int):
    """Random tables and a packed array of segments with distinct indices per table."""
    tables = [torch.from_numpy(rng.integers(-5, 100, n).astype(np.int32)) for n in sizes]
    segs, data, used = [], [], [set() for _ in sizes]
    offset = tu.HEADER * num_segments
    for _ in range(num_segments):
        t = int(rng.integers(len(sizes)))
        free = np.setdiff1d(np.arange(sizes[t]), list(used[t]))
        count = int(rng.integers(0, min(len(free), 300) + 1))
        index = rng.choice(free, count, replace=False)
        used[t].update(index.tolist())
        tomb = bool(rng.integers(2))
        value = rng.integers(-1, 1 << 30, count)
        segs.append((t, offset, -1 if tomb else offset + count, count))
        data += [index] if tomb else [index, value]
        offset += count if tomb else 2 * count
    header = np.array(segs, np.int64).reshape(-1)
    packed = torch.from_numpy(np.concatenate([header, *data]).astype(np.int32))
    return tables, packed, max((s[3] for s in segs), default=0)


def _naive(tables, packed, num_segments):
    out = [t.clone() for t in tables]
    p = packed.tolist()
    for s in range(num_segments):
        t, i0, v0, count = p[4 * s : 4 * s + 4]  # the header row, spelled out
        for j in range(count):
            out[t][p[i0 + j]] = -1 if v0 < 0 else p[v0 + j]
    return out


@pytest.mark.parametrize("sizes,segments", [([7000, 300, 300], 5), ([50] * 11, 14), ([9], 0)])
def test_update_tables_matches_reference_and_naive(sizes, segments):
    rng = np.random.default_rng(len(sizes) * 100 + segments)
    tables, packed, max_count = _case(rng, sizes, segments)
    want = _naive(tables, packed, segments)
    ref = [t.clone() for t in tables]
    tables_ref.update_tables_ref(ref, packed, segments, max_count)
    got = [t.clone() for t in tables]
    tu.update_tables(got, packed, segments, max_count)
    for w, r, g in zip(want, ref, got):
        assert torch.equal(r, w) and torch.equal(g, w)


def _naive_translate(ids: torch.Tensor, v2p: torch.Tensor, ps: int, mult: int) -> torch.Tensor:
    """docs/design.md section 5, one id at a time: padding (< 0) and tombstones
    land in page 0 (the sink) at slot ``tv mod ps``."""
    table = v2p.tolist()
    out = []
    for tv in ids.tolist():
        phys = table[tv // ps] if tv >= 0 else 0
        out.append(max(phys, 0) * mult + tv % ps)  # Python's % is floor modulo
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("ps,bpp", [(1, 1), (1, 3), (3, 4), (16, 1), (16, 2)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_translate_ids_matches_a_naive_loop(ps, bpp, dtype):
    rng = np.random.default_rng(ps * 10 + bpp)
    v2p = torch.from_numpy(rng.integers(-1, 500, 64).astype(np.int32))
    v2p[0] = 0
    ids = torch.from_numpy(rng.integers(-2 * ps, 64 * ps, 600)).to(dtype)
    ids[:3] = torch.tensor([-1, -ps, 0])
    for mult in (ps * bpp, ps):  # kernel ids, physical token ids
        want = _naive_translate(ids, v2p, ps, mult)
        for fn in (tu.translate_ids, tables_ref.translate_ids_ref):
            out = torch.full((610,), 7, dtype=torch.int64)
            got = fn(ids, v2p, ps, mult, out)
            assert torch.equal(got, want) and (out[600:] == 7).all()
            alias = ids.clone()  # out may be the input itself
            assert torch.equal(fn(alias, v2p, ps, mult, alias), want.to(dtype))
