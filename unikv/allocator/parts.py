"""The allocator's parts and how they are wired: each owns its state and holds
only parts below it (passed at construction, in dependency order), so the parts
form a tree without cycles; none holds the facade. A part that needs work from a
part above it gets it as a call argument (``StateCheckpoints.save``'s and
``PrefixCache.reload``'s ``reserve``), never as a stored reference. The graph,
checked against the object graph by ``tests/allocator/test_allocator_tree.py``:
docs/structure.md, "The allocator's parts".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from unikv.allocator.checkpoints import StateCheckpoints
from unikv.allocator.device import make_uploader
from unikv.allocator.fences import FenceQueue
from unikv.allocator.mamba import MambaSlots
from unikv.allocator.page_io import PageIO
from unikv.allocator.pages import PageBook
from unikv.allocator.prefix import PrefixCache
from unikv.allocator.requests import RequestTable, Roles, VirtualSpace
from unikv.allocator.room import Room, Shortfall
from unikv.allocator.step import PrepareStep, StepBuffers
from unikv.allocator.tables import TableWriter
from unikv.allocator.tokens import Tokens
from unikv.kernels.backend import KernelBackend
from unikv.pool import INT32_LIMIT, UnifiedPool


@dataclass(frozen=True)
class Parts:
    """The allocator's parts, for the facade, inspection, tests and
    ``check_integrity``; code outside the allocator uses the facade and the objects
    it hands out (``alloc.prefix``, ``alloc.io``). ``mamba`` is None without a Mamba
    sub-pool; ``states`` (the prefix cache's checkpoints, ``prefix.states``) None
    without one or without a token sub-pool."""

    roles: Roles
    requests: RequestTable
    vspace: VirtualSpace
    books: dict[str, PageBook]
    fences: FenceQueue
    writer: TableWriter
    room: Room
    tokens: Tokens
    io: PageIO
    mamba: MambaSlots | None
    steps: StepBuffers
    prefix: PrefixCache
    states: StateCheckpoints | None = None


def build_parts(
    pool: UnifiedPool,
    max_requests: int,
    max_context: int,
    num_virtual_pages: int | None,
    on_shortfall: Callable[[Shortfall], bool] | None,
    max_shortfall_rounds: int,
    backend: KernelBackend,
) -> Parts:
    """Every part of a PoolAllocator over ``pool`` (arguments: the allocator's)."""
    for what, value in (("max_requests", max_requests), ("max_context", max_context)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"PoolAllocator {what} must be a positive int, got {value!r}")
    if max_requests * max_context >= INT32_LIMIT:
        raise ValueError(
            f"max_requests * max_context = {max_requests * max_context} must stay below 2**31 "
            "(req_to_token is indexed with int32); lower one of them"
        )
    roles = _roles(pool)
    num_virtual = _virtual_size(pool, roles, num_virtual_pages, max_requests, max_context)
    requests = RequestTable(max_requests, max_context, roles.page_size, pool.device)
    vspace = VirtualSpace(num_virtual)
    books = {}
    # the pool's Mamba slots per request beyond the live one: speculative decoding's
    # per-draft-position slots (``UnifiedPool(state_slots=1 + k)``, ``mamba.py``)
    draft_state_slots = pool.state_slots - 1
    # Mamba ids: the sink, one per request slot, k draft slots per request, checkpoints
    ckpt_base = max_requests * (1 + draft_state_slots) + 1
    for s in pool.subpools.values():
        size = ckpt_base + s.max_pages if s.name == roles.mamba_name else num_virtual
        books[s.name] = PageBook(s, size, pool.device)
    for name in roles.windows:
        requests.add_window(name)
    fences = FenceQueue()
    token_books = [books[n] for n in roles.token_names]
    upload = make_uploader(pool.device)
    # the Mamba book's tables too: its writes join a step's one write (``TableWriter.batch``)
    state_books = [books[roles.mamba_name]] if roles.mamba_name is not None else []
    writer = TableWriter(requests.req_to_token, token_books + state_books, upload, backend)

    states = None
    if roles.mamba_name is not None and roles.owner is not None:
        states = StateCheckpoints(pool, books[roles.mamba_name], ckpt_base, fences, writer)
    prefix = PrefixCache(roles, requests, vspace, books, fences, writer, states)
    room = Room(
        pool, books, requests, vspace, fences, writer, on_shortfall, max_shortfall_rounds, prefix
    )
    mamba = None
    if roles.mamba_name is not None:
        mamba = MambaSlots(
            pool, books[roles.mamba_name], requests, fences, room, writer, states,
            draft_state_slots,
        )  # fmt: skip
    steps = StepBuffers(
        requests.req_to_token,
        token_books,
        roles.windows,
        roles.page_size,
        cast(PrepareStep, backend.prepare_step),
    )
    parts = Parts(
        roles, requests, vspace, books, fences, writer, room,
        Tokens(roles, requests, vspace, books, fences, room, writer, prefix),
        PageIO(roles, requests, vspace, books, fences, room, writer),
        mamba, steps, prefix, states,
    )  # fmt: skip
    return parts


def _roles(pool: UnifiedPool) -> Roles:
    token = [s for s in pool.subpools.values() if s.spec.kind != "mamba"]
    mamba = [s for s in pool.subpools.values() if s.spec.kind == "mamba"]
    if len(mamba) > 1:
        raise ValueError(f"at most one Mamba sub-pool is supported, got {[s.name for s in mamba]}")
    if len({s.page_size for s in token}) > 1:
        raise ValueError(
            "token sub-pools share virtual pages, so they need one page size; got "
            f"{ {s.name: s.page_size for s in token} }"
        )
    owner = next((s for s in token if s.spec.kind in ("full", "mla")), token[0] if token else None)
    return Roles(
        owner=owner.name if owner else None,
        token_names=tuple(s.name for s in token),
        mamba_name=mamba[0].name if mamba else None,
        windows={s.name: s.spec.sliding_window for s in token if s.spec.sliding_window},
        page_size=owner.page_size if owner else 1,
    )


def _virtual_size(
    pool: UnifiedPool, roles: Roles, given: object, max_requests: int, max_context: int
) -> int:
    if roles.owner is None:
        return 1
    owner = pool.subpools[roles.owner]
    if given is None:
        pages = -(-max_context // owner.page_size)
        given = max_requests * pages + 1 if owner.spec.sliding_window else owner.max_pages
    if not isinstance(given, int) or given < 2 or given * owner.page_size >= INT32_LIMIT:
        raise ValueError(
            f"num_virtual_pages must be an int in [2, 2**31 / page_size), got {given!r}"
        )
    return given
