"""Setting up the prefix cache's host tier (``prefix_host.py``): the byte budget
split into host slots, the measured H2D bandwidth of the reload rule, attaching it
to an allocator's prefix cache (``alloc.prefix.add_host_tier``), and its invariants
for ``check_integrity``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from unikv.allocator.prefix import HOST
from unikv.io.prefix_host import PrefixHost, ReloadPolicy


def host_slots(
    token_bytes: Mapping[str, int],
    state_bytes: int | None,
    host_bytes: int,
    what: str = "prefix_host_bytes",
):
    """(page slots per token sub-pool, state slots) of ``host_bytes``.

    A host node takes one envelope of every token sub-pool (``token_bytes``: page
    bytes by name); with a state sub-pool (``state_bytes``: one slot's bytes) a
    quarter of the bytes (at least one slot) holds states (checkpoints, or swapped
    requests' states). ValueError, naming the option ``what``, when that leaves no
    whole node."""
    if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < 0:
        raise ValueError(f"{what} must be an int >= 0 (0: off), got {host_bytes!r}")
    node = sum(token_bytes.values())
    states = max(1, host_bytes // 4 // state_bytes) if state_bytes else 0
    pages = (host_bytes - states * (state_bytes or 0)) // node if node else 0
    if pages < 1:
        need = node + (state_bytes or 0)
        raise ValueError(
            f"{what}={host_bytes} holds no whole page envelope: one page "
            f"takes {node} bytes ({dict(token_bytes)})"
            + (f" and the states at least {state_bytes}" if state_bytes else "")
            + f"; give at least {need} bytes, or 0 to turn the host tier off"
        )
    return pages, states


def measure_h2d_bytes_per_s(
    device: torch.device, num_bytes: int = 32 << 20, *, to_device: bool = True
) -> float:
    """Host-to-device (``to_device=False``: device-to-host) bandwidth of a pinned
    copy (CUDA) or a memcpy (CPU), one warm-up and three timed copies (start-up
    only: it syncs)."""
    cuda = device.type == "cuda"
    src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    if not to_device:
        src, dst = dst, src
    dst.copy_(src, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize(device)
    return 3 * num_bytes / max(time.perf_counter() - start, 1e-9)


def enable_prefix_host(alloc, host_bytes: int, policy: ReloadPolicy | None = None) -> PrefixHost:
    """Put a host tier of ``host_bytes`` (``host_slots``) behind the prefix cache of
    the PoolAllocator ``alloc``; returns it (``alloc.prefix.host``). ValueError on a
    budget without one whole node, or on a pool the prefix cache does not serve."""
    from unikv.io.host_tier import HostTier

    pool, roles = alloc.pool, alloc.view.roles

    def build(cache) -> PrefixHost:  # called once the cache said it serves this pool
        token_bytes = {n: pool.subpools[n].page_bytes for n in roles.token_names}
        mamba = roles.mamba_name
        state_bytes = pool.subpools[mamba].page_bytes if mamba is not None else None
        num_slots, num_state_slots = host_slots(token_bytes, state_bytes, host_bytes)
        tiers = {n: HostTier(pool, n, num_slots) for n in token_bytes}
        state_tier = HostTier(pool, mamba, num_state_slots) if mamba is not None else None
        return PrefixHost(tiers, state_tier, policy or ReloadPolicy())  # holds no part

    return alloc.prefix.add_host_tier(build)


def check_prefix_host(parts) -> None:
    """Invariants of the host tier behind the prefix cache (``parts``: the allocator's)."""
    prefix = parts.prefix
    host = prefix.host
    for tier in [*host.tiers.values(), *([host.state_tier] if host.state_tier else [])]:
        tier.check_integrity()
    assert all(
        prefix.by_id.get(i) is not None and prefix.by_id[i].page == HOST for i in host.nodes
    ), "host nodes are live nodes holding no device page"
    assert all(n.page != HOST or n.node_id in host.nodes for n in prefix.by_id.values()), (
        "every node without a device page has host slots"
    )
    assert len(host.nodes) <= host.capacity, "the host nodes fit the host slots"
    for name, tier in host.tiers.items():
        slots = [s[name] for s in host.nodes.values() if s[name] >= 0]
        assert len(set(slots)) == len(slots) and sorted(slots) == tier.used_slots(), (
            f"{name}: host slots are never aliased (each USED slot holds one host node)"
        )
    if host.state_tier is not None:
        slots = list(host.ckpts.values())
        assert len(set(slots)) == len(slots) and sorted(slots) == host.state_tier.used_slots(), (
            "host checkpoint slots are never aliased (each USED slot holds one checkpoint)"
        )
        assert not set(host.ckpts) & set(prefix.states.by_node), (
            "a node's checkpoint lives in one place (device or host)"
        )
    assert all(prefix.reachable(i) for i in [*host.nodes, *host.ckpts]), (
        "host nodes and host checkpoints are reachable from the root"
    )
    assert not host.held, "no reload holds host nodes between verbs"
