"""Prometheus metrics of ``unikv serve`` (prometheus-client, one registry per app).

Pool and scheduler gauges are read at scrape time by a function that runs in
the engine loop's thread between two steps (``EngineLoop.call``), so a scrape
never sees the allocator mid-update:

    unikv_subpool_live_pages{subpool,kind}    pages in use (Mamba: state slots)
    unikv_subpool_usable_pages{subpool,kind}  pages the sub-pool could hold alone
    unikv_subpool_live_bytes{subpool,kind}    bytes of the live pages
    unikv_subpool_usage_ratio{subpool,kind}   live bytes / the pool's bytes
    unikv_pool_bytes                          the pool's byte budget
    unikv_num_requests_running / _waiting
    unikv_num_preemptions_total

Token counters and latency histograms are observed by the HTTP handlers as the
deltas reach them (what a client sees): prompt and generation tokens, requests
by finish reason, time to first token, inter-token latency, end-to-end latency.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2)
LATENCY_BUCKETS += (0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


def engine_snapshot(llm) -> dict:
    """Pool and scheduler counts; call in the engine loop's thread."""
    sched = llm.scheduler
    subpools = {}
    for name, sub in llm.pool.subpools.items():
        live = llm.alloc.subpool(name).num_live
        subpools[name] = {
            "kind": sub.spec.kind,
            "live_pages": live,
            "usable_pages": sub.usable_pages,
            "live_bytes": live * sub.page_bytes,
        }
    return {
        "subpools": subpools,
        "pool_bytes": llm.pool.total_bytes,
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "preemptions": sched.num_preemptions,
    }


class _EngineCollector:
    def __init__(self, loop, llm) -> None:
        self.loop, self.llm = loop, llm

    def describe(self):
        return []  # gauges are made at scrape time

    def collect(self):
        snap = self.loop.call(lambda: engine_snapshot(self.llm)).result(timeout=10)
        labels = ["subpool", "kind"]
        families = {
            key: GaugeMetricFamily(f"unikv_subpool_{key}", text, labels=labels)
            for key, text in (
                ("live_pages", "Pages in use per sub-pool (Mamba: recurrent-state slots)"),
                ("usable_pages", "Pages a sub-pool could hold with the whole pool"),
                ("live_bytes", "Bytes of the live pages per sub-pool"),
                ("usage_ratio", "Live bytes of a sub-pool over the pool's bytes"),
            )
        }
        for name, s in snap["subpools"].items():
            values = dict(s, usage_ratio=s["live_bytes"] / max(snap["pool_bytes"], 1))
            for key, family in families.items():
                family.add_metric([name, s["kind"]], values[key])
        yield from families.values()
        yield GaugeMetricFamily("unikv_pool_bytes", "The pool's byte budget", snap["pool_bytes"])
        yield GaugeMetricFamily(
            "unikv_num_requests_running", "Requests holding pages", snap["running"]
        )
        yield GaugeMetricFamily(
            "unikv_num_requests_waiting",
            "Requests waiting for admission (new or preempted)",
            snap["waiting"] + len(self.loop._inbox),
        )
        yield CounterMetricFamily(
            "unikv_num_preemptions", "Requests preempted (recompute)", snap["preemptions"]
        )


class ServingMetrics:
    """The app's registry and the handler-side counters and histograms."""

    def __init__(self, loop, llm) -> None:
        disable_created_metrics()  # no *_created series (as vLLM)
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter(
            "unikv_prompt_tokens", "Prompt tokens of accepted completions", registry=r
        )
        self.generation_tokens = Counter(
            "unikv_generation_tokens", "Generated tokens sent to clients", registry=r
        )
        self.requests = Counter(
            "unikv_request_success", "Finished completions", ["finish_reason"], registry=r
        )
        self.ttft = Histogram(
            "unikv_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "unikv_inter_token_latency_seconds",
            "Time between two tokens of a completion",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "unikv_e2e_request_latency_seconds",
            "Arrival to the last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(loop, llm))


class RequestClock:
    """Latency bookkeeping of one HTTP request's completions."""

    def __init__(self, metrics: ServingMetrics, start: float) -> None:
        self.metrics, self.start = metrics, start
        self.last: dict[tuple[int, int], float] = {}  # (prompt, index) -> last token time

    def tokens(self, key: tuple[int, int], num: int, now: float) -> None:
        if not num:
            return
        m = self.metrics
        m.generation_tokens.inc(num)
        last = self.last.get(key)
        if last is None:
            m.ttft.observe(now - self.start)
        else:
            m.itl.observe((now - last) / num)
        self.last[key] = now

    def finished(self, reason: str, now: float) -> None:
        self.metrics.requests.labels(reason).inc()
        self.metrics.e2e.observe(now - self.start)
