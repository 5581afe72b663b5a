"""The contract is checked, not only cited: every code name ``docs/design.md`` puts in
backticks (a verb, class, attribute, argument, counter, ``Class.attr``) exists in
unikv under that name, so a renamed verb fails CI until the contract says the same.

Oracle: the names unikv defines, read from its source with ``ast`` (functions,
classes, arguments, keywords, assignment targets, dataclass fields, imports,
module and package names, the keys it reads: ``cfg.get("x")``, ``d["x"]``), the
counters its I/O stats report (``host_``/``swap_`` + field), the ``UNIKV_*``
switches it reads, Python's builtins and torch's tensor and event methods. File
names, shell text and maths are not names.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import re
from pathlib import Path

import torch

from unikv.io.prefix_host import HostStats
from unikv.io.swap import SwapStats

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
NOT_CODE = {"L", "l", "gpu"}  # lengths in formulas; the pytest marker
FOREIGN = ("torch.", "tl.", "triton.", "np.")  # other projects' names
FILES = ("py", "md", "toml", "json", "sh", "txt")  # `allocator.py`: a file, not a name


def _key(node: ast.AST) -> str | None:
    """The string a node reads a config field or a key by: ``cfg.get("x")``,
    ``getattr(o, "x")``, ``d["x"]``."""
    if isinstance(node, ast.Subscript):
        arg = node.slice
    elif (
        isinstance(node, ast.Call)
        and node.args
        and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == "get")
            or (isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"))
        )
    ):
        arg = node.args[1] if isinstance(node.func, ast.Name) else node.args[0]
    else:
        return None
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def defined_names() -> set[str]:
    names = {"unikv", *(p.name for p in (ROOT / "unikv").rglob("*") if p.is_dir())}
    for path in (ROOT / "unikv").rglob("*.py"):
        names.add(path.stem)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg) or isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
            elif (key := _key(node)) is not None:
                names.add(key)
    names |= {f"host_{f.name}" for f in dataclasses.fields(HostStats)}
    names |= {f"swap_{f.name}" for f in dataclasses.fields(SwapStats)}
    source = "\n".join(p.read_text() for p in (ROOT / "unikv").rglob("*.py"))
    names |= set(re.findall(r"\bUNIKV_[A-Z0-9_]+\b", source))  # environment switches read
    return names


def contract_names(text: str) -> list[str]:
    """Backticked code names of ``text``, calls stripped (``f(x)`` -> ``f``)."""
    out = []
    for token in re.findall(r"`([^`\n]+)`", text):
        token = re.sub(r"\(.*\)$", "", token.strip())
        if not NAME.fullmatch(token) or token.startswith(FOREIGN) or token in NOT_CODE:
            continue
        if token.rsplit(".", 1)[-1] in FILES:
            continue
        if re.match(r"cu[A-Z]|cuda[A-Z]", token):  # the CUDA driver's and runtime's API
            continue
        out.append(token)
    return out


def missing(text: str, names: set[str]) -> set[str]:
    return {
        token
        for token in contract_names(text)
        for part in token.split(".")
        if part not in names
        and not hasattr(builtins, part)
        and not any(hasattr(cls, part) for cls in (torch.Tensor, torch.cuda.Event))
    }


def test_every_name_the_contract_gives_exists():
    names = defined_names()
    gone = missing((ROOT / "docs/design.md").read_text(), names)
    assert not gone, f"docs/design.md names what unikv does not define: {sorted(gone)}"


def test_the_check_fails_on_a_renamed_verb():
    names = defined_names()
    assert missing("`PoolAllocator.alloc_extend` and `alloc_decode`", names) == set()
    assert missing("`alloc_extendd` and `PoolAllocator.free_mamba`", names) == {
        "alloc_extendd",
        "PoolAllocator.free_mamba",
    }
