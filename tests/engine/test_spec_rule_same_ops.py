"""Past the batch-size rule a decode step is the plain engine's step, for every
method (issue 42: "at B = 64 speculation is never slower than without"): n-gram,
a draft model and an EAGLE-3 head on Llama, the MTP layer on Qwen3.5.

Oracle: the same engine without ``speculative_config``, over the same requests.
Each decode step is traced twice: the aten ops it dispatches, in order (a
``TorchDispatchMode``: every device op it launches, the plan's uploads and table
builds included; the allocator's table write counted as the one launch it is on
CUDA, whatever entries it carries), split into those inside ``ModelRunner.forward``
(on CUDA a decode step's forward is its decode graph's replay: no host launch per
op) and those outside it, and the Python calls it makes into ``unikv``
(``sys.setprofile``).

- n-gram and a draft model: every decode step dispatches the plain step's ops,
  in the same order, and makes at most a few more Python calls (the rule, decided
  once a step; a draft's page bound where a page fills, as the target's is). A draft model's sub-pools hold the draft's K/V; past the rule its
  rows are written later (``DraftModel.catch_up``), so the step builds and plans
  none of their tables (``Scheduler._tables_for``: before, 43 more ops a step here).
- A head (EAGLE-3, MTP) needs each row's target hidden state for the rows it
  catches up on (a hybrid target's state cannot be recomputed later): the target's
  export of them and their write into the stash's ring (``HiddenStash.write``) are
  inside the forward (the decode graph on CUDA), a few ops whatever the batch;
  outside it the step adds one ``index_copy_`` (the sampled tokens into the ring,
  ``HiddenStash.tokens``, and its two slices); every other op is the plain step's,
  in order.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from engine_fixtures import VOCAB, one_thread, save_tiny_model  # noqa: F401  (a fixture)
from mtp_fixtures import save_tiny_eagle3
from qwen_mtp_fixtures import save_tiny_qwen_mtp
from torch.utils._python_dispatch import TorchDispatchMode

from unikv.engine import LLM, SamplingParams
from unikv.engine.online import EngineLoop
from unikv.engine.runner import ModelRunner
from unikv.models.decoder import DecoderLM

pytestmark = pytest.mark.usefixtures("one_thread")
LIMIT = 2  # disable_by_batch_size: the 4 requests decoding are past it
EXPORT = "export"  # the target's export of the hidden states a head reads
EXPORT_OPS = {"eagle3": 12, "mtp": 13}  # at most, a step (3 layers' residual; the final norm)
RING_OPS = 8  # a head's lazy step's ops inside the forward besides the export, at most
OUTSIDE = ["slice", "slice", "index_copy_"]  # ... and outside it: its only ones
# more Python calls a step makes outside the forward, at most: the rule (decided once,
# ``Scheduler._tables_for``), a draft's unbound page check, a head's ``defer``
CALLS = {"ngram": 1, "draft_model": 7, "eagle3": 8, "mtp": 8}
# the allocator's page binding (a filled page's physical pages, every token sub-pool)
PAGES = tuple(f"allocator/{m}.py" for m in ("pages", "tables", "bands", "capacity", "room"))
KW = {"device": "cpu", "dtype": torch.float32, "page_size": 4, "max_num_seqs": 4,
      "max_num_batched_tokens": 64, "max_model_len": 64, "kv_cache_bytes": 16 << 20}  # fmt: skip


class Trace(TorchDispatchMode):
    """The aten ops dispatched inside it, by name, in order, those inside
    ``ModelRunner.forward`` (``inside``) apart from the others (``ops``); ops inside
    a region ``tag`` names are counted under that tag instead (``tagged``); the
    table write (``update_tables``) is one entry."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.inside: list[str] = []
        self.tagged: Counter = Counter()
        self.region: str | None = None
        self.forward = 0  # depth of ModelRunner.forward calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.region == "update_tables":
            pass
        elif self.region is not None:
            self.tagged[self.region] += 1
        else:
            (self.inside if self.forward else self.ops).append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def tagging(m, trace_of, owner, name: str, tag: str) -> None:
    """Record the ops of ``owner.name`` under ``tag`` in the trace in use."""
    inner = getattr(owner, name)

    def wrapped(*a, **k):
        trace = trace_of()
        if trace is None or trace.region is not None:
            return inner(*a, **k)
        trace.region = tag
        if tag == "update_tables":
            trace.ops.append("update_tables")
        try:
            return inner(*a, **k)
        finally:
            trace.region = None

    m.setattr(owner, name, wrapped)


def inside_forward(m, trace_of) -> None:
    """Mark the ops of ``ModelRunner.forward`` as inside it in the trace in use."""
    inner = ModelRunner.forward

    def wrapped(*a, **k):
        trace = trace_of()
        if trace is not None:
            trace.forward += 1
        try:
            return inner(*a, **k)
        finally:
            if trace is not None:
                trace.forward -= 1

    m.setattr(ModelRunner, "forward", wrapped)


def decode_traces(llm: LLM, prompts, params, monkeypatch) -> tuple[list[tuple], list]:
    """(the greedy tokens, per loop step: (kind, requests, its op names outside the
    forward, tagged op counts, its Python calls into unikv by module and qualified
    name, none inside a tagged region, its op names inside the forward))."""
    out, step, current = [], EngineLoop.step, [None]

    def traced(loop):
        trace, calls = Trace(), Counter()

        def profile(frame, event, arg):
            path = frame.f_code.co_filename.replace("\\", "/")
            if event == "call" and "/unikv/" in path and trace.region is None and not trace.forward:
                calls[path.split("/unikv/")[-1] + ":" + frame.f_code.co_qualname] += 1

        current[0] = trace
        sys.setprofile(profile)
        try:
            with trace:
                got = step(loop)
        finally:
            sys.setprofile(None)
            current[0] = None
        if got is not None:
            batch = got[0]
            out.append((batch.kind.name, len(batch.requests), trace.ops, trace.tagged, calls,
                        trace.inside))  # fmt: skip
        return got

    writer = llm.runner.alloc.parts.writer
    with monkeypatch.context() as m:
        tagging(m, lambda: current[0], writer, "_update", "update_tables")
        for name in ("_export", "_export_final"):
            tagging(m, lambda: current[0], DecoderLM, name, EXPORT)
        inside_forward(m, lambda: current[0])
        m.setattr(EngineLoop, "step", traced)
        tokens = [o.output_ids for o in llm.generate(prompts, params)]
    return tokens, out


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (4,), generator=g).tolist() * 3 for _ in range(4)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("rule_same_ops")
    llama, head, qwen = (str(root / n) for n in ("llama", "eagle3", "qwen3_5"))
    hf = save_tiny_model("llama", llama, num_hidden_layers=6)
    save_tiny_eagle3(head, hf.config)
    save_tiny_qwen_mtp("qwen3_5", qwen)
    return {"llama": llama, "eagle3": head, "qwen3_5": qwen}


def spec_of(method: str, models: dict) -> tuple[str, dict]:
    """(target checkpoint, speculative config) of ``method``, past the rule here."""
    spec = {"method": method, "num_speculative_tokens": 3, "disable_by_batch_size": LIMIT}
    if method == "ngram":
        spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 2}
    elif method == "draft_model":
        spec["model"] = models["llama"]
    elif method == "eagle3":
        spec["model"] = models["eagle3"]
    return models["qwen3_5" if method == "mtp" else "llama"], spec


def cut(ops: list, run: list) -> list | None:
    """``ops`` less the first contiguous occurrence of ``run`` (None: none)."""
    for i in range(len(ops) - len(run) + 1):
        if ops[i : i + len(run)] == run:
            return ops[:i] + ops[i + len(run) :]
    return None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    "method,window",
    [("ngram", None), ("draft_model", None), ("eagle3", None), ("mtp", None),
     ("eagle3", 3), ("mtp", 3)],
)  # fmt: skip
def test_rule_step_dispatches_the_plain_steps_ops(models, method, window, device, monkeypatch):
    """Four requests decoding 12 tokens together, limit 2, after a 3-token warm-up (a
    head's stash 16 deep, or ``window`` 3: the run outgrows it four times over, and
    still no step runs the head: nothing is flushed): each decode step
    but the last (where the requests finish and leave) dispatches the plain step's
    ops in order; a head adds, outside the forward, only ``OUTSIDE`` (the tokens'
    write: one launch), and inside it its export (at most ``EXPORT_OPS``) and after
    the plain forward's ops at most ``RING_OPS`` (the ring write); and makes at most
    ``CALLS`` more Python calls outside the forward (on CUDA a decode step's forward
    is a graph replay), besides binding the draft's page where the plain step binds one
    (a page filled: its sub-pools share the owner's pages); tokens are the plain
    engine's. On CUDA (decode graphs) a head's step dispatches outside the graph
    replay only the plain step's ops and ``OUTSIDE``."""
    path, spec = spec_of(method, models)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    items = prompts()
    warm = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if device == "cuda" and window is not None:
        pytest.skip("a resized stash is for engines without decode graphs (their addresses)")
    kw = {**KW, "device": device}
    engines = LLM(path, **kw), LLM(path, speculative_config=spec, **kw)
    if window is not None:
        draft = engines[1].runner.draft
        draft.enable_lazy(draft.rule, draft.stash, window=window)
    for engine in engines:  # (buffers checked once an engine: not a step's work)
        engine.generate(items, warm)
    want, plain = decode_traces(engines[0], items, params, monkeypatch)
    got, rule = decode_traces(engines[1], items, params, monkeypatch)
    llm = engines[1]
    assert got == want
    assert [t[:2] for t in rule] == [t[:2] for t in plain]
    steps = [(s, p) for s, p in zip(rule[:-1], plain[:-1]) if s[0] == "DECODE"]
    assert len(steps) >= 9 and all(s[1] == 4 for s, _ in steps)
    head = method in ("eagle3", "mtp")
    for i, (s, p) in enumerate(steps):
        assert not p[3]  # (the oracle exports nothing)
        if head and device == "cuda":  # the forward, its export and ring write: the graph's
            assert (cut(s[2], OUTSIDE), s[5], s[3]) == (p[2], p[5], p[3]), (method, i, s[3])
        elif head:
            assert cut(s[2], OUTSIDE) == p[2], (method, i, len(s[2]), len(p[2]))
            ring = s[5][len(p[5]) :]  # (after the model: the stash's write)
            assert s[5][: len(p[5])] == p[5] and 0 < len(ring) <= RING_OPS, (method, i, ring)
            assert 0 < s[3][EXPORT] <= EXPORT_OPS[method], (method, i, s[3])
        else:
            assert (s[2], s[5], s[3]) == (p[2], p[5], p[3]), (method, i, len(s[2]), len(p[2]))
        extra = s[4] - p[4]
        bound = [k for k in extra if k.startswith(PAGES)]  # a draft page bound
        assert not bound or p[4]["allocator/pages.py:PageBook.take"], (method, i, bound)
        assert sum(n for k, n in extra.items() if k not in bound) <= CALLS[method], (
            method,
            i,
            extra,
        )
    assert llm.scheduler.spec.counters.verify_steps == 0
