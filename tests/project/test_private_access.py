"""No module of ``unikv/`` reads or writes another object's private state.

Walks the AST of every module and fails on an attribute access ``x._name`` (one
leading underscore) where ``x`` is not ``self`` or ``cls``, not ``super()`` and not
a module. What one object needs of another is a public method or property; the
few accesses into third-party internals are allowed below, each with its reason.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import unikv

PACKAGE = Path(unikv.__file__).parent

# (module file name, the access as written) -> why it is allowed. By file name, not
# path, so that moving a module between folders keeps its entry.
ALLOWED = {
    ("detokenize.py", "Fast._decode"): "transformers' decoding lives in the private "
    "_decode; a tokenizer class that overrides it decodes its own way (Whisper, ...)",
    ("interpret.py", "interpreter._patch_lang_tensor"): "Triton's interpreter has no "
    "public hook for the patch TRITON_INTERPRET=1 needs",
    ("interpret.py", "patched._unikv_patched"): "unikv's own marker on Triton's patched "
    "function, so that the patch is applied once",
    ("integrity.py", "prefix._next_id"): "the allocator's integrity check audits its parts' "
    "internals (node ids below the next one); the allocator tree work owns this module",
}


def _module_names(tree: ast.Module, path: Path) -> set[str]:
    """Names bound to modules in ``tree``: ``import a.b (as c)`` and ``from p import m``
    where ``p.m`` is a module."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                try:
                    spec = importlib.util.find_spec(f"{node.module}.{a.name}")
                except (ImportError, ValueError):
                    spec = None
                if spec is not None:
                    names.add(a.asname or a.name)
    return names


def _private_accesses(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    candidates = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    ]
    out = []
    modules = None  # found only where needed (find_spec imports parent packages)
    for node in candidates:
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        if isinstance(base, ast.Call) and getattr(base.func, "id", None) == "super":
            continue
        if isinstance(base, ast.Name):
            modules = _module_names(tree, path) if modules is None else modules
            if base.id in modules:
                continue
        out.append((node.lineno, ast.unparse(node)))
    return out


def test_no_module_touches_another_objects_private_state():
    found, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, access in _private_accesses(path):
            if (path.name, access) in ALLOWED:
                used.add((path.name, access))
                continue
            found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {access}")
    assert not found, (
        "modules reach into other objects' private state (give the owner a public method "
        "or property instead):\n" + "\n".join(found)
    )
    assert used == set(ALLOWED), f"allowed accesses no longer present: {set(ALLOWED) - used}"


def test_the_check_sees_a_private_access(tmp_path):
    """The walker itself: it flags a foreign private access and passes the allowed forms."""
    src = tmp_path / "m.py"
    src.write_text(
        "import os\n"
        "class A:\n"
        "    def f(self, other):\n"
        "        self._x = other._y\n"
        "        super()._z()\n"
        "        return os._exit, cls_like._w\n"
    )
    assert [a for _, a in _private_accesses(src)] == ["other._y", "cls_like._w"]
