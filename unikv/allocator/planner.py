"""Band planning for the PoolAllocator: band needs per mode, candidate packings
(fewest band changes first), frontier moves without page moves, and compaction
toward a packing. See ``capacity.py`` for the packer and ``compaction.py`` for
the page moves."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from unikv.allocator.capacity import BandNeed, Bands, bands_disjoint, pack_bands
from unikv.allocator.compaction import compact_to
from unikv.allocator.subpool import PENDING
from unikv.pool import Grow

SLACK_PAGES = 32  # a frontier moved for an allocation takes at least this many spare pages
SLACK_FRACTION = 4  # ... and a quarter of the band's occupied pages, if it can


class PlannerVerbs:
    """Mixed into PoolAllocator (uses subs, pool, fences, _drain)."""

    def _needs(self, new: Mapping[str, int], mode: str) -> dict[str, BandNeed]:
        """Band needs per sub-pool. mode "now": every occupied page is kept;
        "after": pinned pages and transfer-held pages are kept (the forward fence
        will be waited for); "actual": pinned and still-pending pages are kept.
        Under a static split a band's grid is cut to its fixed range."""
        needs = {}
        for name, sub in self.subs.items():
            first, last = self._range(name)
            if mode == "now":
                occupied = sub.num_live + sub.num_pending
                keep = sub.occupied_span()
            else:
                held = (
                    self.fences.held(name, transfer_only=True)
                    if mode == "after"
                    else np.flatnonzero(sub.state == PENDING)
                )
                mask = sub.pins > 0
                mask[held] = True
                occupied = sub.num_live + int((mask & (sub.state == PENDING)).sum())
                keep = sub.occupied_span(mask)
            needs[name] = BandNeed(
                sub.grow,
                sub.page_bytes,
                first,
                last,
                occupied + new.get(name, 0),
                *keep,
            )
        return needs

    def _range(self, name: str) -> tuple[int, int]:
        """Pages ``[first, last)`` a band of ``name`` may cover: its whole grid, or
        its fixed range under a static split (``UnifiedPool.band_limits``)."""
        limits = self.pool.band_limits
        sub = self.subs[name]
        return limits[name] if limits else (sub.first_page, sub.num_pages)

    def _pack(self, needs: Mapping[str, BandNeed]) -> Bands | None:
        return pack_bands(needs, self.pool.sink_bytes, self.pool.total_bytes)

    def _candidates(
        self, needs: dict[str, BandNeed], new: Mapping[str, int], slack: bool
    ) -> list[Bands]:
        """Packings to try, fewest band changes first: bands whose holes already
        cover their demand keep their place; bands that grow take spare pages."""
        new = {n: k for n, k in new.items() if self.subs[n].num_free < k}  # the short ones
        tight = self._pack(needs)
        if tight is None:
            return []
        bases = [tight]
        for share in (1, 8) if slack else ():  # the most spare pages that still pack
            spare = {
                n: replace(need, pages=need.pages + self._slack(n, new[n]) // share)
                if n in new
                else need
                for n, need in needs.items()
            }
            roomy = self._pack(spare)
            if roomy is not None:
                bases.insert(0, roomy)
                break
        kept = [{n: (b[n] if n in new else self.subs[n].band) for n in b} for b in bases]
        ordered = [
            c for pair in zip(kept, bases) for c in pair if c is pair[1] or self._disjoint(c)
        ]
        centred = [self._centre_float(c, new) for c in ordered]
        return [c for c in centred if c is not None and self._disjoint(c)] + ordered

    def _centre_float(self, bands: Bands, new: Mapping[str, int]) -> Bands | None:
        """An empty FLOAT band that must grow is placed mid-gap (moving it is free),
        so the UP and DOWN bands keep room on both sides."""
        subs = {s.grow: s for s in self.subs.values()}
        flt = subs.get(Grow.FLOAT)
        if flt is None or flt.lo != flt.hi or not new.get(flt.name, 0):
            return None
        up, down = subs.get(Grow.UP), subs.get(Grow.DOWN)
        floor = bands[up.name][1] * up.page_bytes if up else self.pool.sink_bytes
        ceiling = bands[down.name][0] * down.page_bytes if down else self.pool.total_bytes
        first, last = self._range(flt.name)
        low = max(first, -(-floor // flt.page_bytes))
        high = min(last, ceiling // flt.page_bytes)
        size = bands[flt.name][1] - bands[flt.name][0]
        if high - low < size:
            return None
        start = low + (high - low - size) // 2
        return {**bands, flt.name: (start, start + size)}

    def _slack(self, name: str, new: int) -> int:
        """Spare pages a growing band takes: geometric, so frontier moves (O(band)
        host work) stay rare; the other bands take them back for free."""
        sub = self.subs[name]
        return max(new, SLACK_PAGES, (sub.num_live + sub.num_pending) // SLACK_FRACTION)

    def _disjoint(self, bands: Bands) -> bool:
        return bands_disjoint(
            {n: (self.subs[n].grow, self.subs[n].page_bytes, b) for n, b in bands.items()}
        )

    def _grow_now(self, new: Mapping[str, int]) -> bool:
        candidates = self._candidates(self._needs(new, "now"), new, slack=True)
        if not candidates:
            return False
        for name, band in candidates[0].items():
            if band != self.subs[name].band:
                self.subs[name].set_band(*band)
        return True

    def _compact_for(self, new: Mapping[str, int]) -> bool:
        if self._pack(self._needs(new, "after")) is None:
            return False
        # "after" counted every page a forward fence holds as free, so wait for ALL
        # of them, not only the latest forward: its event may have fired before an
        # older group's (out of order), or since reserve's drain (host sync, slow path)
        self.fences.wait_forward()
        self._drain()
        candidates = self._candidates(self._needs(new, "actual"), new, slack=False)
        assert candidates, "compaction: the packing that waiting made feasible vanished"
        compact_to(self.pool, self.subs, candidates[0])
        return True
