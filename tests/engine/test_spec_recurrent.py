"""Speculative decoding on recurrent hybrids (per-draft-position state slots) on CPU
(fp32, torch reference ops): Qwen3.5 (Gated DeltaNet + gated attention) and NemotronH
(Mamba-2 + attention + MLP).

Greedy tokens with speculation equal the same engine's without it, and those equal
transformers' greedy ``generate``. Qwen3.5 runs the whole grid k = 1, 3, 5 x page
sizes 1, 4, 16, NemotronH its diagonal; each cell runs one scenario of four: plain,
prefix caching on (a second turn hits the pages and state checkpoints the first left,
speculation included), and a pool too small for the load, preempted by recompute or by
swap to host slots (the pool holds one worst-case request alone, its 1 + k state
slots included, and little more: two requests decoding at once outgrow it). The drafts of these runs (method ``ngram``) come from an
oracle that knows the plain run's tokens and spoils one of them at a position that
moves with the request's length, so every accepted length 0 .. k occurs and each
selects a different state slot; a run must accept some drafts and reject some, and
give every page and state slot back (the allocator checks its invariants after every
verb, the draft slots' included). Then the real n-gram lookup and a draft model (a
tiny Llama of the same vocabulary, its K/V in ``draft_*`` sub-pools) on both families;
the verify graphs' padded plans and the Triton ops (interpreter) on Qwen3.5; and LFM2
(conv-only state) and Kimi-Linear (KDA, MLA) with prefix caching.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_fixtures import (
    VOCAB,
    assert_pages_returned,
    hf_greedy,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_hybrid,
    save_tiny_model,
    save_tiny_nemotron_h,
)

from unikv.engine import LLM, SamplingParams
from unikv.hf_config import specs_from_hf_config
from unikv.placement import pool_bytes_for, worst_case_pages

pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 14
TIGHT_LEN = 40  # max_model_len of the preempting runs (prompts <= 17 + 14 outputs)
CELLS = [  # (family, k, page size, scenario): Qwen3.5 the whole k x pages grid
    ("qwen3_5", 1, 1, "recompute"), ("qwen3_5", 1, 4, "prefix"), ("qwen3_5", 1, 16, "swap"),
    ("qwen3_5", 3, 1, "plain"), ("qwen3_5", 3, 4, "swap"), ("qwen3_5", 3, 16, "prefix"),
    ("qwen3_5", 5, 1, "prefix"), ("qwen3_5", 5, 4, "recompute"),
    ("qwen3_5", 5, 16, "recompute"),
    ("nemotron_h", 1, 1, "swap"), ("nemotron_h", 3, 4, "prefix"),
    ("nemotron_h", 5, 16, "recompute"),
]  # fmt: skip


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (17, 9, 12)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """Per family: its path and transformers' greedy tokens for ``prompts()``; and a
    Llama of the same vocabulary (the draft model)."""
    out = {}
    for family in ("qwen3_5", "nemotron_h"):
        path = str(tmp_path_factory.mktemp(family))
        hf = save_tiny_hybrid(family, path) if family == "qwen3_5" else (
            save_tiny_nemotron_h(path, "M*M-M*-"))  # fmt: skip
        out[family] = (path, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()])
    out["draft"] = str(tmp_path_factory.mktemp("llama"))
    save_tiny_model("llama", out["draft"])
    return out


def make_llm(path: str, ps: int, spec: dict | None, **kw) -> LLM:
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64, **kw}
    return LLM(path, device="cpu", dtype=torch.float32, page_size=ps, debug=True,
               speculative_config=spec, **kw)  # fmt: skip


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}  # fmt: skip


class Oracle:
    """A proposer (``Speculator._propose``) that knows each prompt's greedy outputs
    and spoils the draft at position ``(11 * len(outputs) + 3) % (k + 2)`` (past the
    draft: all accepted); prompts it does not know get the real n-gram lookup."""

    def __init__(self, llm: LLM, known: dict) -> None:
        self.spec, self.known = llm.scheduler.spec, known
        self.real = self.spec._propose
        self.spec._propose = self

    def __call__(self, r, room: int) -> np.ndarray:
        future = self.known.get(tuple(r.prompt_ids))
        if future is None:
            return self.real(r, room)
        done = len(r.output_ids)
        draft = np.asarray(future[done : done + room], np.int64)
        spoil = (11 * done + 3) % (self.spec.k + 2)
        if spoil < len(draft):
            draft[spoil] = (draft[spoil] + 1) % VOCAB
        return draft


def check_speculated(llm: LLM) -> None:
    s = llm.stats
    assert s.spec_verify_steps > 0, "no step verified drafts"
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens, (
        f"want accepts and rejects, got {s.spec_accepted_tokens} of {s.spec_draft_tokens}"
    )


def tight_pool(path: str, ps: int, k: int) -> int:
    """The pages of one request of ``TIGHT_LEN`` tokens and the state slots of two
    (1 + k each): two requests are admitted, and outgrow it as they decode."""
    configs = specs_from_hf_config(path, page_size=ps, dtype=torch.float32)
    pages = {  # (pool_bytes_for adds one page or slot to each)
        c.name: 2 * (1 + k) - 1 if c.spec.kind == "mamba" else
        worst_case_pages(c.spec, ps, TIGHT_LEN, 32) - 1
        for c in configs
    }  # fmt: skip
    return pool_bytes_for(configs, pages)


@pytest.mark.parametrize(("family", "k", "ps", "scenario"), CELLS)
def test_greedy_speculation_equals_plain_decoding(models, family, k, ps, scenario):
    path, hf_tokens = models[family]
    items, params = prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    turns = [p + w + [1] for p, w in zip(items, hf_tokens)]
    cached = scenario == "prefix"
    plain = make_llm(path, ps, None, enable_prefix_caching=cached)
    want = [o.output_ids for o in plain.generate(items, params)]
    assert want == hf_tokens
    kw = {"enable_prefix_caching": cached}
    if scenario in ("recompute", "swap"):
        kw.update(kv_cache_bytes=tight_pool(path, ps, k), max_model_len=TIGHT_LEN)
        items = items + items[::-1]
        want = want + want[::-1]
    if scenario == "swap":
        kw.update(swap_host_bytes=1 << 22, preemption="swap")
    llm = make_llm(path, ps, ngram(k), **kw)
    assert llm.alloc.parts.mamba.k == k
    Oracle(llm, {tuple(p): w for p, w in zip(prompts(), hf_tokens)})
    assert [o.output_ids for o in llm.generate(items, params)] == want
    check_speculated(llm)
    stats = llm.stats
    if scenario == "recompute":
        assert stats.preemptions > 0
    if scenario == "swap":
        assert stats.swapped_out > 0 and stats.swapped_in > 0
    if cached:  # the next turns hit pages and checkpoints that speculation wrote
        again = llm.generate(turns, params)
        oracle = plain.generate(turns, params)
        assert [o.output_ids for o in again] == [o.output_ids for o in oracle]
        # as many hits as without speculation: checkpoints at the pages a verify step
        # completed, taken from the per-draft-position slot of that row
        hits = [o.num_cached_tokens for o in again]
        assert hits == [o.num_cached_tokens for o in oracle] and max(hits) >= 16
    assert_pages_returned(llm)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_real_drafts(models, family):
    """The real n-gram lookup (k = 3, page size 4) and a Llama draft model (k = 2,
    page size 16; its band floats between the target's two): same tokens."""
    path, hf_tokens = models[family]
    items, params = prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    llm = make_llm(path, 4, ngram(3))
    assert [o.output_ids for o in llm.generate(items, params)] == hf_tokens
    assert_pages_returned(llm)
    spec = {"method": "draft_model", "model": models["draft"], "num_speculative_tokens": 2}
    llm = make_llm(path, 16, spec)
    assert "draft_full" in llm.pool.subpools
    assert [o.output_ids for o in llm.generate(items, params)] == hf_tokens
    assert llm.stats.spec_draft_tokens > 0
    assert_pages_returned(llm)


def test_padded_verify_plans_and_triton_ops(models):
    """The verify graphs' plans run eagerly (every lane k + 1 rows, padded lanes at
    the sink, their draft slots too), with the torch ops (three requests run as four
    lanes, k = 3) and with the Triton recurrent ops under the interpreter (one short
    request, k = 4: a step that rejects a draft and one that accepts all):
    Qwen3.5's tokens equal transformers'."""
    path, hf_tokens = models["qwen3_5"]
    runs = {"torch": ([0, 1, 2], 6, 3), "triton": ([1], 6, 4)}  # (prompts, tokens, k)
    for backend, (which, new, k) in runs.items():
        items = [prompts()[i] for i in which]
        llm = make_llm(path, 4, ngram(k), backend=backend)
        llm.runner.capture_verify(k + 1, 4, capture=False)  # sizes 1, 2, 4
        llm.scheduler.spec.pad_drafts = True
        Oracle(llm, {tuple(p): w for p, w in zip(prompts(), hf_tokens)})
        params = SamplingParams(max_tokens=new, temperature=0.0)
        assert [o.output_ids for o in llm.generate(items, params)] == [
            hf_tokens[i][:new] for i in which
        ]
        check_speculated(llm)
        assert_pages_returned(llm)


@pytest.mark.parametrize("family", ["lfm2", "kimi_linear"])
def test_conv_only_and_kda_families(family, tmp_path):
    """The same slots cover LFM2's short convolutions (a conv-only state slot) and
    Kimi-Linear's KDA (a decay per key channel, MLA attention): k = 3, page size 4,
    prefix caching on; greedy tokens equal transformers'."""
    path = str(tmp_path)
    if family == "lfm2":
        from family_fixtures import save_tiny_lfm2

        hf = save_tiny_lfm2(path)
    else:
        from test_engine_kimi_linear import save_tiny_kimi

        hf = save_tiny_kimi(path)
    items, params = prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in items]
    llm = make_llm(path, 4, ngram(3), enable_prefix_caching=True)
    Oracle(llm, {tuple(p): w for p, w in zip(items, want)})
    assert [o.output_ids for o in llm.generate(items, params)] == want
    check_speculated(llm)
    assert_pages_returned(llm)
