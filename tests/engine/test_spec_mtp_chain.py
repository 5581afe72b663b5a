"""An MTP layer's draft chain as one unit (``speculative/chain.py``), CPU fp32, on a
tiny Qwen3.5 (Gated DeltaNet + gated attention, its MTP layer a ``draft_full``
sub-pool) and a tiny DeepSeek-V3 (MLA + MoE, ``draft_mla``).

- Drafts: every chain's drafts equal the MTP chain computed from scratch
  (transformers' hidden states, the layer from the checkpoint's tensors:
  ``oracle_drafts`` of the two MTP test files), eagerly and over padded plans of the
  CUDA graphs' lane counts (``enable_chain(max_rows=...)``, not captured), there with
  the verify steps and the layer's rows after them padded too (``capture_verify``,
  ``capture_verify_rows``, not captured): a padded lane's first draft goes to the
  scratch row, so the real slots' first drafts, which the next chains start from,
  stay the oracle's.
- Greedy outputs equal the same engine without speculation and transformers', at
  pages 1 and 16, in a pool that preempts.
- Mechanisms: a chain plans once (one ``StepPlanner.plan`` per chain, not one a
  step), reads nothing back to the host between its steps (no ``item``, ``tolist``,
  ``cpu``, ``numpy``, ``bool``/``int`` of a tensor), and dispatches fewer ops than
  the same drafts one planned step at a time (``HiddenDraft.propose_steps``), which
  it equals.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import assert_pages_returned, hf_greedy, one_thread  # noqa: F401
from mtp_fixtures import hf_mtp, save_tiny_deepseek_mtp
from qwen_mtp_fixtures import save_tiny_qwen_mtp
from test_spec_mtp import oracle_drafts as deepseek_oracle
from test_spec_qwen_mtp import one_request_pool
from test_spec_qwen_mtp import oracle_drafts as qwen_oracle
from test_spec_rule_ops import _Ops

from unikv.engine import LLM, SamplingParams
from unikv.engine.plan import StepPlanner
from unikv.engine.speculative.chain import DraftChain, VerifyRowGraphs
from unikv.hf_config import specs_from_hf_config
from unikv.placement import pool_bytes_for, worst_case_pages

pytestmark = pytest.mark.usefixtures("one_thread")
K, NEW_TOKENS = 3, 12
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """arch -> (path, oracle(ids, count) -> drafts, transformers model)."""
    out = {}

    def get(arch: str):
        if arch not in out:
            path = str(tmp_path_factory.mktemp(arch))
            if arch == "deepseek":
                save_tiny_deepseek_mtp(path)
                hf, mtp = hf_mtp(path)
                out[arch] = (path, lambda ids, n: deepseek_oracle(hf, mtp, ids, n), hf)
            else:
                hf, block, mtp = save_tiny_qwen_mtp(arch, path)
                out[arch] = (path, lambda ids, n: qwen_oracle(hf, block, mtp, ids, n), hf)
        return out[arch]

    return get


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(6)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 19, 12)]


def preempting_pool(arch: str, path: str, ps: int) -> int:
    """Pool bytes that hold about one request's worst case: two requests preempt."""
    if arch != "deepseek":
        return one_request_pool(path, K, ps, 40)
    (config,) = specs_from_hf_config(path, page_size=ps, dtype=torch.float32)
    pages = 3 * (worst_case_pages(config.spec, ps, 64, 32) + 1) // 2
    return pool_bytes_for([config], {"mla": pages})


def make_llm(path: str, ps: int, spec: bool, **kw) -> LLM:
    config = {"method": "mtp", "num_speculative_tokens": K} if spec else None
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64, **kw}
    return LLM(path, device="cpu", dtype=torch.float32, page_size=ps, debug=True,
               speculative_config=config, **kw)  # fmt: skip


class ChainSpy:
    """Per chain run: (each lane's tokens, its drafts, plans made, host reads)."""

    def __init__(self, llm: LLM, monkeypatch) -> None:
        self.runs = []
        run, plan, chain_body = DraftChain.run, StepPlanner.plan, DraftChain._chain
        state = {"plans": 0, "reads": 0, "in_chain": False}

        def spy_plan(planner, *a, **k):
            state["plans"] += 1
            return plan(planner, *a, **k)

        def spy_body(chain, *a, **k):
            state["in_chain"] = True
            try:
                return chain_body(chain, *a, **k)
            finally:
                state["in_chain"] = False

        def spy_run(chain, requests, virtual_ids, starts):
            state["plans"] = state["reads"] = 0
            out = run(chain, requests, virtual_ids, starts)
            seen = [(r.prompt_ids + r.output_ids) for r in requests]
            self.runs.append((seen, out.tolist(), state["plans"], state["reads"]))
            return out

        for name in HOST_READS:
            inner = getattr(torch.Tensor, name)

            def read(t, *a, _inner=inner, **k):
                state["reads"] += state["in_chain"]
                return _inner(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, read)
        monkeypatch.setattr(DraftChain, "run", spy_run)
        monkeypatch.setattr(DraftChain, "_chain", spy_body)
        monkeypatch.setattr(StepPlanner, "plan", spy_plan)


@pytest.mark.parametrize(
    "arch, ps, padded",
    [("qwen3_5", 16, False), ("qwen3_5", 1, True), ("deepseek", 1, False), ("deepseek", 16, True)],
)
def test_chain_drafts_and_outputs_under_preemption(saved, arch, ps, padded, monkeypatch):
    """Six requests in a pool of about one: preempted and recomputed; tokens equal
    plain decoding's and transformers'; each chain planned once, read nothing back,
    and its drafts are the from-scratch chain's."""
    path, oracle, hf = saved(arch)
    items, params = prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [o.output_ids for o in make_llm(path, ps, False).generate(items, params)]
    assert want == [hf_greedy(hf, p, NEW_TOKENS) for p in items]
    size = {"kv_cache_bytes": preempting_pool(arch, path, ps)}
    size |= {"max_model_len": 40} if arch != "deepseek" else {}
    llm = make_llm(path, ps, True, **size)
    draft = llm.runner.draft
    assert isinstance(draft.chain, DraftChain)
    if padded:  # the graphs' padded plans (lane counts 1, 2, 4), run eagerly
        padded_eager(llm)
        assert draft.chain.sizes == [1, 2, 4]
    lanes: list = []  # (requests, padded size) of each verify step's rows run padded
    with monkeypatch.context() as m:
        spy = ChainSpy(llm, m)
        spy_padded_rows(m, lanes)
        out = llm.generate(items + items[::-1], params)
    assert [o.output_ids for o in out] == want + want[::-1]
    assert llm.stats.preemptions > 0
    assert bool(lanes) == padded  # the rows after a padded verify step: its own path
    assert len(spy.runs) >= 4
    for seen, drafts, plans, reads in spy.runs:
        assert plans == 1 and reads == 0
        assert len(drafts) == len(seen) and all(len(d) == K for d in drafts)
    for seen, drafts, _, _ in spy.runs[:3]:
        for ids, got in zip(seen, drafts):
            assert got == oracle(ids, K)
    assert_pages_returned(llm)


def padded_eager(llm) -> None:
    """The graphs' padded plans (lane counts 1, 2, 4) run eagerly: the chain, the verify
    steps and the rows after them."""
    draft = llm.runner.draft
    draft.enable_chain(K, max_rows=4, capture=False)
    llm.runner.capture_verify(K + 1, 4, capture=False)
    draft.capture_verify_rows(llm.runner.verify_graphs, capture=False)


def spy_padded_rows(m, lanes: list) -> None:
    """Record (requests, padded size) of each verify step's rows run padded."""
    rows_run = VerifyRowGraphs.run

    def spy_rows(graphs, plan, rows, tokens, accepted):
        lanes.append((tokens.shape[0], rows))
        return rows_run(graphs, plan, rows, tokens, accepted)

    m.setattr(VerifyRowGraphs, "run", spy_rows)


def test_padded_lanes_keep_the_real_slots_first_drafts(saved, monkeypatch):
    """Three requests in padded plans of 4 lanes (chain, verify step, the rows after
    it): the padded lane's outputs go to the scratch row, so every chain still starts
    from its request's own first draft: drafts equal the oracle's, tokens plain's."""
    path, oracle, _ = saved("qwen3_5")
    items, params = prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [o.output_ids for o in make_llm(path, 16, False).generate(items, params)]
    llm = make_llm(path, 16, True)
    padded_eager(llm)
    lanes: list = []
    with monkeypatch.context() as m:
        spy = ChainSpy(llm, m)
        spy_padded_rows(m, lanes)
        assert [o.output_ids for o in llm.generate(items, params)] == want
    assert (3, 4) in lanes  # three requests, a padded lane
    three = [run for run in spy.runs if len(run[0]) == 3]
    assert len(three) >= 2
    for seen, drafts, _, _ in three[:3]:
        for ids, got in zip(seen, drafts):
            assert got == oracle(ids, K)
    assert_pages_returned(llm)


def test_chain_costs_fewer_ops_than_a_plan_a_step(saved, monkeypatch):
    """One request, k = 3: at every chain, the same drafts one planned step at a
    time (``propose_steps``, its rows rewritten with the same values) are equal and
    cost more ops and k - 1 plans; the chain costs one plan."""
    path = saved("qwen3_5")[0]
    llm = make_llm(path, 4, True)
    draft, propose = llm.runner.draft, llm.runner.draft.propose
    plans, plan, costs = [0], StepPlanner.plan, []

    def spy_plan(planner, *a, **k):
        plans[0] += 1
        return plan(planner, *a, **k)

    def both(requests, counts, virtual_ids):
        import numpy as np

        if draft.chain is None or not (counts == K).all():
            return propose(requests, counts, virtual_ids)
        measured = []
        for fn in (propose, lambda *a: draft.propose_steps(*a, np.arange(len(counts)) * 4)):
            ops, plans[0] = _Ops(), 0
            with ops:
                out = fn(requests, counts, virtual_ids)
            measured.append((out.tolist(), ops.count, plans[0]))
        costs.append(measured)
        return out

    monkeypatch.setattr(StepPlanner, "plan", spy_plan)
    monkeypatch.setattr(draft, "propose", both)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    llm.generate(prompts()[:1], params)
    assert len(costs) >= 3
    for (chain, chain_ops, chain_plans), (steps, steps_ops, steps_plans) in costs:
        assert chain == steps
        assert chain_plans == 1 and steps_plans == K - 1
        assert chain_ops < steps_ops


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_5", "deepseek"])
def test_chain_graphs_on_gpu(saved, arch, monkeypatch):
    """On CUDA: chains of up to the captured lane counts replay their graph, as do
    the head's rows after each verify graph (none runs eagerly), and greedy tokens
    equal the same engine's without speculation."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path = saved(arch)[0]
    items, params = prompts(), SamplingParams(max_tokens=24, temperature=0.0)
    kw = {"device": "cuda", "dtype": torch.float32, "page_size": 16, "max_num_seqs": 8,
          "max_model_len": 128, "kv_cache_bytes": 64 << 20}  # fmt: skip
    want = [o.output_ids for o in LLM(path, **kw).generate(items, params)]
    llm = LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": K}, **kw)
    chain = llm.runner.draft.chain
    assert chain.graphs and sorted(chain.graphs) == chain.sizes
    eager, body = [], DraftChain._chain

    def spy_body(c, *a, **k):
        eager.append(1)
        return body(c, *a, **k)

    monkeypatch.setattr(DraftChain, "_chain", spy_body)
    runs = [0]
    run = DraftChain.run

    def spy_run(c, *a, **k):
        runs[0] += 1
        return run(c, *a, **k)

    monkeypatch.setattr(DraftChain, "run", spy_run)
    rows_graphs, rows_eager, rows_body = llm.runner.draft.verify_rows, [], VerifyRowGraphs._rows
    assert rows_graphs is not None and sorted(rows_graphs.graphs) == rows_graphs.sizes

    def spy_rows(g, *a, **k):
        rows_eager.append(1)
        return rows_body(g, *a, **k)

    monkeypatch.setattr(VerifyRowGraphs, "_rows", spy_rows)
    assert [o.output_ids for o in llm.generate(items, params)] == want
    assert runs[0] > 0 and not eager and not rows_eager
    llm.alloc.check_integrity()
