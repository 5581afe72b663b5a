"""The page-major layout law (docs/design.md sections 2-3), proven three ways:

1. kernel views (dense 3-D rows, or page-strided 4-D views for asymmetric K/V)
   against the strided (page, slot) oracle views, both directions;
2. dense writes against docs/design.md section 2's byte-address formula, computed
   here by hand from the raw spec fields on the raw uint8 buffer;
3. byte footprints (which bytes each view element covers, from the views' own
   strides) checked for disjointness and completeness.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unikv import layout
from unikv.specs import MambaSpec, MHASpec, MLASpec, StatePart

FP8 = torch.float8_e4m3fn
MHA_SPECS = {
    "fp32": MHASpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32),
    "bf16-asym-wide-v": MHASpec(
        num_layers=2, num_kv_heads=3, head_dim=4, v_head_dim=6, dtype=torch.bfloat16
    ),
    "fp16-asym-wide-k": MHASpec(
        num_layers=2, num_kv_heads=1, head_dim=8, v_head_dim=2, dtype=torch.float16
    ),
    "fp8": MHASpec(num_layers=2, num_kv_heads=2, head_dim=3, dtype=FP8),
}
MLA_SPEC = MLASpec(num_layers=3, kv_lora_rank=6, rope_dim=2, dtype=torch.bfloat16)
PAGE_SIZES = [1, 4, 16]


def raw_itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def make_buffer(spec, page_size: int, num_pages: int) -> torch.Tensor:
    size = num_pages * spec.page_bytes(page_size) + spec.view_tail_pad_bytes(page_size)
    return torch.zeros(size, dtype=torch.uint8)


def random_like(view_row: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random raw bytes reinterpreted as the row's dtype (compare with ``as_bytes``)."""
    nbytes = view_row.numel() * view_row.element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(view_row.dtype).view(view_row.shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def footprint(view: torch.Tensor) -> torch.Tensor:
    """Byte positions (in the buffer) of every element of ``view``: shape
    ``view.shape + (itemsize,)``, computed from the view's own strides."""
    itemsize = view.element_size()
    elems = torch.arange(view.untyped_storage().nbytes() // itemsize)
    index = elems.as_strided(view.shape, view.stride(), view.storage_offset())
    return index[..., None] * itemsize + torch.arange(itemsize)


def probes(num_pages: int, page_size: int) -> list[tuple[int, int]]:
    return sorted({(p, s) for p in (0, num_pages - 1) for s in (0, page_size - 1)})


def hand_kernel_id(page: int, slot: int, page_size: int, blocks: int) -> int:
    return page * page_size * blocks + slot  # docs/design.md section 3


def hand_blocks(spec: MHASpec) -> int:
    """The id multiplier by docs/design.md section 3: 2L row-blocks when K and V rows
    have one width, else 1 (kernel id = physical token id)."""
    return 2 * spec.num_layers if spec.head_dim == spec.v_head_dim else 1


def at(view: torch.Tensor, kid: int, page_size: int) -> torch.Tensor:
    """The row a kernel reads at kernel id ``kid`` (a view: writable)."""
    return layout.as_paged(view, page_size)[kid // page_size, kid % page_size]


# -- 1. dense views <-> (page, slot) oracle -------------------------------------


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", list(MHA_SPECS))
def test_mha_dense_and_paged_views_cross_read(name: str, page_size: int) -> None:
    spec, num_pages = MHA_SPECS[name], 3
    buf = make_buffer(spec, page_size, num_pages)
    dense = layout.mha_dense_views(buf, spec, page_size, num_pages)
    paged = layout.mha_paged_views(buf, spec, page_size, num_pages)
    gen = torch.Generator().manual_seed(0)
    for page, slot in probes(num_pages, page_size):
        phys = torch.tensor([page * page_size + slot])
        kid = int(layout.kernel_ids(phys, page_size, spec.blocks_per_page)[0])
        for layer in range(spec.num_layers):
            for part in (0, 1):
                value = random_like(paged[layer][part][page, slot], gen)
                paged[layer][part][page, slot] = value  # oracle -> kernel view
                row = at(dense[layer][part], kid, page_size)
                assert torch.equal(as_bytes(row), as_bytes(value))
                value = random_like(row, gen)
                row.copy_(value)  # kernel view -> oracle
                assert torch.equal(as_bytes(paged[layer][part][page, slot]), as_bytes(value))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_mla_dense_and_paged_views_cross_read(page_size: int) -> None:
    spec, num_pages = MLA_SPEC, 3
    buf = make_buffer(spec, page_size, num_pages)
    dense = layout.mla_dense_views(buf, spec, page_size, num_pages)
    paged = layout.mla_paged_views(buf, spec, page_size, num_pages)
    gen = torch.Generator().manual_seed(1)
    for page, slot in probes(num_pages, page_size):
        kid = hand_kernel_id(page, slot, page_size, spec.num_layers)  # B = L for MLA
        for layer in range(spec.num_layers):
            value = random_like(paged[layer][page, slot], gen)
            paged[layer][page, slot] = value
            assert torch.equal(as_bytes(dense[layer][kid]), as_bytes(value))
            value = random_like(dense[layer][kid], gen)
            dense[layer][kid] = value
            assert torch.equal(as_bytes(paged[layer][page, slot]), as_bytes(value))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", list(MHA_SPECS))
def test_every_page_and_slot_has_the_same_bytes_in_both_views(name: str, page_size: int) -> None:
    spec, num_pages = MHA_SPECS[name], 2
    buf = make_buffer(spec, page_size, num_pages)
    dense = layout.mha_dense_views(buf, spec, page_size, num_pages)
    paged = layout.mha_paged_views(buf, spec, page_size, num_pages)
    phys = torch.arange(num_pages * page_size)
    kids = layout.kernel_ids(phys, page_size, spec.blocks_per_page)
    for layer in range(spec.num_layers):
        for part in (0, 1):
            by_page = footprint(paged[layer][part]).flatten(0, 1)  # (pages * ps, H, D, itemsize)
            by_kid = footprint(layout.as_paged(dense[layer][part], page_size))
            assert torch.equal(by_kid[kids // page_size, kids % page_size], by_page)


# -- 2. docs/design.md section 2's byte-address formula, by hand ---------------------


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", list(MHA_SPECS))
def test_dense_writes_land_at_the_design_byte_address(name: str, page_size: int) -> None:
    """Write every (token, layer, K/V) through the kernel views; rebuild the whole
    buffer from docs/design.md's formula with raw fields; the two must be identical.
    K rows are H * D wide, V rows H * Dv: no padding (docs/design.md section 2)."""
    spec, num_pages = MHA_SPECS[name], 3
    L, H, ps = spec.num_layers, spec.num_kv_heads, page_size
    item = raw_itemsize(spec.dtype)
    width = {0: spec.head_dim, 1: spec.v_head_dim}
    row = {part: H * width[part] * item for part in (0, 1)}
    page_bytes = ps * L * (row[0] + row[1])
    buf = make_buffer(spec, ps, num_pages)
    dense = layout.mha_dense_views(buf, spec, ps, num_pages)
    expected = torch.zeros_like(buf)
    gen = torch.Generator().manual_seed(2)
    for t in range(num_pages * ps):
        kid = hand_kernel_id(t // ps, t % ps, ps, hand_blocks(spec))
        for layer in range(L):
            for part in (0, 1):  # K then V of each layer
                target = at(dense[layer][part], kid, ps)
                value = random_like(target, gen)
                target.copy_(value)
                block = ps * (layer * (row[0] + row[1]) + part * row[0])
                addr = (t // ps) * page_bytes + block + (t % ps) * row[part]
                expected[addr : addr + row[part]] = as_bytes(value)
    assert torch.equal(buf, expected)


def test_kernel_ids_of_physical_ids_match_design() -> None:
    t = torch.arange(0, 200, dtype=torch.int64)
    for ps, blocks in ((1, 2), (4, 6), (16, 3)):
        want = torch.tensor([hand_kernel_id(i // ps, i % ps, ps, blocks) for i in t.tolist()])
        assert torch.equal(layout.kernel_ids(t, ps, blocks), want)
        assert torch.equal(layout.kernel_ids(t.int(), ps, blocks), want.int())


# -- no aliasing at one kernel id --------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    num_layers=st.integers(1, 4),
    heads=st.integers(1, 3),
    head_dim=st.integers(1, 6),
    v_head_dim=st.integers(1, 6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.uint8, FP8]),
    page_size=st.sampled_from(PAGE_SIZES),
    num_pages=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_no_aliasing_at_one_kernel_id(
    num_layers, heads, head_dim, v_head_dim, dtype, page_size, num_pages, seed
) -> None:
    """At each probed id, write 2L distinct values through all 2L views; all read back."""
    spec = MHASpec(num_layers, heads, head_dim, v_head_dim, dtype)
    buf = make_buffer(spec, page_size, num_pages)
    dense = layout.mha_dense_views(buf, spec, page_size, num_pages)
    views = [view for pair in dense for view in pair]
    assert len(views) == 2 * num_layers
    gen = torch.Generator().manual_seed(seed)
    written = {}
    for page, slot in probes(num_pages, page_size):
        kid = hand_kernel_id(page, slot, page_size, hand_blocks(spec))
        for i, view in enumerate(views):
            written[kid, i] = random_like(at(view, kid, page_size), gen)
            at(view, kid, page_size).copy_(written[kid, i])
    for (kid, i), value in written.items():
        assert torch.equal(as_bytes(at(views[i], kid, page_size)), as_bytes(value)), (kid, i)


# -- 3. footprints: disjoint, complete, tail pad tight ----------------------------


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", list(MHA_SPECS))
def test_dense_rows_at_valid_ids_tile_the_pages(name: str, page_size: int) -> None:
    """The rows of all 2L views at every valid kernel id never overlap and cover
    every byte of the pages exactly once (no padding, symmetric or not)."""
    spec, num_pages = MHA_SPECS[name], 2
    buf = make_buffer(spec, page_size, num_pages)
    dense = layout.mha_dense_views(buf, spec, page_size, num_pages)
    kids = torch.tensor(
        [
            hand_kernel_id(p, s, page_size, hand_blocks(spec))
            for p in range(num_pages)
            for s in range(page_size)
        ]
    )
    spots = torch.cat(
        [
            footprint(layout.as_paged(v, page_size))[kids // page_size, kids % page_size].flatten()
            for pair in dense
            for v in pair
        ]
    )
    assert spots.unique().numel() == spots.numel(), "two views share a byte"
    item, H, L = raw_itemsize(spec.dtype), spec.num_kv_heads, spec.num_layers
    assert spots.numel() == num_pages * page_size * L * H * (spec.head_dim + spec.v_head_dim) * item
    assert torch.equal(spots.sort().values, torch.arange(num_pages * spec.page_bytes(page_size)))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_tail_pad_is_exactly_what_the_last_dense_view_needs(page_size: int) -> None:
    for spec in (*MHA_SPECS.values(), MLA_SPEC):
        num_pages = 2
        buf = make_buffer(spec, page_size, num_pages)
        if isinstance(spec, MHASpec):
            views = [
                v for pair in layout.mha_dense_views(buf, spec, page_size, num_pages) for v in pair
            ]
        else:
            views = layout.mla_dense_views(buf, spec, page_size, num_pages)
        assert max(int(footprint(v).max()) for v in views) < buf.numel()
        assert int(footprint(views[-1]).max()) + 1 == buf.numel()  # the last view ends the pad
        short = buf[:-1]
        with pytest.raises(ValueError, match="tail pad"):
            if isinstance(spec, MHASpec):
                layout.mha_dense_views(short, spec, page_size, num_pages)
            else:
                layout.mla_dense_views(short, spec, page_size, num_pages)
        with pytest.raises(ValueError, match="view_tail_pad_bytes"):
            (layout.mha_paged_views if isinstance(spec, MHASpec) else layout.mla_paged_views)(
                short, spec, page_size, num_pages
            )


def test_view_builders_reject_a_non_uint8_buffer() -> None:
    spec = MHA_SPECS["fp32"]
    buf = torch.zeros(1000, dtype=torch.float32)
    with pytest.raises(ValueError, match="1-D uint8 buffer"):
        layout.mha_dense_views(buf, spec, 1, 2)


def test_mla_views_never_alias_across_layers_and_slots() -> None:
    spec, ps, num_pages = MLA_SPEC, 4, 3
    buf = make_buffer(spec, ps, num_pages)
    dense = layout.mla_dense_views(buf, spec, ps, num_pages)
    kids = [hand_kernel_id(p, s, ps, spec.num_layers) for p in range(num_pages) for s in range(ps)]
    spots = torch.cat([footprint(v)[kids].flatten() for v in dense])
    assert torch.equal(spots.sort().values, torch.arange(num_pages * spec.page_bytes(ps)))


# -- Mamba --------------------------------------------------------------------------

MAMBA_SPEC = MambaSpec(
    num_layers=3,
    conv=(StatePart((3, 3), torch.bfloat16), StatePart((5,), torch.uint8)),
    temporal=StatePart((2, 3, 2), torch.float32),
)


def test_mamba_views_never_alias_and_stay_in_their_slot() -> None:
    spec, num_slots = MAMBA_SPEC, 4
    buf = make_buffer(spec, 1, num_slots)
    views = layout.mamba_state_views(buf, spec, num_slots)
    assert list(views) == ["conv0", "conv1", "temporal"]
    all_spots = []
    for name, part in zip(views, spec.state_parts):
        view = views[name]
        assert view.shape == (spec.num_layers, num_slots, *part.shape)
        assert view.dtype == part.dtype
        spots = footprint(view).flatten(2)  # (layers, slots, bytes of one state)
        for layer in range(spec.num_layers):
            for slot in range(num_slots):
                ours = spots[layer, slot].sort().values  # one (layer, slot, part): contiguous
                assert torch.equal(ours, torch.arange(int(ours[0]), int(ours[0]) + ours.numel()))
                assert (
                    slot * spec.entry_bytes <= int(ours[0])
                    and int(ours[-1]) < (slot + 1) * spec.entry_bytes
                )
        all_spots.append(spots.flatten())
    spots = torch.cat(all_spots)
    assert spots.unique().numel() == spots.numel(), "two (layer, slot, part) share a byte"
    per_slot = sum(
        spec.num_layers * raw_itemsize(p.dtype) * torch.Size(p.shape).numel()
        for p in spec.state_parts
    )
    assert spots.numel() == num_slots * per_slot


def test_mamba_views_match_design_slot_layout() -> None:
    """Slot = [conv0, all layers][conv1, all layers][temporal, all layers], each
    part aligned to its itemsize (docs/design.md section 2; specs.py MambaSpec)."""
    spec, num_slots = MAMBA_SPEC, 3
    buf = make_buffer(spec, 1, num_slots)
    views = layout.mamba_state_views(buf, spec, num_slots)
    gen = torch.Generator().manual_seed(3)
    values = {name: random_like(view, gen) for name, view in views.items()}
    for name, view in views.items():
        view.copy_(values[name])
    cursor, starts = 0, {}
    for name, part in zip(views, spec.state_parts):
        item = raw_itemsize(part.dtype)
        cursor = (cursor + item - 1) // item * item
        starts[name] = cursor
        cursor += spec.num_layers * torch.Size(part.shape).numel() * item
    for slot in range(num_slots):
        base = slot * spec.entry_bytes
        for name, part in zip(views, spec.state_parts):
            n = spec.num_layers * torch.Size(part.shape).numel() * raw_itemsize(part.dtype)
            raw = buf[base + starts[name] : base + starts[name] + n]
            want = as_bytes(values[name][:, slot])  # (layers, *shape) contiguous
            assert torch.equal(raw, want), (slot, name)


def test_mamba_view_needs_every_slot_byte() -> None:
    buf = make_buffer(MAMBA_SPEC, 1, 3)
    with pytest.raises(ValueError, match="too small"):
        layout.mamba_state_views(buf[:-1], MAMBA_SPEC, 3)


def test_fp8_is_stored_as_uint8_and_views_as_fp8() -> None:
    spec = MHA_SPECS["fp8"]
    buf = make_buffer(spec, 4, 2)
    k, v = layout.mha_dense_views(buf, spec, 4, 2)[0]
    assert k.dtype == v.dtype == torch.uint8
    value = torch.tensor([[0.5, -2.0, 448.0], [1.0, 0.0, -0.25]], dtype=FP8)
    k[5] = value.view(torch.uint8)
    assert torch.equal(k[5].view(FP8).float(), value.float())
    as_uint8 = MHASpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype=torch.uint8)
    assert spec.entry_bytes == as_uint8.entry_bytes
