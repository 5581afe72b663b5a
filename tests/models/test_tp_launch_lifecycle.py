"""The launched ranks' lifecycle (``engine/tp_launch.py``), gloo on the CPU:

- a worker killed while a serving loop idles ends that loop within a bounded
  time (``error`` a ``TensorParallelError`` naming rank 1, ``on_death`` called: a
  server exits non-zero);
- a worker killed mid-run gives rank 0 a ``TensorParallelError`` naming its rank
  and pid within a bounded time, and so does every later call; ``close()`` then
  leaves no child process and no process group;
- a second TP LLM starts after the first closed, and its first batch equals TP 1;
- after a step interrupted on rank 0 alone (Ctrl-C), the next call is a
  ``TensorParallelError`` saying so;
- an option every rank refuses while building (after the spawn) is raised as it
  is (a ValueError, not a worker's error), and no process or group is left;
- a script that never calls ``close()`` exits on its own (no hang in
  multiprocessing's exit hook) and its worker is gone; its tokens equal TP 1's.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist
from tp_launch_fixtures import GREEDY, OPTIONS, bound_the_ranks, build_llama, gone, ids, prompts

from unikv.engine import LLM
from unikv.engine.tp_launch import TensorParallelError

KILL_DEADLINE_S = 30.0  # the error reaches rank 0 well within this (gloo: at once)


@pytest.fixture(autouse=True)
def bounded(monkeypatch):
    bound_the_ranks(monkeypatch)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("llama"))


# the serving loop's thread ends by raising the error (as designed): not a warning here
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_killed_worker_is_a_clear_error_and_a_second_llm_starts(llama):
    path, _, greedy, _ = llama
    with LLM(path, device="cpu", tensor_parallel_size=2, **OPTIONS) as first:
        died = threading.Event()
        first.engine.on_death = lambda err: died.set()
        first.engine.start()  # serving: generate submits to the loop's thread
        assert ids(first.generate(prompts()[:1], GREEDY)) == greedy[:1]
        os.kill(first.workers.pids[0], signal.SIGKILL)  # while the loop idles
        assert died.wait(KILL_DEADLINE_S), "an idle serving loop did not notice the death"
        assert isinstance(first.engine.error, TensorParallelError)
        assert "rank 1" in str(first.engine.error)
    llm = LLM(path, device="cpu", tensor_parallel_size=2, **OPTIONS)  # after the first closed
    try:
        (pid,) = llm.workers.pids
        assert ids(llm.generate(prompts()[1:2], GREEDY)) == greedy[1:2]

        def kill_at_step_3(_, batch, logits, steps=[]):  # noqa: B006  (a step counter)
            steps.append(1)
            if len(steps) == 3:
                os.kill(pid, signal.SIGKILL)

        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1") as err:
            llm.generate(prompts(), GREEDY, on_step=kill_at_step_3)
        assert time.monotonic() - start < KILL_DEADLINE_S
        assert f"pid {pid}" in str(err.value) and "died" in str(err.value)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1"):
            llm.generate(prompts(), GREEDY)
        assert time.monotonic() - start < 5
    finally:
        llm.close()
    assert gone(pid) and multiprocessing.active_children() == []
    assert not dist.is_initialized()


EXIT_SCRIPT = """
import sys, torch
from unikv.engine import LLM, SamplingParams
if __name__ == "__main__":
    torch.set_num_threads(1)
    llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2, page_size=4, max_model_len=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    print(llm.workers.pids[0], out[0].output_ids, flush=True)
"""  # exits without close(): atexit stops the worker


def test_the_interpreter_exit_stops_the_workers(llama, tmp_path):
    path, *_ = llama
    script = tmp_path / "tp_exit.py"
    script.write_text(EXIT_SCRIPT)
    env = dict(os.environ, UNIKV_TP_TIMEOUT_S="60")
    done = subprocess.run(
        [sys.executable, str(script), path],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    pid, tokens = done.stdout.strip().splitlines()[-1].split(" ", 1)
    tp1 = LLM(path, device="cpu", page_size=4, max_model_len=64)
    assert tokens.strip() == str(tp1.generate([[1, 2, 3]], GREEDY)[0].output_ids[:4])
    deadline = time.monotonic() + 10  # reaped by init once its parent is gone
    while not gone(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(int(pid))


def test_an_interrupted_step_is_refused_afterwards(llama):
    """Ctrl-C mid-step leaves the worker inside the step: the next call must be a
    clear error, not collectives paired with the wrong step."""
    path, *_ = llama

    def interrupt(_, batch, logits):
        raise KeyboardInterrupt

    with LLM(path, device="cpu", tensor_parallel_size=2, **OPTIONS) as llm:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts(), GREEDY, on_step=interrupt)
        with pytest.raises(TensorParallelError, match="interrupted on rank 0"):
            llm.generate(prompts(), GREEDY)
    assert multiprocessing.active_children() == []


def test_a_bad_option_every_rank_refuses_is_raised_as_is(llama):
    path, *_ = llama
    with pytest.raises(ValueError, match="max_model_len must be in"):
        LLM(path, device="cpu", tensor_parallel_size=2, max_model_len=10**6)
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()
