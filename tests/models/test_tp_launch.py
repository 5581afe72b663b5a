"""``LLM(model, tensor_parallel_size=N)`` starts its own ranks (``engine/tp_launch.py``):
gloo on the CPU here, NCCL with one GPU per rank under ``-m gpu`` on a 2-GPU machine.

Checked against independent derivations made in this process:

- greedy tokens of a mixed-length batch (chunked prefill, GQA 4/2 heads) at TP 2
  equal transformers' ``generate`` and a TP-1 ``LLM``; seeded sampling (``n`` 2)
  equals TP 1's; a second batch after ``reset_prefix_cache`` (a call the workers
  repeat) and a refused ``resize_kv_cache`` (refused on every rank) equals it too;
  TP 4 (4 KV heads) equals transformers;
- the ``with`` block leaves no child process and no process group;
- refusals come before any process is spawned or any weight loaded (the
  checkpoints hold a config only): indivisible Llama heads (the error names the
  fields), a family that cannot shard this way (qwen3_5, with head counts 3 does
  not divide either, so it is refused whether or not the family shards), both
  ``tp_group`` and ``tensor_parallel_size``, a host tier, speculation, a bad size,
  and
  torch.distributed already initialised.

The lifecycle (a killed worker, the interpreter's exit) is in
``tests/models/test_tp_launch_lifecycle.py``, the server in ``tests/models/test_tp_launch_serve.py``.
"""

from __future__ import annotations

import multiprocessing
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from engine_fixtures import hf_greedy, save_tiny_model, tiny_hf_config, tiny_hybrid_config
from tp_launch_fixtures import (
    GREEDY,
    NEW_TOKENS,
    OPTIONS,
    SAMPLED,
    bound_the_ranks,
    build_llama,
    gone,
    ids,
    prompts,
)

from unikv.engine import LLM


@pytest.fixture(autouse=True)
def bounded(monkeypatch):
    bound_the_ranks(monkeypatch)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("llama"))


def test_tp2_equals_tp1_and_transformers_and_close_leaves_nothing(llama):
    path, hf, greedy, sampled = llama
    assert [g[0] for g in greedy] == hf
    with LLM(path, device="cpu", tensor_parallel_size=2, **OPTIONS) as llm:
        pids = llm.workers.pids
        assert len(pids) == 1 and not gone(pids[0])
        assert ids(llm.generate(prompts(), GREEDY)) == greedy
        assert ids(llm.generate(prompts(), SAMPLED)) == sampled
        assert llm.reset_prefix_cache()  # on every rank, or the next schedules differ
        with pytest.raises(ValueError, match="elastic pool"):  # every rank refuses it alike
            llm.resize_kv_cache(1 << 20)
        assert ids(llm.generate(prompts()[::-1], GREEDY)) == greedy[::-1]
        assert llm.pool.subpools["full"].spec.num_kv_heads == 1  # rank 0's shard of 2
    assert all(gone(pid) for pid in pids)
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


def test_tp4_equals_transformers(tmp_path):
    path = str(tmp_path / "kv4")
    hf = save_tiny_model("llama", path, num_key_value_heads=4)
    with LLM(path, device="cpu", tensor_parallel_size=4, **OPTIONS) as llm:
        assert len(llm.workers.pids) == 3
        got = llm.generate(prompts()[:2], GREEDY)
    assert [o.output_ids for o in got] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()[:2]]
    assert multiprocessing.active_children() == []


# -- refusals: before any process or weight --------------------------------------------


def _config_only(path, config) -> str:
    config.save_pretrained(path)  # no weights: loading any would fail differently
    return str(path)


@pytest.fixture
def refused(tmp_path):
    """Config-only checkpoints; asserts no child process was started."""
    bad = tiny_hf_config("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
    bad.architectures = ["LlamaForCausalLM"]
    good = tiny_hf_config("llama")
    good.architectures = ["LlamaForCausalLM"]
    hybrid = tiny_hybrid_config("qwen3_5", num_attention_heads=3, num_key_value_heads=3)
    hybrid.architectures = ["Qwen3_5ForCausalLM"]
    paths = {
        "bad": _config_only(tmp_path / "bad", bad),
        "good": _config_only(tmp_path / "good", good),
        "qwen3_5": _config_only(tmp_path / "qwen3_5", hybrid),
    }
    yield paths
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


def test_indivisible_heads_are_refused_naming_the_fields(refused):
    with pytest.raises(ValueError, match="divisible by 2") as err:
        LLM(refused["bad"], device="cpu", tensor_parallel_size=2)
    assert "num_attention_heads" in str(err.value) and "num_key_value_heads" in str(err.value)


def test_a_family_that_cannot_shard_is_refused(refused):
    with pytest.raises(ValueError, match="tensor.parallel") as err:
        LLM(refused["qwen3_5"], device="cpu", tensor_parallel_size=2)
    message = str(err.value)
    assert "qwen3_5" in message or "num_attention_heads" in message, message


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tensor_parallel_size": 2, "tp_group": object()}, "not both"),
        ({"tensor_parallel_size": 2, "swap_host_bytes": 1 << 20}, "swap_host_bytes"),
        ({"tensor_parallel_size": 2, "prefix_host_bytes": 1 << 20}, "prefix_host_bytes"),
        ({"tensor_parallel_size": 2, "speculative_config": {"method": "ngram"}}, "speculative"),
        ({"tensor_parallel_size": 0}, "int >= 1"),
        ({"tensor_parallel_size": "2"}, "int >= 1"),
    ],
)
def test_bad_launch_options_are_refused(refused, kw, match):
    with pytest.raises(ValueError, match=match):
        LLM(refused["good"], device="cpu", **kw)


def test_an_existing_process_group_is_refused(refused, monkeypatch):
    store = dist.HashStore()
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=10)
    )
    try:
        with pytest.raises(ValueError, match="already initialised"):
            LLM(refused["good"], device="cpu", tensor_parallel_size=2)
    finally:
        dist.destroy_process_group()


# -- NCCL: one GPU per rank ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_over_nccl_equals_transformers(llama, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # the workers inherit it at spawn
    path, hf, _, _ = llama
    with LLM(path, device="cuda:0", tensor_parallel_size=2, **OPTIONS) as llm:
        assert str(llm.device) == "cuda:0"
        assert [o.output_ids for o in llm.generate(prompts(), GREEDY)] == hf
    assert multiprocessing.active_children() == []
