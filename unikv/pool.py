"""The unified pool: one zero-filled byte buffer, 1-3 sub-pools, moving boundaries.

    byte 0                                                        total_bytes   +tail pad
    | sink | up-grower ->      |  <- float ->  |      <- down-grower | pad |
           ^ sink_bytes (floor)

Every sub-pool indexes the same bytes on its own page grid (page p at
``p * page_bytes``). Sub-pools stay disjoint because of their allocators' byte
frontiers, not because of fixed regions: the allocator moves the boundaries at
run time. The bytes below ``sink_bytes`` belong to no sub-pool; page 0 of every
sub-pool lies there, so padded lanes, tombstones and dummy ids hit harmless
bytes. The tail pad lets the last row-block's dense view run past the last page.

An elastic pool (``max_bytes``) reserves ``max_bytes`` of address space in a
``backing.Backing`` and commits only ``[0, total_bytes + tail pad)``, in chunks;
``resize`` moves the top (docs/design.md section 4). Its views span the whole
reservation (``max_pages`` per grid) and never change, so kernels, captured graphs
and the runner's caches stay valid across resizes; only pages below ``num_pages``
are ever in a band.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from unikv import layout
from unikv.backing import Backing, make_backing, round_up
from unikv.ids import PhysicalPageIds, expect
from unikv.placement import (  # re-exported: the pool's public vocabulary
    Grow,
    SubPoolConfig,
    default_grow,
    pool_bytes_for,
    worst_case_pages,
)
from unikv.specs import MHASpec, MLASpec, Spec
from unikv.static_split import check_alone, check_static_split, static_band_limits

if TYPE_CHECKING:
    from unikv.kernels.backend import KernelBackend

__all__ = [
    "Grow",
    "SubPool",
    "SubPoolConfig",
    "UnifiedPool",
    "check_pages",
    "default_grow",
    "pool_bytes_for",
    "worst_case_pages",
]

INT32_LIMIT = layout.INT32_LIMIT
POISON_BYTE = 0xFF  # NaN in fp32, fp16, bf16 and both fp8 formats


@dataclass
class SubPool:
    """Geometry and views of one sub-pool inside a built pool."""

    name: str
    spec: Spec
    page_size: int
    grow: Grow
    layers: tuple[int, ...]
    page_bytes: int
    num_pages: int  # pages of this grid inside total_bytes, sink pages included
    first_page: int  # lowest page wholly above the sink floor
    views: object = field(repr=False)  # [(K, V)] per layer | [latent] | {part: state}
    paged_views: object = field(repr=False)  # (page, slot) oracle, None for Mamba
    max_pages: int = 0  # pages inside max_bytes: what the views span (0: num_pages)

    def __post_init__(self) -> None:
        self.max_pages = self.max_pages or self.num_pages

    @property
    def blocks_per_page(self) -> int | None:
        return self.spec.blocks_per_page

    @property
    def usable_pages(self) -> int:
        return self.num_pages - self.first_page

    @property
    def ids(self) -> layout.IdMap:
        """This sub-pool's kernel id arithmetic (page entries, kernel ids, limit)."""
        return layout.IdMap.of(self.spec, self.page_size)

    @property
    def kernel_id_limit(self) -> int:
        """One past the largest kernel id (slots for Mamba): ``ids.limit(num_pages)``."""
        return self.ids.limit(self.num_pages)


def check_pages(sub: SubPool, pages: torch.Tensor, what: str, *, distinct: bool = True) -> None:
    """Validate a physical page list of ``sub`` on the host (a sync for device
    tensors; never on the per-step path): every page is a real page, never the
    sink, and, if ``distinct``, none repeats."""
    if pages.numel() == 0:
        return
    host = pages.detach().to("cpu", torch.int64)
    lo, hi = int(host.min()), int(host.max())
    if lo < sub.first_page or hi >= sub.num_pages:
        raise ValueError(
            f"{what} must lie in [{sub.first_page}, {sub.num_pages}) of sub-pool "
            f"{sub.name!r} (the sink pages below {sub.first_page} are never moved), "
            f"got pages in [{lo}, {hi}]"
        )
    if distinct and torch.unique(host).numel() != host.numel():
        raise ValueError(f"{what} must be distinct, got {host.tolist()}")


def _build_views(
    buffer: torch.Tensor, spec: Spec, page_size: int, num_pages: int
) -> tuple[Any, Any]:
    if isinstance(spec, MHASpec):
        return (
            layout.mha_dense_views(buffer, spec, page_size, num_pages),
            layout.mha_paged_views(buffer, spec, page_size, num_pages),
        )
    if isinstance(spec, MLASpec):
        return (
            layout.mla_dense_views(buffer, spec, page_size, num_pages),
            layout.mla_paged_views(buffer, spec, page_size, num_pages),
        )
    return layout.mamba_state_views(buffer, spec, num_pages), None


def _copy_op(
    backend: KernelBackend | None, copy_pages: Callable[..., None] | None, device: torch.device
) -> Callable[..., None]:
    """The page-copy op, chosen once: ``copy_pages`` if given, else the backend's."""
    if backend is not None and copy_pages is not None:
        raise ValueError(
            "give UnifiedPool either backend= or copy_pages=, not both; backend.copy_pages "
            "is the page copy of a KernelBackend"
        )
    if copy_pages is not None:
        return copy_pages
    if backend is None:
        from unikv.kernels.backend import get_backend

        backend = get_backend(device)
    return cast(Callable[..., None], backend.copy_pages)


class UnifiedPool:
    """One uint8 buffer holding every sub-pool's pages; see the module docstring.

    Args:
        configs: 1 to 3 sub-pools, at most one per grow direction.
        total_bytes: the pool's byte budget (the tail pad comes on top).
        device: where the buffer lives.
        poison: fill with 0xFF (NaN in every float dtype) instead of zeros, so
            reads of never-written bytes fail fast. A debugging aid.
        max_request_tokens: if given, start-up fails unless one request of this
            many tokens fits alone in the empty pool.
        chunk_tokens: prefill chunk size used for the sliding-window worst case.
        state_slots: Mamba slots one request holds (1; 1 + k with k per-draft-position
            slots under speculative decoding): the same check, and the allocator's
            layout of the Mamba ids (``allocator/mamba.py``).
        backend: the kernel backend whose ``copy_pages`` moves envelopes, chosen
            once (default: ``kernels.get_backend(device)``).
        copy_pages: a bare page-copy op instead of ``backend`` (kept for callers
            that predate the backend; give one or the other).
        static_split: None (boundaries move), or ``{sub-pool name: fraction of the
            usable bytes}``: each sub-pool stays inside a fixed byte range
            (``band_limits``, see ``unikv.static_split``).
        max_bytes: None (a fixed pool, one plain tensor), or the largest
            ``total_bytes`` that ``resize`` may reach: an elastic pool whose
            address range is reserved once in ``backing`` (default
            ``backing.make_backing(device)``) and committed up to the tail pad.
        backing: the ``backing.Backing`` of an elastic pool (an empty one: the pool
            reserves it); giving one makes the pool elastic.
    """

    def __init__(
        self,
        configs: Sequence[SubPoolConfig],
        total_bytes: int,
        device: torch.device | str = "cpu",
        *,
        poison: bool = False,
        max_request_tokens: int | None = None,
        chunk_tokens: int = 1,
        state_slots: int = 1,
        backend: KernelBackend | None = None,
        copy_pages: Callable[..., None] | None = None,
        static_split: Mapping[str, float] | None = None,
        max_bytes: int | None = None,
        backing: Backing | None = None,
    ) -> None:
        configs = list(configs)
        if not 1 <= len(configs) <= 3:
            raise ValueError(f"a unified pool holds 1 to 3 sub-pools, got {len(configs)}")
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            raise ValueError(f"sub-pool names must be unique, got {names}")
        grows = default_grow(configs)
        for direction in Grow:
            holders = [c.name for c, g in zip(configs, grows) if g == direction]
            if len(holders) > 1:
                raise ValueError(
                    f"at most one sub-pool may grow {direction.value!r}, got {holders}; "
                    "set SubPoolConfig.grow so each direction has one holder"
                )
        if not isinstance(total_bytes, int) or total_bytes <= 0:
            raise ValueError(f"total_bytes must be a positive int, got {total_bytes!r}")
        elastic = max_bytes is not None or backing is not None
        max_bytes = total_bytes if max_bytes is None else max_bytes
        if not isinstance(max_bytes, int) or max_bytes < total_bytes:
            raise ValueError(
                f"max_bytes must be an int >= total_bytes ({total_bytes}), got {max_bytes!r}"
            )
        if elastic and static_split is not None:
            raise ValueError("an elastic pool (max_bytes, backing) cannot take a static_split")
        self.max_bytes = max_bytes
        # pages one request holds alone at its peak (None: unchecked): start-up and
        # resize refuse a size that cannot place them; a caller with a stricter rule
        # (prefix caching keeps window pages bound) may raise it after construction
        self.alone_demand: dict[str, int] | None = None
        if not isinstance(state_slots, int) or isinstance(state_slots, bool) or state_slots < 1:
            raise ValueError(f"state_slots must be an int >= 1, got {state_slots!r}")
        self.state_slots = state_slots  # Mamba slots one request holds (the allocator's layout)

        page_bytes = [c.spec.page_bytes(c.page_size) for c in configs]
        self.sink_bytes = max(page_bytes)  # page 0 of every sub-pool lies below it
        self.tail_pad_bytes = max(c.spec.view_tail_pad_bytes(c.page_size) for c in configs)
        self.total_bytes = total_bytes
        self.device = torch.device(device)
        # Start-up checks run on a meta buffer first, so that a bad budget fails
        # with its message before any memory is taken.
        self.buffer = torch.empty(
            total_bytes + self.tail_pad_bytes, dtype=torch.uint8, device="meta"
        )
        self._copy_pages = _copy_op(backend, copy_pages, self.device)

        self.subpools: dict[str, SubPool] = {}
        for config, grow, pb in zip(configs, grows, page_bytes):
            num_pages, max_pages = total_bytes // pb, max_bytes // pb
            first_page = -(-self.sink_bytes // pb)
            if num_pages <= first_page:
                raise ValueError(
                    f"sub-pool {config.name!r} fits no real page: {total_bytes} bytes hold "
                    f"{num_pages} pages of {pb} bytes and the first {first_page} lie in the "
                    f"{self.sink_bytes}-byte sink; raise total_bytes to at least "
                    f"{(first_page + 1) * pb} or lower page_size"
                )
            views, paged = _build_views(self.buffer, config.spec, config.page_size, num_pages)
            subpool = SubPool(
                config.name,
                config.spec,
                config.page_size,
                grow,
                config.layers,
                pb,
                num_pages,
                first_page,
                views,
                paged,
                max_pages,
            )
            reach = subpool.ids.limit(max_pages)  # the largest grid resize may reach
            if reach > INT32_LIMIT:
                limit = INT32_LIMIT // subpool.ids.limit(1) * pb
                what = "max_bytes" if elastic else "total_bytes"
                raise ValueError(
                    f"sub-pool {config.name!r}: kernel ids reach {reach} > 2**31 "
                    f"({max_pages} pages x {config.spec.blocks_per_page} blocks x page_size "
                    f"{config.page_size}); lower {what} to at most {limit} or split the "
                    "layers over more sub-pools"
                )
            self.subpools[config.name] = subpool

        self.band_limits: dict[str, tuple[int, int]] | None = None  # pages; None: unified
        if static_split is not None:
            split = check_static_split(static_split, names)
            self.band_limits = static_band_limits(
                self.subpools, split, self.sink_bytes, total_bytes
            )
        if max_request_tokens is not None:
            if not isinstance(max_request_tokens, int) or max_request_tokens <= 0:
                raise ValueError(
                    f"max_request_tokens must be a positive int or None, got {max_request_tokens!r}"
                )
            demand = {
                s.name: worst_case_pages(
                    s.spec, s.page_size, max_request_tokens, chunk_tokens, state_slots
                )
                for s in self.subpools.values()
            }
            self.alone_demand = demand
            if self.band_limits is not None:
                check_alone(self, demand, split, max_request_tokens)
            elif not self.fits(demand):
                need = sum(self.subpools[n].page_bytes * (d + 1) for n, d in demand.items())
                raise ValueError(
                    f"one worst-case request of {max_request_tokens} tokens cannot run alone: it "
                    f"needs pages {demand} and the {total_bytes}-byte pool cannot place them; "
                    f"raise total_bytes to about {need + self.sink_bytes} or lower max_request_tokens"
                )

        self.fill = POISON_BYTE if poison else 0
        self.backing: Backing | None = None
        if elastic:
            self.backing = backing if backing is not None else make_backing(self.device)
            # the whole reservation: the views' base, fixed for the pool's lifetime
            self.whole = self.backing.reserve(max_bytes + self.tail_pad_bytes)
            self._end = 0  # committed bytes: [0, _end), chunk-aligned
            self._commit_to(total_bytes)
            self.buffer = self.whole[: total_bytes + self.tail_pad_bytes]
        else:
            self.buffer = torch.full(
                (total_bytes + self.tail_pad_bytes,), self.fill, dtype=torch.uint8,
                device=self.device,
            )  # fmt: skip
            self.whole = self.buffer
        for s in self.subpools.values():
            s.views, s.paged_views = _build_views(self.whole, s.spec, s.page_size, s.max_pages)

    # -- geometry ---------------------------------------------------------------

    def __getitem__(self, name: str) -> SubPool:
        if name not in self.subpools:
            raise KeyError(f"no sub-pool {name!r}; the pool has {list(self.subpools)}")
        return self.subpools[name]

    def by_grow(self, grow: Grow) -> SubPool | None:
        return next((s for s in self.subpools.values() if s.grow == grow), None)

    def fits(
        self,
        demand: Mapping[str, int],
        up_floor: int | None = None,
        down_ceiling: int | None = None,
    ) -> bool:
        """Whether bands holding ``demand[name]`` pages each can be packed between
        ``up_floor`` and ``down_ceiling`` bytes (default: the sink floor and the
        top): the up-grower from the floor, the down-grower from the ceiling, the
        float band in the gap, each on its own page grid."""
        lo = self.sink_bytes if up_floor is None else up_floor
        hi = self.total_bytes if down_ceiling is None else down_ceiling
        up, down, flt = (self.by_grow(g) for g in (Grow.UP, Grow.DOWN, Grow.FLOAT))
        if up is not None and demand.get(up.name, 0):
            lo = (-(-lo // up.page_bytes) + demand[up.name]) * up.page_bytes
        if down is not None and demand.get(down.name, 0):
            hi = (hi // down.page_bytes - demand[down.name]) * down.page_bytes
        if flt is not None and demand.get(flt.name, 0):
            lo = (-(-lo // flt.page_bytes) + demand[flt.name]) * flt.page_bytes
        return lo <= hi

    # -- resizing (elastic pools; the allocator's ``resize`` calls this) ----------

    def check_resize(self, total_bytes: int) -> dict[str, int]:
        """ValueError unless this elastic pool may take ``total_bytes`` as its size
        (geometry only: what the bands hold is the allocator's question). Returns
        each grid's ``num_pages`` at that size."""
        if self.backing is None:
            raise ValueError(
                "resize needs an elastic pool: build it with max_bytes= (a reserved range)"
            )
        ok = isinstance(total_bytes, int) and not isinstance(total_bytes, bool)
        if not ok or not 0 < total_bytes <= self.max_bytes:
            raise ValueError(
                f"resize: total_bytes must be an int in (0, {self.max_bytes}] (max_bytes, the "
                f"reservation), got {total_bytes!r}"
            )
        pages = {}
        for name, sub in self.subpools.items():
            pages[name] = total_bytes // sub.page_bytes
            if pages[name] <= sub.first_page:
                raise ValueError(
                    f"resize: at {total_bytes} bytes sub-pool {name!r} fits no real page; "
                    f"the least is {(sub.first_page + 1) * sub.page_bytes}"
                )
        demand = self.alone_demand
        if demand is not None and not self.fits(demand, down_ceiling=total_bytes):
            raise ValueError(
                f"resize: one worst-case request (pages {demand}) could not run alone in "
                f"{total_bytes} bytes"
            )
        return pages

    def resize(self, total_bytes: int) -> None:
        """Move the top to ``total_bytes``: commit the chunks up to it plus the tail
        pad, or release those above (after the device finished every queued copy).
        The caller (``allocator.resize``) has emptied the bytes a shrink gives up."""
        pages = self.check_resize(total_bytes)
        if total_bytes >= self.total_bytes:
            self._commit_to(total_bytes)
        else:
            assert self.backing is not None, "resize: only an elastic pool resizes"
            end = round_up(total_bytes + self.tail_pad_bytes, self.backing.chunk)
            if self.device.type == "cuda":  # compaction copies may still read the chunks
                torch.cuda.synchronize(self.device)
            self.backing.release(end, self._end)
            self._end = end
        self.total_bytes = total_bytes
        self.buffer = self.whole[: total_bytes + self.tail_pad_bytes]
        for name, sub in self.subpools.items():
            sub.num_pages = pages[name]

    def _commit_to(self, total_bytes: int) -> None:
        assert self.backing is not None, "commit: only an elastic pool commits chunks"
        end = round_up(total_bytes + self.tail_pad_bytes, self.backing.chunk)
        if end > self._end:
            self.backing.commit(self._end, end)
            self.whole[self._end : end].fill_(self.fill)
            self._end = end

    # -- page moves -------------------------------------------------------------

    def move_pages(
        self,
        name: str,
        src_pages: PhysicalPageIds,
        dst_pages: PhysicalPageIds,
        *,
        check: bool = True,
        disjoint: bool = False,
    ) -> None:
        """Copy whole page envelopes ``src -> dst`` of sub-pool ``name``: one
        envelope copy per page. Every source is read before any destination is
        written. ``check`` validates on the host (a sync); the allocator, which
        keeps these invariants itself, passes ``check=False``. ``disjoint``: the
        caller promises no page is both a source and a destination (compaction:
        live pages into holes), so the copy runs in one pass, half the traffic."""
        subpool = self[name]
        src = expect(src_pages, PhysicalPageIds, "move_pages src_pages", name)
        dst = expect(dst_pages, PhysicalPageIds, "move_pages dst_pages", name)
        if check:
            self._check_move(subpool, src, dst)
        if src.numel() == 0:
            return
        if disjoint:
            self._copy_pages(self.buffer, src, dst, subpool.page_bytes, disjoint=True)
        else:
            self._copy_pages(self.buffer, src, dst, subpool.page_bytes)

    def _check_move(self, subpool: SubPool, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.shape != dst.shape or src.dim() != 1:
            raise ValueError(
                f"move_pages takes two 1-D page lists of one length, got {tuple(src.shape)} "
                f"and {tuple(dst.shape)}"
            )
        check_pages(subpool, src, "move_pages src pages", distinct=False)
        check_pages(subpool, dst, "move_pages dst pages")

    def zero_pages(self, name: str, pages: PhysicalPageIds) -> None:
        """Zero whole page envelopes of sub-pool ``name`` (one fill; no host sync).
        A new recurrent-state slot starts from zeros (docs/design.md section 8)."""
        subpool = self[name]
        ids = expect(pages, PhysicalPageIds, "zero_pages pages", name)
        rows = self.buffer[: subpool.num_pages * subpool.page_bytes].view(
            subpool.num_pages, subpool.page_bytes
        )  # (pages, envelope)
        rows.index_fill_(0, ids.long(), 0)

    def page_envelope(self, name: str, page: int) -> torch.Tensor:
        """The bytes of one physical page of sub-pool ``name`` (a view)."""
        subpool = self[name]
        if not 0 <= page < subpool.num_pages:
            raise ValueError(f"page must be in [0, {subpool.num_pages}), got {page}")
        start = page * subpool.page_bytes
        return self.buffer[start : start + subpool.page_bytes]
