"""GPU tests of the decode step's fused rope + K/V store and the greedy argmax
(``pytest -m gpu``), at the Llama-3.2-1B shape on a 16-layer page-major pool.

Oracles: the two compiled Triton ops the fused launch replaces (rope_qk then
store_kv: the pool's bytes must be identical), the torch references (rope_qk,
a naive indexed write through the (page, slot) view), and ``torch.argmax``.
"""

from __future__ import annotations

import pytest
import torch

from unikv import layout
from unikv.kernels import get_backend
from unikv.kernels.linear import ref as elementwise_ref
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HQ, HKV, DIM, LAYERS, PS = 32, 8, 64, 16, 16


def _pool(pages=600):
    spec = MHASpec(LAYERS, HKV, DIM, dtype=torch.bfloat16)
    cfg = [SubPoolConfig("full", spec, page_size=PS)]
    pool = UnifiedPool(cfg, pool_bytes_for(cfg, {"full": pages}), "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8,
                                    device="cuda", generator=gen))  # fmt: skip
    return pool


@pytest.mark.parametrize("tokens", [1, 256, 8192])
def test_fused_rope_store_equals_rope_then_store(tokens):
    torch.manual_seed(tokens)
    pools = [_pool() for _ in range(3)]
    sub = pools[0]["full"]
    physical = torch.randperm(sub.usable_pages * PS, device="cuda")[:tokens] + sub.first_page * PS
    ids = layout.kernel_ids(physical, PS, sub.blocks_per_page)
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * DIM, device="cuda", dtype=torch.bfloat16)
    cos, sin = (
        torch.randn(9000, DIM // 2, device="cuda"),
        torch.randn(9000, DIM // 2, device="cuda"),
    )
    pos = torch.randint(0, 9000, (tokens,), device="cuda")
    ops = get_backend("cuda", "triton")

    def views():
        q, k, v = qkv.clone().split([HQ * DIM, HKV * DIM, HKV * DIM], dim=-1)
        return q.view(tokens, HQ, DIM), k.view(tokens, HKV, DIM), v.view(tokens, HKV, DIM)

    q, k, v = views()
    got_q, got_k = ops.rope_store_kv(*pools[0]["full"].views[5], ids, q, k, v, cos, sin, pos)
    q2, k2, v2 = views()
    q2, k2 = ops.rope_qk(q2, k2, cos, sin, pos)
    ops.store_kv(*pools[1]["full"].views[5], ids, k2, v2)
    assert torch.equal(pools[0].buffer, pools[1].buffer)
    assert torch.equal(got_q, q2) and torch.equal(got_k, k2)
    q3, k3, v3 = views()
    want_q, want_k = elementwise_ref.rope_qk(q3, k3, cos, sin, pos)
    torch.testing.assert_close(got_q, want_q, rtol=1e-2, atol=1e-2)
    paged_k, paged_v = pools[0]["full"].paged_views[5]
    page, slot = physical // PS, physical % PS
    torch.testing.assert_close(paged_k[page, slot], want_k, rtol=1e-2, atol=1e-2)
    assert torch.equal(paged_v[page, slot], v3)


@pytest.mark.parametrize("rows", [1, 7, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_equals_torch_argmax(rows, dtype):
    torch.manual_seed(rows)
    vocab = 128256
    logits = torch.randn(rows, vocab, device="cuda").to(dtype)
    top = float(logits.max()) + 1.0
    logits[0, [100_000, 5, 70_000]] = top  # ties across chunks: the first index
    got = get_backend("cuda", "triton").argmax(logits)
    assert torch.equal(got, logits.argmax(dim=-1)) and int(got[0]) == 5
