"""KV store (Triton under TRITON_INTERPRET=1, and the torch reference): byte-identical
to a naive indexed write into a second pool through the (page, slot) oracle view."""

from __future__ import annotations

import pytest
import torch

from unikv import layout
from unikv.kernels import get_backend
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def _pools(spec, ps, pages=6):
    cfg = [SubPoolConfig("full", spec, page_size=ps)]
    total = pool_bytes_for(cfg, {"full": pages})
    pools = [UnifiedPool(cfg, total, "cpu") for _ in range(2)]
    seed = torch.randint(
        0, 256, pools[0].buffer.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    for pool in pools:
        pool.buffer.copy_(seed)  # the same random background in both
    return pools


def _naive_write(pool, layer, physical_tokens, k, v):
    """The oracle: an indexed write through the strided (page, slot) view."""
    sub = pool["full"]
    paged_k, paged_v = sub.paged_views[layer]
    page = physical_tokens // sub.page_size
    slot = physical_tokens % sub.page_size
    paged_k[page, slot] = k.view(paged_k.dtype)
    paged_v[page, slot] = v.view(paged_v.dtype)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_store_is_byte_identical_to_indexed_write(backend, dtype, id_dtype):
    spec = MHASpec(num_layers=3, num_kv_heads=2, head_dim=16, v_head_dim=8, dtype=dtype)
    ps = 4
    pools = _pools(spec, ps)
    sub = pools[0]["full"]
    gen = torch.Generator().manual_seed(1)
    physical = torch.randperm(sub.usable_pages * ps, generator=gen)[:9] + sub.first_page * ps
    kernel_ids = layout.kernel_ids(physical, ps, sub.blocks_per_page).to(id_dtype)
    k = torch.randn(9, 2, 16, generator=gen).to(dtype)
    v = torch.randn(9, 2, 8, generator=gen).to(dtype)
    k_cache, v_cache = sub.views[1]
    get_backend("cpu", backend=backend).store_kv(k_cache, v_cache, kernel_ids, k, v)
    _naive_write(pools[1], 1, physical, k, v)
    assert torch.equal(pools[0].buffer, pools[1].buffer)


@pytest.mark.parametrize("ps", [1, 16])
def test_store_sink_ids_touch_only_the_sink(ps):
    """Padded lanes write at kernel id 0: only sink bytes may change."""
    spec = MHASpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float16)
    pools = _pools(spec, ps)
    sub = pools[0]["full"]
    live = torch.tensor([sub.first_page * ps + 1])
    ids = torch.cat(
        [torch.zeros(3, dtype=torch.long), layout.kernel_ids(live, ps, sub.blocks_per_page)]
    )
    k = torch.randn(4, 1, 8).half()
    v = torch.randn(4, 1, 8).half()
    get_backend("cpu", backend="triton").store_kv(*sub.views[0], ids, k, v)
    _naive_write(pools[1], 0, live, k[3:], v[3:])
    sink = pools[0].sink_bytes
    assert torch.equal(pools[0].buffer[sink:], pools[1].buffer[sink:])


def test_store_rejects_bad_input():
    spec = MHASpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    pools = _pools(spec, 4)
    k_cache, v_cache = pools[0]["full"].views[0]
    before = pools[0].buffer.clone()
    ops = get_backend("cpu", backend="triton")
    ids = torch.tensor([20, 21], dtype=torch.int32)
    k = torch.randn(2, 2, 8).half()
    with pytest.raises(ValueError, match="int32/int64"):
        ops.store_kv(k_cache, v_cache, ids.float(), k, k)
    with pytest.raises(ValueError, match="must be"):
        ops.store_kv(k_cache, v_cache, ids, k[:1], k[:1])
    with pytest.raises(ValueError, match="dtype"):
        ops.store_kv(k_cache, v_cache, ids, k.float(), k.float())
    assert torch.equal(pools[0].buffer, before)
