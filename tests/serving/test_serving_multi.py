"""Several models and an elastic pool behind the HTTP app (issue 44 items 1-2),
in process, on CPU with the emulated backing: two models under one budget
through the ``openai`` client (each answers as a standalone ``LLM`` of the same
checkpoint does; an unknown model is a 404 naming both); ``POST
/admin/resize_kv_cache`` (401 without the key, 404 without
``enable_admin_routes``, 409 with nothing changed below what running requests
hold, 400 for a size the pool cannot take, the new size otherwise); the idle
shrink to a floor, then the regrowth on demand with the same tokens."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from engine_fixtures import one_thread  # noqa: F401  (a fixture)
from serving_fixtures import AppThread, ScriptedLLM, save_instruct_llama

import unikv.pool
from unikv.backing import EmulatedBacking
from unikv.engine import LLM, SamplingParams
from unikv.engine.budget_broker import idle_budget, least_size
from unikv.engine.multi import MultiLLM
from unikv.serving.app import create_app
from unikv.serving.ops import ServeOptions

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "sk-multi"
AUTH = {"authorization": f"Bearer {KEY}"}
KW = {"device": "cpu", "page_size": 4, "max_num_seqs": 8, "max_model_len": 128,
      "max_num_batched_tokens": 32}  # fmt: skip
CHUNK = 4096
TOTAL = 512 << 10
PROMPTS = ["The quick brown fox", "Hello, how are you", "Pages move, requests keep"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    out = {}
    for seed, name in enumerate(("a", "b")):
        out[name] = str(tmp_path_factory.mktemp(name))
        save_instruct_llama(out[name], seed=seed + 1)
    return out


@pytest.fixture(scope="module")
def want(paths):
    """Each checkpoint's texts from a standalone fixed-size LLM."""
    out = {}
    for name, path in paths.items():
        llm = LLM(path, kv_cache_bytes=TOTAL, **KW)
        out[name] = [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY)]
    assert out["a"] != out["b"], "two different checkpoints"
    return out


def _complete(client, model: str, prompt: str) -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    return r.choices[0].text


def test_two_models_one_budget_over_http(paths, want):
    multi = MultiLLM(paths, total_kv_bytes=TOTAL, chunk=CHUNK, **KW)
    options = ServeOptions(api_key=KEY, enable_admin_routes=True)
    app = AppThread(create_app(multi, served_model_names=["a", "b"], options=options))
    try:
        client = openai.OpenAI(base_url=app.url + "/v1", api_key=KEY, timeout=60, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["a", "b"]
        for name in ("a", "b"):
            assert [_complete(client, name, p) for p in PROMPTS] == want[name], name
        with pytest.raises(openai.NotFoundError) as err:
            _complete(client, "c", PROMPTS[0])
        assert "'a'" in str(err.value) and "'b'" in str(err.value)
        assert multi.backing.committed_bytes <= TOTAL
        _metrics_list_both(app.url, multi)
        url = app.url + "/admin/resize_kv_cache"
        r = httpx.post(url, json={"bytes": 1 << 16, "model": "a"}, timeout=30)
        assert r.status_code == 401
        r = httpx.post(url, json={"bytes": 1 << 16}, headers=AUTH, timeout=30)
        assert r.status_code == 400 and "several models" in r.json()["error"]["message"]
        before = multi.committed()
        r = httpx.post(url, json={"bytes": TOTAL, "model": "b"}, headers=AUTH, timeout=30)
        assert r.status_code == 400 and "shared budget" in r.json()["error"]["message"]
        assert multi.committed() == before, "a refused grow changed nothing"
        floor = multi.budget.members["b"].floor
        r = httpx.post(url, json={"bytes": floor, "model": "b"}, headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json() == {"model": "b", "bytes": floor}
        assert multi["b"].pool.total_bytes == floor
        assert [_complete(client, "b", p) for p in PROMPTS] == want["b"]
    finally:
        app.stop()
        multi.close()


def _metrics_list_both(url: str, multi) -> None:
    """/metrics exports every model's series, labelled by model, each family once:
    the handler counters against the tokens the client got (3 x 12 per model), the
    pool gauge against each model's own pool."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), "a family exported twice"
    by = {f.name: {s.labels.get("model_name"): s.value for s in f.samples} for f in families}
    assert by["vllm:generation_tokens"] == {"a": 36, "b": 36}
    assert by["unikv:pool_bytes"] == {n: multi[n].pool.total_bytes for n in ("a", "b")}
    assert set(by["vllm:num_requests_running"]) == {"a", "b"}


def test_admin_resize_refuses_below_live_and_is_off_by_default(paths, want):
    scripted = AppThread(create_app(ScriptedLLM(), served_model_names=["x"]))
    try:  # not mounted without enable_admin_routes
        r = httpx.post(scripted.url + "/admin/resize_kv_cache", json={"bytes": 1}, timeout=10)
        assert r.status_code == 404
    finally:
        scripted.stop()
    llm = LLM(paths["a"], kv_cache_bytes=TOTAL // 2, kv_cache_max_bytes=TOTAL, **KW)
    llm.engine.on_step = lambda *_: time.sleep(0.01)  # a slow engine: requests stay live
    options = ServeOptions(api_key=KEY, enable_admin_routes=True)
    app = AppThread(create_app(llm, served_model_names=["a"], options=options))
    url = app.url + "/admin/resize_kv_cache"
    try:
        client = openai.OpenAI(base_url=app.url + "/v1", api_key=KEY, timeout=60, max_retries=0)
        long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        done = []
        worker = threading.Thread(target=lambda: done.append(llm.generate(PROMPTS * 2, long)))
        worker.start()
        while not llm.scheduler.running:
            time.sleep(0.01)
        time.sleep(0.6)
        books = llm.alloc.parts.books.values()
        shape = (llm.pool.total_bytes, [(b.band, b.num_live) for b in books])
        least = least_size(llm.pool)  # one worst-case request: below what 6 hold
        assert sum(b.num_live * b.page_bytes for b in books) > least
        r = httpx.post(url, json={"bytes": least}, headers=AUTH)
        assert r.status_code == 409, r.text
        assert "running requests need" in r.json()["error"]["message"]
        assert llm.pool.total_bytes == shape[0], "a refused shrink changed nothing"
        worker.join(120)
        assert [o.outputs[0].token_ids for o in done[0]][:3] == [
            o.outputs[0].token_ids for o in LLM(paths["a"], kv_cache_bytes=TOTAL, **KW).generate(
                PROMPTS, long)
        ]  # fmt: skip
        for body in ({"bytes": 0}, {"bytes": "1"}, {"bytes": 1, "extra": 1}, [1]):
            assert httpx.post(url, json=body, headers=AUTH).status_code == 400, body
        r = httpx.post(url, content=b'{"bytes": 1}', headers=AUTH)  # no JSON content type
        assert r.status_code == 415
        r = httpx.post(url, json={"bytes": TOTAL + 1}, headers=AUTH)
        assert r.status_code == 400 and "max_bytes" in r.json()["error"]["message"]
        r = httpx.post(url, json={"bytes": TOTAL // 4}, headers=AUTH)
        assert r.status_code == 200 and r.json()["bytes"] == TOTAL // 4 == llm.pool.total_bytes
        assert [_complete(client, "a", p) for p in PROMPTS] == want["a"]
    finally:
        app.stop()


def test_idle_shrink_then_regrow_gives_the_same_tokens(paths, want, monkeypatch):
    monkeypatch.setattr(unikv.pool, "make_backing", lambda device: EmulatedBacking(CHUNK))
    llm = LLM(paths["b"], kv_cache_bytes=TOTAL // 2, kv_cache_max_bytes=TOTAL // 2, **KW)
    budget = idle_budget(llm, 0.2, 1 << 16)
    floor = budget.members["model"].floor
    assert floor == max(1 << 16, floor) and floor < llm.pool.total_bytes
    app = AppThread(create_app(llm, served_model_names=["b"]))  # the watcher starts with it
    try:
        client = openai.OpenAI(base_url=app.url + "/v1", api_key="x", timeout=60, max_retries=0)
        assert [_complete(client, "b", p) for p in PROMPTS] == want["b"]
        start = llm.pool.backing.committed_bytes
        deadline = time.monotonic() + 10
        while llm.pool.total_bytes != floor:
            assert time.monotonic() < deadline, "no idle shrink"
            time.sleep(0.05)
        assert llm.pool.backing.committed_bytes < start
        assert [_complete(client, "b", p) for p in PROMPTS] == want["b"]
        assert budget.members["model"].grants >= 1, "it grew back on demand"
    finally:
        app.stop()


def test_serve_command_line_takes_several_models():
    from unikv.serving.cli import split_models

    argv = ["--model", "A", "--port", "1", "--model=B", "--model", "C", "--kv-cache", "1GiB"]
    rest, models = split_models(argv)
    assert models == ["A", "B", "C"]
    assert rest == ["--model", "A", "--port", "1", "--kv-cache", "1GiB"]
    assert split_models(["--model=A"]) == (["--model=A"], ["A"])
    with pytest.raises(ValueError, match="less than two"):
        MultiLLM({"a": "x", "b": "y"}, total_kv_bytes=3 * CHUNK, chunk=CHUNK, device="cpu")
