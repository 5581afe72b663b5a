"""Two models under one KV budget (issue 44 item 4; ``engine/multi.py``,
``engine/budget_broker.py``) on CPU with the emulated backing: a hypothesis state
machine admits requests to either model, steps either loop (each step asks the
oracle, which grows the hungry model and shrinks an idle one), and resizes either
pool by hand, interleaved. After every rule: ``check_integrity`` of both
allocators, and the committed chunks of both pools (counted by the shared
reservation itself) never exceed the budget. Every finished request's greedy
tokens equal transformers' ``generate`` of the same weights and a fixed-size
``LLM`` run. Released chunks are poisoned (NaN), so a page read after its chunk
went would change the tokens.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import VOCAB, hf_greedy, one_thread, save_tiny_model  # noqa: F401
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from unikv.engine import LLM, SamplingParams
from unikv.engine.multi import MultiLLM

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = ("a", "b")
ARCHS = {"a": "llama", "b": "mistral"}
PROMPT_LENS = [5, 19, 33, 11]
NEW = 10
CHUNK = 4096
TOTAL = 160 << 10  # tight: a few requests of either model at its fair share
KW = {"device": "cpu", "page_size": 4, "max_num_seqs": 8, "max_model_len": 56,
      "max_num_batched_tokens": 16}  # fmt: skip
PARAMS = SamplingParams(max_tokens=NEW, temperature=0.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    paths, want = {}, {}
    for i, name in enumerate(NAMES):
        paths[name] = str(tmp_path_factory.mktemp(name))
        hf = save_tiny_model(ARCHS[name], paths[name], seed=i + 1)
        want[name] = [hf_greedy(hf, p, NEW) for p in prompts]
        fixed = LLM(paths[name], kv_cache_bytes=TOTAL, **KW)
        assert [o.output_ids for o in fixed.generate(prompts, PARAMS)] == want[name]
    return paths, prompts, want


def shape(llm) -> tuple:
    """What a refused resize must leave unchanged: size, bands, live pages."""
    books = llm.alloc.parts.books.values()
    top = llm.pool.total_bytes, llm.pool.backing.committed_bytes
    return top, tuple((b.name, b.band, b.num_live) for b in books)


def held_by_requests(llm) -> int:
    """Bytes of the pages the running requests hold: cached prefix pages no request
    holds are free to a shrink (it evicts them), so they do not count."""
    cached = llm.alloc.prefix.cached_pages
    books = llm.alloc.parts.books.values()
    return sum((b.num_live - cached(b.name)) * b.page_bytes for b in books)


class TwoModels(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        paths, self.prompts, self.want = SETUP
        self.multi = MultiLLM(paths, total_kv_bytes=TOTAL, chunk=CHUNK, **KW)
        self.live: dict[str, list] = {n: [] for n in NAMES}  # (prompt index, request)
        self.checked = 0

    def teardown(self) -> None:
        for name in NAMES:
            self._finish(name)
        for m in self.multi.budget.members.values():
            for key in ("grants", "shrinks", "refused"):
                TALLY[key] += getattr(m, key)
        TALLY["checked"] += self.checked
        self.multi.close()

    def _finish(self, name: str) -> None:
        llm = self.multi[name]
        while llm.engine.step() is not None:
            self._invariants()
        self._compare(name)

    def _compare(self, name: str) -> None:
        """The finished requests' tokens (called once the loop settled its last step:
        a step's tokens reach the host one step later)."""
        keep = []
        for i, r in self.live[name]:
            if r.finish_reason is None:
                keep.append((i, r))
            else:
                assert r.output_ids == self.want[name][i], (name, i)
                self.checked += 1
        self.live[name] = keep

    def _invariants(self) -> None:
        for llm in self.multi.llms.values():
            llm.alloc.check_integrity()
        used = self.multi.backing.committed_bytes
        assert used == sum(self.multi.committed().values())
        assert used <= TOTAL, (used, TOTAL)

    @rule(name=st.sampled_from(NAMES), which=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def admit(self, name, which):
        llm = self.multi[name]
        for i in which:
            group = llm.make_group(self.prompts[i], PARAMS)
            llm.engine.submit(group, bounded=False)
            self.live[name].append((i, group.requests[0]))

    @rule(name=st.sampled_from(NAMES), steps=st.integers(1, 6))
    def step(self, name, steps):
        llm = self.multi[name]
        for _ in range(steps):
            if llm.engine.step() is None:
                break
            self._invariants()

    @rule(name=st.sampled_from(NAMES))
    def finish(self, name):
        self._finish(name)

    @rule(name=st.sampled_from(NAMES), fraction=st.floats(0.05, 1.0))
    def resize(self, name, fraction):
        llm = self.multi[name]
        before = shape(llm)
        target = int(TOTAL * fraction)
        try:
            got = self.multi.resize_kv_cache(name, target)
        except ValueError as e:
            text = str(e)
            assert any(k in text for k in ("running requests", "worst-case", "shared budget",
                                           "fits no real page", "max_bytes")), text  # fmt: skip
            assert shape(llm) == before, "a refused resize changed the pool"
        else:
            assert got == target == llm.pool.total_bytes

    @rule(name=st.sampled_from(NAMES))
    def shrink_below_live(self, name):
        llm = self.multi[name]
        held = held_by_requests(llm)
        if held == 0:
            return
        before = shape(llm)
        with pytest.raises(ValueError, match="running requests|worst-case"):
            self.multi.resize_kv_cache(name, llm.pool.sink_bytes + held // 2)
        assert shape(llm) == before

    @invariant()
    def within_budget(self):
        self._invariants()


NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)  # a failure prints its whole run
SETUP: tuple = ()
SETTINGS = settings(  # derandomized: six fixed runs, so the tally below is the same in CI
    derandomize=True,
    max_examples=6,
    stateful_step_count=25,
    deadline=None,
    phases=NO_SHRINK,
    suppress_health_check=list(HealthCheck),
)
TALLY = {"grants": 0, "shrinks": 0, "refused": 0, "checked": 0}


def test_two_models_one_budget(setup):
    global SETUP
    SETUP = setup
    run_state_machine_as_test(
        TwoModels,
        settings=SETTINGS,
    )
    print(TALLY)
    assert TALLY["grants"] and TALLY["shrinks"] and TALLY["checked"] > 20, TALLY


def test_busy_model_takes_from_idle_and_gives_back(setup):
    """The hot model grows past its fair share by shrinking the idle one, then
    hands the memory back when the other gets busy; tokens stay exact."""
    paths, prompts, want = setup
    with MultiLLM(paths, total_kv_bytes=TOTAL, chunk=CHUNK, **KW) as multi:
        share = multi.committed()
        out = [o.output_ids for o in multi.generate("a", prompts * 2, PARAMS)]
        assert out == want["a"] * 2
        grown = multi.committed()
        assert grown["a"] > share["a"] and grown["b"] < share["b"], (share, grown)
        assert multi.llms["b"].pool.total_bytes == multi.budget.members["b"].floor
        out = [o.output_ids for o in multi.generate("b", prompts * 2, PARAMS)]
        assert out == want["b"] * 2
        back = multi.committed()
        assert back["b"] > grown["b"] and back["a"] < grown["a"], (grown, back)
        assert sum(back.values()) <= TOTAL
    fixed = MultiLLM(paths, total_kv_bytes=TOTAL, chunk=CHUNK, elastic=False, **KW)
    before = fixed.committed()
    assert [o.output_ids for o in fixed.generate("a", prompts * 2, PARAMS)] == want["a"] * 2
    assert fixed.committed() == before  # a fixed split never moves
    with pytest.raises(KeyError, match="not served here"):
        fixed["c"]


def test_a_shrink_below_the_running_requests_is_refused(setup):
    """The derandomized state machine's runs may not reach ``shrink_below_live`` with
    pages held: here two requests hold pages, and a shrink to half of them is refused
    with the pool, its bands and its live pages unchanged."""
    paths, prompts, _ = setup
    with MultiLLM(paths, total_kv_bytes=TOTAL, chunk=CHUNK, **KW) as multi:
        llm = multi["a"]
        for p in prompts[1:3]:
            llm.engine.submit(llm.make_group(p, PARAMS), bounded=False)
        for _ in range(3):
            llm.engine.step()
        held = held_by_requests(llm)
        assert held > 0
        before = shape(llm)
        with pytest.raises(ValueError, match="running requests|worst-case"):
            multi.resize_kv_cache("a", llm.pool.sink_bytes + held // 2)
        assert shape(llm) == before
