"""PoolAllocator: every sub-pool of a UnifiedPool, sharing one buffer (the chain).

    byte 0                                                          total_bytes
    | sink | UP band ->  | free | <- FLOAT -> | free |   <- DOWN band |
                        frontiers move at run time; bands stay byte-disjoint

Roles (docs/design.md section 5): full attention (or MLA) is the id owner and mints
virtual pages; every other token sub-pool (SWA) binds the owner's virtual pages
to physical pages of its own grid; with only SWA sub-pools the first is the
owner. A Mamba sub-pool has one slot per request (virtual id = request slot + 1).

The facade composes ``parts.py``'s tree (docs/structure.md), hands out ``prefix``, ``io``
and ``view`` (``verbs.py``); each verb's contract is on the part implementing it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np
import torch

from unikv.allocator.integrity import check_chain
from unikv.allocator.mamba import MambaSlots, rollback
from unikv.allocator.pages import PageBook
from unikv.allocator.parts import build_parts
from unikv.allocator.prefix import PrefixHit
from unikv.allocator.room import Shortfall
from unikv.allocator.step import DecodeStep
from unikv.allocator.tokens import StagedGrow
from unikv.allocator.translate import check_block_table, check_tombstones, translate
from unikv.allocator.verbs import hand_out
from unikv.ids import (
    KernelIds,
    KernelPageIds,
    PhysicalPageIds,
    PhysicalTokenIds,
    VirtualTokenIds,
    expect,
)
from unikv.kernels.backend import KernelBackend, get_backend
from unikv.layout import IdMap
from unikv.pool import UnifiedPool


class PoolAllocator:
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
        backend: the kernel ops for table writes, translation and block tables
            (default ``unikv.kernels.get_backend(pool.device)``).
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
        backend: KernelBackend | None = None,
    ) -> None:
        backend = backend or get_backend(pool.device)  # decided once
        self.pool = pool
        self.parts = build_parts(
            pool, max_requests, max_context, num_virtual_pages, on_shortfall,
            max_shortfall_rounds, backend,
        )  # fmt: skip
        self._debug = debug
        self.prefix, self.io, self.view = hand_out(pool, self.parts, debug)
        self._translate_ids = cast(Callable[..., torch.Tensor], backend.translate_ids)
        self._build_block_table = backend.build_block_table
        books = [self.parts.books[n] for n in self.parts.roles.token_names]
        self._ids = {b.name: IdMap(b.page_size, b.blocks_per_page) for b in books}

    # -- allocating ---------------------------------------------------------------------

    def new_request(self, prefix: PrefixHit | None = None) -> int:
        """Open a request slot (host int) with no tokens, or holding the shared
        pages of ``prefix`` (an ``alloc.prefix.match`` hit, taken right before: its
        ``num_tokens`` tokens; the request writes from its next page on)."""
        slot = self.parts.requests.open()
        if slot is None:
            raise ValueError(
                f"all {self.parts.requests.max_requests} request slots are open; free a "
                "request or raise max_requests"
            )
        if prefix is not None:
            self.parts.writer.stage(self.parts.prefix.attach(slot, prefix))  # (closes it on error)
            self._after_verb()
        return slot

    def alloc_extend(
        self, slots: object, prefix_lens: object, extend_lens: object
    ) -> VirtualTokenIds | None:
        """``extend_lens[i]`` tokens after the ``prefix_lens[i]`` each request holds
        ((B,) host ints): (sum ext,) int32 virtual token ids on the device, or None
        (state unchanged). Contract: ``tokens.Tokens.stage_extend``."""
        return self._grow(self.parts.tokens.stage_extend, slots, prefix_lens, extend_lens)

    def alloc_decode(self, slots: object, seq_lens: object) -> VirtualTokenIds | None:
        """One new token per request at position ``seq_lens[i]`` (the length BEFORE
        it). slots, seq_lens: (B,) host integer arrays. Returns (B,) int32 virtual
        token ids on the device, or None (state unchanged)."""
        tokens = self.parts.tokens
        return self._grow(tokens.stage_decode, *tokens.decode_args(slots, seq_lens, "alloc_decode"))

    def _grow(
        self, stage: Callable[..., StagedGrow | None], *args: object
    ) -> VirtualTokenIds | None:
        with self.parts.writer.batch():  # what made room goes out with the grow's write
            staged = stage(*args)
            if staged is None:
                return None
            written = self.parts.writer.write(staged.patch)
        self._after_verb()
        return VirtualTokenIds(written[staged.token_ids])

    def alloc_mamba(self, slots: object) -> PhysicalPageIds | None:
        """One zeroed state slot per request in ``slots`` ((B,) host ints, requests
        without one); the (B,) physical slots on the device, or None (state unchanged)."""
        phys = self._mamba("alloc_mamba").alloc(slots)
        if phys is not None:
            self._after_verb()
        return phys

    def mamba_slots(self, req_slots: torch.Tensor, drafts: bool = False) -> PhysicalPageIds:
        """(B,) device request slots' state slots (0: the sink); ``drafts``: (B, k). No sync."""
        return self._mamba("mamba_slots").slots(req_slots, drafts)

    def _mamba(self, what: str) -> MambaSlots:
        if self.parts.mamba is None:
            raise ValueError(f"{what}: this pool has no Mamba sub-pool")
        return self.parts.mamba

    def decode_step(
        self,
        slots: object,
        seq_lens: object,
        *,
        block_tables: Mapping[str, torch.Tensor] | None = None,
        write_ids: Mapping[str, torch.Tensor] | None = None,
    ) -> DecodeStep | None:
        """``alloc_decode``, ``free_out_of_window(slots, seq_lens + 1)``, ``block_table``
        and ``translate`` per token sub-pool in one upload and two launches; a
        ``DecodeStep``, or None (state unchanged). Buffers: ``step.StepBuffers.get``."""
        parts = self.parts
        if parts.roles.owner is None:
            raise ValueError("decode_step: this pool has no token sub-pool")
        slots, seq = parts.tokens.decode_args(slots, seq_lens, "decode_step")
        new_lens, bsz = seq + 1, len(slots)
        targets, run, books = parts.steps.get(
            bsz, int(new_lens.max()) if bsz else 1, block_tables, write_ids
        )
        with parts.writer.batch():  # the step's one table write: with what made room
            staged = parts.tokens.stage_decode(slots, seq)
            if staged is None:
                return None
            parts.tokens.stage_window_frees(slots, new_lens, staged.patch)
            slot_part, lens_part = staged.patch.part(slots), staged.patch.part(new_lens)
            written = parts.writer.write(staged.patch)
        req_slots, lens_dev = written[slot_part], written[lens_part]
        build = parts.steps.builder(run, targets, req_slots, lens_dev, self._debug, books)
        build()
        self._after_verb()
        virtual_ids = VirtualTokenIds(written[staged.token_ids])
        step = parts.steps.result(virtual_ids, req_slots, lens_dev, targets, books)
        step.moves, step.rebuild = parts.writer.moves, build
        step.count_moves = lambda: parts.writer.moves  # pages moved since: step.refresh()
        return step

    # -- freeing ------------------------------------------------------------------------

    def free_request(self, slots: int | object, defer: bool = False) -> None:
        """Free and close request ``slots`` (an int) or each of ``slots`` (host ints:
        those finishing in one step) in one table write (``Tokens.free_requests``);
        ``defer``: in none, with the next one (``TableWriter.batch(hold=True)``)."""
        with self.parts.writer.batch(hold=defer):  # pages and state slots: one write
            checked = self.parts.tokens.free_requests(slots)  # (checked first)
            if self.parts.mamba is not None:
                self.parts.mamba.free_bound((checked + 1).astype(np.int32))
        self._after_verb()

    def free_out_of_window(self, slots: object, seq_lens: object) -> None:
        """Free the sliding-window pages no query at position >= seq_lens[i] - 1 can
        see ((B,) host ints; the owner's virtual pages live on). Contract:
        ``tokens.Tokens.stage_out_of_window``."""
        self.parts.writer.stage(self.parts.tokens.stage_out_of_window(slots, seq_lens))
        self._after_verb()

    def truncate(self, slots: object, new_lens: object, state_rows: object = None) -> None:
        """Free each request's tokens beyond ``new_lens[i]`` (whole pages past the tail;
        (B,) host ints); a cut into pages of a windowed sub-pool freed out of the window
        is refused. ``state_rows``: a verify step's state rollback (``mamba.rollback``)."""
        select = rollback(self.parts.mamba, slots, state_rows)  # checked first
        self.parts.writer.stage(self.parts.tokens.stage_truncate(slots, new_lens))
        select()
        self._after_verb()

    # -- lookups --------------------------------------------------------------------------

    def translate(
        self,
        virtual_ids: VirtualTokenIds,
        name: str,
        out: torch.Tensor | None = None,
        *,
        physical: bool = False,
    ) -> KernelIds | PhysicalTokenIds:
        """Kernel ids (``physical``: physical token ids ``P * ps + tv % ps``) of token
        sub-pool ``name`` for (n,) device virtual token ids; padding and tombstones
        go to the sink. One launch; ``out`` rules: ``translate.translate``."""
        ids = expect(virtual_ids, VirtualTokenIds, "translate")
        book, idmap = self._token_book(name, "translate"), self._ids[name]
        if self._debug:
            check_tombstones(ids, book.v2p, book.page_size, name)
        mult = idmap.page_size if physical else idmap.multiplier
        result = translate(self._translate_ids, ids, book.v2p, book.page_size, mult, out)
        return PhysicalTokenIds(result, name) if physical else KernelIds(result, name)

    def block_table(
        self,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        name: str,
        out: torch.Tensor,
        window: int = 0,
    ) -> KernelPageIds:
        """Kernel page entries of token sub-pool ``name`` into ``out`` (B, max_pages) int32.

        req_slots, seq_lens: (B,) int32 device tensors (request slots, tokens in the
        cache). window: 0, or W to zero pages wholly before ``seq_len - W``."""
        book, r2t = self._token_book(name, "block_table"), self.parts.requests.req_to_token
        self._build_block_table(
            r2t, req_slots, seq_lens, book.v2p, page_size=book.page_size,
            blocks_per_page=book.blocks_per_page, out=out, window=window,
        )  # fmt: skip
        if self._debug:
            w = self.parts.roles.windows.get(name, 0)
            check_block_table(out, r2t, req_slots, seq_lens, book.v2p, book.page_size, w, name)
        return KernelPageIds(out, name)

    def _token_book(self, name: str, what: str) -> PageBook:
        if name not in self.parts.books:
            raise KeyError(f"no sub-pool {name!r}; the allocator has {list(self.parts.books)}")
        book = self.parts.books[name]
        if name not in self._ids:
            raise ValueError(f"{what}: {name!r} is a Mamba sub-pool; use mamba_slots")
        return book

    def request_pages(self, slot: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per sub-pool: (page columns ``slot`` still holds, their physical pages), int64."""
        return self.parts.tokens.request_pages(slot)

    # -- capacity and fences ---------------------------------------------------------------

    def can_admit(self, demand: Mapping[str, int]) -> tuple[bool, bool]:
        """Whether ``demand`` (new pages per sub-pool name; pages of the owner are
        new virtual pages too) can be met now (no page moves) and after
        compaction. An allocation succeeds exactly when the second is True."""
        new = self.parts.room.check_demand(demand)
        owner = self.parts.roles.owner
        return self.parts.room.can_admit(new, new.get(owner, 0) if owner else 0)

    def mark_in_flight(self, event: Any = None) -> None:
        """A forward over the live pages was enqueued; ``event`` (or None: it ran)
        fires when it is done (``fences.FenceQueue.mark_in_flight``)."""
        self.parts.fences.mark_in_flight(event)

    def compact(self) -> int:
        """Idle-time compaction: wait for the forward fences, then pack every band
        tight (live pages into holes, frontiers back). Returns the pages moved."""
        return self.parts.room.compact()

    def resize(self, total_bytes: int) -> int:
        """An elastic pool's top to ``total_bytes``; the pages moved (slow path, between
        steps; ``room.Room.resize``: ValueError, nothing changed, if they do not fit)."""
        moved = self.parts.room.resize(total_bytes)
        self._after_verb()
        return moved

    def check_integrity(self) -> None:
        """Verify every invariant (host syncs); AssertionError names the broken one."""
        check_chain(self.pool, self.parts)

    def _after_verb(self) -> None:
        if self._debug:
            self.check_integrity()
