"""PoolAllocator: every sub-pool of a UnifiedPool, sharing one buffer (the chain).

    byte 0                                                          total_bytes
    | sink | UP band ->  | free | <- FLOAT -> | free |   <- DOWN band |
                        frontiers move at run time; bands stay byte-disjoint

Roles (docs/design.md section 5): full attention (or MLA) is the id owner and mints
virtual pages; every other token sub-pool (SWA) binds the owner's virtual pages
to physical pages of its own grid; with only SWA sub-pools the first is the
owner. A Mamba sub-pool has one slot per request (virtual id = request slot + 1).

Room for an allocation (``reserve``), cheapest first:
1. holes on each free stack (no band moves);
2. *now*: move frontiers over free bytes and trailing holes (no page moves);
3. *after compaction*: wait for the forward fence, move live pages into holes;
4. the shortfall callback (``on_shortfall``) evicts from any sub-pool, given
   the joint picture, and the allocator tries again.
``can_admit`` answers 2 and 3 with the same packer (``capacity.pack_bands``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from unikv.allocator.compaction import compact_to
from unikv.allocator.device import make_table_ops, make_uploader
from unikv.allocator.fences import FenceQueue
from unikv.allocator.lookups import LookupVerbs
from unikv.allocator.planner import PlannerVerbs
from unikv.allocator.requests import RequestTable, VirtualSpace
from unikv.allocator.step import StepVerbs
from unikv.allocator.subpool import SubPoolAllocator
from unikv.allocator.tokens import TokenVerbs
from unikv.pool import UnifiedPool

INT32_LIMIT = 2**31


@dataclass
class Shortfall:
    """The joint picture handed to ``on_shortfall`` (LESSONS.md bugs 9 and 11).

    demand: new pages asked per sub-pool; virtual: new virtual pages asked;
    usage: per sub-pool ``{live, pending, pinned, free_in_band, page_bytes, band}``;
    free_bytes: bytes inside no band. The callback may free requests of ANY
    sub-pool (a Mamba shortfall may take room from full attention) and returns
    True when it freed something, so the allocator tries again."""

    demand: dict[str, int]
    virtual: int
    virtual_free: int
    usage: dict[str, dict[str, Any]]
    free_bytes: int


class PoolAllocator(TokenVerbs, StepVerbs, LookupVerbs, PlannerVerbs):
    """Allocator over every sub-pool of ``pool`` (see the module docstring).

    Args:
        pool: the UnifiedPool.
        max_requests, max_context: size the request slots and ``req_to_token``.
        debug: translation raises on live lanes that read tombstones, and every
            mutating verb ends with ``check_integrity()`` (host syncs).
        num_virtual_pages: the owner's virtual page space (default: its page grid,
            or every request's worst case when the owner has a sliding window).
        on_shortfall: ``callback(Shortfall) -> bool`` (see :class:`Shortfall`).
        max_shortfall_rounds: how many times the callback is asked per allocation.
    """

    def __init__(
        self,
        pool: UnifiedPool,
        *,
        max_requests: int,
        max_context: int,
        debug: bool = False,
        num_virtual_pages: int | None = None,
        on_shortfall: Callable[[Shortfall], bool] | None = None,
        max_shortfall_rounds: int = 8,
        build_block_table: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        for what, value in (("max_requests", max_requests), ("max_context", max_context)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"PoolAllocator {what} must be a positive int, got {value!r}")
        if max_requests * max_context >= INT32_LIMIT:
            raise ValueError(
                f"max_requests * max_context = {max_requests * max_context} must stay below 2**31 "
                "(req_to_token is indexed with int32); lower one of them"
            )
        self.pool, self.device, self.debug = pool, pool.device, debug
        self.on_shortfall, self.max_shortfall_rounds = on_shortfall, max_shortfall_rounds
        self.upload = make_uploader(pool.device)
        self._ops = make_table_ops(pool.device)  # fused table writes / translation
        self._step_cache = None  # decode_step: buffers checked last time, and their launch
        self.fences = FenceQueue()
        token = [s for s in pool.subpools.values() if s.spec.kind != "mamba"]
        mamba = [s for s in pool.subpools.values() if s.spec.kind == "mamba"]
        if len(mamba) > 1:
            raise ValueError(
                f"at most one Mamba sub-pool is supported, got {[s.name for s in mamba]}"
            )
        owner = next(
            (s for s in token if s.spec.kind in ("full", "mla")), token[0] if token else None
        )
        if len({s.page_size for s in token}) > 1:
            raise ValueError(
                "token sub-pools share virtual pages, so they need one page size; got "
                f"{ {s.name: s.page_size for s in token} }"
            )
        self.page_size = owner.page_size if owner else 1
        num_virtual = self._virtual_size(owner, num_virtual_pages, max_requests, max_context)
        self.requests = RequestTable(max_requests, max_context, self.page_size, self.device)
        self.vspace = VirtualSpace(num_virtual)
        self.subs: dict[str, SubPoolAllocator] = {}
        for s in pool.subpools.values():
            size = max_requests + 1 if s.spec.kind == "mamba" else num_virtual
            self.subs[s.name] = SubPoolAllocator(
                s, size, self.device, self.upload, self, table_ops=self._ops
            )
        self.owner = owner.name if owner else None
        self.token_names = [s.name for s in token]
        self.mamba_name = mamba[0].name if mamba else None
        self.windows = {s.name: s.spec.sliding_window for s in token if s.spec.sliding_window}
        for name in self.windows:
            self.requests.add_window(name)
        # tables written by _grow: req_to_token (flat), then v2p, p2v of each token sub-pool
        self._grow_tables = [self.requests.req_to_token.view(-1)] + [
            t for n in self.token_names for t in (self.subs[n].v2p, self.subs[n].p2v)
        ]
        if build_block_table is None:  # decided once: the kernels backend of the device
            from unikv.kernels import get_backend

            build_block_table = get_backend(self.device).build_block_table
        self._build_block_table = build_block_table

    def _virtual_size(self, owner, given, max_requests, max_context) -> int:
        if owner is None:
            return 1
        if given is None:
            pages = -(-max_context // owner.page_size)
            given = max_requests * pages + 1 if owner.spec.sliding_window else owner.num_pages
        if not isinstance(given, int) or given < 2 or given * owner.page_size >= INT32_LIMIT:
            raise ValueError(
                f"num_virtual_pages must be an int in [2, 2**31 / page_size), got {given!r}"
            )
        return given

    # -- members other components use --------------------------------------------

    @property
    def req_to_token(self) -> torch.Tensor:
        """(max_requests, max_context) int32 device tensor of virtual token ids."""
        return self.requests.req_to_token

    def subpool(self, name: str) -> SubPoolAllocator:
        if name not in self.subs:
            raise KeyError(f"no sub-pool {name!r}; the allocator has {list(self.subs)}")
        return self.subs[name]

    # -- fences ---------------------------------------------------------------------

    def mark_in_flight(self, event: Any = None) -> None:
        """A forward that reads/writes the live pages was enqueued; ``event`` (e.g. a
        torch.cuda.Event recorded after it, or None when it already ran) fires when
        it is done. Until then freed pages are neither reused nor moved, and live
        pages are not moved."""
        if event is not None and not (hasattr(event, "query") and hasattr(event, "synchronize")):
            raise TypeError(
                f"mark_in_flight takes an event with query()/synchronize() or None, got {event!r}"
            )
        self.fences.forward = event

    def _drain(self) -> None:
        for name, pages in self.fences.drain().items():
            self.subs[name].release_pending(pages)

    # -- capacity -------------------------------------------------------------------

    def _fits_free(self, new: Mapping[str, int], virtual: int) -> bool:
        return virtual <= self.vspace.num_free and all(
            self.subs[n].num_free >= k for n, k in new.items()
        )

    def can_admit(self, demand: Mapping[str, int]) -> tuple[bool, bool]:
        """Whether ``demand`` (new pages per sub-pool name; pages of the owner are
        new virtual pages too) can be met now (no page moves) and after
        compaction. ``reserve`` succeeds exactly when the second is True."""
        new = self._check_demand(demand)
        virtual = new.get(self.owner, 0) if self.owner else 0
        if virtual > self.vspace.num_free:
            return False, False
        self._drain()
        if self._fits_free(new, 0):
            return True, True
        if self._pack(self._needs(new, "now")) is not None:
            return True, True
        return False, self._pack(self._needs(new, "after")) is not None

    def _check_demand(self, demand: Mapping[str, int]) -> dict[str, int]:
        if not isinstance(demand, Mapping):
            raise TypeError(f"demand must be a mapping {{sub-pool name: pages}}, got {demand!r}")
        for name, pages in demand.items():
            if name not in self.subs:
                raise ValueError(
                    f"demand names sub-pool {name!r}; the allocator has {list(self.subs)}"
                )
            if not isinstance(pages, (int, np.integer)) or pages < 0:
                raise ValueError(f"demand[{name!r}] must be a non-negative int, got {pages!r}")
        return {n: int(p) for n, p in demand.items()}

    # -- making room ------------------------------------------------------------------

    def reserve(
        self, new: Mapping[str, int], virtual: int = 0, slots: np.ndarray | None = None
    ) -> bool:
        """Make each free stack hold ``new[name]`` holes (and the virtual space
        ``virtual`` ids). False, with no page moved, when impossible. ``slots``:
        the requests being served, which the shortfall callback must not free."""
        self._drain()
        if self._fits_free(new, virtual):
            return True
        for _ in range(self.max_shortfall_rounds + 1):
            if virtual <= self.vspace.num_free and (self._grow_now(new) or self._compact_for(new)):
                assert self._fits_free(new, virtual), (
                    "reserve: a feasible plan left free stacks short"
                )
                return True
            if self.on_shortfall is None or not self.on_shortfall(self._shortfall(new, virtual)):
                return False
            if slots is not None and not self.requests.in_use[slots].all():
                raise RuntimeError(
                    "the shortfall callback freed a request of the allocation it was called "
                    f"for (slots {slots.tolist()}); evict only requests outside the batch"
                )
            self._drain()
            if self._fits_free(new, virtual):
                return True
        return False

    def compact(self) -> int:
        """Idle-time compaction: wait for the forward fence, then pack every band
        tight (live pages into holes, frontiers back). Returns the pages moved."""
        self.fences.wait_forward()
        self._drain()
        targets = self._pack(self._needs({}, "actual"))
        assert targets is not None, "compaction: the current occupancy does not pack"
        return compact_to(self.pool, self.subs, targets)

    def _shortfall(self, new: Mapping[str, int], virtual: int) -> Shortfall:
        usage = {
            n: {
                "live": s.num_live,
                "pending": s.num_pending,
                "pinned": int((s.pins > 0).sum()),
                "free_in_band": s.num_free,
                "page_bytes": s.page_bytes,
                "band": s.band,
            }
            for n, s in self.subs.items()
        }
        used = sum((s.hi - s.lo) * s.page_bytes for s in self.subs.values())
        free_bytes = self.pool.total_bytes - self.pool.sink_bytes - used
        return Shortfall(dict(new), virtual, self.vspace.num_free, usage, free_bytes)

    def check_owned(self, name: str, vpages: np.ndarray, what: str) -> None:
        """ValueError unless every virtual page of sub-pool ``name`` belongs to an
        open request (for Mamba, virtual id = request slot + 1)."""
        if name == self.mamba_name:
            unowned = ~self.requests.in_use[vpages - 1]
        else:
            unowned = self.vspace.owner[vpages] < 0
        if unowned.any():
            raise ValueError(
                f"{what}: virtual pages {vpages[unowned].tolist()} of {name!r} belong to no "
                "request (never allocated or already freed)"
            )

    def owner_slots(self, name: str, vpages: np.ndarray) -> np.ndarray:
        """Request slots owning virtual pages of sub-pool ``name``."""
        if name == self.mamba_name:
            return (vpages - 1).astype(np.int64)
        return self.vspace.owner[vpages].astype(np.int64)

    def check_in_window(self, name: str, vpages: np.ndarray, what: str) -> None:
        """ValueError if a virtual page of windowed sub-pool ``name`` left the window."""
        if name not in self.windows:
            return
        slots = self.vspace.owner[vpages]
        gone = self.vspace.column[vpages] < self.requests.window_lo[name][slots]
        if gone.any():
            raise ValueError(
                f"{what}: virtual pages {vpages[gone].tolist()} of {name!r} left the sliding "
                "window; they are not bound again"
            )

    def check_integrity(self) -> None:
        """Verify every invariant (host syncs); AssertionError names the broken one."""
        from unikv.allocator.integrity import check_chain

        check_chain(self)
