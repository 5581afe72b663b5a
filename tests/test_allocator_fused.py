"""The fused device path (Triton table writes and translation, run by the CPU
interpreter) leaves every table byte-identical to the torch path, and its
translation equals the unfused torch translation (``translate.translate_kernel``),
including an ``out=`` that overlaps the input shifted by one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import build, churn, snapshot

from unikv.allocator import chain, device, translate_kernel, translate_physical
from unikv.ids import VirtualTokenIds


def _pair(monkeypatch, chain_name: str, ps: int):
    """Two equal allocators: torch table ops, and Triton table ops."""
    _, ref = build(chain_name, ps, requests=3)
    monkeypatch.setattr(chain, "make_table_ops", lambda d: device.make_table_ops(d, "triton"))
    _, fused = build(chain_name, ps, requests=3)
    assert fused._ops.update_tables is not ref._ops.update_tables
    return ref, fused


@pytest.mark.parametrize("chain_name,ps", [("full+swa+mamba", 1), ("mla+swa", 16)])
def test_fused_tables_equal_torch_tables_after_churn(monkeypatch, chain_name, ps):
    ref, fused = _pair(monkeypatch, chain_name, ps)
    churn(ref, np.random.default_rng(7), 120)
    churn(fused, np.random.default_rng(7), 120)
    fused.check_integrity()  # device tables mirror the host ones
    assert snapshot(fused) == snapshot(ref)


@pytest.mark.parametrize("ps", [1, 16])
def test_fused_translation_equals_torch_translation(monkeypatch, ps):
    ref, fused = _pair(monkeypatch, "full+swa", ps)
    for alloc in (ref, fused):
        r = alloc.new_request()
        ids = alloc.alloc_extend(np.array([r]), np.array([0]), np.array([5 * ps + 2]))
        alloc.free_out_of_window(np.array([r]), alloc.requests.lens[[r]])
    padded = torch.cat([ids.data, torch.tensor([-1, -ps - 3], dtype=torch.int32)])
    n = len(padded)
    for name in ("full", "swa"):
        v2p, bpp = ref.subs[name].v2p, ref.subs[name].blocks_per_page
        oracle = translate_kernel(padded, v2p, ps, bpp, debug=False)  # the unfused torch path
        physical = translate_physical(padded, v2p, ps)
        assert torch.equal(fused.translate(VirtualTokenIds(padded), name).data, oracle)
        assert torch.equal(fused.translate_physical(VirtualTokenIds(padded), name).data, physical)
        buffer = torch.full((n + 4,), -9, dtype=torch.int32)  # out shifted over its input
        buffer[1 : n + 1] = padded
        got = fused.translate(VirtualTokenIds(buffer[1 : n + 1]), name, out=buffer).data
        assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, oracle)
        assert (buffer[n:] == torch.tensor([padded[-1], -9, -9, -9], dtype=torch.int32)).all()
        wide = torch.zeros(n, dtype=torch.int64)
        assert torch.equal(fused.translate(VirtualTokenIds(padded), name, out=wide).data, oracle)
