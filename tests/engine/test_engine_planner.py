"""One kernel backend through the engine, one step planner (issue 16, R2 and R3).

- ``LLM`` builds one backend and the pool, the allocator and the runner all
  call it: a recording backend sees each one's ops, and the tokens still equal
  transformers' greedy ones.
- Under ``backend="triton"`` (the CPU interpreter) the runner rotates and stores
  K/V with ``kernels/attention/rope_store.py``'s ``rope_store_kv`` (one launch a layer),
  samples greedy rows with ``kernels/linear/argmax.py``, and decode attention's launch plan is made
  once per step, its workspace a view of the planner's buffer.
- CUDA-graph replay simulated on CPU: each padded size's plan is built once,
  over an empty batch, and every later step of that size runs THAT plan. Only
  if the planner lays every step at the same addresses, pads lanes onto the sink
  and fills state slots do the tokens equal transformers' (full attention,
  sliding windows with sinks, hybrid recurrent state).
- A DECODE batch's tables (decode_step's fused launch into the planner's
  buffers) equal the allocator's separate block-table and translation lookups.
- The structure the review asked for: one function builds every StepPlan, no
  ``data_ptr`` in the engine, no device branch in the runner's per-step methods,
  the scheduler imports nothing about graphs.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib
from collections import Counter

import numpy as np
import pytest
import torch
from engine_fixtures import (
    VOCAB,
    GreedyReference,
    assert_pages_returned,
    check_engine_outputs,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_hybrid,
    save_tiny_model,
)

import unikv.engine.build as llm_module  # build_engine looks up get_backend
from unikv.engine import LLM, SamplingParams, graphs
from unikv.engine.graphs import DecodeGraphs
from unikv.engine.request import Pending
from unikv.engine.scheduler import Batch, BatchKind
from unikv.ids import PhysicalPageIds
from unikv.kernels import OPS, KernelBackend, get_backend

pytestmark = pytest.mark.usefixtures("one_thread")
ENGINE = pathlib.Path(__file__).resolve().parents[2] / "unikv" / "engine"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    return GreedyReference(save_tiny_model("llama", path), path, [3, 17, 30], 12)


class Recording:
    """A KernelBackend whose every op is ``inner``'s, counted and its keyword
    arguments kept (the last call's)."""

    def __init__(self, inner: KernelBackend) -> None:
        self.calls: Counter[str] = Counter()
        self.kwargs: dict[str, dict] = {}
        ops = {op: self._wrap(op, getattr(inner, op)) for op in OPS}
        self.backend = KernelBackend(name=inner.name, **ops)

    def _wrap(self, op, fn):
        @functools.wraps(fn)  # keeps the signature (soft-cap check) and __wrapped__
        def call(*args, **kwargs):
            self.calls[op] += 1
            self.kwargs[op] = kwargs
            return fn(*args, **kwargs)

        return call


def _recorded_llm(monkeypatch, path: str, backend: str, **kw) -> tuple[LLM, Recording]:
    rec = Recording(get_backend("cpu", backend))
    monkeypatch.setattr(llm_module, "get_backend", lambda device, name=None: rec.backend)
    kw = {"page_size": 4, "max_model_len": 64, "max_num_batched_tokens": 16, **kw}
    return LLM(path, device="cpu", backend=backend, **kw), rec


def test_one_backend_reaches_the_pool_the_allocator_and_the_runner(llama, monkeypatch):
    llm, rec = _recorded_llm(monkeypatch, llama.path, "torch")
    assert llm.runner.backend is llm.backend is rec.backend
    outputs = llm.generate(llama.prompts, SamplingParams(max_tokens=12, temperature=0.0))
    check_engine_outputs(llama, llm, outputs)
    runner_ops = {"rope_store_kv", "rope_store_decode_attention", "extend_attention",
                  "plan_decode", "argmax"}  # fmt: skip
    allocator_ops = {"update_tables", "prepare_step", "translate_ids", "build_block_table"}
    assert runner_ops | allocator_ops <= set(rec.calls), rec.calls
    name = next(iter(llm.pool.subpools))
    first = llm.pool.subpools[name].first_page
    pages = [PhysicalPageIds(torch.tensor([first + i]), name) for i in (0, 1)]
    llm.pool.move_pages(name, *pages)  # the pool's page copy is the backend's too
    assert rec.calls["copy_pages"] == 1


def _record_extends(llm, rec) -> tuple[list, list]:
    """Every extend attention call's (fresh_kv passed, its requests all fresh, its
    last request fresh), and every planned extend step's split (None or FreshSplit)."""
    inner, calls, splits = rec.backend.extend_attention, [], []

    def extend(q, k, v, table, q_indptr, seq_lens, **kw):
        q_lens = q_indptr[1:] - q_indptr[:-1]
        fresh = seq_lens == q_lens
        assert q_indptr[0] == 0 and q_indptr[-1] == q.shape[0], "rows of this call only"
        calls.append((kw.get("fresh_kv") is not None, bool(fresh.all()), bool(fresh[-1])))
        return inner(q, k, v, table, q_indptr, seq_lens, **kw)

    llm.runner.backend = dataclasses.replace(rec.backend, extend_attention=extend)
    plan = llm.runner.planner.plan

    def planned(batch, *args, **kw):
        step = plan(batch, *args, **kw)
        if not step.is_decode:
            splits.append(step.split)
        return step

    llm.runner.planner.plan = planned
    return calls, splits


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fresh_kv_is_passed_exactly_for_requests_without_cached_tokens(llama, monkeypatch, backend):
    """Extend attention gets the step's own K/V (``fresh_kv``) iff every request of
    the call has no cached token, read off the op's own arguments. 16-token chunks
    make fresh steps, steps of continued chunks, and mixed steps whose joining
    prompts are split off into a fresh call (after the cached part's call, which
    then ends with a cached request). Tokens equal transformers' (the Triton kernels
    under the interpreter on CPU)."""
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("GPU runs Triton natively (test_engine_gpu)")
    llm, rec = _recorded_llm(monkeypatch, llama.path, backend)
    calls, splits = _record_extends(llm, rec)
    prompts = llama.prompts if backend == "torch" else llama.prompts[:3]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    assert [o.output_ids for o in outputs] == [g[:4] for g in llama.greedy[: len(prompts)]]
    assert all(passed == fresh for passed, fresh, _ in calls), calls
    assert not any(last for passed, _, last in calls if not passed), (
        "a call through the block table never ends with a fresh prompt",
        calls,
    )
    assert {f for _, f, _ in calls} == {True, False}, "both kinds of extend call ran"
    split = [sp for sp in splits if sp is not None]
    assert split, "a mixed step was split"
    layers = llm.model.config.num_layers
    assert len(calls) == layers * (len(splits) + len(split)), "two calls a split step"


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively (test_engine_gpu)")
def test_triton_store_and_one_decode_plan_per_step(llama, monkeypatch):
    from unikv.kernels.attention import rope_store
    from unikv.kernels.linear import argmax

    llm, rec = _recorded_llm(monkeypatch, llama.path, "triton")
    rec.calls.clear()  # construction sized the planner's workspace with plan_decode
    outputs = llm.generate(llama.prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))
    assert [o.output_ids for o in outputs] == [g[:4] for g in llama.greedy[:2]]
    assert rec.backend.rope_store_kv.__wrapped__ is rope_store.rope_store_kv
    assert rec.backend.argmax.__wrapped__ is argmax.argmax
    num_layers = llm.model.config.num_layers
    assert rec.calls["store_kv"] == 0 and rec.calls["rope_qk"] == 0  # one launch a layer
    prefill_steps = llm.stats.steps - llm.stats.decode_steps
    assert rec.calls["rope_store_kv"] == num_layers * prefill_steps
    assert num_layers > 1 and rec.calls["plan_decode"] == llm.stats.decode_steps > 0
    # decode steps: rope + store inside the attention's launch, one call a layer
    assert rec.calls["decode_attention"] == 0
    assert rec.calls["rope_store_decode_attention"] == num_layers * llm.stats.decode_steps
    launch = rec.kwargs["rope_store_decode_attention"]
    assert {"num_splits", "config", "workspace"} <= set(launch)
    storage = llm.runner.planner.workspace.untyped_storage()
    assert launch["workspace"].untyped_storage().data_ptr() == storage.data_ptr()


class CPUGraphs(DecodeGraphs):
    """DecodeGraphs with capture and replay done eagerly: each size's plan is
    built once at capture, over an empty batch, and replayed as it is (the greedy
    graphs' forward_greedy)."""

    def _capture(self, forward, planner, forward_greedy) -> None:
        self.forward, self.forward_greedy, self.plans, self.replays = (
            forward, forward_greedy, {}, Counter()
        )  # fmt: skip
        for rows in self.sizes:
            self.plans[rows] = planner.plan(Batch(), rows=rows)

    def replay(self, rows: int, greedy: bool = False):
        assert not greedy or self.has_greedy(rows), "the runner asks for graphs that exist"
        self.replays[rows, greedy] += 1
        if greedy:
            return self.forward_greedy(self.plans[rows])
        return self.forward(self.plans[rows]), None


@pytest.fixture(scope="module", params=["llama", "gpt_oss", "qwen3_5"])
def family(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    if request.param == "qwen3_5":
        hf = save_tiny_hybrid("qwen3_5", path)
    else:
        hf = save_tiny_model(request.param, path)
    return GreedyReference(hf, path, [3, 11, 19, 5], 10, seed=4)


@pytest.mark.parametrize("greedy_rows", [8, 0])  # the argmax inside the graphs, or after
def test_graph_replay_over_the_planners_buffers(family, monkeypatch, greedy_rows):
    """Four requests decode at 4 lanes, then one stops early: the three left run
    padded to 4 lanes, the sink lane where the fourth request's row was (its
    stale write id, table row or state slot would corrupt a live request)."""
    monkeypatch.setattr(graphs, "GREEDY_ROWS", greedy_rows)
    llm = LLM(family.path, device="cpu", page_size=4, max_model_len=64, max_num_seqs=8)
    runner = llm.runner
    runner.graphs = CPUGraphs(runner.forward, runner.planner, 8, runner.forward_greedy)
    max_tokens = [10, 2, 10, 10]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens]
    outputs = llm.generate(family.prompts, params)
    assert [o.output_ids for o in outputs] == [g[:n] for g, n in zip(family.greedy, max_tokens)]
    assert_pages_returned(llm)
    replays = llm.runner.graphs.replays
    assert replays[4, greedy_rows >= 4] > 3, replays  # 4 lanes, then 3 decodes padded to 4
    assert not replays[4, greedy_rows < 4], replays


@pytest.mark.parametrize("feed", [True, False])
def test_one_row_graphs_read_the_last_token_from_the_feedback_buffer(family, monkeypatch, feed):
    """One request decodes under the one-row greedy graph with ``feed_graphs`` on: its
    steps after the first skip the token gather (the graph reads the placeholder's
    token from the planner's feedback buffer, where the last greedy step wrote it),
    and the tokens stay transformers' greedy ones; then two requests (a two-row graph:
    gathers) and one again. Off (``feed``: False), every step gathers. Models without
    ``resolves_feedback`` (Qwen3.5 here) keep the gather."""
    from unikv.engine.plan_upload import StepUpload

    llm = LLM(family.path, device="cpu", page_size=4, max_model_len=64, max_num_seqs=8)
    runner = llm.runner
    runner.planner.feed_graphs = feed and getattr(runner.model, "resolves_feedback", False)
    runner.graphs = CPUGraphs(runner.forward, runner.planner, 8, runner.forward_greedy)
    fills, fill = [], StepUpload.fill
    monkeypatch.setattr(StepUpload, "fill", staticmethod(lambda *a: fills.append(1) or fill(*a)))
    one = llm.generate(family.prompts[:1], SamplingParams(max_tokens=10, temperature=0.0))
    gathers = len(fills)
    assert one[0].output_ids == family.greedy[0][:10]
    if runner.planner.feed_graphs:
        assert gathers <= 2, gathers  # the first decode reads the prefill's samples
        assert torch.equal(runner.planner.feedback[:1], torch.tensor(one[0].output_ids[-1:]))
    else:
        assert gathers >= 8, gathers
    two = llm.generate(family.prompts[:2], SamplingParams(max_tokens=6, temperature=0.0))
    assert [o.output_ids for o in two] == [g[:6] for g in family.greedy[:2]]
    again = llm.generate(family.prompts[2:3], SamplingParams(max_tokens=8, temperature=0.0))
    assert again[0].output_ids == family.greedy[2][:8]
    assert_pages_returned(llm)


def test_decode_tables_equal_the_allocators_lookups(tmp_path):
    """gpt-oss: a full and a sliding-window sub-pool, page size 4, window 6."""
    save_tiny_model("gpt_oss", str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", page_size=4, max_model_len=64, max_num_seqs=4)
    sched, planner, alloc = llm.scheduler, llm.runner.planner, llm.alloc
    for r in llm.make_requests(
        [[1, 2, 3, 4, 5], [6, 7, 8]], SamplingParams(max_tokens=14, temperature=0.0)
    ):
        sched.add(r)
    kinds = Counter()
    while sched.has_work():
        batch = sched.schedule()
        kinds[batch.kind] += 1
        plan = planner.plan(batch)
        if batch.kind is BatchKind.DECODE:
            for sub in planner.subpools:
                got = plan.subpools[sub.name]
                want = torch.zeros_like(got.block_table)
                window = sub.spec.sliding_window or 0
                slots = torch.tensor([r.slot for r in batch.requests], dtype=torch.int32)
                alloc.block_table(slots, plan.seq_lens, sub.name, want, window=window)
                assert torch.equal(got.block_table, want), sub.name
                ids = alloc.translate(batch.virtual_ids, sub.name).data
                assert torch.equal(got.write_ids.data, ids.to(got.write_ids.data.dtype))
            padded = planner.plan(batch, rows=4)
            for sub in planner.subpools:
                step = padded.subpools[sub.name]
                assert not step.block_table[len(batch.requests) :].any()
                assert not step.write_ids.data[len(batch.requests) :].any()
            assert padded.seq_lens[len(batch.requests) :].tolist() == [1] * (
                4 - len(batch.requests)
            )
        sched.complete(batch, llm.runner.step(batch)[0])
    assert kinds[BatchKind.DECODE] > 0 and kinds[BatchKind.EXTEND] > 0


def test_pending_fill_matches_a_naive_loop():
    g = torch.Generator().manual_seed(0)
    prev = torch.randint(0, VOCAB, (5,), generator=g)
    ids = torch.randint(0, VOCAB, (9,), generator=g)
    lanes = np.random.default_rng(0).permutation(5)[:4]
    at = [0, 3, 4, 8]
    for i, lane in zip(at, lanes):
        ids[i] = Pending.of(int(lane))
    want = [int(prev[Pending.lane(t)]) if Pending.lane(t) is not None else t for t in ids.tolist()]
    assert Pending.fill(ids, prev).tolist() == want and ids.tolist() == want


def _tree(name: str) -> ast.Module:
    return ast.parse((ENGINE / name).read_text())


def test_one_function_builds_every_step_plan_and_no_data_ptr():
    builders = []
    for path in sorted(ENGINE.glob("*.py")):
        text = path.read_text()
        assert "data_ptr" not in text, path.name
        for fn in ast.walk(ast.parse(text)):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "StepPlan":
                        builders.append((path.name, fn.name))
    assert builders == [("plan.py", "plan")]


def test_no_device_branch_per_step_and_no_graphs_in_the_scheduler():
    runner = next(n for n in _tree("runner.py").body if getattr(n, "name", "") == "ModelRunner")
    for fn in runner.body:
        if isinstance(fn, ast.FunctionDef) and fn.name != "__init__":
            attrs = [n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)]
            assert "type" not in attrs and "is_cuda" not in attrs, fn.name
    for node in ast.walk(_tree("scheduler.py")):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [getattr(node, "module", None) or ""] + [a.name for a in node.names]
            assert not any("graph" in n.lower() for n in names), names


def test_warm_linears_runs_each_distinct_weight_at_every_row_count(monkeypatch):
    """The GEMM warm-up (engine/warmup.py): one F.linear per distinct weight and
    row count; lm_head up to the logits rows, the layers' up to the chunk; a
    weight shared in shape with lm_head is warmed to the larger of the two."""
    from torch import nn

    from unikv.engine import warmup

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(8, 12), nn.Linear(8, 12), nn.Linear(12, 8, bias=False)])
    model.lm_head = nn.Linear(8, 10, bias=False)
    model.other = nn.Module()
    model.other.lm_head = nn.Linear(12, 8, bias=False)  # the shape of layers[2]: one entry
    seen: dict[tuple, list[int]] = {}
    real = warmup.F.linear

    def linear(x, weight, bias=None):
        seen.setdefault((tuple(weight.shape), bias is not None), []).append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(warmup.F, "linear", linear)
    launched = warmup.warm_linears(model, max_logit_rows=5, max_tokens=300)
    grid = [*range(1, 257), 272, 288, 300]
    assert seen == {
        ((12, 8), True): grid,
        ((8, 12), False): grid,
        ((10, 8), False): [1, 2, 3, 4, 5],
    }
    assert launched == 2 * len(grid) + 5


def test_warm_sampling_runs_the_backend_argmax_over_a_full_batch():
    from unikv.engine import warmup

    calls = []

    class Backend:
        def argmax(self, logits):
            calls.append((tuple(logits.shape), logits.dtype))
            return logits.argmax(-1)

    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(4, 11, bias=False).to(torch.bfloat16)
    model.logits_dtype = None  # logits in lm_head's dtype
    warmup.warm_sampling(Backend(), model, rows=7)
    assert calls == [((1, 11), torch.bfloat16), ((7, 11), torch.bfloat16)]
    del model.logits_dtype  # a model that returns fp32 logits
    calls.clear()
    warmup.warm_sampling(Backend(), model, rows=7)
    assert calls == [((1, 11), torch.float32), ((7, 11), torch.float32)]
