"""An MTP layer past the batch-size rule is lazy (``speculative/mtp.py``): the
rule's plain decode steps run no layer, they stash the target's exported hidden
states and sampled tokens, and the layer writes the stashed rows in one extend
(``HiddenDraft.catch_up``) when speculation resumes, when a request leaves with
pages that stay, and at the latest every ``window`` lazy steps.

Oracle: every draft proposed after resumption equals the MTP chain computed from
scratch (transformers' hidden states, the layer from the checkpoint's tensors:
``test_spec_qwen_mtp.oracle_drafts``), which holds only if the layer's rows in
the pool, those the lazy steps stashed included, are the true ones; tokens equal
transformers' greedy ones.
"""

from __future__ import annotations

import pytest
from engine_fixtures import assert_pages_returned, hf_greedy, one_thread  # noqa: F401
from qwen_mtp_fixtures import save_tiny_qwen_mtp
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
    """(outputs, lazy steps past the rule, layer runs in them, layer runs in all)."""
    count = {"rule": 0, "rule_runs": 0, "runs": 0}
    runner, launch, layer_run = llm.runner, llm.runner.launch, HiddenDraft._run

    def spy_run(draft, *a, **k):
        count["runs"] += 1
        return layer_run(draft, *a, **k)

    def spy_launch(batch, prev=None):
        before = count["runs"]
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


@pytest.mark.parametrize("window", [3, 16])
def test_lazy_mtp_resumes_on_the_true_chain(qwen, window, monkeypatch):
    """Three requests (10, 14 and 24 tokens), limit 2: the rule's steps run the layer
    only in a flush every ``window`` of them (none at 16); the drafts after
    resumption are the from-scratch chain's; tokens are transformers'."""
    path, hf, block, mtp = qwen
    items = prompts()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (10, 14, 24)]
    llm = make_llm(path, 3, 4, speculative_disable_by_batch_size=LIMIT)
    draft = llm.runner.draft
    draft.enable_lazy(draft.rule, draft.stash, window=window)
    seen = spy_drafts(llm)
    got, count = run(llm, items, params, monkeypatch)
    assert got == [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(items, params)]
    assert count["rule"] >= 3 and count["rule_runs"] <= count["rule"] // window
    assert len(seen) >= 3 and any(len(d) == 3 for _, d, _ in seen)
    for ids, drafts, _ in seen:
        assert drafts == oracle_drafts(hf, block, mtp, ids, len(drafts))
    assert not draft.lagging
    assert_pages_returned(llm)


def test_lazy_mtp_under_swap(qwen, monkeypatch):
    """Preemption by swap while rows lag: they are written before the pages leave,
    so the swapped-in request's drafts are still the chain's."""
    path, hf, block, mtp = qwen
    k, ps, length = 3, 4, 40
    items = prompts()
    items = items + items[::-1]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = make_llm(path, k, ps, kv_cache_bytes=one_request_pool(path, k, ps, length),
                   max_model_len=length, preemption="swap", swap_host_bytes=1 << 22,
                   speculative_disable_by_batch_size=1)  # fmt: skip
    draft = llm.runner.draft
    draft.enable_lazy(draft.rule, draft.stash, window=3)
    seen = spy_drafts(llm)
    got, count = run(llm, items, params, monkeypatch, limit=1)
    assert got == [hf_greedy(hf, p, 12) for p in items]
    s = llm.stats
    assert s.preemptions > 0 and s.swapped_in > 0 and count["rule"] > 0
    assert count["rule_runs"] <= count["rule"] // 3 and len(seen) > 0
    for ids, drafts, _ in seen:
        assert drafts == oracle_drafts(hf, block, mtp, ids, len(drafts))
    assert_pages_returned(llm)


def test_lazy_eagle3_resumes_on_the_true_chain(tmp_path_factory, monkeypatch):
    """An EAGLE-3 head (three target hidden states per row in the stash), pages 1,
    prefix caching on, window 3: no head run in the rule's steps but the flushes;
    the drafts after resumption are the head's chain; tokens are transformers'."""
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
    seen = spy_drafts(llm)
    got, count = run(llm, items, params, monkeypatch)
    assert got == [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(items, params)]
    assert count["rule"] >= 3 and count["rule_runs"] <= count["rule"] // 3
    assert len(seen) >= 3 and any(len(d) == 3 for _, d, _ in seen)
    for ids, drafts, _ in seen:
        assert drafts == e3.oracle_drafts(hf, saved[3], ids, len(drafts))
    assert_pages_returned(llm)
