"""Speculative decoding (ngram) end to end on CPU (fp32, torch reference kernels):
greedy tokens with speculation equal the same engine's tokens without it, and
those equal transformers' greedy ``generate``, for Llama, gpt-oss (sliding windows
and sinks), Gemma-2 (windows, soft-capping), DeepSeek-V3 (MLA) and MiMo-V2-Flash
(asymmetric K/V heads, windows, sinks).

Per family three runs cover k = 1, 3 and 5 at page sizes 1, 4 and 16 (rotated over
the families): a plain one; one with prefix caching on, run twice (the second run
hits the pages the first left, speculation included); and one in a pool too small
for the load (requests preempted and recomputed). Each run must verify drafts,
accept some and reject some (so the test fails if verification were skipped or
everything accepted), and give every page back; the allocator runs in debug mode
(``check_integrity`` after every verb, the truncate rollback included).
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    assert_pages_returned,
    hf_greedy,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_deepseek,
    save_tiny_gemma,
    save_tiny_model,
)

from unikv.engine import LLM, SamplingParams
from unikv.hf_config import specs_from_hf_config
from unikv.placement import pool_bytes_for, worst_case_pages

pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 16
# page sizes of the (plain k = 1, cached k = 3, preempted k = 5) runs per family
ROTATION = {
    "llama": (1, 4, 16),
    "gpt_oss": (4, 16, 1),
    "gemma2": (16, 1, 4),
    "deepseek_v3": (1, 4, 16),
    "mimo": (16, 1, 4),  # (at page size 1 its wide window pages leave room: no preemption)
}
FAMILIES = tuple(ROTATION)


def save(family: str, path: str):
    if family in ("llama", "gpt_oss"):
        return save_tiny_model(family, path)
    if family == "gemma2":
        return save_tiny_gemma("gemma2", path, tie_word_embeddings=False)
    if family == "deepseek_v3":
        return save_tiny_deepseek(3, path)
    from test_engine_mimo import save_tiny_mimo

    return save_tiny_mimo(path)


def prompts() -> list[list[int]]:
    """Repetitive prompts (n-gram lookups find matches) and a random one."""
    g = torch.Generator().manual_seed(4)
    pattern = torch.randint(0, VOCAB, (5,), generator=g).tolist()
    short = torch.randint(0, VOCAB, (3,), generator=g).tolist()
    return [
        pattern * 3 + [7, 9],
        torch.randint(0, VOCAB, (13,), generator=g).tolist(),
        short * 5,
    ]


def make_llm(path: str, ps: int, k: int, **kw) -> LLM:
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3} if k else None  # fmt: skip
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64, **kw}
    return LLM(path, device="cpu", dtype=torch.float32, page_size=ps, debug=True,
               speculative_config=spec, **kw)  # fmt: skip


def check_speculated(llm: LLM) -> None:
    s = llm.stats
    assert s.spec_verify_steps > 0, "no step verified drafts"
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens, (
        f"want accepts and rejects, got {s.spec_accepted_tokens} of {s.spec_draft_tokens}"
    )
    assert 0 < s.spec_acceptance_rate < 1 and s.spec_mean_accepted_length > 1


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculation_equals_plain_decoding(family, tmp_path):
    path = str(tmp_path)
    hf = save(family, path)
    items = prompts()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    ps_a, ps_b, ps_c = ROTATION[family]

    plain_llm = make_llm(path, ps_a, 0)
    want = [o.output_ids for o in plain_llm.generate(items, params)]
    assert want == [hf_greedy(hf, p, NEW_TOKENS) for p in items]

    llm = make_llm(path, ps_a, 1)  # k = 1
    assert [o.output_ids for o in llm.generate(items, params)] == want
    check_speculated(llm)
    assert_pages_returned(llm)

    llm = make_llm(path, ps_b, 3, enable_prefix_caching=True)  # k = 3, cached
    assert [o.output_ids for o in llm.generate(items, params)] == want
    check_speculated(llm)
    # the next turns hit the pages of prompt and answer that speculation wrote, as
    # many as the same engine's cache holds without speculation
    turns = [p + w + [1] for p, w in zip(items, want)]
    again = llm.generate(turns, params)
    cached = make_llm(path, ps_b, 0, enable_prefix_caching=True)
    cached.generate(items, params)
    oracle = cached.generate(turns, params)
    assert [o.output_ids for o in again] == [o.output_ids for o in oracle]
    hits = [o.num_cached_tokens for o in again]
    assert hits == [o.num_cached_tokens for o in oracle] and max(hits) > len(items[0])
    assert_pages_returned(llm)

    configs = specs_from_hf_config(path, page_size=ps_c, dtype=torch.float32)
    # one request's worst case per sub-pool, and a little more
    pages = {c.name: worst_case_pages(c.spec, ps_c, 64, 32) + 1 for c in configs}
    budget = pool_bytes_for(configs, pages)
    llm = make_llm(path, ps_c, 5, kv_cache_bytes=budget)  # k = 5, preempted
    out = llm.generate(items + items[::-1], params)
    assert [o.output_ids for o in out] == want + want[::-1]
    assert llm.stats.preemptions > 0
    check_speculated(llm)
    assert_pages_returned(llm)


def test_refusals(tmp_path):
    from engine_fixtures import save_tiny_hybrid

    path = str(tmp_path)
    save_tiny_hybrid("qwen3_5", path)
    with pytest.raises(ValueError, match="recurrent state"):
        make_llm(path, 4, 3)
    with pytest.raises(ValueError, match="needs 'model'"):
        LLM(
            path, device="cpu", speculative_config={"method": "eagle3", "num_speculative_tokens": 2}
        )


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama"))
    save_tiny_model("llama", path)
    return path


def test_batch_size_rule_turns_speculation_off(llama):
    """disable_by_batch_size=1: steps with several decoding requests do not speculate
    (counted), the last request alone does; tokens equal plain decoding."""
    items = prompts()
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (6, 8, 24)]
    want = [o.output_ids for o in make_llm(llama, 4, 0).generate(items, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "disable_by_batch_size": 1}  # fmt: skip
    llm = LLM(llama, device="cpu", dtype=torch.float32, page_size=4, max_num_seqs=4,
              max_model_len=64, debug=True, speculative_config=spec)  # fmt: skip
    assert [o.output_ids for o in llm.generate(items, params)] == want
    counters = llm.scheduler.spec.counters
    assert counters.skipped_by_batch_size >= 5 and counters.verify_steps > 0
    assert llm.stats.spec_verify_requests == llm.stats.spec_verify_steps  # one at a time


def test_sampled_speculation_is_seeded_and_served(llama):
    """temperature > 0 (rejection sampling): a seed gives the same tokens twice, the
    tokens are the vocabulary's, drafts were verified; /metrics exports the counters
    as ``llm.stats`` counted them; ``--speculative-config`` builds the same engine."""
    import argparse

    from prometheus_client import generate_latest
    from serving_fixtures import metric_values

    from unikv.engine.cli import add_engine_args, llm_from_args
    from unikv.serving.metrics import ServingMetrics

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--model", llama, "--device", "cpu", "--dtype", "fp32", "--page-size", "4",
         "--max-num-seqs", "4", "--max-model-len", "64", "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}']
    )  # fmt: skip
    llm = llm_from_args(args)
    assert llm.speculative_config.num_speculative_tokens == 3
    metrics = ServingMetrics(llm.engine, llm)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=5)
    first = [o.output_ids for o in llm.generate(prompts(), params)]
    stats = llm.stats
    assert first == [o.output_ids for o in llm.generate(prompts(), params)]
    assert all(len(t) == 16 and 0 <= min(t) and max(t) < VOCAB for t in first)
    assert stats.spec_verify_steps > 0 and stats.spec_draft_tokens > 0
    text = generate_latest(metrics.registry).decode()
    drafted = metric_values(text, "vllm:spec_decode_num_draft_tokens_total")
    assert list(drafted.values()) == [stats.spec_draft_tokens + llm.stats.spec_draft_tokens]


@pytest.mark.parametrize("k", [1, 3])
def test_padded_verify_plans_equal_plain_decoding(llama, k):
    """The verify graphs' plans (every lane k + 1 rows, drafts padded to k, padded
    lanes at the sink, full-width tables), run eagerly on CPU: same tokens."""
    items = prompts()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [o.output_ids for o in make_llm(llama, 4, 0).generate(items, params)]
    llm = make_llm(llama, 4, k)
    llm.runner.capture_verify(k + 1, 4, capture=False)  # sizes 1, 2, 4
    llm.scheduler.spec.pad_drafts = True
    used = []  # (requests, padded rows) of each verify step a "graph" ran
    rows_for = llm.runner.verify_graphs.rows_for

    def watch(batch):
        rows = rows_for(batch)
        used.append((len(batch.requests), rows)) if rows is not None else None
        return rows

    llm.runner.verify_graphs.rows_for = watch
    assert [o.output_ids for o in llm.generate(items, params)] == want
    assert used and {rows for _, rows in used} <= {1, 2, 4}
    assert any(num < rows for num, rows in used)  # padded lanes at the sink took part
    check_speculated(llm)
    assert_pages_returned(llm)


def test_preemption_by_swap_with_speculation(llama):
    """A pool that preempts, preempted requests swapped to host slots and back:
    speculating, the tokens equal plain decoding's and the swap path ran."""
    items = prompts()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [o.output_ids for o in make_llm(llama, 4, 0).generate(items, params)]
    configs = specs_from_hf_config(llama, page_size=4, dtype=torch.float32)
    pages = {c.name: worst_case_pages(c.spec, 4, 64, 32) + 1 for c in configs}
    llm = make_llm(llama, 4, 3, kv_cache_bytes=pool_bytes_for(configs, pages),
                   swap_host_bytes=1 << 22, preemption="swap")  # fmt: skip
    out = llm.generate(items + items[::-1], params)
    assert [o.output_ids for o in out] == want + want[::-1]
    assert llm.stats.swapped_out > 0 and llm.stats.swapped_in > 0
    check_speculated(llm)
    assert_pages_returned(llm)
