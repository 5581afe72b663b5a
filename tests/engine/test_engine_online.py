"""The online engine loop (``unikv.engine.online``) in its own thread: requests
that join a running batch, abort (of running and waiting requests), the bounded
admission queue, shutdown, and ``LLM.generate`` as a user of the running loop.

Oracles: transformers' greedy tokens on the same weights; the allocator's own
page and state-slot counts (every sub-pool back to 0 live pages after an abort)
and its integrity check; the batches the loop actually ran (``on_step``).
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    hf_greedy,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_hybrid,
    save_tiny_model,
)
from test_allocator_free_many import allocator_state, assert_same_state

from unikv.engine import LLM, SamplingParams
from unikv.engine.online import EngineClosed, QueueFull

pytestmark = pytest.mark.usefixtures("one_thread")
WAIT_S = 60.0  # every wait below is bounded


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    return path, save_tiny_model("llama", path)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_5"))
    return path, save_tiny_hybrid("qwen3_5", path)


def _prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


class Sink:
    """A thread-safe sink: every Delta of a group, in order."""

    def __init__(self) -> None:
        self.deltas: queue.Queue = queue.Queue()

    def __call__(self, delta) -> None:
        self.deltas.put(delta)

    def until(self, pred, timeout=WAIT_S) -> list:
        """Deltas until ``pred(delta)`` holds (bounded in time)."""
        got, deadline = [], time.monotonic() + timeout
        while True:
            delta = self.deltas.get(timeout=max(deadline - time.monotonic(), 0.01))
            got.append(delta)
            if pred(delta):
                return got


def _live(llm) -> dict[str, int]:
    """Live pages (Mamba: slots) per sub-pool, read in the loop's thread."""
    return llm.engine.call(
        lambda: {n: llm.alloc.parts.books[n].num_live for n in llm.pool.subpools}
    ).result(timeout=WAIT_S)


def _tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_a_request_submitted_mid_run_joins_the_batch(llama):
    path, hf = llama
    llm = LLM(path, device="cpu", page_size=4, max_model_len=128, max_num_seqs=4)
    batches = []
    llm.engine.on_step = lambda llm, batch, logits: batches.append(
        {r.request_id for r in batch.requests}
    )
    first, second = _prompts([9, 14])
    llm.engine.start()
    try:
        a_sink, b_sink = Sink(), Sink()
        long = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0)
        a = llm.engine.submit(llm.make_group(first, long, sink=a_sink))
        a_deltas = a_sink.until(lambda d: len(d.token_ids) > 0)  # A is decoding
        b = llm.engine.submit(
            llm.make_group(second, SamplingParams(max_tokens=8, temperature=0.0), sink=b_sink)
        )
        b_deltas = b_sink.until(lambda d: d.finish_reason is not None)
        a_deltas += a_sink.until(lambda d: d.finish_reason is not None)
    finally:
        llm.engine.shutdown()
    assert any({a.request_id, b.request_id} <= ids for ids in batches)  # one batch held both
    assert _tokens(a_deltas) == hf_greedy(hf, first, 60)
    assert _tokens(b_deltas) == hf_greedy(hf, second, 8)
    assert a.output().outputs[0].token_ids == _tokens(a_deltas)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_abort_frees_pages_and_state_slots(family, llama, qwen):
    """A running request and a waiting one (max_num_seqs=1) are aborted: both end
    with finish_reason "abort" and every sub-pool (the Mamba one too) is empty."""
    path, hf = llama if family == "llama" else qwen
    llm = LLM(path, device="cpu", page_size=4, max_model_len=128, max_num_seqs=1)
    assert family == "llama" or "mamba" in {s.spec.kind for s in llm.pool.subpools.values()}
    running, waiting = _prompts([11, 6])
    llm.engine.start()
    try:
        r_sink, w_sink = Sink(), Sink()
        long = SamplingParams(max_tokens=100, ignore_eos=True, temperature=0.0)
        r = llm.engine.submit(llm.make_group(running, long, sink=r_sink))
        w = llm.engine.submit(llm.make_group(waiting, long, sink=w_sink))
        seen = []
        got = r_sink.until(lambda d: len(seen.extend(d.token_ids) or seen) >= 3)
        assert max(_live(llm).values()) > 0  # it holds pages (and a slot) now
        llm.engine.abort(w)
        llm.engine.abort(r)
        got += r_sink.until(lambda d: d.finish_reason is not None)
        w_end = w_sink.until(lambda d: d.finish_reason is not None)
        assert got[-1].finish_reason == w_end[-1].finish_reason == "abort"
        llm.reset_prefix_cache()  # with caching on, the cache alone may hold pages
        assert _live(llm) == {name: 0 for name in llm.pool.subpools}
        llm.engine.call(llm.alloc.check_integrity).result(timeout=WAIT_S)
        tokens = _tokens(got)
        assert 3 <= len(tokens) < 100 and tokens == hf_greedy(hf, running, len(tokens))
        assert _tokens(w_end) == [] and w.output().outputs[0].finish_reason == "abort"
        # the engine goes on serving
        again = llm.generate(running, SamplingParams(max_tokens=5, temperature=0.0))
        assert again[0].output_ids == hf_greedy(hf, running, 5)
    finally:
        llm.engine.shutdown()


def test_admission_queue_is_bounded(llama):
    path, _ = llama
    llm = LLM(path, device="cpu", page_size=4, max_model_len=64, max_num_seqs=1)
    llm.engine.max_waiting = 2
    prompt = _prompts([5])[0]
    groups = [
        llm.make_group(prompt, SamplingParams(max_tokens=4, temperature=0.0)) for _ in range(3)
    ]
    llm.engine.submit(groups[0])
    llm.engine.submit(groups[1])
    with pytest.raises(QueueFull, match="max_waiting=2"):
        llm.engine.submit(groups[2])
    outputs = llm.generate(
        prompt, SamplingParams(max_tokens=4, temperature=0.0)
    )  # unbounded: the API's own
    assert len(outputs[0].output_ids) == 4
    assert [g.output().outputs[0].finish_reason for g in groups[:2]] == ["length"] * 2


@pytest.mark.parametrize("drain", [False, True])
def test_shutdown_aborts_or_drains_in_flight_requests(llama, drain):
    path, hf = llama
    llm = LLM(path, device="cpu", page_size=4, max_model_len=128, max_num_seqs=4)
    prompt = _prompts([7])[0]
    llm.engine.start()
    sink = Sink()
    group = llm.engine.submit(
        llm.make_group(
            prompt, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0), sink=sink
        )
    )
    sink.until(lambda d: len(d.token_ids) > 0)
    llm.engine.shutdown(drain=drain, timeout=WAIT_S)
    assert sink.until(lambda d: d.finish_reason is not None)[-1].finish_reason
    assert not llm.engine.running
    out = group.output().outputs[0]
    assert out.finish_reason == ("length" if drain else "abort")
    assert out.token_ids == hf_greedy(hf, prompt, len(out.token_ids))
    if llm.prefix_caching:  # the loop has stopped: the cache alone may hold pages
        llm.alloc.prefix.reset()
    assert {llm.alloc.parts.books[n].num_live for n in llm.pool.subpools} == {0}
    with pytest.raises(EngineClosed):
        llm.engine.submit(llm.make_group(prompt, SamplingParams(max_tokens=2, temperature=0.0)))


def test_generate_from_threads_while_the_loop_serves(llama):
    """``generate`` called from two threads at once on a running loop: each gets
    transformers' tokens (their requests share the loop's batches)."""
    path, hf = llama
    llm = LLM(path, device="cpu", page_size=4, max_model_len=128, max_num_seqs=8)
    prompts = _prompts([5, 12, 20, 9])
    results: dict[int, list] = {}
    llm.engine.start()
    try:

        def run(i: int) -> None:
            mine = prompts[2 * i : 2 * i + 2]
            results[i] = [
                o.output_ids
                for o in llm.generate(mine, SamplingParams(max_tokens=12, temperature=0.0))
            ]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        with pytest.raises(ValueError, match="on_step"):
            llm.generate(prompts[0], on_step=lambda *a: None)
    finally:
        llm.engine.shutdown()
    assert results[0] + results[1] == [hf_greedy(hf, p, 12) for p in prompts]


def test_a_loop_that_dies_fails_its_requests_and_reports_down(llama):
    """An error inside the loop's thread (here a failing step; on CUDA it was
    ``set_device("cuda")`` without an index) must not leave clients waiting: the
    live request's stream ends with the error, ``error`` is set and the loop is no
    longer running (the server's /health then answers 503)."""
    path, _ = llama
    llm = LLM(path, device="cpu", page_size=4, max_model_len=64, max_num_seqs=2)

    def broken_step():
        raise RuntimeError("injected step failure")

    llm.engine.step = broken_step
    sink = Sink()
    llm.engine.start()
    llm.engine.submit(
        llm.make_group(_prompts([5])[0], SamplingParams(max_tokens=4, temperature=0.0), sink=sink)
    )
    last = sink.until(lambda d: d.finish_reason is not None)[-1]
    llm.engine._thread.join(WAIT_S)
    assert last.finish_reason == "abort" and "injected step failure" in (last.error or "")
    assert isinstance(llm.engine.error, RuntimeError) and not llm.engine.running


def _abort_three_of_five(path: str, together: bool) -> tuple[int, list, dict]:
    """Five groups (three running, two waiting) stepped in the caller's thread, then
    three (two running, one waiting) aborted; the loop drains the aborts ``together``
    (one step's) or one at a time. (free_request calls, the aborted groups, the
    allocator's state right after)."""
    llm = LLM(path, device="cpu", page_size=4, max_model_len=64, max_num_seqs=3)
    long = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    groups = [llm.engine.submit(llm.make_group(p, long)) for p in _prompts([9, 5, 13, 7, 6])]
    for _ in range(3):
        llm.engine.step()
    sched = llm.engine.scheduler
    assert [r.request_id for r in sched.running] == [g.request_id for g in groups[:3]]
    frees, free = [], llm.alloc.free_request
    llm.alloc.free_request = lambda slots, defer=False: frees.append(1) or free(slots, defer)
    doomed = [groups[2], groups[4], groups[0]]
    for g in doomed:
        llm.engine.abort(g)
        if not together:
            llm.engine._take_inbox()
    llm.engine._take_inbox()
    state = allocator_state(llm.alloc)
    llm.engine.shutdown(drain=True)
    return len(frees), doomed, state


def test_aborts_drained_together_free_in_one_call(llama):
    """The aborts one step drains end in one ``_finish``: the running ones' pages go
    back in one ``free_request``, the allocator's state byte for byte that of the
    same aborts drained one at a time; each aborted stream ends with "abort"."""
    path, _ = llama
    ref_frees, _, ref_state = _abort_three_of_five(path, together=False)
    frees, doomed, state = _abort_three_of_five(path, together=True)
    assert (ref_frees, frees) == (2, 1)
    assert_same_state(ref_state, state)
    for g in doomed:
        assert g.output().outputs[0].finish_reason == "abort"
