"""Greedy acceptance inside the verify graph (issue 42): a greedy verify step run
under a verify graph accepts on the device, in the graph's replay
(``speculative.graphs.accept_in_graph``): the host builds no acceptance block
(``step.verify_step`` is not called) and reads one small tensor. Its tokens equal
plain decoding's and transformers'; rejection sampling (temperature > 0) still
accepts through ``verify_step``, with the same tokens as the eager verify steps.
On CPU the graphs are their eager stand-in (``capture=False``: the same ops)."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import VOCAB, hf_greedy, one_thread, save_tiny_model  # noqa: F401

import unikv.engine.runner as runner_module
from unikv.engine import LLM, SamplingParams
from unikv.engine.speculative.config import allow_forced_acceptance
from unikv.engine.speculative.graphs import accept_in_graph

pytestmark = pytest.mark.usefixtures("one_thread")
K = 3


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    return path, save_tiny_model("llama", path)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    pattern = torch.randint(0, VOCAB, (5,), generator=g).tolist()
    return [pattern * 3 + [7, 9], torch.randint(0, VOCAB, (11,), generator=g).tolist()]


def make_llm(path: str, spec: dict | None, device: str = "cpu", **kw) -> LLM:
    kw = {"page_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 32,
          "max_model_len": 64, "kv_cache_bytes": 8 << 20, **kw}  # fmt: skip
    with allow_forced_acceptance():
        return LLM(path, device=device, dtype=torch.float32, speculative_config=spec, **kw)


NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


def graphed(llm: LLM) -> LLM:
    """``llm`` with verify graphs' eager stand-in (sizes 1, 2, 4) and padded drafts."""
    llm.runner.capture_verify(K + 1, 4, capture=False)
    llm.scheduler.spec.pad_drafts = True
    return llm


def spy(monkeypatch, llm: LLM) -> dict:
    """Counts of host-side acceptances (``verify_step``) and of graphed verify steps."""
    seen = {"host": 0, "graphed": 0}
    real, rows_for = runner_module.verify_step, llm.runner.verify_graphs.rows_for

    def host(*a, **k):
        seen["host"] += 1
        return real(*a, **k)

    def watch(batch):
        rows = rows_for(batch)
        seen["graphed"] += rows is not None
        return rows

    monkeypatch.setattr(runner_module, "verify_step", host)
    monkeypatch.setattr(llm.runner.verify_graphs, "rows_for", watch)
    return seen


def naive_accept(logits: torch.Tensor, fed: list[list[int]]) -> list[list[int]]:
    """Greedy acceptance one lane at a time, from the definition: a lane emits the
    target's argmax at each row until the row after a draft that differs from it."""
    out, at = [], 0
    for lane in fed:
        emitted = []
        for j in range(len(lane)):
            token = int(logits[at + j].argmax())
            emitted.append(token)
            if j + 1 == len(lane) or lane[j + 1] != token:
                break
        out.append(emitted)
        at += len(lane)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_accept_in_graph_equals_a_naive_acceptance(seed):
    """The captured ops' packed tensor (emitted tokens, -1 past them, then the count)
    and next pending tokens equal a lane-by-lane acceptance; forced: every draft."""
    g = torch.Generator().manual_seed(seed)
    rows, q, vocab = 3, K + 1, 5
    logits = torch.randn(rows * q, vocab, generator=g)
    targets = logits.argmax(dim=-1).view(rows, q)
    fed = torch.randint(0, vocab, (rows, q), generator=g)
    fed[0, 1:] = targets[0, :-1]  # lane 0 accepts everything
    fed[1, 1:3] = targets[1, :2]  # lane 1 accepts two
    ids = torch.cat([fed.reshape(-1), torch.full((5,), 99)])  # buffer longer than the step
    out = accept_in_graph(logits, ids, rows, q, force=False)
    want = naive_accept(logits, fed.tolist())
    assert len(want[0]) == q and len(want[1]) >= 3
    for lane, emitted in enumerate(want):
        row = out.packed[lane].tolist()
        assert row[: len(emitted)] == emitted and set(row[len(emitted) : q]) <= {-1}
        assert row[q] == len(emitted) - 1 and int(out.last[lane]) == emitted[-1]
    forced = accept_in_graph(logits, ids, rows, q, force=True)
    assert forced.accepted.tolist() == [K] * rows
    assert torch.equal(forced.tokens[:, :K], fed[:, 1:])
    assert torch.equal(forced.last, targets[:, -1])


def test_greedy_verify_graph_accepts_on_the_device(llama, monkeypatch):
    """Greedy verify steps under (stand-in) graphs never call the host acceptance;
    the tokens equal plain decoding's and transformers'."""
    path, hf = llama
    items, new = prompts(), 12
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    want = [o.output_ids for o in make_llm(path, None).generate(items, params)]
    assert want == [hf_greedy(hf, p, new) for p in items]
    llm = graphed(make_llm(path, NGRAM))
    seen = spy(monkeypatch, llm)
    assert [o.output_ids for o in llm.generate(items, params)] == want
    s = llm.stats
    assert seen["graphed"] > 0 and s.spec_verify_steps > 0
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens  # accepts and rejects
    eager = s.spec_verify_steps - seen["graphed"]  # (ragged steps, if any: the host path)
    assert seen["host"] == eager, f"{seen['host']} host acceptances for {eager} eager steps"


def test_forced_acceptance_in_the_graph(llama, monkeypatch):
    """The benchmark mode (every draft accepted) under (stand-in) graphs: accepted on
    the device, the same tokens as the eager verify steps of the same mode."""
    path, _ = llama
    spec = {"method": "ngram", "num_speculative_tokens": K, "force_accept": True}
    params = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)
    want = [o.output_ids for o in make_llm(path, spec).generate(prompts(), params)]
    llm = graphed(make_llm(path, spec))
    seen = spy(monkeypatch, llm)
    assert [o.output_ids for o in llm.generate(prompts(), params)] == want
    assert seen["graphed"] > 0 and seen["host"] == 0
    assert llm.stats.spec_accepted_tokens == llm.stats.spec_draft_tokens


def test_sampled_verify_steps_keep_rejection_sampling(llama, monkeypatch):
    """Temperature > 0 under (stand-in) graphs: the graph's logits, accepted by
    ``verify_step`` (rejection sampling), the same tokens as eager verify steps."""
    path, _ = llama
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    want = [o.output_ids for o in make_llm(path, NGRAM).generate(prompts(), params)]
    llm = graphed(make_llm(path, NGRAM))
    seen = spy(monkeypatch, llm)
    assert [o.output_ids for o in llm.generate(prompts(), params)] == want
    assert seen["graphed"] > 0 and seen["host"] == llm.stats.spec_verify_steps


@pytest.mark.gpu
def test_greedy_verify_graph_on_gpu(llama, monkeypatch):
    """On a CUDA GPU with CUDA graphs (``pytest -m gpu``; fp32): the captured verify
    graphs accept greedy drafts themselves, forced and not; tokens equal plain
    decoding's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path, _ = llama
    params = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)
    want = [o.output_ids for o in make_llm(path, None, "cuda").generate(prompts(), params)]
    forced = {"method": "ngram", "num_speculative_tokens": K, "force_accept": True}
    for spec in (NGRAM, forced):
        llm = make_llm(path, spec, "cuda", cuda_graphs=True)
        assert llm.runner.verify_graphs is not None and llm.runner.verify_graphs.graphs
        seen = spy(monkeypatch, llm)
        out = [o.output_ids for o in llm.generate(prompts(), params)]
        assert seen["graphed"] > 0 and seen["host"] == llm.stats.spec_verify_steps - seen["graphed"]
        if spec is NGRAM:
            assert out == want
