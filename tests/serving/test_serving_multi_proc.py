"""``unikv serve --model A --model B`` with the engine in its own process (the
default mode): ONE engine process holds both models under one KV budget
(``engine_client.ProcMulti``), each request goes to the model it names.

Oracles: each checkpoint's greedy texts from a standalone ``LLM.generate`` in
this process (the same checkpoint alone, a fixed pool); the server's process
tree (one engine process); the shared budget's own refusal of a grow past it,
answered from the engine process through the admin route.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from engine_fixtures import one_thread  # noqa: F401  (a fixture)
from serving_fixtures import ServerProcess, save_instruct_llama

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_LEN = 128
BUDGET = 8 << 20  # CLI chunks are 2 MiB (the emulated backing's too): 2 per model at least
PROMPTS = ["Hello, how are you", "The quick brown fox", "Pages move, requests keep"]
KEY = "sk-multi-proc"


def _engine_children(pid: int) -> int:
    n = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    n += b"unikv.serving.engine_core" in c.read()
    return n


def test_two_models_in_one_engine_process(tmp_path):
    paths, want = {}, {}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for seed, name in enumerate(("a", "b")):
        paths[name] = str(tmp_path / name)
        save_instruct_llama(paths[name], seed=seed + 1)
        llm = LLM(paths[name], device="cpu", page_size=4, max_model_len=MAX_LEN,
                  kv_cache_bytes=BUDGET // 2)  # fmt: skip
        want[name] = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
        del llm
    assert want["a"] != want["b"], "two different checkpoints"
    proc = ServerProcess(paths["a"], "--model", paths["b"], "--served-model-name", "a",
                         "--served-model-name", "b", "--kv-cache", str(BUDGET),
                         "--max-model-len", str(MAX_LEN), "--max-num-seqs", "8",
                         "--api-key", KEY, "--enable-admin-routes")  # fmt: skip
    auth = {"authorization": f"Bearer {KEY}"}
    url = proc.url + "/v1/completions"

    def complete(model: str, prompt: str) -> httpx.Response:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        return httpx.post(url, json=body, headers=auth, timeout=60)

    try:
        assert _engine_children(proc.proc.pid) == 1, "one engine process for both models"
        models = httpx.get(proc.url + "/v1/models", headers=auth, timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["a", "b"]
        with ThreadPoolExecutor(6) as pool:  # both models at once, interleaved
            jobs = {(m, p): pool.submit(complete, m, p) for p in PROMPTS for m in ("a", "b")}
            got = {k: f.result().json()["choices"][0]["text"] for k, f in jobs.items()}
        for name in ("a", "b"):
            assert [got[name, p] for p in PROMPTS] == want[name], name
        r = complete("c", PROMPTS[0])
        assert r.status_code == 404, r.text
        assert "'a'" in r.json()["error"]["message"] and "'b'" in r.json()["error"]["message"]
        # the budget lives in the engine process: a grow past it is refused there
        r = httpx.post(proc.url + "/admin/resize_kv_cache", json={"bytes": BUDGET, "model": "b"},
                       headers=auth, timeout=30)  # fmt: skip
        assert r.status_code == 400 and "shared budget" in r.json()["error"]["message"], r.text
        assert complete("b", PROMPTS[1]).json()["choices"][0]["text"] == want["b"][1]
        assert httpx.get(proc.url + "/health", timeout=10).status_code == 200
    finally:
        out = proc.stop()
    # SIGTERM: each model's loop stops, then the one engine process; no engine death
    assert proc.proc.returncode == 0, out
