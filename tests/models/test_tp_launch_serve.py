"""``unikv serve -tp 2``: the server's async engine drives the tensor-parallel
engine (rank 0's loop in the server's thread, the worker started by the server).

A tiny instruct Llama with a real tokenizer (``serving_fixtures``) is served at
TP 2 over gloo on the CPU; the openai client's answers are checked against a
TP-1 ``LLM`` in this process: greedy text and token counts (one prompt per
request and three in one request, plain and streamed), a stop string (the
workers find it too, by detokenizing: the next answers prove the ranks stayed
in step), seeded sampling with ``n`` 2, seeded sampling under a regex
constraint (the worker compiles it again), and a greedy answer after a client hung
up mid-stream (the abort reached the worker). The server's worker process is
gone once the server is stopped.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
from serving_fixtures import ServerProcess, save_instruct_llama

from unikv.engine import LLM, SamplingParams

openai = pytest.importorskip("openai")
PROMPTS = ["Hello, how are you", "The quick brown fox", "unikv serves models over one"]
MAX_LEN = 128


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    path = str(tmp_path_factory.mktemp("instruct"))
    save_instruct_llama(path)
    return path, LLM(path, device="cpu", page_size=4, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def server(ckpt):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UNIKV_TP_TIMEOUT_S", "60")
        proc = ServerProcess(ckpt[0], "-tp", "2", "--max-model-len", str(MAX_LEN),
                             "--served-model-name", "tiny")  # fmt: skip
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)


def _complete(client, prompt, **kw):
    return client.completions.create(model="tiny", prompt=prompt, temperature=0, **kw)


def test_greedy_completions_equal_tp1(ckpt, client):
    llm = ckpt[1]
    want = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    for prompt, ref in zip(PROMPTS, want):
        got = _complete(client, prompt, max_tokens=12)
        assert got.choices[0].text == ref.text
        assert got.usage.completion_tokens == len(ref.output_ids)
        chunks = list(_complete(client, prompt, max_tokens=12, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == ref.text
    together = _complete(client, PROMPTS, max_tokens=12)
    assert [c.text for c in sorted(together.choices, key=lambda c: c.index)] == [
        r.text for r in want
    ]


def test_a_stop_string_and_sampling_equal_tp1(ckpt, client):
    llm = ckpt[1]
    full = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0))[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"pick a stop string inside {full!r}"
    want = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0, stop=[stop]))
    got = _complete(client, PROMPTS[1], max_tokens=16, stop=[stop])
    assert got.choices[0].text == want[0].text and got.choices[0].finish_reason == "stop"
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=5, n=2)
    want = [c.text for c in llm.generate(PROMPTS[0], params)[0].outputs]
    got = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0.9, seed=5, n=2
    )
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want


def test_structured_outputs_equal_tp1(ckpt, client):
    """The worker compiles the constraint again from its source (a compiled
    grammar does not travel): sampled under it, the texts equal TP 1's."""
    pytest.importorskip("xgrammar")
    from unikv.engine.structured import compile_structured

    llm, regex = ckpt[1], "(yes|no)-[0-9]+"
    structured = compile_structured(llm, "regex", regex)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, n=3, structured=structured)
    want = [c.text for c in llm.generate("Hello", params)[0].outputs]
    got = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=10, temperature=1.0, seed=3, n=3,
        extra_body={"structured_outputs": {"regex": regex}},
    )  # fmt: skip
    texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
    assert texts == want and all(re.fullmatch(regex, t) for t in texts), (texts, want)


def test_a_client_hanging_up_keeps_the_ranks_in_step(ckpt, client, server):
    stream = _complete(
        client, PROMPTS[2], max_tokens=100, stream=True, extra_body={"ignore_eos": True}
    )
    for _, _ in zip(range(3), stream):
        pass
    stream.close()  # the server aborts the request on every rank
    time.sleep(0.5)
    ref = ckpt[1].generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert _complete(client, PROMPTS[0], max_tokens=12).choices[0].text == ref.text
    workers = _children(server.proc.pid)
    assert len(workers) >= 1  # the rank-1 process (and maybe multiprocessing's tracker)
    server.stop()
    deadline = time.monotonic() + 20
    while any(os.path.exists(f"/proc/{p}") for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in workers if os.path.exists(f"/proc/{p}")], "a worker outlived the server"
