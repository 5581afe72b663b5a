"""Shared builders for the allocator tests: tiny pools of 2 and 3 sub-pools whose
page envelopes all differ in size, a fake done-event, and a state snapshot."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from unikv.allocator import PoolAllocator
from unikv.pool import Grow, SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MambaSpec, MHASpec, MLASpec, StatePart

WINDOW = {1: 5, 16: 40}  # sliding window per page size (not a multiple of it)


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
    parts = [alloc.requests.in_use, alloc.requests.lens, alloc.requests.pages,
             alloc.vspace.owner, np.sort(alloc.vspace.free_ids()), alloc.req_to_token.cpu().numpy()]
    parts += list(alloc.requests.window_lo.values())
    for sub in alloc.subs.values():
        parts += [sub.v2p_host, sub.p2v_host, sub.state, sub.pins, np.sort(sub._stack[: sub.num_free]),
                  np.array([sub.lo, sub.hi, sub.num_live, sub.num_pending]),
                  sub.v2p.cpu().numpy(), sub.p2v.cpu().numpy()]
    for part in parts:
        digest.update(np.ascontiguousarray(part).tobytes())
    digest.update(alloc.pool.buffer.numpy().tobytes())
    return digest.hexdigest()
