"""The capacity oracle: can bands holding a demand be packed into the buffer?

One function answers for the whole chain (docs/design.md section 6). Each sub-pool
needs a band of ``pages`` pages on its own grid that contains every page it
cannot give up or move (``keep_lo..keep_hi``). Bands are packed in byte order

    sink | UP [first, hi) | FLOAT [lo, hi) | DOWN [lo, num_pages) | top
           ^ fixed floor                     fixed ceiling ^

and the tightest packing is optimal: the UP band's top only rises with its
need and its kept pages, the DOWN band's bottom only falls, and the FLOAT band,
given the room between them, is best placed as low as it can go (its top is a
non-decreasing function of its bottom). So the greedy answer below is exact;
tests check it against an enumeration of every band placement.

Two questions use the same function with different ``keep`` spans:
- *now* (no page moves): every occupied page is kept;
- *after compaction*: only pinned pages and pages a transfer still holds are
  kept; every other live page may move into a hole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise

from unikv.pool import Grow

Bands = dict[str, tuple[int, int]]  # name -> (lo, hi) pages, half-open


@dataclass(frozen=True)
class BandNeed:
    """One sub-pool's request to the packer (all in pages of its own grid).

    pages: the band size needed (occupied pages plus new ones);
    keep_lo, keep_hi: the band must contain pages keep_lo..keep_hi (inclusive);
        keep_lo > keep_hi means nothing is kept.
    """

    grow: Grow
    page_bytes: int
    first_page: int
    num_pages: int
    pages: int
    keep_lo: int = 1
    keep_hi: int = 0

    @property
    def keeps(self) -> bool:
        return self.keep_lo <= self.keep_hi


def pack_bands(needs: Mapping[str, BandNeed], sink_bytes: int, total_bytes: int) -> Bands | None:
    """The tightest placement of every band, or None when the needs cannot be met.

    Generalises ``UnifiedPool.fits`` (which it equals when nothing is kept)."""
    by_grow = {need.grow: (name, need) for name, need in needs.items()}
    bands: Bands = {}
    floor, ceiling = sink_bytes, total_bytes
    if Grow.UP in by_grow:
        name, need = by_grow[Grow.UP]
        hi = need.first_page + need.pages
        if need.keeps:
            hi = max(hi, need.keep_hi + 1)
        if hi > need.num_pages:
            return None
        bands[name] = (need.first_page, hi)
        if hi > need.first_page:  # an empty band takes no bytes (no rounding of the floor)
            floor = max(floor, hi * need.page_bytes)
    if Grow.DOWN in by_grow:
        name, need = by_grow[Grow.DOWN]
        lo = need.num_pages - need.pages
        if need.keeps:
            if need.keep_hi >= need.num_pages:  # a kept page above the top (a shrink)
                return None
            lo = min(lo, need.keep_lo)
        if lo < need.first_page:
            return None
        bands[name] = (lo, need.num_pages)
        if lo < need.num_pages:  # an empty band takes no bytes (no rounding of the top)
            ceiling = min(ceiling, lo * need.page_bytes)
    if Grow.FLOAT in by_grow:
        name, need = by_grow[Grow.FLOAT]
        lo = max(need.first_page, -(-floor // need.page_bytes))
        hi = lo + need.pages
        if need.keeps:
            if lo > need.keep_lo:
                return None
            hi = max(hi, need.keep_hi + 1)
        if need.pages == 0 and not need.keeps:
            lo = hi = min(lo, need.num_pages)  # an empty band takes no bytes
        elif hi > need.num_pages or hi * need.page_bytes > ceiling:
            return None
        else:
            floor = hi * need.page_bytes
        bands[name] = (lo, hi)
    if floor > ceiling:
        return None
    return bands


def band_bytes(band: tuple[int, int], page_bytes: int) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` of a band of pages."""
    return band[0] * page_bytes, band[1] * page_bytes


def bands_disjoint(bands: Mapping[str, tuple[Grow, int, tuple[int, int]]]) -> bool:
    """Whether bands ``{name: (grow, page_bytes, (lo, hi))}`` lie in byte order
    UP <= FLOAT <= DOWN without overlap (empty bands take no bytes)."""
    order = {Grow.UP: 0, Grow.FLOAT: 1, Grow.DOWN: 2}
    ranges = sorted(
        (order[grow], *band_bytes(band, pb))
        for grow, pb, band in bands.values()
        if band[1] > band[0]
    )
    return all(prev[2] <= nxt[1] for prev, nxt in pairwise(ranges))
