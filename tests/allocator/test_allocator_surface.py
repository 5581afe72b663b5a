"""The allocator's shape (review R1, "done when"): a facade of at most 22 public
members (R1's 18, plus issue 43's ``prefix``, ``io``, ``view`` and ``resize``, which
replaced every read of ``alloc.parts`` outside the allocator), parts that never reach back to the facade, and classes that read only
the ``self.`` attributes they assign themselves.

Each check is run once against a planted defect first, so it can fail.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import types

import numpy as np
import pytest
import torch
from allocator_fixtures import FakeEvent, build, churn, full_config

import unikv.allocator as allocator_package
from unikv.allocator import PoolAllocator
from unikv.pool import UnifiedPool, pool_bytes_for

ALLOCATOR_DIR = pathlib.Path(allocator_package.__file__).parent

# The review's core verbs and the engine's: the budget may not be met by dropping them.
REQUIRED = {
    "new_request", "alloc_extend", "alloc_decode", "decode_step", "free_request",
    "free_out_of_window", "truncate", "translate", "block_table", "can_admit", "compact",
    "mark_in_flight", "alloc_mamba", "mamba_slots", "request_pages", "check_integrity",
}  # fmt: skip


def public_members(alloc: PoolAllocator) -> set[str]:
    """Public names of the class (methods, properties, class attributes, along the
    MRO below ``object``) and of the instance."""
    names = set()
    for cls in type(alloc).__mro__[:-1]:
        names |= set(vars(cls))
    names |= set(vars(alloc))
    return {n for n in names if not n.startswith("_")}


def busy(chain: str, steps: int = 120, **kwargs) -> PoolAllocator:
    """An allocator driven through every kind of verb, with fences outstanding."""
    _, alloc = build(chain, 4, **kwargs)
    churn(alloc, np.random.default_rng(7), steps)
    alloc.mark_in_flight(FakeEvent())
    return alloc


def busy_prefix() -> PoolAllocator:
    """A full-attention allocator (debug) with cached, shared and evictable prefix pages."""
    configs = [full_config(4)]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": 14}))
    alloc = PoolAllocator(pool, max_requests=4, max_context=40, debug=True)
    for prompt in (np.arange(13), np.arange(100, 108)):
        a = alloc.new_request()
        alloc.alloc_extend(np.array([a]), np.array([0]), np.array([len(prompt)]))
        alloc.prefix.insert(a, prompt)
        b = alloc.new_request(prefix=alloc.prefix.match(prompt[:-1]))
        held = int(alloc.parts.requests.lens[b])
        alloc.alloc_extend(np.array([b]), np.array([held]), np.array([len(prompt) - held]))
        alloc.free_request(a)
    alloc.free_request(b)  # the second prompt's pages: cached, evictable
    stats = alloc.prefix.counters()
    assert stats["pages"] == 5 and stats["evictable"] == 2 and stats["hit_tokens"] == 16, stats
    alloc.mark_in_flight(FakeEvent())
    return alloc


def reaches(root: object, target: object) -> list[str]:
    """Paths from ``root`` to ``target`` through instance ``__dict__``s, slots,
    containers, dataclass fields, closures, bound methods and partials (tensors and
    arrays are leaves). Empty when there is none."""
    found, seen, stack = [], set(), [(root, "part")]
    while stack:
        obj, path = stack.pop()
        if obj is target:
            found.append(path)
            continue
        if id(obj) in seen or isinstance(obj, (torch.Tensor, np.ndarray, type, types.ModuleType)):
            continue
        seen.add(id(obj))
        children: list[tuple[object, str]] = []
        if isinstance(obj, dict):
            children = [(v, f"{path}[{k!r}]") for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        elif isinstance(obj, types.MethodType):
            children = [(obj.__self__, f"{path}.__self__"), (obj.__func__, path)]
        elif isinstance(obj, types.FunctionType):
            cells = obj.__closure__ or ()
            children = [(c.cell_contents, f"{path}.<closure>") for c in cells if _filled(c)]
            children += [(d, f"{path}.<default>") for d in obj.__defaults__ or ()]
        else:
            if hasattr(obj, "__dict__"):
                children = [(v, f"{path}.{k}") for k, v in vars(obj).items()]
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    children.append((getattr(obj, name), f"{path}.{name}"))
            for attr in ("func", "args", "keywords"):  # functools.partial
                if type(obj).__name__ == "partial" and hasattr(obj, attr):
                    children.append((getattr(obj, attr), f"{path}.{attr}"))
        stack.extend(children)
    return found


def _filled(cell: types.CellType) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True


# -- the facade's size ------------------------------------------------------------------


def test_facade_has_at_most_22_public_members():
    alloc = busy("full+swa+mamba")
    members = public_members(alloc)
    assert REQUIRED <= members, f"the facade lost verbs: {sorted(REQUIRED - members)}"
    assert len(members) <= 22, f"{len(members)} public members: {sorted(members)}"


def test_member_count_sees_instance_attributes_and_properties():
    alloc = busy("full+swa")
    before = public_members(alloc)
    alloc.extra = 1  # a planted public attribute
    assert public_members(alloc) == before | {"extra"}
    assert {"pool", "parts"} <= before  # instance attributes count


def test_facade_module_is_short():
    lines = (ALLOCATOR_DIR / "allocator.py").read_text().count("\n")
    assert lines <= 300, f"allocator.py has {lines} lines"


# -- no part reaches the facade ----------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: busy("full+swa+mamba", debug=True), busy_prefix])
def test_no_part_reaches_the_facade(make):
    alloc = make()
    fields = dataclasses.fields(alloc.parts)
    assert len(fields) >= 10, "every part is a field of Parts"
    for f in fields:
        part = getattr(alloc.parts, f.name)
        assert not reaches(part, alloc), f"part {f.name!r} reaches the facade"
    assert not reaches(alloc.pool, alloc), "the pool reaches the facade"


def test_reach_finds_a_planted_back_pointer():
    alloc = busy_prefix()
    prefix = alloc.parts.prefix
    assert not reaches(prefix, alloc)
    try:
        prefix.check = alloc.check_integrity  # a bound method: a back-pointer
        assert reaches(prefix, alloc) == ["part.check.__self__"]
        prefix.check = lambda: alloc.check_integrity()  # a closure over the facade
        assert reaches(prefix, alloc) == ["part.check.<closure>"]
    finally:
        del prefix.check


# -- no class reads what it does not assign ----------------------------------------------


def foreign_reads(source: str) -> list[str]:
    """``module:Class.attr`` for every ``self.attr`` a class reads but neither it
    nor a base class of the same module assigns (methods, properties, class-level
    names and dataclass fields count as assigned; dunders are the runtime's)."""
    tree = ast.parse(source)
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    own: dict[str, set[str]] = {}
    reads: dict[str, dict[str, int]] = {}
    for name, cls in classes.items():
        assigned, read = set(), {}
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                assigned.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for t in targets:
                    assigned |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        for node in ast.walk(cls):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
                continue
            if node.value.id != "self":
                continue
            if isinstance(node.ctx, ast.Store):
                assigned.add(node.attr)
            else:
                read.setdefault(node.attr, node.lineno)
        own[name], reads[name] = assigned, read
    out = []
    for name, cls in classes.items():
        assigned = set(own[name])
        pending = [ast.unparse(b) for b in cls.bases]
        while pending:  # bases defined in the same module
            base = pending.pop()
            if base in classes:
                assigned |= own[base]
                pending += [ast.unparse(b) for b in classes[base].bases]
        for attr, line in reads[name].items():
            if attr not in assigned and not (attr.startswith("__") and attr.endswith("__")):
                out.append(f"{name}.{attr} (line {line})")
    return out


def test_no_allocator_class_reads_a_foreign_self_attribute():
    files = sorted(ALLOCATOR_DIR.glob("*.py"))
    assert len(files) >= 15, f"expected the allocator's modules, found {files}"
    bad = {f.name: foreign_reads(f.read_text()) for f in files}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_foreign_read_check_catches_a_mixin():
    mixin = """
class Base:
    def __init__(self):
        self.own, (self.pair, self.other) = 1, (2, 3)

class Mixin:
    def verb(self):
        return self.table  # assigned by whoever mixes it in

class Child(Base):
    count: int = 0
    def total(self):
        self.count += 1
        return self.own + self.pair + self.other + self.count + self.total() + len(self.__dict__)
"""
    assert foreign_reads(mixin) == ["Mixin.table (line 8)"]


def test_the_facade_composes_and_does_not_inherit():
    assert PoolAllocator.__mro__ == (PoolAllocator, object), "no mixins"
    source = inspect.getsource(allocator_package.allocator)
    assert "self.chain" not in source
