"""The package's comments and docstrings carry no commit hashes (issue 43 item 3): a
measurement's commit lives in docs/perf.md (or docs/history.md), and the code points
there. Code is not scanned, so hex constants and strings in expressions are free."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# 7-40 hex digits with at least one letter and one digit: a short or full commit id.
# (An all-digit id cannot be told from a number; an all-letter word is not an id.)
COMMIT = re.compile(r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?!\w)")


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every module/class/function docstring."""
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        doc = ast.get_docstring(node, clean=False) if isinstance(node, kinds) else None
        if doc:
            found += [(node.body[0].lineno + i, line) for i, line in enumerate(doc.splitlines())]
    return found


def hashes(source: str) -> list[tuple[int, str]]:
    return sorted((line, m.group(0)) for line, text in prose(source) for m in COMMIT.finditer(text))


def test_the_scanner_finds_hashes_in_prose_only():
    source = '''"""Set at a11af81 on the H200."""
MASK = 0xdeadbeef1  # fitted at 5ff46ff
KEY = "abc1234def"
def f():
    """No id here: 1.4426950408889634, 1000000, 0x1f2e3d4c, defaced."""
    return 0x7f3a9c1  # full id 0123456789abcdef0123456789abcdef01234567
'''
    assert hashes(source) == [
        (1, "a11af81"),
        (2, "5ff46ff"),
        (6, "0123456789abcdef0123456789abcdef01234567"),
    ]


def test_package_prose_names_no_commit():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {token}"
        for path in sorted((ROOT / "unikv").rglob("*.py"))
        for line, token in hashes(path.read_text(encoding="utf-8"))
    ]
    assert not found, (
        "commit ids in the package's comments/docstrings; move each measurement's commit "
        "to docs/perf.md and point there:\n" + "\n".join(found)
    )
