"""The allocator's parts form a tree (issue 43): the object graph of a built
``PoolAllocator`` has no cycle and equals the table docs/structure.md draws.

Oracle: the objects themselves. An edge ``a -> b`` is a path from part ``a`` to part
``b`` through instance attributes, containers, closures, bound methods and partials
that passes no other part; the documented table is a second, hand-written
description of the same graph. The cycle finder is shown to find the wiring this
replaced (a lambda over the room held by the checkpoints).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from allocator_fixtures import build, churn

from unikv.io.prefix_host import ReloadPolicy
from unikv.io.prefix_host_setup import enable_prefix_host

ROOT = pathlib.Path(__file__).resolve().parents[2]
PUBLIC = {"prefix": "PrefixVerbs", "io": "IOVerbs", "view": "AllocatorView"}


def documented() -> dict[str, set[str]]:
    """The table under "holder  holds" in docs/structure.md, as {holder: parts}."""
    text = (ROOT / "docs/structure.md").read_text()
    block = text.split("    holder         holds\n", 1)[1].split("\n\n", 1)[0]
    table = {}
    for line in block.splitlines():
        holder, *held = line.split()
        table[holder] = set() if held == ["-"] else set(held)
    return table


def nodes_of(alloc, extra: dict[str, object] | None = None) -> dict[str, list[object]]:
    """Node name -> its objects: every part (each sub-pool's PageBook is ``books``),
    the objects the facade hands out, and ``extra``."""
    parts = alloc.parts
    nodes = {f.name: [getattr(parts, f.name)] for f in dataclasses.fields(parts)}
    nodes = {name: objs for name, objs in nodes.items() if objs[0] is not None}
    nodes["books"] = [parts.books, *parts.books.values()]
    nodes |= {name: [getattr(alloc, attr)] for attr, name in PUBLIC.items()}
    return nodes | {name: [obj] for name, obj in (extra or {}).items()}


def children(obj: object) -> list[object]:
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        return cells + list(obj.__defaults__ or ())
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    out = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    return out + [getattr(obj, n) for n in getattr(type(obj), "__slots__", ()) if hasattr(obj, n)]


def _filled(cell: types.CellType) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True


def held(root: object, names: dict[int, str]) -> set[str]:
    """The nodes ``root`` reaches without passing another node."""
    found, seen, stack = set(), {id(root)}, children(root)
    while stack:
        obj = stack.pop()
        if id(obj) in names:
            if names[id(obj)] != names[id(root)]:
                found.add(names[id(obj)])
            continue
        if id(obj) in seen or isinstance(obj, (torch.Tensor, np.ndarray, type, types.ModuleType)):
            continue
        seen.add(id(obj))
        stack.extend(children(obj))
    return found


def graph(alloc, extra: dict[str, object] | None = None) -> dict[str, set[str]]:
    """Each node's held nodes (``held``)."""
    nodes = nodes_of(alloc, extra)
    names = {id(obj): name for name, objs in nodes.items() for obj in objs}
    return {name: set().union(*(held(o, names) for o in objs)) for name, objs in nodes.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``edges`` as a node list, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_object_graph_is_the_documented_tree():
    _, alloc = build("full+swa+mamba", 4)  # every part
    churn(alloc, np.random.default_rng(3), 40)
    assert graph(alloc) == documented()
    assert cycle(graph(alloc)) is None


def test_in_debug_mode_the_handed_out_objects_hold_the_check_alone():
    """Debug mode: ``alloc.prefix`` and ``alloc.io`` also hold the debug check, a
    partial over the pool and ``Parts`` (every part), not the facade: the parts
    below keep their edges, and still no cycle."""
    _, alloc = build("full+swa+mamba", 4, debug=True)
    edges, docs = graph(alloc, {"Parts": alloc.parts}), documented()
    every = {f.name for f in dataclasses.fields(alloc.parts)}
    assert edges.pop("Parts") == every
    assert edges.pop("PrefixVerbs") == docs.pop("PrefixVerbs") | {"Parts"}
    assert edges.pop("IOVerbs") == docs.pop("IOVerbs") | {"Parts"}
    assert edges == docs


@pytest.mark.parametrize("chain", ["full+swa", "full+mamba", "swa+mamba", "mla+swa"])
def test_every_chain_is_acyclic_and_within_the_documented_edges(chain):
    _, alloc = build(chain, 4)
    edges, docs = graph(alloc), documented()
    assert cycle(edges) is None
    for holder, parts in edges.items():  # a chain without a Mamba sub-pool has fewer
        assert parts <= docs[holder], f"{holder} holds {parts - docs[holder]} undocumented"


def test_a_planted_back_reference_is_a_cycle():
    """The pre-issue-43 wiring: the checkpoints held a lambda over the room."""
    _, alloc = build("full+swa+mamba", 4)
    states, room = alloc.parts.states, alloc.parts.room
    states.reserve = lambda new: room.reserve(new, callback=False, evict_pages=False)
    try:
        edges = graph(alloc)
        assert "room" in edges["states"] and edges != documented()
        assert cycle(edges) in (
            ["prefix", "states", "room", "prefix"],
            ["room", "prefix", "states", "room"],
            ["states", "room", "prefix", "states"],
        )
    finally:
        del states.reserve


def test_with_the_host_tier_attached_there_is_no_cycle():
    """The prefix cache's host tier (an io object) holds no allocator part: the cache
    passes itself where the tier reads or changes it. Attached, it is held by
    ``prefix`` and ``states`` only, and the graph stays acyclic (issue 43 item 7)."""
    for chain in ("full+mamba", "full+swa+mamba"):
        _, alloc = build(chain, 4)
        host = enable_prefix_host(alloc, 1 << 16, ReloadPolicy(mode="always"))
        churn(alloc, np.random.default_rng(5), 40)  # the parts' containers filled
        edges = graph(alloc, {"host": host})
        assert edges["host"] == set(), edges["host"]
        assert {k for k, v in edges.items() if "host" in v} == {"prefix", "states"}
        assert cycle(edges) is None
        assert {k: v - {"host"} for k, v in edges.items() if k != "host"} == documented()


def test_a_host_tier_holding_the_cache_is_a_cycle():
    """The wiring this replaced (the tier held the cache it extends) is a cycle the
    finder sees: prefix -> host -> prefix."""
    _, alloc = build("full+mamba", 4)
    host = enable_prefix_host(alloc, 1 << 16, ReloadPolicy(mode="always"))
    host.prefix = alloc.parts.prefix
    try:
        edges = graph(alloc, {"host": host})
        assert edges["host"] == {"prefix"}
        assert cycle(edges) in (["host", "prefix", "host"], ["prefix", "host", "prefix"])
    finally:
        del host.prefix


def test_importing_the_allocator_imports_no_triton():
    """Device-side code (uploads, the step kernel) stays behind lazy imports."""
    code = "import sys, unikv.allocator; assert 'triton' not in sys.modules, 'triton'"
    run = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
