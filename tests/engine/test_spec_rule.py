"""The batch-size rule (issue 42: "at B = 64 speculation is never slower than
without"): a step the rule keeps from speculating is the plain engine's step.

The oracle is the same engine without ``speculative_config``: with every decode
step past ``disable_by_batch_size``, the speculative engine launches the same
steps in the same order (batch kind, rows per request, one step in flight: the
previous step handed to ``launch`` unsettled), settles as often, never runs the
n-gram proposer, and emits the same tokens. When requests finish and the batch
falls under the rule, it speculates again (the step in flight settled first) and
the tokens still equal plain decoding's. On a GPU, the rule's steps replay the
plain engine's decode graphs, size for size.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import VOCAB, one_thread, save_tiny_model  # noqa: F401  (a fixture)

from unikv.engine import LLM, SamplingParams
from unikv.engine.runner import Launched
from unikv.engine.speculative import engine as spec_engine
from unikv.engine.speculative.ngram import NgramIndex

pytestmark = pytest.mark.usefixtures("one_thread")
LIMIT = 2  # disable_by_batch_size: 4 requests decoding are past it


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama"))
    save_tiny_model("llama", path)
    return path


def prompts() -> list[list[int]]:
    """Repetitive prompts: the n-gram lookup would find drafts in every one."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (4,), generator=g).tolist() * 3 for _ in range(4)]


def make_llm(path: str, spec: bool, device: str = "cpu") -> LLM:
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
              "prompt_lookup_max": 2, "disable_by_batch_size": LIMIT} if spec else None  # fmt: skip
    return LLM(path, device=device, dtype=torch.float32, page_size=4, max_num_seqs=4,
               max_num_batched_tokens=64, max_model_len=64, kv_cache_bytes=16 << 20,
               speculative_config=config)  # fmt: skip


class Spy:
    """Records each ``launch`` (batch kind, rows per request, whether a previous step
    was handed over unsettled, a verify step?), each settle (``Launched.tokens``) and
    each proposer call, while installed on ``llm``."""

    def __init__(self, llm: LLM, monkeypatch) -> None:
        self.launches, self.settles, self.proposals = [], 0, 0
        runner, launch = llm.runner, llm.runner.launch
        tokens = Launched.tokens

        def spy_launch(batch, prev=None):
            kind = "verify" if batch.drafts is not None else batch.kind.name
            self.launches.append((kind, tuple(batch.num_new), prev is not None))
            return launch(batch, prev)

        def spy_tokens(launched):
            self.settles += 1
            return tokens(launched)

        def spy_propose(*a, **k):
            self.proposals += 1
            return propose(*a, **k)

        propose = NgramIndex.propose  # the n-gram proposer (kept per request)
        monkeypatch.setattr(runner, "launch", spy_launch)
        monkeypatch.setattr(Launched, "tokens", spy_tokens)
        monkeypatch.setattr(NgramIndex, "propose", spy_propose)


def run(llm: LLM, params, monkeypatch) -> tuple[list[list[int]], Spy]:
    with monkeypatch.context() as m:
        spy = Spy(llm, m)
        out = [o.output_ids for o in llm.generate(prompts(), params)]
    return out, spy


def test_rule_steps_are_the_plain_engines_steps(llama, monkeypatch):
    """Four requests of 12 tokens, limit 2: no step speculates; the launches (kind,
    rows, one step in flight), the settles and the tokens are the plain engine's,
    and the proposer never runs (the rule is decided before any draft work)."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want, plain = run(make_llm(llama, spec=False), params, monkeypatch)
    llm = make_llm(llama, spec=True)
    got, spy = run(llm, params, monkeypatch)
    assert got == want
    decodes = [x for x in plain.launches if x[0] == "DECODE"]
    assert len(decodes) >= 10 and all(x[2] for x in decodes)  # the oracle overlaps
    assert spy.launches == plain.launches  # same steps, each launched with one in flight
    assert spy.settles == plain.settles
    assert spy.proposals == 0
    counters = llm.scheduler.spec.counters
    assert counters.verify_steps == 0 and counters.draft_seconds == 0.0
    assert counters.skipped_by_batch_size == len(decodes)


def test_speculation_resumes_under_the_rule(llama, monkeypatch):
    """Lengths 5, 7, 20 and 24: while more than 2 run, steps are plain and overlap;
    once 2 are left, the step in flight settles first and drafts are verified; the
    tokens equal plain decoding's throughout."""
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 7, 20, 24)
    ]
    want = [o.output_ids for o in make_llm(llama, spec=False).generate(prompts(), params)]
    llm = make_llm(llama, spec=True)
    got, spy = run(llm, params, monkeypatch)
    assert got == want
    kinds = [kind for kind, _, _ in spy.launches]
    wide = [x for x in spy.launches[1:] if x[0] == "DECODE" and len(x[1]) > LIMIT]
    assert wide and all(prev for _, _, prev in wide)  # past the rule: one step in flight
    assert "verify" in kinds and kinds.index("verify") > kinds.index("DECODE")
    assert all(not prev for kind, _, prev in spy.launches if kind == "verify")  # settled first
    assert spy.proposals > 0 and llm.stats.spec_verify_steps > 0


def test_drafts_never_read_a_step_in_flight():
    """A step planned while the last one runs (its samples still ``Pending``
    placeholders) does not speculate: the draft is not asked; with the same
    requests' tokens on the host it is (so the check is the placeholder)."""
    from unikv.engine.request import Pending, Request
    from unikv.engine.speculative.config import speculative_config_of

    config = speculative_config_of({"method": "ngram", "num_speculative_tokens": 2})
    spec = spec_engine.Speculator(config, max_num_batched_tokens=64)
    asked = []

    class Draft:  # a draft model's interface: device drafts for ``counts`` rows
        def propose(self, requests, counts, virtual_ids):
            asked.append(counts.tolist())
            return torch.zeros(int(counts.sum()), dtype=torch.int64)

    spec.draft = Draft()
    params = SamplingParams(max_tokens=8, temperature=0.0)

    def request(i: int, last: int) -> Request:
        return Request(i, [3, 4, 3, 4], params, 0, frozenset(), 64, output_ids=[3, last])

    def allocate(num_new):
        return torch.arange(int(num_new.sum()))

    assert spec.drafts([request(0, 4), request(1, Pending.of(1))], allocate) is None
    assert asked == []
    _, ids, device = spec.drafts([request(0, 4), request(1, 4)], allocate)
    assert asked == [[2, 2]] and ids.tolist() == list(range(6)) and device.shape == (4,)


@pytest.mark.gpu
def test_rule_steps_replay_the_plain_decode_graphs(llama, monkeypatch):
    """On CUDA: the rule's decode steps replay the plain engine's decode graphs
    (same padded sizes, same greedy-in-graph choice, in the same order), none eager."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    replays = {}
    for spec in (False, True):
        llm = make_llm(llama, spec=spec, device="cuda")
        graphs, calls = llm.runner.graphs, []
        replay = graphs.replay

        def spy_replay(rows, greedy=False, _calls=calls, _replay=replay):
            _calls.append((rows, greedy))
            return _replay(rows, greedy)

        with monkeypatch.context() as m:
            m.setattr(graphs, "replay", spy_replay)
            out = [o.output_ids for o in llm.generate(prompts(), params)]
        replays[spec] = (out, calls)
    assert replays[True] == replays[False]
    assert len(replays[True][1]) >= 10
