"""/metrics' pool gauges on a hybrid model (tiny Qwen3.5: full-attention pages
and Mamba state slots), read while a request runs and after it is aborted.

Oracle: the pages a request of known length must hold (ceil(tokens / page
size) full-attention pages, exactly one state slot), and the allocator's own
counts read in the loop's thread.
"""

from __future__ import annotations

import queue

import pytest
from engine_fixtures import one_thread, save_tiny_hybrid, save_tiny_model  # noqa: F401
from serving_fixtures import metric_values

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("prometheus_client")


def test_hybrid_pool_gauges_count_pages_and_state_slots(tmp_path):
    from prometheus_client import generate_latest

    from unikv.serving.metrics import ServingMetrics

    save_tiny_hybrid("qwen3_5", str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", page_size=4, max_model_len=64, max_num_seqs=2)
    metrics = ServingMetrics(llm.engine, llm)
    deltas: queue.Queue = queue.Queue()
    prompt = list(range(10, 23))  # 13 tokens
    llm.engine.start()
    try:
        group = llm.make_group(
            prompt, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0), sink=deltas.put
        )
        llm.engine.submit(group)
        deltas.get(timeout=60)
        seen = {}

        def read():
            seen["cached"] = group.requests[0].num_cached
            return generate_latest(metrics.registry).decode()

        text = llm.engine.call(read).result(timeout=60)
        live = metric_values(text, "unikv:subpool_live_pages")
        assert live['{kind="mamba",subpool="mamba"}'] == 1
        held = live['{kind="full",subpool="full"}']
        # the step in flight was allocated too: cached tokens plus up to one more
        assert -(-seen["cached"] // 4) <= held <= -(-(seen["cached"] + 1) // 4)
        ratio = metric_values(text, "unikv:subpool_usage_ratio")['{kind="mamba",subpool="mamba"}']
        sub = llm.pool.subpools["mamba"]
        assert ratio == pytest.approx(sub.page_bytes / llm.pool.total_bytes)
        assert metric_values(text, "vllm:num_requests_running")[""] == 1
        llm.engine.abort(group)
        while deltas.get(timeout=60).finish_reason is None:
            pass
        text = llm.engine.call(lambda: generate_latest(metrics.registry).decode()).result(60)
        assert set(metric_values(text, "unikv:subpool_live_pages").values()) == {0.0}
    finally:
        llm.engine.shutdown()


def test_lock_free_histograms_and_counters_export_as_prometheus_client_would():
    """The handlers' plain-int histogram against prometheus-client's own Histogram
    fed the same values (bucket edges included), and the counters' names."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client import Histogram as PromHistogram

    from unikv.serving.metrics import LATENCY_BUCKETS, ServingMetrics

    ours = ServingMetrics(None, None)  # no engine: the handler figures alone
    ref = CollectorRegistry()
    want = PromHistogram(
        "vllm:inter_token_latency_seconds", "x", ["model_name"], buckets=LATENCY_BUCKETS,
        registry=ref,
    ).labels("unikv")  # fmt: skip
    values = [0.0, 0.001, 0.0010001, 0.05, 0.2, 3.0, 80.0, 81.0] + list(LATENCY_BUCKETS)
    for v in values:
        ours.itl.observe(v)
        want.observe(v)
    ours.generation_tokens += 5
    ours.finished("stop")
    ours.finished("abort", 2)

    def samples(text: str, name: str) -> list[str]:
        return [ln for ln in text.splitlines() if ln.startswith(name)]

    text = generate_latest(ours.registry).decode()
    name = "vllm:inter_token_latency_seconds"
    assert samples(text, name) == samples(generate_latest(ref).decode(), name)
    assert metric_values(text, "vllm:generation_tokens_total")[""] == 5
    done = metric_values(text, "vllm:request_success_total")
    assert done == {'{finished_reason="stop"}': 1, '{finished_reason="abort"}': 2}


def test_prefix_cache_counters_reach_metrics(tmp_path):
    """/metrics exports the allocator's prefix-cache counters: after the same
    prompt twice, the hit tokens equal the second request's num_cached_tokens."""
    from prometheus_client import generate_latest

    from unikv.serving.metrics import ServingMetrics

    save_tiny_model("llama", str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", page_size=4, max_model_len=64, max_num_seqs=2,
              enable_prefix_caching=True)  # fmt: skip
    metrics = ServingMetrics(llm.engine, llm)
    prompt = list(range(10, 23))  # 13 tokens: 3 whole pages of 4
    params = SamplingParams(max_tokens=3, temperature=0.0)
    llm.generate([prompt], params)
    second = llm.generate([prompt], params)[0]
    text = generate_latest(metrics.registry).decode()
    hits = metric_values(text, "vllm:prefix_cache_hits_total")[""]
    assert hits == second.num_cached_tokens == 12
    assert metric_values(text, "unikv:prefix_cache_pages")[""] >= 3
