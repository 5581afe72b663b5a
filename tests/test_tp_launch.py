"""``LLM(model, tensor_parallel_size=N)`` starts its own ranks (``engine/tp_launch.py``):
gloo on the CPU here, NCCL with one GPU per rank under ``-m gpu`` on a 2-GPU machine.

Checked against independent derivations made in this process:

- greedy tokens of a mixed-length batch (chunked prefill, GQA 4/2 heads) at TP 2
  equal transformers' ``generate`` and a TP-1 ``LLM``; seeded sampling (``n`` 2)
  equals TP 1's; a second batch after ``reset_prefix_cache`` (a call the workers
  repeat) equals it too; TP 4 (4 KV heads) equals transformers;
- refusals come before any process is spawned or any weight loaded (the
  checkpoints hold a config only): indivisible Llama heads (the error names the
  fields), a family that cannot shard this way (qwen3_5, with head counts 3 does
  not divide either, so it is refused whether or not the family shards), both
  ``tp_group`` and ``tensor_parallel_size``, a host tier, a bad size, and
  torch.distributed already initialised;
- a worker killed mid-run gives rank 0 a ``TensorParallelError`` naming the rank
  within a bounded time, and so does every later call;
- ``close()`` (and the ``with`` block) leave no child process and no process
  group, and a second TP LLM starts after the first closed.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from engine_fixtures import VOCAB, hf_greedy, save_tiny_model, tiny_hf_config, tiny_hybrid_config

from unikv.engine import LLM, SamplingParams
from unikv.engine.tp_launch import TensorParallelError

PROMPT_LENS = [3, 19, 33]
NEW_TOKENS = 8
OPTIONS = {
    "dtype": torch.float32,
    "page_size": 4,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,
    "max_model_len": 64,
}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=20, seed=7, n=2)
KILL_DEADLINE_S = 30.0  # the error reaches rank 0 well within this (gloo: at once)


@pytest.fixture(autouse=True)
def short_timeouts(monkeypatch):
    """Collectives and start-up time out after 60 s (a broken test never hangs CI)."""
    monkeypatch.setenv("UNIKV_TP_TIMEOUT_S", "60")
    torch.set_num_threads(1)  # the workers take rank 0's thread count


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(path, transformers' greedy tokens, TP 1's greedy and sampled outputs)."""
    path = str(tmp_path_factory.mktemp("llama"))
    hf = save_tiny_model("llama", path)
    tp1 = LLM(path, device="cpu", **OPTIONS)
    greedy, sampled = (
        _ids(tp1.generate(_prompts(), GREEDY)),
        _ids(tp1.generate(_prompts(), SAMPLED)),
    )
    return path, [hf_greedy(hf, p, NEW_TOKENS) for p in _prompts()], greedy, sampled


def test_tp2_equals_tp1_and_transformers_and_close_leaves_nothing(llama):
    path, hf, greedy, sampled = llama
    assert [g[0] for g in greedy] == hf
    with LLM(path, device="cpu", tensor_parallel_size=2, **OPTIONS) as llm:
        pids = llm.workers.pids
        assert len(pids) == 1 and not _gone(pids[0])
        assert _ids(llm.generate(_prompts(), GREEDY)) == greedy
        assert _ids(llm.generate(_prompts(), SAMPLED)) == sampled
        assert llm.reset_prefix_cache()  # on every rank, or the next schedules differ
        assert _ids(llm.generate(_prompts()[::-1], GREEDY)) == greedy[::-1]
        assert llm.pool.subpools["full"].spec.num_kv_heads == 1  # rank 0's shard of 2
    assert all(_gone(pid) for pid in pids)
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


def test_a_killed_worker_is_a_clear_error_and_a_second_llm_starts(llama):
    path, _, greedy, _ = llama
    llm = LLM(path, device="cpu", tensor_parallel_size=2, **OPTIONS)
    try:
        (pid,) = llm.workers.pids
        assert _ids(llm.generate(_prompts()[:1], GREEDY)) == greedy[:1]  # the second one works

        def kill_at_step_3(_, batch, logits, steps=[]):  # noqa: B006  (a step counter)
            steps.append(1)
            if len(steps) == 3:
                os.kill(pid, signal.SIGKILL)

        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1") as err:
            llm.generate(_prompts(), GREEDY, on_step=kill_at_step_3)
        assert time.monotonic() - start < KILL_DEADLINE_S
        assert f"pid {pid}" in str(err.value) and "died" in str(err.value)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1"):
            llm.generate(_prompts(), GREEDY)
        assert time.monotonic() - start < 5
    finally:
        llm.close()
    assert _gone(pid) and multiprocessing.active_children() == []
    assert not dist.is_initialized()


def test_tp4_equals_transformers(tmp_path):
    path = str(tmp_path / "kv4")
    hf = save_tiny_model("llama", path, num_key_value_heads=4)
    with LLM(path, device="cpu", tensor_parallel_size=4, **OPTIONS) as llm:
        assert len(llm.workers.pids) == 3
        got = llm.generate(_prompts()[:2], GREEDY)
    assert [o.output_ids for o in got] == [hf_greedy(hf, p, NEW_TOKENS) for p in _prompts()[:2]]
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
        assert [o.output_ids for o in llm.generate(_prompts(), GREEDY)] == hf
    assert multiprocessing.active_children() == []
