"""Bad input to the engine on hybrid models gets a clear error, and state stays
unchanged: a budget too small for one request's state slot, a tensor-parallel size
the recurrent heads do not split, a layer pattern the config does not define."""

from __future__ import annotations

import json
import os

import pytest
import torch
from engine_fixtures import save_tiny_hybrid

from unikv.engine import LLM
from unikv.hf_config import specs_from_hf_config
from unikv.models import load_model_config
from unikv.models.parallel import check_tp_config


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen35"))
    save_tiny_hybrid("qwen3_5", path)
    return path


def test_budget_below_one_state_slot_names_the_state(qwen35):
    """A pool whose bytes cannot hold one request's pages plus its state slot."""
    configs = specs_from_hf_config(qwen35, dtype=torch.float32)
    slot = next(c.spec.entry_bytes for c in configs if c.spec.kind == "mamba")
    page = next(c.spec.page_bytes(c.page_size) for c in configs if c.spec.kind == "full")
    budget = slot + 4 * page  # sink (one slot) + pages: no room for the request's own slot
    with pytest.raises(ValueError, match=r"cannot run alone.*'mamba': 1.*raise"):
        LLM(qwen35, kv_cache_bytes=budget, max_model_len=64, page_size=16)


def test_tensor_parallel_refused_where_the_recurrent_heads_do_not_split(qwen35):
    """The recurrent state is sharded by heads (``tests/models/test_tp_recurrent.py``): TP 2
    splits 4 value / 2 key heads, TP 3 splits neither and is refused naming them."""
    config, _ = load_model_config(qwen35)
    check_tp_config(config, 2)
    with pytest.raises(ValueError, match=r"tensor parallelism of 3 needs .*linear_num_value_heads"):
        check_tp_config(config, 3)


def test_layer_pattern_the_config_does_not_define(qwen35, tmp_path):
    with open(os.path.join(qwen35, "config.json")) as f:
        raw = json.load(f)
    raw["layer_types"] = ["linear_attention", "conv_attention"] + raw["layer_types"][2:]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match="conv_attention"):
        specs_from_hf_config(str(tmp_path))
