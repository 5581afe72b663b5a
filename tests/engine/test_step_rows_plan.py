"""The step planner makes the row-shaped ops' plan once per step (issue 43 item 5):
``StepPlan.rows`` for the step's token rows, ``StepPlan.logit_rows`` for the LM head's
(one a request), a CUDA graph's at its captured size; the decoder runs every layer
under it, so no op of a step derives its variant from a shape. The speculative draft
heads (MTP, EAGLE-3), whose forwards bypass the decoder's, run under the same plans.

Oracles: the step's own tensors (its token count is ``input_ids``' length, its logits
rows ``logits_indices``'), the variants the rules name on both sides of their
thresholds (the GEMV at one row, not two; the MoE's dense table at 256 tokens, not
257), a spy on each rule function that sees every call an op makes without a plan
(shown to see one), and transformers' greedy tokens for the whole run.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import VOCAB, hf_greedy, one_thread, save_tiny_model  # noqa: F401
from mtp_fixtures import save_tiny_deepseek_mtp, save_tiny_eagle3

from unikv.engine import LLM, SamplingParams
from unikv.engine.scheduler import Batch
from unikv.engine.speculative.chain import VerifyRowGraphs
from unikv.kernels.linear import fp8_gemm, gemv
from unikv.kernels.moe import fused
from unikv.kernels.moe import ref as moe_ref

pytestmark = pytest.mark.usefixtures("one_thread")

RULES = ((gemv, "route_rows"), (moe_ref, "dense_rows"), (fused, "bucket"), (fp8_gemm, "row_choice"))


def rule_spies(monkeypatch) -> list[str]:
    """Each call of a row rule made through its module (an op deriving its variant from
    a shape); the backends' ``plan_rows`` hold their own references, unseen here."""
    calls: list[str] = []
    for module, name in RULES:
        real = getattr(module, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)
    return calls


def planned(llm, monkeypatch) -> list:
    """Every StepPlan the engine's planner makes from here on."""
    plans, planner = [], llm.runner.planner
    real = planner.plan

    def record(*args, **kwargs):
        plans.append(real(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(planner, "plan", record)
    return plans


def tiny_llm(arch: str, path: str, backend: str, **kw) -> LLM:
    return LLM(path, device="cpu", backend=backend, page_size=4, **kw)


def test_each_step_plans_its_rows_and_no_op_derives_them(tmp_path, monkeypatch):
    """On the Triton kernels: a 6-token prompt alone (its head: one row), its decodes,
    then two prompts together and their decodes: each step's plans are its token and
    logits rows', the GEMV named at one row and not at two, body and head alike, and
    no op applies a row rule itself; the tokens are transformers' greedy ones."""
    hf = save_tiny_model("llama", str(tmp_path))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 4, 3)]
    llm = tiny_llm("llama", str(tmp_path), "triton", max_model_len=64, max_num_batched_tokens=16)
    plans, calls = planned(llm, monkeypatch), rule_spies(monkeypatch)
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    outputs = llm.generate(prompts[:1], greedy) + llm.generate(prompts[1:], greedy)
    assert calls == []
    assert [o.output_ids for o in outputs] == [hf_greedy(hf, p, 2) for p in prompts]
    plan_rows = llm.backend.plan_rows
    assert plans and all(p.rows == plan_rows(p.input_ids.shape[0]) for p in plans)
    assert all(p.logit_rows == plan_rows(p.logits_indices.shape[0]) for p in plans)
    sizes = [(p.input_ids.shape[0], p.logits_indices.shape[0]) for p in plans]
    assert sizes == [(6, 1), (1, 1), (7, 2), (2, 2)], sizes
    body = [p.rows.gemv for p in plans]
    head = [p.logit_rows.gemv for p in plans]
    assert body == [False, True, False, False]  # one token row: the GEMV
    assert head == [True, True, False, False]  # one request's head: the GEMV
    # the spies see an op that plans by its shape (the check above is not vacuous)
    llm.backend.linear(torch.zeros(1, 8), torch.zeros(4, 8))
    assert calls == ["route_rows"]


def test_a_graph_plan_is_its_captured_size(tmp_path):
    """``plan(Batch(), rows=R)``, the plan a CUDA graph is captured over, plans R rows
    (its replays run the variants of R), body and head alike."""
    save_tiny_model("llama", str(tmp_path))
    llm = tiny_llm("llama", str(tmp_path), "triton", max_model_len=64, max_num_seqs=4)
    planner = llm.runner.planner
    for rows in (1, 2, 4):
        plan = planner.plan(Batch(), rows=rows)
        assert plan.input_ids.shape[0] == rows
        assert plan.rows == plan.logit_rows == llm.backend.plan_rows(rows)
        assert plan.rows.gemv == (rows == 1)


def test_the_moe_step_takes_its_loop_from_the_plan(tmp_path, monkeypatch):
    """gpt-oss on the torch references: a 257-token prompt's step plans the sparse
    loop, its decode steps the dense table (256 tokens would be dense: the other side),
    and each MoE layer ran the plan's loop (every expert on every token, or not);
    the tokens are transformers' greedy ones."""
    hf = save_tiny_model("gpt_oss", str(tmp_path))
    prompt = torch.randint(0, VOCAB, (257,), generator=torch.Generator().manual_seed(2)).tolist()
    llm = tiny_llm("gpt_oss", str(tmp_path), "torch", max_model_len=300, max_num_batched_tokens=512)
    plans, calls = planned(llm, monkeypatch), rule_spies(monkeypatch)
    expert_rows, real = [], moe_ref._expert
    monkeypatch.setattr(
        moe_ref, "_expert", lambda x, *a: expert_rows.append(x.shape[0]) or real(x, *a)
    )
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    assert calls == [] and out.output_ids == hf_greedy(hf, prompt, 2)
    assert [(p.input_ids.shape[0], p.rows.moe_dense) for p in plans] == [(257, False), (1, True)]
    assert llm.backend.plan_rows(256).moe_dense
    experts, layers = 4, 4
    prefill, decode = expert_rows[: experts * layers], expert_rows[experts * layers :]
    assert all(r < 257 for r in prefill) and decode == [1] * (experts * layers)


def plan_rows_seen(monkeypatch) -> list[tuple[int, object]]:
    """(the rows of its input, the plan it was given) of every GEMV-routed op's
    routing (``gemv._routes``: linears, fused norms, the gated MLP's down projection)."""
    seen, real = [], gemv._routes

    def routes(x, weight, plan, num_rows=None):
        seen.append((x.shape[0] if num_rows is None else num_rows, plan))
        return real(x, weight, plan, num_rows)

    monkeypatch.setattr(gemv, "_routes", routes)
    return seen


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_draft_heads_run_under_the_steps_plans(tmp_path, monkeypatch, method):
    """Speculative decoding on the Triton kernels with an EAGLE-3 head (tiny Llama
    target) or the checkpoint's MTP layer (tiny DeepSeek-V3: MLA and MoE): four
    requests past the batch-size rule (3) decode plainly, the head lazy; once one
    finishes the head catches up in one extend and the three speculate, their verify
    steps on padded plans (a "captured" size of 4, run eagerly). The heads' forwards
    (``project``, the layer, the greedy head) run under the step's row plans, so no
    op applies a row rule itself, and every routed op's plan is of its own input's
    rows, target and head alike; the tokens are transformers' greedy ones."""
    target = str(tmp_path / "target")
    if method == "eagle3":
        hf = save_tiny_model("llama", target, num_hidden_layers=4)
        save_tiny_eagle3(str(tmp_path / "head"), hf.config)
        spec = {"method": "eagle3", "model": str(tmp_path / "head")}
    else:
        hf = save_tiny_deepseek_mtp(target)
        spec = {"method": "mtp"}
    k = 2
    spec |= {"num_speculative_tokens": k, "disable_by_batch_size": 3}
    llm = tiny_llm(method, target, "triton", dtype=torch.float32, max_model_len=32,
                   max_num_seqs=4, max_num_batched_tokens=32, speculative_config=spec)  # fmt: skip
    llm.runner.capture_verify(k + 1, 4, capture=False)  # padded sizes 1, 2, 4
    padded, rows_for = [], llm.runner.verify_graphs.rows_for

    def watch(batch):
        rows = rows_for(batch)
        padded.append(len(batch.requests) < rows) if rows is not None else None
        return rows

    llm.runner.verify_graphs.rows_for = watch
    draft, lazy = llm.runner.draft, []  # the lazy steps' stashes, the catch-up extends
    for name in ("defer", "_extend"):
        real = getattr(draft, name)
        spy = lambda *a, _real=real, _name=name: lazy.append(_name) or _real(*a)
        monkeypatch.setattr(draft, name, spy)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 3, 4, 6)]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (3, 6, 6, 6)]
    calls, seen = rule_spies(monkeypatch), plan_rows_seen(monkeypatch)
    outputs = llm.generate(prompts, params)
    assert calls == []
    want = [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(prompts, params)]
    assert [o.output_ids for o in outputs] == want
    stats = llm.stats
    assert stats.spec_verify_steps > 0 and stats.spec_draft_tokens > 0  # the heads drafted
    assert "defer" in lazy and "_extend" in lazy[lazy.index("defer") :]  # lazy, then caught up
    assert any(padded)  # a verify plan of 4 rows for 3 requests ran
    assert seen and all(plan is not None and plan.rows == rows for rows, plan in seen)
    # the spies see an op that plans by its shape (the checks above are not vacuous)
    llm.backend.linear(torch.zeros(3, 8), torch.zeros(4, 8))
    assert calls == ["route_rows"] and seen[-1] == (3, None)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_draft_heads_take_the_step_plans_under_cuda_graphs(tmp_path, monkeypatch, method):
    """On a CUDA GPU (``pytest -m gpu``; fp32, exact) with CUDA graphs: the target's
    decode and verify steps replay at their captured sizes (3 requests: 4 lanes), the
    draft heads' rows after them replay their own graphs over those padded plans; no op calls a
    row rule, every routed op's plan is of its own input's rows (a padded plan's: its
    captured size's), and the tokens equal plain decoding's."""
    target = str(tmp_path / "target")
    if method == "eagle3":
        hf = save_tiny_model("llama", target, num_hidden_layers=4)
        save_tiny_eagle3(str(tmp_path / "head"), hf.config)
        spec = {"method": "eagle3", "model": str(tmp_path / "head")}
    else:
        save_tiny_deepseek_mtp(target)
        spec = {"method": "mtp"}
    kw = {"device": "cuda", "dtype": torch.float32, "page_size": 16, "max_num_seqs": 4,
          "max_model_len": 128, "kv_cache_bytes": 64 << 20, "cuda_graphs": True}  # fmt: skip
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 5, 7)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = [o.output_ids for o in LLM(target, **kw).generate(prompts, params)]
    llm = LLM(target, speculative_config={**spec, "num_speculative_tokens": 2}, **kw)
    graphs = llm.runner.verify_graphs
    assert llm.runner.graphs is not None and graphs is not None and graphs.graphs
    padded, rows_for = [], graphs.rows_for

    def watch(batch):
        rows = rows_for(batch)
        padded.append(len(batch.requests) < rows) if rows is not None else None
        return rows

    monkeypatch.setattr(graphs, "rows_for", watch)
    head_rows, head_run = [], VerifyRowGraphs.run

    def watch_head(g, plan, rows, *a, **k):
        head_rows.append((rows, rows in g.graphs))
        return head_run(g, plan, rows, *a, **k)

    monkeypatch.setattr(VerifyRowGraphs, "run", watch_head)
    calls, seen = rule_spies(monkeypatch), plan_rows_seen(monkeypatch)
    assert [o.output_ids for o in llm.generate(prompts, params)] == want
    assert llm.stats.spec_verify_steps > 0 and llm.stats.spec_draft_tokens > 0
    assert calls == []
    assert seen and all(plan is not None and plan.rows == rows for rows, plan in seen)
    assert any(padded)  # a verify graph of 4 lanes replayed for 3 requests ...
    # ... and the head's rows after it replayed their own graph over that padded plan
    assert (4, True) in head_rows
    llm.alloc.check_integrity()
