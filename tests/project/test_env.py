"""``unikv/env.py``: the one reader of the environment.

- No other module of unikv reads ``os.environ`` or ``os.getenv`` (oracle: every
  module's syntax tree);
- every variable env.py reads is listed in ``docs/env.md`` and every variable listed
  there is read (a second description of the same switches);
- values parse as documented, and a bad value names its variable.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from unikv import env

ROOT = Path(__file__).resolve().parents[2]


def _reads_environ(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv", "environb")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            lines.append(node.lineno)
    return lines


def test_only_env_reads_the_environment():
    readers = {
        str(p.relative_to(ROOT)): lines
        for p in sorted((ROOT / "unikv").rglob("*.py"))
        if (lines := _reads_environ(p))
    }
    assert list(readers) == ["unikv/env.py"], readers


def test_the_docs_list_every_variable():
    read = {var for var, _ in env.PARSERS.values()} | {env.API_KEY_ENV, env.FAULT_ENV}
    read |= set(env.HUB_CACHE_ENV)
    documented = set(
        re.findall(r"^\| `([A-Z0-9_]+)` \|", (ROOT / "docs/env.md").read_text(), re.MULTILINE)
    )
    assert documented == read


def test_values_parse_and_bad_ones_name_the_variable():
    assert env.Flags.from_environ({}) == env.Flags()
    flags = env.Flags.from_environ(
        {"UNIKV_PDL": "0", "UNIKV_MOE_HOPPER": "0", "UNIKV_EXTEND_SDPA": "1",
         "UNIKV_GRAPH_GREEDY_ROWS": "0", "UNIKV_MXFP4_DECODE": "halves", "TRITON_INTERPRET": "1"}
    )  # fmt: skip
    assert (flags.pdl, flags.moe_hopper, flags.extend_sdpa) == (False, False, True)
    assert (flags.graph_greedy_rows, flags.mxfp4_decode, flags.triton_interpret) == (
        0,
        "halves",
        True,
    )
    assert env.Flags.from_environ({"UNIKV_EXTEND_HOPPER": "anything"}).extend_hopper  # on unless 0
    with pytest.raises(ValueError, match="UNIKV_MXFP4_DECODE.*one of"):
        env.Flags.from_environ({"UNIKV_MXFP4_DECODE": "fast"})
    with pytest.raises(ValueError, match="UNIKV_DECODE_MERGE_TILE.*integer"):
        env.Flags.from_environ({"UNIKV_DECODE_MERGE_TILE": "big"})
    served = env.serve_environ({"UNIKV_API_KEY": "k", "UNIKV_TEST_ENGINE_FAULT": ""})
    assert served == env.ServeEnviron(api_key="k", engine_fault=None)
