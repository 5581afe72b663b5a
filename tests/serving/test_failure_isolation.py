"""Failures stay with their request (``unikv.engine.online``'s isolation).

The model's forward is wrapped to raise whenever a marker token id is among the
step's input ids, i.e. whenever the poisoned request's prompt is prefilled (again
after each preemption). Oracles: the same prompts through ``LLM.generate`` on an
un-poisoned ``LLM`` of the same weights (greedy and seeded-sampled tokens), the
allocator's page counts and integrity check, and the loop's own counters.
"""

from __future__ import annotations

import queue
import time

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    assert_pages_returned,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_model,
)

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
WAIT_S = 60.0
MARKER = VOCAB - 1  # the poisoned prompt holds it; the others never do


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    save_tiny_model("llama", path)
    return path


def _llm(path: str) -> LLM:
    return LLM(path, device="cpu", page_size=4, max_model_len=64, max_num_seqs=8)


def _prompts(lengths, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MARKER, (n,), generator=g).tolist() for n in lengths]


def _params(i: int) -> SamplingParams:
    """Greedy for even i, seeded sampling for odd i (seeds survive recompute)."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=10, temperature=0.9, seed=100 + i, ignore_eos=True)


class Poison:
    """The model's forward, raising when MARKER is fed; counts the raises."""

    def __init__(self, model) -> None:
        self.model, self.raised = model, 0

    def __call__(self, input_ids, *args, **kwargs):
        if bool((input_ids == MARKER).any()):
            self.raised += 1
            raise RuntimeError("poisoned input")
        return self.model(input_ids, *args, **kwargs)


class Sink:
    def __init__(self) -> None:
        self.deltas: queue.Queue = queue.Queue()

    def __call__(self, delta) -> None:
        self.deltas.put(delta)

    def final(self) -> tuple[list[int], object]:
        """(every token, the finishing delta), waiting at most WAIT_S."""
        tokens, deadline = [], time.monotonic() + WAIT_S
        while True:
            delta = self.deltas.get(timeout=max(deadline - time.monotonic(), 0.01))
            tokens += delta.token_ids
            if delta.finish_reason is not None:
                return tokens, delta


def test_a_raising_forward_fails_only_the_request_that_raised(llama):
    """Five requests start together with a poisoned one among them; later two
    more join while others decode (one poisoned). Only the poisoned requests end,
    with finish_reason "error" and the exception's text; every other request's
    tokens equal an un-poisoned ``LLM.generate``'s; no page is left behind and the
    loop serves a request afterwards."""
    clean = _llm(llama)
    prompts = _prompts([5, 9, 6, 12, 7, 8, 10])
    want = [clean.generate(p, _params(i))[0].output_ids for i, p in enumerate(prompts)]
    bad = [prompts[2][:3] + [MARKER] + prompts[2][3:], [MARKER] + prompts[6]]

    llm = _llm(llama)
    poison = llm.runner.model = Poison(llm.runner.model)
    llm.engine.start()
    try:
        sinks = {}

        def submit(key, ids, params):
            sinks[key] = Sink()
            llm.engine.submit(llm.make_group(ids, params, sink=sinks[key]))

        for i in (0, 1, 3, 4):  # the first batch: four good ones and the poisoned one
            submit(i, prompts[i], _params(i))
        submit("bad0", bad[0], _params(2))
        first = sinks[0].deltas.get(timeout=WAIT_S)  # a token out: the others decode now
        submit(5, prompts[5], _params(5))
        submit("bad1", bad[1], _params(6))
        results = {key: sink.final() for key, sink in sinks.items()}
        results[0] = (first.token_ids + results[0][0], results[0][1])
        for key in ("bad0", "bad1"):
            tokens, last = results[key]
            assert last.finish_reason == "error" and "poisoned input" in last.error, key
        for i in (0, 1, 3, 4, 5):
            tokens, last = results[i]
            assert last.error is None and last.finish_reason == "length", (i, last)
            assert tokens == want[i], i
        assert llm.engine.num_failed_requests == 2 and poison.raised >= 2
        again = Sink()
        llm.engine.submit(llm.make_group(prompts[1], _params(1), sink=again))
        assert again.final()[0] == want[1]
        assert_pages_returned(llm)
        assert llm.engine.running and llm.engine.error is None
    finally:
        llm.engine.shutdown()


def test_generate_raises_and_the_llm_stays_usable(llama):
    """Inline ``generate``: an exception in a step is re-raised, the call's
    requests end with their pages freed, and the next call gives the tokens an
    un-poisoned LLM gives. A seed outside int64 is refused at construction."""
    clean = _llm(llama)
    prompts = _prompts([6, 9, 4])
    params = [_params(i) for i in range(3)]
    want = [o.output_ids for o in clean.generate(prompts, params)]

    llm = _llm(llama)
    model = llm.runner.model
    llm.runner.model = Poison(model)
    with pytest.raises(RuntimeError, match="poisoned input"):
        llm.generate([prompts[0], [MARKER] + prompts[1]], params[:2])
    llm.runner.model = model
    assert not llm.scheduler.has_work()
    assert_pages_returned(llm)
    assert [o.output_ids for o in llm.generate(prompts, params)] == want
    for seed in (2**63, -(2**63) - 1, 123456789012345678901234567890):
        with pytest.raises(ValueError, match="^seed"):
            SamplingParams(seed=seed)
    edge = SamplingParams(max_tokens=3, temperature=1.0, seed=2**63 - 1)
    assert len(llm.generate(prompts[0], edge)[0].output_ids) == 3


def test_sampling_params_default_to_vllms():
    """vLLM's defaults: temperature 1.0 (sampling), top_p 1, top_k off (-1 accepted)."""
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.n) == (1.0, 1.0, 0, 16, 1)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=1e-5).temperature == 0.01  # vLLM's floor
