"""A burst of requests reaches the engine process together and is planned as few
prefill steps (issue 40):

- the API process (``ProcEngine``) sends the submissions of one event-loop turn
  as ONE ``adds`` message; an abort of a submission not yet sent follows its add;
- the engine process's admission window (``admission_window_ms``): requests
  arriving one by one while nothing runs are planned together, in at most
  ceil(prompt tokens / ``max_num_batched_tokens``) prefill steps, with
  ``LLM.generate``'s tokens; the window never waits while steps run;
- a drained burst's parameters are validated once per distinct form, and a
  malformed one is refused alone.

Oracles: the messages counted on the engine's side of the socket (a PULL socket
of the test's own), the planner spied on (each batch's rows classified by a
naive count of the tokens each request was fed before), SamplingParams'
validation spied on (its calls counted), and ``LLM.generate`` on the same
prompts.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
import zmq
from engine_fixtures import one_thread  # noqa: F401  (a fixture)
from serving_fixtures import save_instruct_llama

from unikv.engine import LLM, SamplingParams
from unikv.engine.config import EngineConfig
from unikv.serving.engine_client import ProcEngine
from unikv.serving.engine_core import _core, admission_window, encode_params, serve_all

pytestmark = pytest.mark.usefixtures("one_thread")
BURST, NEW, BUDGET = 6, 4, 256
WINDOW_MS = 400  # long against the gaps below (a loaded CI host), far below the test's time
GAP_S = 0.02  # between two arrivals: the loop would step between them without a window


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    save_instruct_llama(path)
    return path


def _prompts() -> list[list[int]]:
    return [[7 + i, 19, 30 + 3 * i, 11, 50 + i, 4] for i in range(BURST)]


def _prefill_steps(llm) -> list[int]:
    """Spy on the planner: the prefill tokens of each planned batch (a row is prefill
    while its request was fed fewer tokens than its prompt's)."""
    fed: dict[int, int] = {}
    steps: list[int] = []
    inner = llm.scheduler.schedule

    def spy():
        batch = inner()
        prefill = 0
        for r, n in zip(batch.requests, batch.num_new):
            before = fed.get(r.request_id, 0)
            prefill += n if before < len(r.prompt_ids) else 0
            fed[r.request_id] = before + n
        steps.append(prefill)
        return batch

    llm.scheduler.schedule = spy
    return steps


def test_requests_arriving_one_by_one_are_planned_as_one_prefill(model_dir):
    llm = LLM(model_dir, device="cpu", page_size=4, max_model_len=64, max_num_seqs=8,
              max_num_batched_tokens=BUDGET, admission_window_ms=WINDOW_MS,
              enable_prefix_caching=False)  # fmt: skip
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]
    steps = _prefill_steps(llm)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind("inproc://burst-in")
    pull.bind("inproc://burst-out")
    core = _core(llm, ctx, ["inproc://burst-out"], None)
    assert core.admission_window_s == WINDOW_MS / 1000  # from the engine's config
    inp = ctx.socket(zmq.PULL)
    inp.connect("inproc://burst-in")
    box: list = []
    thread = threading.Thread(target=lambda: box.append(serve_all([core], [(inp, core, 0)])))
    thread.start()
    try:
        for key, ids in enumerate(_prompts()):  # one by one, as an HTTP burst arrives
            push.send(enc.encode(("add", key, [(ids, encode_params(params))], None, key)))
            time.sleep(GAP_S)
        got: dict[int, list[int]] = {k: [] for k in range(BURST)}
        done = 0
        while done < BURST:
            assert pull.poll(30000), "the engine loop sent nothing in time"
            msg = dec.decode(pull.recv())
            if msg[0] != "out":
                assert msg[0] == "acks" and all(a[1] is None for a in msg[1]), msg
                continue
            for w, t in zip(msg[1], msg[2]):
                got[w].append(t)
            for w, toks, _, reason, *_ in msg[3]:
                got[w].extend(toks)
                done += reason is not None
        assert [got[k] for k in range(BURST)] == want
        prefills = [p for p in steps if p]
        total = sum(map(len, _prompts()))
        assert sum(prefills) == total
        assert len(prefills) <= math.ceil(total / BUDGET), steps  # one step here
    finally:
        push.send(enc.encode(("stop",)))
        thread.join(30)
        for sock in (push, pull, inp, *core.main_outs):
            sock.close()
        ctx.term()
    assert box == [0]


class _Loop(SimpleNamespace):
    pass


class _Poller:
    def __init__(self, answers) -> None:
        self.answers, self.timeouts = list(answers), []

    def poll(self, timeout_ms):
        self.timeouts.append(timeout_ms)
        if not self.answers:
            raise AssertionError("the admission window polled past its end")
        return self.answers.pop(0)


def _live(queued: int, stepping: bool):
    return [SimpleNamespace(loop=_Loop(num_queued=queued, stepping=stepping), open=[True])]


def test_the_window_never_waits_while_steps_run_or_with_nothing_new():
    poller = _Poller([])
    read = lambda: pytest.fail("nothing to read: the window did not open")
    admission_window(_live(3, True), poller, -1, 0.05, read)  # decodes run: no wait
    admission_window(_live(0, False), poller, -1, 0.05, read)  # nothing arrived
    assert poller.timeouts == []


def test_the_window_extends_on_arrivals_and_closes_when_quiet():
    live = _live(1, False)
    reads = []

    def read():  # each poll that saw a message brings one more request
        reads.append(1)
        live[0].loop.num_queued += 1

    poller = _Poller([[(0, 1)], [(0, 1)], []])  # two arrivals, then a quiet window
    admission_window(live, poller, -1, 0.05, read)
    assert len(reads) == 2 and len(poller.timeouts) == 3
    assert all(0 < t <= 50 for t in poller.timeouts)  # each wait within one window (ms)
    wake = _Poller([[(7, 1)]])  # a queued call (the wake pipe, fd 7) ends it at once
    admission_window(_live(1, False), wake, 7, 0.05, lambda: pytest.fail("not read"))
    assert len(wake.timeouts) == 1


def test_concurrent_submissions_reach_the_engine_in_one_message():
    """``ProcEngine.asubmit`` from N tasks of one event-loop turn: ONE ``adds``
    message carries the N adds (the engine's side answers them with one ``acks``);
    a submission cancelled before its add was sent is aborted after it."""
    n = 8
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine = ProcEngine(EngineConfig(model="unused", device="cpu"), wait=False, spawn=False)
    engine.proc = SimpleNamespace(poll=lambda: None, kill=lambda: None, pid=0)
    engine.front = SimpleNamespace(tokenizer=None, tokenizer_lock=threading.Lock())
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(engine.addr_in)
    push.connect(engine.addr_out)
    seen: list = []

    async def main():
        engine.start()
        tasks = [
            asyncio.ensure_future(engine.asubmit([([3, 4, 5 + i], None, params)])) for i in range(n)
        ]
        await asyncio.sleep(0)  # the tasks ran once: their adds queued, not yet sent
        tasks[-1].cancel()  # a client gone before its add left
        while not pull.poll(0):
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        while pull.poll(0):
            seen.append(dec.decode(pull.recv()))
        adds = [a for m in seen for a in {"add": [m], "adds": m[1]}.get(m[0], [])]
        push.send(enc.encode(("acks", [[a[1], None, None] for a in adds])))
        return await asyncio.gather(*tasks[:-1])

    try:
        subs = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        engine.close()
        pull.close(0)
        push.close(0)
        ctx.term()
    assert [m[0] for m in seen] == ["adds", "abort"], seen  # 2 messages for 8 requests
    adds = seen[0][1]
    assert [a[0] for a in adds] == ["add"] * n
    assert [a[2][0][0] for a in adds] == [[3, 4, 5 + i] for i in range(n)]
    assert seen[1][1] == [adds[-1][1]]  # the cancelled one, after its add
    assert len(subs) == n - 1 and len({s.key for s in subs}) == n - 1


def test_a_drained_burst_validates_each_distinct_params_once_and_fails_alone(
    model_dir, monkeypatch
):
    """``Core.add_all`` over one drain: requests with the same parameters share one
    decoded SamplingParams (validated once per distinct wire form), a malformed one
    is refused alone (and not kept), and every completion equals ``LLM.generate``'s."""
    from functools import partial

    from unikv.engine.sampling import SamplingParams as SP
    from unikv.engine.structured import compile_structured
    from unikv.serving.engine_core import Core

    llm = LLM(model_dir, device="cpu", page_size=4, max_model_len=64, max_num_seqs=16,
              enable_prefix_caching=False)  # fmt: skip
    plain = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    longer = SamplingParams(max_tokens=NEW + 2, temperature=0.0, ignore_eos=True)
    bad = encode_params(plain) | {"temperature": -1.0}  # refused by SamplingParams
    prompts = _prompts() * 2
    wires = [encode_params(longer if k % 4 == 1 else plain) for k in range(len(prompts))]
    wires[5] = bad
    checks = []
    inner = SP.__post_init__
    monkeypatch.setattr(SP, "__post_init__", lambda self: (checks.append(1), inner(self))[1])
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("inproc://params-out")
    dec = msgspec.msgpack.Decoder()
    core = Core(llm.engine, llm.requests, llm.reset_prefix_cache,
                partial(compile_structured, llm), ctx, ["inproc://params-out"], None)  # fmt: skip
    llm.engine.adopt()
    got: dict[int, list[int]] = {}
    try:
        core.add_all([("add", k, [(ids, w)], None, k) for k, (ids, w) in
                      enumerate(zip(prompts, wires))])  # fmt: skip
        acks = dec.decode(pull.recv())
        assert acks[0] == "acks"
        refused = {key: kind for key, kind, _ in acks[1] if kind is not None}
        assert refused == {5: "ValueError"}, acks
        # two distinct valid forms: two validations (one per request without the cache);
        # the bad form is validated each time it comes (it raised: nothing kept)
        assert len(checks) == 3, len(checks)
        core.add_all([("add", 99, [(prompts[0], bad)], None, 99)])
        assert dec.decode(pull.recv())[1][0][1] == "ValueError"
        done = 0
        while done < len(prompts) - 1:
            assert llm.engine.turn()
            while pull.poll(0):
                msg = dec.decode(pull.recv())
                if msg[0] != "out":
                    continue
                for w, t in zip(msg[1], msg[2]):
                    got.setdefault(w, []).append(t)
                for w, toks, _, reason, *_ in msg[3]:
                    got.setdefault(w, []).extend(toks)
                    done += reason is not None
    finally:
        llm.engine.shutdown()
        pull.close(0)
        for sock in core.main_outs:
            sock.close(0)
        ctx.term()
    monkeypatch.undo()
    ref = LLM(model_dir, device="cpu", page_size=4, max_model_len=64, max_num_seqs=16,
              enable_prefix_caching=False)  # fmt: skip
    keep = [k for k in range(len(prompts)) if k != 5]
    want = ref.generate([prompts[k] for k in keep],
                        [longer if k % 4 == 1 else plain for k in keep])  # fmt: skip
    assert [got[k] for k in keep] == [w.outputs[0].token_ids for w in want]
