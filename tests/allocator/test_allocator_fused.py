"""The fused device path (Triton table writes and translation, run by the CPU
interpreter) leaves every table byte-identical to the torch path, and its
translation equals a naive per-id loop composed with ``layout.kernel_ids``,
including an ``out=`` that overlaps the input shifted by one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import build, churn, snapshot

from unikv.ids import VirtualTokenIds
from unikv.kernels import get_backend
from unikv.layout import kernel_ids


def _pair(chain_name: str, ps: int):
    """Two equal allocators: torch table ops, and Triton table ops."""
    _, ref = build(chain_name, ps, requests=3, backend=get_backend("cpu", "torch"))
    _, fused = build(chain_name, ps, requests=3, backend=get_backend("cpu", "triton"))
    return ref, fused


def _naive_physical(ids: torch.Tensor, v2p: torch.Tensor, ps: int) -> torch.Tensor:
    """Physical token ids, one id at a time: padding reads page 0, tombstones the sink."""
    out = []
    for tv in ids.tolist():
        page = tv // ps if tv >= 0 else 0
        out.append(max(int(v2p[page]), 0) * ps + tv % ps)  # Python's % is floor modulo
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("chain_name,ps", [("full+swa+mamba", 1), ("mla+swa", 16)])
def test_fused_tables_equal_torch_tables_after_churn(chain_name, ps):
    ref, fused = _pair(chain_name, ps)
    churn(ref, np.random.default_rng(7), 120)
    churn(fused, np.random.default_rng(7), 120)
    fused.check_integrity()  # device tables mirror the host ones
    assert snapshot(fused) == snapshot(ref)


@pytest.mark.parametrize("ps", [1, 16])
def test_fused_translation_equals_naive_translation(ps):
    ref, fused = _pair("full+swa", ps)
    for alloc in (ref, fused):
        r = alloc.new_request()
        ids = alloc.alloc_extend(np.array([r]), np.array([0]), np.array([5 * ps + 2]))
        alloc.free_out_of_window(np.array([r]), alloc.parts.requests.lens[[r]])
    padded = torch.cat([ids.data, torch.tensor([-1, -ps - 3], dtype=torch.int32)])
    n = len(padded)
    for name in ("full", "swa"):
        v2p, bpp = ref.parts.books[name].v2p, ref.parts.books[name].blocks_per_page
        physical = _naive_physical(padded, v2p, ps)
        oracle = kernel_ids(physical, ps, bpp).to(torch.int32)  # the layout's rule
        assert torch.equal(fused.translate(VirtualTokenIds(padded), name).data, oracle)
        assert torch.equal(
            fused.translate(VirtualTokenIds(padded), name, physical=True).data, physical
        )
        buffer = torch.full((n + 4,), -9, dtype=torch.int32)  # out shifted over its input
        buffer[1 : n + 1] = padded
        got = fused.translate(VirtualTokenIds(buffer[1 : n + 1]), name, out=buffer).data
        assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, oracle)
        assert (buffer[n:] == torch.tensor([padded[-1], -9, -9, -9], dtype=torch.int32)).all()
        wide = torch.zeros(n, dtype=torch.int64)
        assert torch.equal(fused.translate(VirtualTokenIds(padded), name, out=wide).data, oracle)
