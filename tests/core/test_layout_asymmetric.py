"""Asymmetric K/V (head_dim != v_head_dim) stored without padding (docs/design.md
sections 1-3), proven against an independent byte-address derivation.

Each (token, layer, part, head, dim) byte offset is computed here by hand from the
raw spec fields (no spec or layout method); K/V are written through the kernels
(``store_kv`` of both backends, at the kernel ids the design doc defines) into a
real pool, and the raw uint8 buffer is read back at those offsets. Attention
over the same pool is compared with a naive softmax over the values written.
"""

from __future__ import annotations

import math

import pytest
import torch

from unikv.kernels import get_backend
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

FP8 = torch.float8_e4m3fn
BACKENDS = ["torch", "triton"]  # triton runs under TRITON_INTERPRET=1 on CPU
# (layers, heads, D, Dv): D != Dv both ways, and one symmetric control
SHAPES = [(1, 2, 6, 4), (3, 1, 4, 6), (2, 2, 5, 3), (2, 1, 4, 4)]


def hand_byte(t, layer, part, head, dim, *, ps, L, H, D, Dv, item) -> int:
    """docs/design.md section 2, from raw fields: page t // ps holds, per layer,
    ps K rows of H*D items then ps V rows of H*Dv items; no padding anywhere."""
    width = D if part == 0 else Dv
    page_bytes = ps * L * H * (D + Dv) * item
    block = ps * (layer * H * (D + Dv) + part * H * D) * item
    row = (t % ps) * H * width * item
    return (t // ps) * page_bytes + block + row + (head * width + dim) * item


def hand_kernel_id(t, *, ps, L, D, Dv) -> int:
    """docs/design.md section 3: multiplier 2L for one row width, else 1."""
    blocks = 2 * L if D == Dv else 1
    return (t // ps) * ps * blocks + t % ps


def build(shape, ps, dtype, num_tokens):
    L, H, D, Dv = shape
    spec = MHASpec(L, H, D, v_head_dim=Dv, dtype=dtype)
    cfg = [SubPoolConfig("full", spec, page_size=ps)]
    pool = UnifiedPool(cfg, pool_bytes_for(cfg, {"full": math.ceil(num_tokens / ps) + 1}))
    return spec, pool, pool["full"]


def random_rows(num, heads, width, dtype, gen):
    x = torch.randn(num, heads, width, generator=gen)
    return x.to(dtype)


def stored_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1).view(torch.uint8).view(*x.shape, x.element_size())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
@pytest.mark.parametrize("ps", [1, 3, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"L{s[0]}H{s[1]}D{s[2]}Dv{s[3]}" for s in SHAPES])
def test_store_kv_lands_at_the_hand_derived_bytes(backend, dtype, ps, shape) -> None:
    L, H, D, Dv = shape
    item = torch.empty((), dtype=dtype).element_size()
    num_tokens = 2 * ps + 1
    spec, pool, sub = build(shape, ps, dtype, num_tokens)
    assert spec.entry_bytes == L * H * (D + Dv) * item  # exact: no padding
    assert pool.buffer.numel() == pool.total_bytes + (0 if D != Dv else pool.tail_pad_bytes)
    tokens = list(range(sub.first_page * ps, sub.first_page * ps + num_tokens))
    tokens = tokens[::2] + tokens[1::2]  # out of order, pages interleaved
    kids = torch.tensor([hand_kernel_id(t, ps=ps, L=L, D=D, Dv=Dv) for t in tokens])
    gen = torch.Generator().manual_seed(L * 100 + ps)
    ops = get_backend("cpu", backend=backend)
    written = {}
    for layer in range(L):
        k = random_rows(num_tokens, H, D, dtype, gen)
        v = random_rows(num_tokens, H, Dv, dtype, gen)
        ops.store_kv(*sub.views[layer], kids.int(), k, v)
        written[layer] = (stored_bytes(k), stored_bytes(v))
    raw = pool.buffer
    touched = torch.zeros_like(raw, dtype=torch.bool)
    for layer, parts in written.items():
        for part, data in enumerate(parts):
            width = D if part == 0 else Dv
            for i, t in enumerate(tokens):
                for h in range(H):
                    for d in range(width):
                        at = hand_byte(t, layer, part, h, d, ps=ps, L=L, H=H, D=D, Dv=Dv, item=item)
                        assert torch.equal(raw[at : at + item], data[i, h, d]), (t, layer, part)
                        touched[at : at + item] = True
    assert int(touched.sum()) == num_tokens * spec.entry_bytes  # bytes are never shared
    assert not raw[~touched].any(), "a write landed outside its hand-derived bytes"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ps", [1, 3, 16])
@pytest.mark.parametrize("shape", [(2, 2, 6, 4), (1, 1, 4, 8)], ids=["wide-k", "wide-v"])
def test_attention_reads_the_rows_store_wrote(backend, ps, shape) -> None:
    """Decode and extend over a block table of the design's page entries (P * 1)
    equal a naive softmax over the K/V handed to store_kv (fp32)."""
    L, H, D, Dv = shape
    lens = [ps + 2, 2 * ps + 1]
    _, _, sub = build(shape, ps, torch.float32, sum(lens) + 2 * ps)
    gen = torch.Generator().manual_seed(ps)
    ops = get_backend("cpu", backend=backend)
    num_pages = [math.ceil(n / ps) for n in lens]
    pages = torch.randperm(sub.usable_pages, generator=gen)[: sum(num_pages)] + sub.first_page
    table = torch.zeros(len(lens), max(num_pages) + 1, dtype=torch.int32)
    layer, dense, cursor = L - 1, [], 0
    for b, (n, np_) in enumerate(zip(lens, num_pages)):
        mine = pages[cursor : cursor + np_]
        cursor += np_
        table[b, :np_] = mine.int()  # entry = P * B with B = 1
        t = mine.repeat_interleave(ps)[:n] * ps + torch.arange(n) % ps  # physical token ids
        kids = torch.tensor([hand_kernel_id(int(x), ps=ps, L=L, D=D, Dv=Dv) for x in t])
        k, v = random_rows(n, H, D, torch.float32, gen), random_rows(n, H, Dv, torch.float32, gen)
        ops.store_kv(*sub.views[layer], kids.int(), k, v)
        dense.append((k, v))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    k_view, v_view = sub.views[layer]
    q = torch.randn(len(lens), 2 * H, D, generator=gen)
    got = ops.decode_attention(q, k_view, v_view, table, seq_lens, page_size=ps, sm_scale=0.3)
    for b, (k, v) in enumerate(dense):
        kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # GQA group 2
        w = torch.softmax(torch.einsum("hd,lhd->hl", q[b], kk) * 0.3, dim=-1)
        torch.testing.assert_close(got[b], torch.einsum("hl,lhd->hd", w, vv), rtol=1e-4, atol=1e-5)
    q_lens = [2, 3]
    qx = torch.randn(sum(q_lens), 2 * H, D, generator=gen)
    indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
    got = ops.extend_attention(
        qx, k_view, v_view, table, indptr, seq_lens, max_q_len=3, page_size=ps, sm_scale=0.3
    )
    for b, (k, v) in enumerate(dense):
        kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        for j in range(q_lens[b]):
            pos = lens[b] - q_lens[b] + j
            w = torch.softmax(
                torch.einsum("hd,lhd->hl", qx[indptr[b] + j], kk[: pos + 1]) * 0.3, -1
            )
            want = torch.einsum("hl,lhd->hd", w, vv[: pos + 1])
            torch.testing.assert_close(got[indptr[b] + j], want, rtol=1e-4, atol=1e-5)


def bytes_per_token(specs) -> tuple[int, int]:
    """(padded to max(D, Dv), exact) bytes of one token over every layer of ``specs``."""
    padded = sum(2 * s.num_layers * s.num_kv_heads * max(s.head_dim, s.v_head_dim) for s in specs)
    return padded * specs[0].itemsize, sum(s.entry_bytes for s in specs)


def test_bytes_per_token_of_192_128_heads_and_mimo_v2_flash() -> None:
    """The figures of issue 13: 192/128 heads (9 layer-heads, bf16) and MiMo-V2-Flash
    (transformers' mimo_v2_flash: 48 layers, full at 0 and every 6th, 4 KV heads;
    39 sliding layers with 8 KV heads; K 192, V 128; bf16)."""
    assert bytes_per_token([MHASpec(9, 1, 192, 128)]) == (6912, 5760)
    full, swa = MHASpec(9, 4, 192, 128), MHASpec(39, 8, 192, 128, sliding_window=128)
    assert bytes_per_token([full]) == (27648, 23040)
    assert bytes_per_token([swa]) == (239616, 199680)
    assert bytes_per_token([full, swa]) == (267264, 222720)
