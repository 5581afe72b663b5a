"""Band planning, as pure functions of the page books: what each band needs, the
packings to try (fewest band changes first), and the page moves and their order
that reach a packing. ``capacity.pack_bands`` is the packer; ``compaction.py``
carries a plan out. Nothing here changes state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from unikv.allocator.capacity import BandNeed, Bands, bands_disjoint, pack_bands
from unikv.allocator.pages import FREE, LIVE, PENDING, PageBook
from unikv.pool import Grow

SLACK_PAGES = 32  # a frontier moved for an allocation takes at least this many spare pages
SLACK_FRACTION = 4  # ... and a quarter of the band's occupied pages, if it can

Books = Mapping[str, PageBook]


class Mode(Enum):
    """Which occupied pages a band must keep where they are."""

    NOW = "now"  # no page moves: every occupied page
    AFTER = "after"  # after waiting for the forward fences: pinned and transfer-held pages
    ACTUAL = "actual"  # as things stand: pinned and still-pending pages


@dataclass(frozen=True)
class Frame:
    """The buffer the bands share: bytes below ``sink_bytes`` are the sink; under
    a static split, ``ranges[name]`` is the fixed page range ``[first, last)``."""

    sink_bytes: int
    total_bytes: int
    ranges: Mapping[str, tuple[int, int]] | None = None

    def range_of(self, book: PageBook) -> tuple[int, int]:
        return self.ranges[book.name] if self.ranges else (book.first_page, book.num_pages)

    def pack(self, needs: Mapping[str, BandNeed]) -> Bands | None:
        return pack_bands(needs, self.sink_bytes, self.total_bytes)


def band_needs(
    books: Books,
    frame: Frame,
    new: Mapping[str, int],
    mode: Mode,
    transfer_held: Mapping[str, np.ndarray] | None = None,
    reclaim: Mapping[str, np.ndarray] | None = None,
) -> dict[str, BandNeed]:
    """Band needs per sub-pool: occupied pages (those ``mode`` keeps in place among
    them) plus ``new[name]`` pages. ``transfer_held``: for ``Mode.AFTER``, the
    pages each transfer fence holds (a wait on the forward fences frees the rest).
    ``reclaim``: live, unpinned pages per sub-pool counted as holes (evictable
    prefix-cache pages)."""
    needs = {}
    for name, book in books.items():
        gone = reclaim.get(name) if reclaim else None
        if mode is Mode.NOW:
            occupied = book.num_live + book.num_pending
            if gone is None or len(gone) == 0:
                keep = book.occupied_span()
            else:
                mask = book.state >= LIVE
                mask[gone] = False
                keep = book.occupied_span(mask)
        else:
            if mode is Mode.AFTER:
                assert transfer_held is not None, "band_needs: Mode.AFTER needs transfer_held"
                held = transfer_held[name]
            else:
                held = book.state == PENDING
            mask = book.pins > 0
            mask[held] = True
            occupied = book.num_live + int((mask & (book.state == PENDING)).sum())
            keep = book.occupied_span(mask)
        occupied -= 0 if gone is None else len(gone)
        first, last = frame.range_of(book)
        pages = occupied + new.get(name, 0)
        needs[name] = BandNeed(book.grow, book.page_bytes, first, last, pages, *keep)
    return needs


def disjoint(books: Books, bands: Bands) -> bool:
    """Whether ``bands`` of these books lie in byte order without overlap."""
    return bands_disjoint({n: (books[n].grow, books[n].page_bytes, b) for n, b in bands.items()})


def candidates(
    books: Books, frame: Frame, needs: dict[str, BandNeed], new: Mapping[str, int], slack: bool
) -> list[Bands]:
    """Packings to try, fewest band changes first: bands whose holes already cover
    their demand keep their place; bands that grow take spare pages (``slack``)."""
    short = {n: k for n, k in new.items() if books[n].num_free < k}
    tight = frame.pack(needs)
    if tight is None:
        return []
    bases = [tight]
    for share in (1, 8) if slack else ():  # the most spare pages that still pack
        spare = {
            n: replace(need, pages=need.pages + _slack(books[n], short[n]) // share)
            if n in short
            else need
            for n, need in needs.items()
        }
        roomy = frame.pack(spare)
        if roomy is not None:
            bases.insert(0, roomy)
            break
    ordered = []
    for base in bases:  # first with the other bands where they are, then the base itself
        kept = {n: (base[n] if n in short else books[n].band) for n in base}
        if disjoint(books, kept):
            ordered.append(kept)
        ordered.append(base)
    centred = [_centre_float(books, frame, c, short) for c in ordered]
    return [c for c in centred if c is not None and disjoint(books, c)] + ordered


def _centre_float(books: Books, frame: Frame, bands: Bands, new: Mapping[str, int]) -> Bands | None:
    """An empty FLOAT band that must grow is placed mid-gap (moving it is free),
    so the UP and DOWN bands keep room on both sides."""
    by_grow = {b.grow: b for b in books.values()}
    flt = by_grow.get(Grow.FLOAT)
    if flt is None or flt.lo != flt.hi or not new.get(flt.name, 0):
        return None
    up, down = by_grow.get(Grow.UP), by_grow.get(Grow.DOWN)
    floor = bands[up.name][1] * up.page_bytes if up else frame.sink_bytes
    ceiling = bands[down.name][0] * down.page_bytes if down else frame.total_bytes
    first, last = frame.range_of(flt)
    low = max(first, -(-floor // flt.page_bytes))
    high = min(last, ceiling // flt.page_bytes)
    size = bands[flt.name][1] - bands[flt.name][0]
    if high - low < size:
        return None
    start = low + (high - low - size) // 2
    return {**bands, flt.name: (start, start + size)}


def _slack(book: PageBook, new: int) -> int:
    """Spare pages a growing band takes: geometric, so frontier moves (O(band)
    host work) stay rare; the other bands take them back for free."""
    return max(new, SLACK_PAGES, (book.num_live + book.num_pending) // SLACK_FRACTION)


def plan_moves(book: PageBook, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Sources (live pages outside ``[lo, hi)``) and destinations (holes inside it,
    farthest from the frontier first): host int32 arrays. The band must already
    cover ``[lo, hi)``."""
    pages = np.arange(book.lo, book.hi, dtype=np.int32)
    states = book.state[book.lo : book.hi]
    src = pages[(states == LIVE) & ((pages < lo) | (pages >= hi))]
    target = np.arange(lo, hi, dtype=np.int32)
    open_ = target[book.state[lo:hi] == FREE]
    if book.grow == Grow.DOWN:
        open_ = open_[::-1]
    assert len(open_) >= len(src), (
        f"{book.name!r}: target band [{lo}, {hi}) has {len(open_)} open pages for {len(src)} moves"
    )
    return src, open_[: len(src)].copy()


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


def compaction_order(books: Books, targets: Bands) -> list[str]:
    """Names in an order where a band retreats before another target takes its
    bytes: if X's target overlaps Y's current band, Y goes first (along the chain
    UP | FLOAT | DOWN this has no cycle)."""

    def span(name: str, band: tuple[int, int]) -> tuple[int, int]:
        pb = books[name].page_bytes
        return band[0] * pb, band[1] * pb

    before = {
        x: {y for y in targets if y != x and _overlaps(span(x, targets[x]), span(y, books[y].band))}
        for x in targets
    }
    order: list[str] = []
    while len(order) < len(targets):
        ready = [x for x in targets if x not in order and before[x] <= set(order)]
        assert ready, f"compaction order has a cycle: {before}"
        order.append(ready[0])
    return order
