"""``benchmarks/bench_capacity_real.py`` on CPU (``--tiny``): the engine runs every
scheme, and a layout the engine does not store (rows padded to the K width; per-head
K/V instead of the MLA latent row) is emulated by the pages it holds: checked here
against a real pool of the transformed specs at the same bytes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

from benchmarks import bench_capacity_real as bench
from benchmarks.capacity_models import SCHEME_RULES, static_shares
from unikv.hf_config import model_specs_from_hf_config
from unikv.pool import UnifiedPool


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("capacity") / "capacity_real.json"
    bench.main(["--tiny", "--requests", "16", "--device", "cpu", "--out", str(out)])
    return json.loads(out.read_text())


def _transformed_pool_pages(hf: dict, scheme: str, budget: int) -> dict[str, int]:
    """Pages per sub-pool of a pool built from the scheme's transformed specs at the
    scheme's full budget (what the emulation stands in for)."""
    policy, transform = SCHEME_RULES[scheme]
    configs = list(model_specs_from_hf_config(hf, page_size=16, dtype=torch.float32).subpools)
    configs = [dataclasses.replace(c, layers=()) for c in transform(configs, hf)]
    split = static_shares(configs) if policy == "static_split" else None
    pool = UnifiedPool(configs, budget, device="meta", static_split=split)
    return bench.usable_pages(pool)


def test_every_scheme_ran_the_workload(result):
    assert [m["model"] for m in result["models"]] == ["mimo-v2-flash", "deepseek-v3"]
    for model in result["models"]:
        case = next(c for c in bench.MODELS if c.name == model["model"])
        assert list(model["schemes"]) == list(case.schemes)
        for row in model["schemes"].values():
            assert row["output_tokens"] > 0 and row["max_concurrent"] >= 1
            for name, peak in row["peak_pages"].items():
                assert peak <= row["pages"][name]  # never more pages live than the pool holds


@pytest.mark.parametrize("model, scheme", [("mimo-v2-flash", "unified_padded"),
                                           ("mimo-v2-flash", "static_split_padded"),
                                           ("deepseek-v3", "expanded_kv")])  # fmt: skip
def test_emulated_layout_holds_the_pages_of_the_real_one(result, model, scheme, tmp_path):
    """The exact layout at budget x (exact / transformed bytes) holds, per sub-pool,
    the pages a pool of the transformed rows holds at the full budget (to one page)."""
    entry = next(m for m in result["models"] if m["model"] == model)
    hf = bench.save_model(bench.shrunk_config(model, True), str(tmp_path), torch.float32)
    want = _transformed_pool_pages(hf, scheme, entry["budget_bytes"])
    got = entry["schemes"][scheme]["pages"]
    assert set(got) == set(want)
    assert all(abs(got[n] - want[n]) <= 1 for n in want), (got, want)
    assert entry["schemes"][scheme]["byte_scale"] < 1.0
