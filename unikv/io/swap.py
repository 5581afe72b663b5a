"""Preemption by swap (issue 17): a preempted request's pages go to host slots
instead of being recomputed, and come back (one copy per envelope) when it is
readmitted.

    swap out (``Scheduler._preempt``)             swap in (readmission)
    request_pages(slot): per sub-pool the         new slot, pages reserved for its
    columns it holds (a window's live pages       ``num_cached`` tokens (chunked, the
    only; the state slot as column 0)       ->    window freed behind) and a state
    -> one host slot per page, then the           slot -> host slots copied into the
    request is freed (pages back to the pool)     pages now held, host slots freed

Cost rule (``SwapPolicy``): swap when ``bytes / d2h + bytes / h2d`` (measured
pinned-copy bandwidths) is below ``num_cached / prefill_tokens_per_s`` (the
prefill estimate of the prefix host's reload rule), else recompute; no free host
slots for every page: recompute. ``mode`` "swap" / "recompute" forces it.

Ordering: the offload's side stream waits for the current stream (the forward
that wrote the pages), and the current stream waits for the offload before any
later kernel (which may reuse the freed pages); a reload is waited for by the
current stream before the next forward reads it (``HostCopy.wait``: no host sync;
on CPU copies are synchronous). The host slots are split like the prefix host's
(``prefix_host_setup.host_slots``): one envelope of every token sub-pool per
page slot, a quarter of the bytes for state slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from unikv.ids import PhysicalPageIds
from unikv.io.host_tier import HostPageIds, HostTier

MODES = ("auto", "swap", "recompute")


@dataclass
class SwapPolicy:
    """Swap a preempted request out, or recompute it (module docstring)."""

    mode: str = "auto"
    d2h_bytes_per_s: float = 10e9
    h2d_bytes_per_s: float = 10e9
    prefill_tokens_per_s: float = 1e4

    def swap(self, num_bytes: int, num_tokens: int) -> bool:
        if self.mode not in MODES:
            raise ValueError(f"SwapPolicy.mode must be one of {MODES}, got {self.mode!r}")
        if self.mode != "auto":
            return self.mode == "swap"
        copy_s = num_bytes / self.d2h_bytes_per_s + num_bytes / self.h2d_bytes_per_s
        return copy_s < num_tokens / self.prefill_tokens_per_s


@dataclass
class SwapStats:
    """Swap counters since construction (host ints), ``swap_``-prefixed in ``counters()``."""

    swapped_out: int = 0  # requests swapped out on preemption
    swapped_in: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    declined: int = 0  # preemptions the cost rule chose to recompute
    no_room: int = 0  # preemptions recomputed for want of host slots
    dropped: int = 0  # swapped requests that ended while waiting


@dataclass
class Swapped:
    """A swapped-out request: ``num_cached`` tokens (and its state) on the host;
    ``slots[name] = (columns, host slots)`` (host int64, one slot per column)."""

    num_cached: int
    slots: dict[str, tuple[np.ndarray, np.ndarray]]
    num_bytes: int
    state_at: list[int] | None = field(default=None)  # the scheduler's checkpoint ends


class SwapSpace:
    """Host slots that preempted requests swap into.

    Args:
        alloc: the PoolAllocator (``request_pages``; its pool's sub-pools).
        num_slots: host page slots per token sub-pool; ``num_state_slots``: host
            slots of the Mamba sub-pool (0 without one).
        policy: the swap-or-recompute rule.
    """

    def __init__(self, alloc, num_slots: int, num_state_slots: int, policy: SwapPolicy):
        roles = alloc.view.roles
        self.alloc, self.policy, self.stats = alloc, policy, SwapStats()
        self.tiers = {n: HostTier(alloc.pool, n, num_slots) for n in roles.token_names}
        if roles.mamba_name is not None:
            self.tiers[roles.mamba_name] = HostTier(alloc.pool, roles.mamba_name, num_state_slots)
        self.held: dict[int, Swapped] = {}  # request id -> its host copy

    def counters(self) -> dict[str, int]:
        out = {f"swap_{k}": v for k, v in self.stats.__dict__.items()}
        return {**out, "swap_held_requests": len(self.held)}

    def swap_out(self, request_id: int, slot: int, num_cached: int) -> Swapped | None:
        """Copy the pages request ``slot`` holds (``num_cached`` tokens in) to host
        slots, when the rule says so and the slots are free; the caller frees the
        request. None: recompute it (nothing changed)."""
        pages = self.alloc.request_pages(slot)
        num_bytes = sum(len(p) * self.tiers[n].page_bytes for n, (_, p) in pages.items())
        if not num_cached or not self.policy.swap(num_bytes, num_cached):
            self.stats.declined += bool(num_cached)
            return None
        if any(self.tiers[n].num_free < len(p) for n, (_, p) in pages.items()):
            self.stats.no_room += 1
            return None
        slots = {}
        for name, (cols, ppages) in pages.items():
            if len(cols):
                ids = PhysicalPageIds(torch.from_numpy(ppages), name)
                copy = self.tiers[name].offload(ids, check=False)
                assert copy is not None, "swap: an offload finds the host slots it counted"
                copy.wait()  # later kernels (reusing the freed pages) run after the copy
                slots[name] = (cols, copy.host_slots.data.numpy())
        record = Swapped(num_cached, slots, num_bytes)
        self.held[request_id] = record
        self.stats.swapped_out += 1
        self.stats.swapped_out_bytes += num_bytes
        return record

    def swap_in(self, request_id: int, slot: int) -> None:
        """Copy request ``request_id``'s host pages into the pages request ``slot``
        holds now (reserved for its ``num_cached`` tokens, state slot bound) and
        free its host slots; the current stream waits for the copies."""
        record = self.held.pop(request_id)
        pages = self.alloc.request_pages(slot)
        for name, (cols, host) in record.slots.items():
            held_cols, ppages = pages[name]
            where = np.searchsorted(held_cols, cols)
            assert (where < len(held_cols)).all() and (held_cols[where] == cols).all(), (
                f"swap invariant: {name}: a swapped-in request holds every page it swapped out"
            )
            tier = self.tiers[name]
            dst = PhysicalPageIds(torch.from_numpy(ppages[where]), name)
            tier.reload(HostPageIds(torch.from_numpy(host)), dst, check=False).wait()
            tier.free(HostPageIds(torch.from_numpy(host)))
        self.stats.swapped_in += 1
        self.stats.swapped_in_bytes += record.num_bytes

    def drop(self, request_id: int) -> None:
        """Forget a swapped request that ended while waiting (its host slots freed)."""
        record = self.held.pop(request_id, None)
        if record is not None:
            for name, (_, host) in record.slots.items():
                self.tiers[name].free(HostPageIds(torch.from_numpy(host)))
            self.stats.dropped += 1

    def check_integrity(self) -> None:
        """Every tier's own invariants, and each USED host slot holds one page of
        one swapped request (host only; for tests and debug)."""
        for name, tier in self.tiers.items():
            tier.check_integrity()
            slots = [s for r in self.held.values() if name in r.slots for s in r.slots[name][1]]
            assert sorted(slots) == tier.used_slots(), (
                f"swap: {name}: the USED host slots are exactly the swapped requests' pages"
            )
        assert all(r.num_cached > 0 for r in self.held.values()), (
            "swap: a swapped request holds computed tokens"
        )


def build_swap_space(alloc, host_bytes: int, policy: SwapPolicy) -> SwapSpace:
    """A SwapSpace of ``host_bytes`` over ``alloc``'s pool (split by
    ``prefix_host_setup.host_slots``); ValueError when it holds no whole page."""
    from unikv.io.prefix_host_setup import host_slots

    subpools, roles = alloc.pool.subpools, alloc.view.roles
    token = {n: subpools[n].page_bytes for n in roles.token_names}
    mamba = roles.mamba_name
    state = subpools[mamba].page_bytes if mamba is not None else None
    num_slots, num_state_slots = host_slots(token, state, host_bytes, "swap_host_bytes")
    return SwapSpace(alloc, num_slots, num_state_slots, policy)
