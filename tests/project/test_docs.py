"""The documents the code cites are in the repository, and docs/structure.md is the
module map of unikv/ as it is.

Citations: every ``*.md`` path that a file of unikv/, tests/ or benchmarks/ (or
README.md, docs/*.md) mentions must name a repo-relative file that a fresh clone
holds (it exists and git does not ignore it); a bare ``LESSONS`` or ``DESIGN`` (a
document named without its path) is dangling. Where a citation gives a number
(``docs/design.md section 7``, ``sections 2-3``, ``docs/lessons.md bugs 9 and
11``), the document must have a heading of that number (``## 7. ...``). Markdown
link targets in README.md and docs/*.md resolve from the linking file, and the
repo paths they name in backticks (``unikv/pool.py``, ``tests/x.py::test_y``)
exist, down to the test function.

Module map: docs/structure.md lists every module of unikv/ exactly once, in a
numbered layer, with the unikv packages it may import. Oracle: the import
statements of each module (``ast``, lazy imports included), resolved to files.
A module may import its own package freely, and otherwise only what its row lists;
a row may list only layers at or below its own.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STRUCTURE = ROOT / "docs" / "structure.md"
SUBPACKAGES = {p.parent.name for p in (ROOT / "unikv").glob("*/__init__.py")}

# a path token ending in .md, not starting inside a longer token (URLs never match)
DOC_PATH = re.compile(r"(?<![\w/.:-])((?:\.{1,2}/|/|~/)?[\w.-]+(?:/[\w.-]+)*\.md)\b")
BARE_NAME = re.compile(r"\b(LESSONS|DESIGN)\b(?!\.md)")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
NUMBERS = r"\d+(?:\s*(?:-|,|and|or|to)\s*\d+)*"
# what follows a citation: "section 7", "sections 2-3", "bugs 9 and 11", "'s ... (section 4)"
SECTION_AFTER = re.compile(rf"^(?:'s)?\s+(?:sections?|bugs?)\s+({NUMBERS})")
SECTION_PAREN = re.compile(rf"^'s\b[^()]{{0,60}}\((?:sections?|bugs?)\s+({NUMBERS})\)")
CODE_PATH = re.compile(r"`((?:unikv|tests|benchmarks|docs)/[\w./*-]+(?:::\w+)?)`")
HEADING = re.compile(r"^#{2,3}\s+(\d+)\.\s", re.MULTILINE)


def _scanned() -> list[Path]:
    files = [p for d in ("unikv", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    files += list((ROOT / "benchmarks").rglob("*.sh"))
    files += [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return sorted(p for p in files if p != Path(__file__).resolve())


def _numbers(text: str) -> set[int]:
    """'2-3' -> {2, 3}; '9 and 11' -> {9, 11}."""
    out: set[int] = set()
    for part in re.split(r"\s*(?:,|and|or)\s*", text):
        bounds = [int(n) for n in re.split(r"\s*(?:-|to)\s*", part)]
        out.update(range(bounds[0], bounds[-1] + 1))
    return out


def _cited_numbers(text: str, end: int) -> set[int]:
    """Numbers cited right after a document path that ends at ``end``; comment
    markers and line breaks between the words do not count."""
    after = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text[end : end + 160])
    match = SECTION_AFTER.match(after) or SECTION_PAREN.match(after)
    return _numbers(match.group(1)) if match else set()


def _citations() -> list[tuple[str, str, str, set[int]]]:
    """(where, cited text, repo-relative path or '' if it leaves the repo, numbers)."""
    found = []
    for path in _scanned():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT).as_posix()
        links = []
        if path.suffix == ".md":
            for m in MD_LINK.finditer(text):
                target = m.group(1).split("#")[0]
                if target and not re.match(r"^[a-z]+:", target):
                    links.append((m.start(1), m.end(1), (path.parent / target).resolve()))
        for start, end, target in links:
            where = f"{rel}:{text.count(chr(10), 0, start) + 1}"
            found.append((where, text[start:end], _inside(target), set()))
        in_link = [(s, e) for s, e, _ in links]
        for m in DOC_PATH.finditer(text):
            if any(s <= m.start() < e for s, e in in_link):
                continue
            where = f"{rel}:{text.count(chr(10), 0, m.start()) + 1}"
            token = m.group(1)
            target = ROOT / token if not token.startswith(("/", "~")) else Path("/nonexistent")
            found.append((where, token, _inside(target.resolve()), _cited_numbers(text, m.end())))
        for m in BARE_NAME.finditer(text):
            where = f"{rel}:{text.count(chr(10), 0, m.start()) + 1}"
            found.append((where, m.group(1), "", set()))
    return found


def _inside(target: Path) -> str:
    try:
        return target.relative_to(ROOT).as_posix()
    except ValueError:
        return ""


def _ignored(paths: set[str]) -> set[str]:
    """The paths git ignores (a fresh clone lacks them); none without git."""
    if not paths or shutil.which("git") is None or not (ROOT / ".git").exists():
        return set()
    done = subprocess.run(
        ["git", "check-ignore", "--stdin"],
        input="\n".join(sorted(paths)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    return set(done.stdout.split())


def test_every_cited_document_is_in_the_repository():
    citations = _citations()
    assert len(citations) > 30, "the scan found almost no citations: is the pattern broken?"
    cited = {rel for _, _, rel, _ in citations if rel and (ROOT / rel).exists()}
    ignored = _ignored(cited)
    dangling = []
    for where, token, rel, _ in citations:
        if not rel:
            dangling.append(f"{where}: {token!r} is not a repo-relative document")
        elif not (ROOT / rel).exists():
            dangling.append(f"{where}: {token!r} -> {rel} does not exist")
        elif rel in ignored:
            dangling.append(f"{where}: {token!r} -> {rel} is git-ignored (a clone lacks it)")
    assert not dangling, "dangling document references:\n" + "\n".join(dangling)


def test_every_cited_section_exists():
    missing = []
    for where, token, rel, numbers in _citations():
        if not numbers or not rel or not (ROOT / rel).is_file():
            continue
        have = {int(n) for n in HEADING.findall((ROOT / rel).read_text(encoding="utf-8"))}
        for n in sorted(numbers - have):
            missing.append(f"{where}: {token} has no section {n} (it has {sorted(have)})")
    assert not missing, "cited sections that do not exist:\n" + "\n".join(missing)


def test_every_path_and_test_a_document_names_exists():
    """Backticked repo paths in README.md and docs/*.md (``unikv/pool.py``,
    ``tests/core/test_layout.py::test_name``) name files, and tests, that exist."""
    missing = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for m in CODE_PATH.finditer(text):
            where = f"{path.relative_to(ROOT).as_posix()}:{text.count(chr(10), 0, m.start()) + 1}"
            file, _, test = m.group(1).partition("::")
            if "*" in file:
                continue
            if not (ROOT / file).exists():
                missing.append(f"{where}: {file} does not exist")
            elif test and not re.search(
                rf"^\s*(?:async\s+)?def {re.escape(test)}\(",
                (ROOT / file).read_text(),
                re.MULTILINE,
            ):
                missing.append(f"{where}: {file} defines no test {test}")
    assert not missing, "documents name what is not there:\n" + "\n".join(missing)


def test_citation_numbers_are_read_across_line_breaks_and_comments():
    """The citation reader itself, on the forms the code uses (a second reader here
    would restate it; these are hand-written expectations)."""
    text = "x (docs/design.md\n    section 7) y  # docs/design.md sections 2-3\n"
    text += "see docs/lessons.md bugs 9 and 11; docs/design.md's default placement (section 4)"
    ends = [m.end() for m in DOC_PATH.finditer(text)]
    assert [_cited_numbers(text, e) for e in ends] == [{7}, {2, 3}, {9, 11}, {4}]
    assert [m.group(1) for m in DOC_PATH.finditer("a ../shared/DESIGN.md b /w/x.md")] == [
        "../shared/DESIGN.md",
        "/w/x.md",
    ]
    assert not DOC_PATH.findall("https://example.com/README.md")


# -- the module map ------------------------------------------------------------------------


def _structure() -> dict[str, tuple[int, str, set[str]]]:
    """docs/structure.md rows: module path -> (layer number, unit, units it may import)."""
    rows: dict[str, tuple[int, str, set[str]]] = {}
    layer, dupes = 0, []
    for line in STRUCTURE.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"^## (\d+)\. ", line):
            layer = int(m.group(1))
        elif m := re.match(r"^\|\s*`(unikv/[\w/]+\.py)`\s*\|.*\|([^|]*)\|\s*$", line):
            path, may = m.group(1), m.group(2)
            dupes += [path] if path in rows else []
            rows[path] = (layer, _unit(path), set(re.findall(r"[a-z_0-9]+", may)))
    assert not dupes, f"docs/structure.md lists these modules twice: {dupes}"
    layers: dict[str, set[int]] = {}
    for layer, unit, _ in rows.values():
        layers.setdefault(unit, set()).add(layer)
    split = {unit: sorted(n) for unit, n in layers.items() if len(n) > 1}
    assert not split, f"docs/structure.md puts one unit in several layers: {split}"
    return rows


def _unit(path: str) -> str:
    """unikv/allocator/chain.py -> 'allocator'; unikv/pool.py -> 'pool'; the package
    facade unikv/__init__.py -> 'unikv'."""
    parts = Path(path).with_suffix("").parts[1:]
    if parts[0] in SUBPACKAGES:
        return parts[0]
    return "unikv" if parts[0] == "__init__" else parts[0]


def _imported_units(path: Path) -> set[str]:
    """The unikv units a module imports anywhere in its body (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.update(f"{module}.{a.name}" for a in node.names)
    units = set()
    for name in names:
        parts = name.split(".")
        if parts[0] != "unikv":
            continue
        if len(parts) == 1 or not (
            (ROOT / "unikv" / f"{parts[1]}.py").exists() or parts[1] in SUBPACKAGES
        ):
            units.add("unikv")  # a name of the package facade
        else:
            units.add(parts[1])
    return units


def test_the_module_map_lists_every_module_once():
    rows = _structure()
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "unikv").rglob("*.py")}
    missing, stale = sorted(modules - set(rows)), sorted(set(rows) - modules)
    assert not missing, f"add a row to docs/structure.md for each of: {missing}"
    assert not stale, f"docs/structure.md lists modules that do not exist: {stale}"


def test_imports_follow_the_module_map():
    rows = _structure()
    layer_of = {unit: layer for layer, unit, _ in rows.values()}
    wrong = []
    for path, (layer, unit, may) in sorted(rows.items()):
        if not (ROOT / path).exists():
            continue  # reported by the test above
        for other in sorted(may - {unit}):
            if other not in layer_of:
                wrong.append(f"{path}: may import {other!r}, which is no unit of the map")
            elif layer_of[other] > layer:
                wrong.append(f"{path} (layer {layer}) may import {other} (layer {layer_of[other]})")
        for other in sorted(_imported_units(ROOT / path) - may - {unit}):
            wrong.append(f"{path} imports {other}, which its row in docs/structure.md omits")
    assert not wrong, "imports against docs/structure.md:\n" + "\n".join(wrong)
