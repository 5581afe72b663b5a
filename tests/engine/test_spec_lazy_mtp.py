"""An MTP layer past the batch-size rule is lazy (``speculative/mtp.py``): the
rule's plain decode steps run no layer, they stash the target's exported hidden
states and sampled tokens, and the layer writes a request's last ``window`` stashed
rows in one extend (``HiddenDraft.catch_up``) when it speculates again; older rows
are holes, zeroed (``speculative/holes.py``). Nothing is flushed past the rule.

Oracle: every draft proposed after resumption equals the MTP chain computed from
scratch (transformers' hidden states, the layer from the checkpoint's tensors:
``test_spec_qwen_mtp.oracle_drafts``), with the layer's K and V zeroed at the hole
rows, which the test derives from the steps it saw (the lazy rows of each request
but the last ``window`` of each run of them); this holds only if the layer's rows in
the pool, those the lazy steps stashed included, are the true ones and the holes'
are zeros, whatever the pool held before (it starts filled with NaN here); tokens
equal transformers' greedy ones.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import pytest
import torch
from engine_fixtures import assert_pages_returned, hf_greedy, one_thread  # noqa: F401
from qwen_mtp_fixtures import qwen_mtp_rows, save_tiny_qwen_mtp
from test_spec_qwen_mtp import make_llm, one_request_pool, oracle_drafts, prompts, spy_drafts

from unikv.engine import SamplingParams
from unikv.engine.request import BatchKind
from unikv.engine.speculative.mtp import HiddenDraft

pytestmark = pytest.mark.usefixtures("one_thread")
LIMIT = 2


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(path, transformers model, MTP block, MTP tensors) of a tiny Qwen3.5 with MTP."""
    path = str(tmp_path_factory.mktemp("qwen3_5"))
    return (path, *save_tiny_qwen_mtp("qwen3_5", path))


def run(llm, items, params, monkeypatch, limit: int = LIMIT):
    """(outputs, counts): lazy steps past the rule (``rule``), layer runs in them
    (``rule_runs``) and in all (``runs``), and each request's lazy rows (``lazy``: id
    -> the positions its lazy steps fed)."""
    count = {"rule": 0, "rule_runs": 0, "runs": 0, "lazy": defaultdict(list)}
    runner, launch, layer_run = llm.runner, llm.runner.launch, HiddenDraft._run

    def spy_run(draft, *a, **k):
        count["runs"] += 1
        return layer_run(draft, *a, **k)

    def spy_launch(batch, prev=None):
        before = count["runs"]
        if batch.kind is BatchKind.DECODE and batch.lazy:
            for r in batch.requests:
                count["lazy"][r.request_id].append(r.num_cached)
        out = launch(batch, prev)
        if batch.kind is BatchKind.DECODE and len(batch.requests) > limit:
            count["rule"] += 1
            count["rule_runs"] += count["runs"] - before
        return out

    with monkeypatch.context() as m:
        m.setattr(HiddenDraft, "_run", spy_run)
        m.setattr(runner, "launch", spy_launch)
        out = [o.output_ids for o in llm.generate(items, params)]
    return out, count


def spy_proposals(llm) -> list:
    """Record (request id, its tokens, its drafts) of every proposal."""
    seen, propose = [], llm.runner.draft.propose

    def spy(requests, counts, virtual_ids):
        out = propose(requests, counts, virtual_ids)
        flat, at = out.tolist(), 0
        for r, n in zip(requests, counts.tolist()):
            seen.append((r.request_id, r.prompt_ids + r.output_ids, flat[at : at + n]))
            at += n
        return out

    llm.runner.draft.propose = spy
    return seen


def holes_of(rows: list[int], window: int, before: int) -> list[int]:
    """The hole positions under ``before`` of a request whose lazy steps fed
    ``rows``: each run of consecutive rows but its last ``window`` (a run ends where
    the layer ran over the request again: its stashed rows were written then)."""
    rows = sorted(p for p in rows if p < before)
    runs, holes = [], []
    for p in rows:
        if runs and runs[-1][-1] == p - 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    for r in runs:
        holes += r[: max(len(r) - window, 0)]
    return holes


def fill_draft_pool(llm, value: float) -> None:
    """Every K/V byte of the layer's sub-pool set to ``value`` (as uninitialised
    memory may hold)."""
    for cache in llm.runner.draft.caches:
        cache.store_k.fill_(value)
        cache.store_v.fill_(value)


@contextmanager
def zeroed_kv(attn, holes: list[int]):
    """transformers' attention module ``attn`` (eager) with the K and V rows at
    positions ``holes`` zeroed after rope, as the engine's zeroed rows read."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    eager, config = mq.eager_attention_forward, attn.config
    impl = config._attn_implementation

    def attend(module, q, k, v, mask, **kw):
        if module is attn:
            k, v = k.clone(), v.clone()
            k[:, :, holes] = 0
            v[:, :, holes] = 0
        return eager(module, q, k, v, mask, **kw)

    mq.eager_attention_forward, config._attn_implementation = attend, "eager"
    try:
        yield
    finally:
        mq.eager_attention_forward, config._attn_implementation = eager, impl


@torch.no_grad()
def hole_oracle(hf, block, mtp, ids: list[int], count: int, holes: list[int]) -> list[int]:
    """``oracle_drafts`` with the layer's K/V zeroed at ``holes``."""
    if not holes:
        return oracle_drafts(hf, block, mtp, ids, count)
    hidden = hf.model(torch.tensor([ids[:-1]])).last_hidden_state[0]
    tokens, drafts = ids[1:], []
    with zeroed_kv(block.self_attn, holes):
        for _ in range(count):
            g = qwen_mtp_rows(hf, block, mtp, tokens, hidden)
            drafts.append(int(hf.lm_head(g[-1]).argmax()))
            tokens, hidden = tokens + drafts[-1:], torch.cat([hidden, g[-1:]])
    return drafts


@pytest.mark.parametrize("window", [3, 16])
def test_lazy_mtp_resumes_on_the_true_chain(qwen, window, monkeypatch):
    """Three requests (10, 14 and 24 tokens), limit 2, the layer's pool filled with
    NaN first: the rule's steps run no layer; the drafts after resumption are the
    from-scratch chain's with the K/V at the holes zeroed (window 3: some; 16:
    none); tokens are transformers'."""
    path, hf, block, mtp = qwen
    items = prompts()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (10, 14, 24)]
    llm = make_llm(path, 3, 4, speculative_disable_by_batch_size=LIMIT)
    draft = llm.runner.draft
    draft.enable_lazy(draft.rule, draft.stash, window=window)
    fill_draft_pool(llm, float("nan"))
    seen = spy_proposals(llm)
    got, count = run(llm, items, params, monkeypatch)
    assert got == [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(items, params)]
    assert count["rule"] >= 3 and count["rule_runs"] == 0
    assert len(seen) >= 3 and any(len(d) == 3 for _, _, d in seen)
    holed = 0
    for rid, ids, drafts in seen:
        holes = holes_of(count["lazy"][rid], window, len(ids) - 1)
        holed += bool(holes)
        assert drafts == hole_oracle(hf, block, mtp, ids, len(drafts), holes), (rid, holes)
    assert (holed > 0) == (window == 3) == (llm.stats.spec_head_hole_rows > 0)
    assert not draft.lagging
    assert_pages_returned(llm)


def test_lazy_mtp_under_swap(qwen, monkeypatch):
    """Preemption by swap while rows lag: the stashed rows are written before the
    pages leave (the slot's ring does not come back), so the swapped-in request's
    drafts are still the chain's; the rule's steps run no layer."""
    path, hf, block, mtp = qwen
    k, ps, length = 3, 4, 40
    items = prompts()
    items = items + items[::-1]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = make_llm(path, k, ps, kv_cache_bytes=one_request_pool(path, k, ps, length),
                   max_model_len=length, preemption="swap", swap_host_bytes=1 << 22,
                   speculative_disable_by_batch_size=1)  # fmt: skip
    draft = llm.runner.draft
    draft.enable_lazy(draft.rule, draft.stash, window=16)  # (no hole: the chain's drafts)
    seen = spy_drafts(llm)
    got, count = run(llm, items, params, monkeypatch, limit=1)
    assert got == [hf_greedy(hf, p, 12) for p in items]
    s = llm.stats
    assert s.preemptions > 0 and s.swapped_in > 0 and count["rule"] > 0
    assert count["rule_runs"] == 0 and len(seen) > 0
    for ids, drafts, _ in seen:
        assert drafts == oracle_drafts(hf, block, mtp, ids, len(drafts))
    assert_pages_returned(llm)


def test_lazy_eagle3_holes_and_a_hit_on_them(tmp_path_factory, monkeypatch):
    """An EAGLE-3 head (three target hidden states per row in the stash), pages 1,
    prefix caching on, window 3, its pool NaN first: no head run in the rule's steps;
    the drafts after resumption are the head's chain with the holes' K/V zeroed. The
    first request finishes lagging: its rows are zeroed, not written, and its first
    page holding one is recorded; a next turn over its tokens hits those pages,
    counted (``spec_head_hole_hits``), and drafts the chain with the hit's holes zeroed;
    tokens are transformers'."""
    import test_spec_eagle3 as e3
    from mtp_fixtures import save_tiny_eagle3

    target = str(tmp_path_factory.mktemp("llama6"))
    hf = e3.save_tiny_model("llama", target, num_hidden_layers=6)
    head = str(tmp_path_factory.mktemp("eagle3"))
    saved = (target, hf, head, save_tiny_eagle3(head, hf.config))
    items = e3.prompts()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (10, 14, 22)]
    llm = e3.make_llm(
        saved, 3, 1, enable_prefix_caching=True, speculative_disable_by_batch_size=LIMIT
    )
    draft = llm.runner.draft
    draft.enable_lazy(draft.rule, draft.stash, window=3)
    fill_draft_pool(llm, float("nan"))
    seen = spy_proposals(llm)
    got, count = run(llm, items, params, monkeypatch)
    assert got == [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(items, params)]
    assert count["rule"] >= 3 and count["rule_runs"] == 0
    assert len(seen) >= 3 and any(len(d) == 3 for _, _, d in seen)
    for rid, ids, drafts in seen:
        holes = holes_of(count["lazy"][rid], 3, len(ids) - 1)
        assert drafts == e3.oracle_drafts(hf, saved[3], ids, len(drafts), holes), (rid, holes)
    first = min(count["lazy"])  # the shortest request: it finished lagging
    assert not any(rid == first for rid, _, _ in seen) and draft.holes.stale
    assert llm.stats.spec_head_hole_hits == 0
    turn = items[0] + got[0]
    seen.clear()
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([turn], sp)
    assert out.output_ids == hf_greedy(hf, turn, 8) and llm.stats.spec_head_hole_hits == 1
    hit = out.num_cached_tokens
    holes = [p for p in count["lazy"][first] if p < hit]
    assert hit > 0 and holes and seen
    for _, ids, drafts in seen:
        assert drafts == e3.oracle_drafts(hf, saved[3], ids, len(drafts), holes)
    assert_pages_returned(llm)


def test_lazy_mla_mtp_holes_are_zeros(tmp_path_factory, monkeypatch):
    """DeepSeek-V3's MTP layer (an MLA latent cache), window 3: the drafts after
    resumption are the same whether the layer's pool held NaN or 7.0 before (the
    holes' latent rows are zeroed, the rest written), and the holes' rows read as
    zeros; tokens are transformers'."""
    from mtp_fixtures import hf_mtp, save_tiny_deepseek_mtp

    path = str(tmp_path_factory.mktemp("deepseek_mtp"))
    save_tiny_deepseek_mtp(path)
    hf, _ = hf_mtp(path)
    items = prompts()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (10, 14, 24)]
    runs = []
    for fill in (float("nan"), 7.0):
        llm = make_llm(path, 3, 4, speculative_disable_by_batch_size=LIMIT)
        draft = llm.runner.draft
        draft.enable_lazy(draft.rule, draft.stash, window=3)
        for cache in draft.caches:
            cache.latent.fill_(fill)
        seen = spy_proposals(llm)
        got, count = run(llm, items, params, monkeypatch)
        assert got == [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(items, params)]
        assert count["rule_runs"] == 0 and llm.stats.spec_head_hole_rows > 0
        runs.append(seen)
    assert runs[0] == runs[1] and any(len(d) == 3 for _, _, d in runs[0])
