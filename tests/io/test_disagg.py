"""Prefill/decode disaggregation over gloo (two CPU processes on loopback), fp32;
the same over NCCL with one GPU per rank on a 2-GPU machine (``-m gpu``).

Rank 0 prefills (``PrefillWorker``), rank 1 decodes (``DecodeWorker``); pages
move with ``send_pages`` / ``recv_pages`` into pages the decode instance's own
allocator picked. Checked against independent derivations in this process:

- tiny Llama (full attention), tiny gpt-oss (sliding window 6 + full
  layers, so some SWA pages are already out of the window when handed off) and
  tiny Qwen3.5 (Gated DeltaNet + full layers: each request's recurrent-state
  slot travels with its pages):
  the decode rank's outputs equal a single-process ``LLM.generate`` with the
  same per-prompt params (greedy, one seeded temperature sample, one request
  that finishes at its first token), and the greedy ones equal transformers'
  ``generate``; every running request's pages were transferred (none was
  recomputed), so the decode side continued from the received bytes;
- a decode pool too small for the batch: requests that do not fit are
  prefilled again on the decode side, with the same tokens;
- instances built with other page sizes are refused on both ranks with a
  ValueError before any page moves.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_fixtures import BACKENDS, init_group, rank_device, run_two, save_result
from engine_fixtures import VOCAB, hf_greedy, save_tiny_hybrid, save_tiny_model

from unikv.engine import LLM, SamplingParams
from unikv.engine.disagg import PrefillWorker
from unikv.engine.disagg_decode import DecodeWorker
from unikv.hf_config import specs_from_hf_config
from unikv.pool import pool_bytes_for

ARCHS = ["llama", "gpt_oss", "qwen3_5"]
PROMPT_LENS = [3, 17, 30, 45, 9]
NEW_TOKENS = 12
OPTIONS = {
    "dtype": torch.float32,
    "page_size": 4,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,
    "max_model_len": 80,
}
TIGHT_PAGES = 24  # the decode pool of the tight run: 96 tokens, the batch needs ~190


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _params() -> list[SamplingParams]:
    """Greedy, except prompt 1 (seeded sampling) and prompt 4 (one token only)."""
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0) for _ in PROMPT_LENS]
    params[1] = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=20, seed=11)
    params[4] = SamplingParams(max_tokens=1, temperature=0.0)
    return params


def _pair(rank: int, device, path: str, **decode_options) -> dict:
    """One disaggregated run; rank 0's stats or rank 1's outputs."""
    llm = LLM(path, device=device, **{**OPTIONS, **(decode_options if rank == 1 else {})})
    if rank == 0:
        stats = PrefillWorker(llm, 1, group=dist.group.WORLD).run(_prompts(), _params())
        return {"pages": stats.pages, "requests": stats.num_requests}
    worker = DecodeWorker(llm, 0, group=dist.group.WORLD)
    outputs = worker.run()
    llm.alloc.check_integrity()
    llm.reset_prefix_cache()  # caching on (Llama's default): "live" counts what requests hold
    return {
        "tokens": [o.output_ids for o in outputs],
        "finish": [o.finish_reason for o in outputs],
        "recomputed": worker.num_recomputed,
        "live": {n: llm.alloc.parts.books[n].num_live for n in llm.pool.subpools},
    }


def _worker(rank: int, port: int, out_dir: str, backend: str, paths: dict, tight: int) -> None:
    device = init_group(rank, port, backend)
    result = {arch: _pair(rank, device, path) for arch, path in paths.items()}
    result["tight"] = _pair(rank, device, paths["llama"], kv_cache_bytes=tight)
    try:
        _pair(rank, device, paths["llama"], page_size=8)
        result["mismatch"] = "no error"
    except ValueError as e:
        result["mismatch"] = str(e)
    save_result(out_dir, rank, result)
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=BACKENDS)
def runs(request, tmp_path_factory):
    """(per arch: transformers' greedy tokens, single-instance outputs; both ranks)."""
    backend = request.param
    root = tmp_path_factory.mktemp("disagg")
    torch.set_num_threads(1)
    device = rank_device(backend, 0)
    paths, refs = {}, {}
    for arch in ARCHS:
        paths[arch] = str(root / arch)
        save = save_tiny_hybrid if arch == "qwen3_5" else save_tiny_model
        hf = save(arch, paths[arch])
        single = LLM(paths[arch], device=device, **OPTIONS).generate(_prompts(), _params())
        refs[arch] = {
            "hf": [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(_prompts(), _params())],
            "tokens": [o.output_ids for o in single],
            "finish": [o.finish_reason for o in single],
        }
    configs = specs_from_hf_config(paths["llama"], page_size=4, dtype=torch.float32)
    tight = pool_bytes_for(configs, {c.name: TIGHT_PAGES for c in configs})
    return refs, run_two(_worker, str(root), backend, paths, tight)


@pytest.mark.parametrize("arch", ARCHS)
def test_disaggregated_tokens_match_single_instance(runs, arch):
    refs, (prefill, decode) = runs
    ref, got = refs[arch], decode[arch]
    assert got["tokens"] == ref["tokens"]
    assert got["finish"] == ref["finish"]
    greedy = [i for i, sp in enumerate(_params()) if sp.temperature == 0]
    assert [got["tokens"][i] for i in greedy] == [ref["hf"][i] for i in greedy]
    assert got["recomputed"] == 0  # the decode side continued from received pages
    assert prefill[arch]["requests"] == len(PROMPT_LENS)
    assert all(n > 0 for n in prefill[arch]["pages"].values())
    assert all(n == 0 for n in got["live"].values())  # every page came back


def test_gpt_oss_hands_off_only_window_pages(runs):
    """Full pages: every page of every prompt; SWA: fewer (out-of-window pages stay)."""
    _, (prefill, _) = runs
    pages = prefill["gpt_oss"]["pages"]
    full = sum(-(-n // OPTIONS["page_size"]) for n in PROMPT_LENS[:4])  # prompt 4 finished
    assert pages["full"] == full
    assert 0 < pages["swa"] < full


def test_tight_decode_pool_recomputes_with_same_tokens(runs):
    refs, (_, decode) = runs
    got = decode["tight"]
    assert got["recomputed"] > 0  # the scenario happened
    assert got["tokens"] == refs["llama"]["tokens"]


def test_mismatched_instances_are_refused(runs):
    _, ranks = runs
    for rank in ranks:
        assert "differ" in rank["mismatch"] and "page_sizes" in rank["mismatch"], rank["mismatch"]


def test_a_windowed_prefill_instance_with_prefix_caching_is_refused(tmp_path):
    """Prefix caching keeps a sliding-window request's cached prompt pages in its window
    sub-pool, so a hand-off would carry other SWA columns than the decode instance's
    window rule keeps (the disagg invariant): refused when the worker is built, before any
    message, saying what to change; caching off (gpt-oss's default) is accepted."""
    path = str(tmp_path)
    save_tiny_model("gpt_oss", path)
    llm = LLM(path, device="cpu", enable_prefix_caching=True, **OPTIONS)
    with pytest.raises(ValueError, match="needs prefix caching off.*enable_prefix_caching=False"):
        PrefillWorker(llm, 1)
