"""Shared builders for the allocator tests: tiny pools of 2 and 3 sub-pools whose
page envelopes all differ in size, a fake done-event, and a state snapshot,
and ``same_start`` (a state machine's initial rule run once, forked into each example)."""

from __future__ import annotations

import copy
import functools
import hashlib
from collections.abc import Callable

import numpy as np
import torch

from unikv.allocator import PoolAllocator
from unikv.ids import PhysicalPageIds, VirtualPageIds
from unikv.pool import Grow, SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MambaSpec, MHASpec, MLASpec, StatePart

WINDOW = {1: 5, 4: 10, 16: 40}  # sliding window per page size (not a multiple of it)


def full_config(ps: int, grow: Grow | None = None) -> SubPoolConfig:
    return SubPoolConfig("full", MHASpec(1, 1, 2, dtype=torch.float32), page_size=ps, grow=grow)


def swa_config(ps: int, grow: Grow | None = None) -> SubPoolConfig:
    spec = MHASpec(1, 1, 3, dtype=torch.float32, sliding_window=WINDOW[ps])
    return SubPoolConfig("swa", spec, page_size=ps, grow=grow)


def mla_config(ps: int) -> SubPoolConfig:
    return SubPoolConfig("mla", MLASpec(2, 3, 2, dtype=torch.float32), page_size=ps)


def mamba_config() -> SubPoolConfig:
    return SubPoolConfig("mamba", MambaSpec(1, (StatePart((3,)),), StatePart((5,))))


CHAINS = {
    "full+swa": lambda ps: [full_config(ps), swa_config(ps)],
    "full+swa+mamba": lambda ps: [full_config(ps), swa_config(ps), mamba_config()],
    "full+mamba": lambda ps: [full_config(ps), mamba_config()],
    "swa+mamba": lambda ps: [swa_config(ps), mamba_config()],
    "mla+swa": lambda ps: [mla_config(ps), swa_config(ps, Grow.UP)],
}

PAGES = {"full": 14, "swa": 7, "mamba": 6, "mla": 10}


def build(chain: str, ps: int, *, requests: int = 4, context: int | None = None, **kwargs):
    """(pool, allocator) for a named chain; bytes for PAGES pages side by side."""
    configs = CHAINS[chain](ps)
    total = pool_bytes_for(configs, {c.name: PAGES[c.name] for c in configs})
    pool = UnifiedPool(configs, total)
    context = context or (10 * ps if ps > 1 else 24)
    return pool, PoolAllocator(pool, max_requests=requests, max_context=context, **kwargs)


class FakeEvent:
    """A done-event under test control (query/synchronize like torch.cuda.Event)."""

    def __init__(self) -> None:
        self.fired = False

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        self.fired = True


def snapshot(alloc: PoolAllocator) -> str:
    """A digest of every piece of allocator state, host and device."""
    digest = hashlib.sha256()
    parts = [
        alloc.parts.requests.in_use,
        alloc.parts.requests.lens,
        alloc.parts.requests.pages,
        alloc.parts.vspace.owner,
        np.sort(alloc.parts.vspace.free_ids()),
        alloc.parts.requests.req_to_token.cpu().numpy(),
    ]
    parts += list(alloc.parts.requests.window_lo.values())
    for sub in alloc.parts.books.values():
        parts += [
            sub.v2p_host,
            sub.p2v_host,
            sub.state,
            sub.pins,
            np.sort(sub.free_ids()),
            np.array([sub.lo, sub.hi, sub.num_live, sub.num_pending]),
            sub.v2p.cpu().numpy(),
            sub.p2v.cpu().numpy(),
        ]
    for part in parts:
        digest.update(np.ascontiguousarray(part).tobytes())
    digest.update(alloc.pool.buffer.numpy().tobytes())
    return digest.hexdigest()


def churn(
    alloc: PoolAllocator,
    rng: np.random.Generator,
    steps: int,
    *,
    pins: bool = True,
    events: bool = True,
) -> list[FakeEvent]:
    """Drive ``alloc`` through random extends, decodes, frees, window frees, pins
    and fenced releases, leaving holes behind. Returns the outstanding events."""
    open_, outstanding = [], []
    for _ in range(steps):
        op = rng.integers(0, 8)
        if op == 0 and len(open_) < alloc.parts.requests.max_requests:
            open_.append(alloc.new_request())
        elif op in (1, 2) and open_:
            slot = int(rng.choice(open_))
            held = int(alloc.parts.requests.lens[slot])
            ext = int(rng.integers(1, 3 * alloc.parts.roles.page_size + 1))
            if held + ext <= alloc.parts.requests.max_context:
                alloc.alloc_extend(np.array([slot]), np.array([held]), np.array([ext]))
            if (
                alloc.parts.roles.mamba_name
                and alloc.parts.books[alloc.parts.roles.mamba_name].v2p_host[slot + 1] < 0
            ):
                alloc.alloc_mamba(np.array([slot]))
        elif op == 3 and open_:
            slot = open_.pop(int(rng.integers(len(open_))))
            alloc.free_request(slot)
        elif op == 4 and open_ and alloc.parts.roles.windows:
            slots = np.array(open_)
            alloc.free_out_of_window(slots, alloc.parts.requests.lens[slots])
        elif op == 5 and pins:
            names = alloc.parts.roles.token_names
            sub = alloc.parts.books[names[int(rng.integers(len(names)))]]
            live = np.flatnonzero(sub.state == 2)
            if len(live):
                alloc.io.pin(
                    sub.name, PhysicalPageIds(torch.tensor([int(rng.choice(live))]), sub.name)
                )
        elif op == 6 and events:
            event = FakeEvent()
            alloc.mark_in_flight(event)
            outstanding.append(event)
        elif op == 7 and open_ and events:
            slot = int(rng.choice(open_))
            vpages = alloc.parts.requests.pages[
                slot, : int(alloc.parts.requests.num_pages(np.array([slot]))[0])
            ]
            sub = alloc.parts.books[alloc.parts.roles.owner]
            bound = [v for v in vpages if sub.v2p_host[v] >= 0 and sub.pins[sub.v2p_host[v]] == 0]
            if bound:
                event = FakeEvent()
                alloc.io.release_physical(
                    sub.name, VirtualPageIds(torch.tensor(bound[:1])), fence=event
                )
                outstanding.append(event)
    return [e for e in outstanding if not e.fired]


_STARTS: dict[type, dict] = {}  # machine class -> its fields after its first start


def same_start(machine, build: Callable[[], None]) -> None:
    """A state machine's ``@initialize`` rule that draws nothing (so every example
    starts the same): ``build`` runs once per machine class, its debug-mode checks
    with it, and each later example starts from a fork of the fields it left (those
    ``RuleBasedStateMachine.__init__`` did not set)."""
    start = _STARTS.get(type(machine))
    if start is None:
        build()
        start = _STARTS[type(machine)] = fork(_own_fields(machine))
    vars(machine).update(fork(start))


def _own_fields(machine) -> dict:
    from hypothesis.stateful import RuleBasedStateMachine

    probe = object.__new__(type(machine))
    RuleBasedStateMachine.__init__(probe)
    return {k: v for k, v in vars(machine).items() if k not in vars(probe)}


def fork(fields: dict) -> dict:
    """A deep copy of a machine's fields (a pool, its allocator, the test's shadows)
    that keeps aliasing: torch views stay views of their storage's copy (torch's own
    deepcopy), numpy views views of their base's copy (numpy's deepcopy copies a view
    alone, e.g. the request table's flat view of its pages)."""
    memo: dict = {}
    for a in _arrays(fields, set()):
        if isinstance(a.base, np.ndarray):
            base = copy.deepcopy(a.base, memo)
            offset = a.__array_interface__["data"][0] - a.base.__array_interface__["data"][0]
            memo[id(a)] = np.ndarray(a.shape, a.dtype, base, offset, a.strides)
    return copy.deepcopy(fields, memo)


def _arrays(obj, seen: set) -> list[np.ndarray]:
    """The numpy arrays reachable from ``obj`` through containers, partials and
    this project's objects (unikv's and the tests')."""
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return [obj]
    if isinstance(obj, dict):
        kids = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        kids = list(obj)
    elif isinstance(obj, functools.partial):
        kids = [*obj.args, *obj.keywords.values()]
    elif type(obj).__module__.startswith(("unikv.", "test_", "allocator_fixtures")):
        kids = list(getattr(obj, "__dict__", {}).values())
        kids += [getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)]
    else:
        return []
    return [a for kid in kids for a in _arrays(kid, seen)]
