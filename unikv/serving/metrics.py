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
    unikv_prefix_cache_{hit,query}_tokens_total, _evicted_pages_total, _pages

Token counters and latency histograms are observed by the HTTP handlers as the
deltas reach them (what a client sees): prompt and generation tokens, requests
by finish reason, time to first token, inter-token latency, end-to-end latency.
They are plain ints and bucket lists kept by the event loop's thread (no lock
per token), exported at scrape time under prometheus-client's names.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2)
LATENCY_BUCKETS += (0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


def engine_snapshot(llm) -> dict:
    """Pool and scheduler counts; call in the engine loop's thread."""
    sched = llm.scheduler
    subpools = {}
    for name, sub in llm.pool.subpools.items():
        live = llm.alloc.parts.books[name].num_live
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
        "prefix": llm.alloc.parts.prefix.counters(),
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
            "unikv_num_preemptions", "Requests preempted (recompute or swap)", snap["preemptions"]
        )
        prefix = snap["prefix"]
        for key, text in (
            ("hit_tokens", "Prompt tokens served from the prefix cache"),
            ("query_tokens", "Prompt tokens looked up in the prefix cache"),
            ("evicted_pages", "Prefix-cache pages evicted"),
            ("host_spilled_pages", "Prefix-cache pages spilled to the host tier"),
            ("host_hit_tokens", "Prompt tokens served by reloading host-tier pages"),
            ("host_reloaded_pages", "Host-tier pages reloaded on a hit"),
            ("host_evicted_pages", "Host-tier pages dropped"),
        ):
            if key in prefix:  # the host tier's counters exist when one is attached
                yield CounterMetricFamily(f"unikv_prefix_cache_{key}", text, prefix[key])
        yield GaugeMetricFamily(
            "unikv_prefix_cache_pages",
            "Pages the prefix cache holds (evictable included)",
            prefix["pages"],
        )


class Histogram:
    """Bucket counts of one histogram, written by one thread (the event loop):
    plain ints, no lock (prometheus-client takes two per observation)."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.doc, self.bounds = name, doc, tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        counts, total = list(self.counts), self.sum  # a copy: the loop keeps writing
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        family = HistogramMetricFamily(self.name, self.doc)
        family.add_metric([], list(zip(les, accumulate(counts))), total)
        return family


class ServingMetrics:
    """The app's registry and the handler-side counters and histograms.

    The handlers' figures are plain ints and bucket lists updated by the event
    loop's thread only (no lock per token) and exported at scrape time."""

    def __init__(self, loop, llm) -> None:
        disable_created_metrics()  # no *_created series (as vLLM)
        self.registry = CollectorRegistry()
        self.prompt_tokens = 0  # of accepted completions
        self.generation_tokens = 0  # sent to clients
        self.requests: dict[str, int] = {}  # finished completions by finish reason
        self.ttft = Histogram("unikv_time_to_first_token_seconds", "Arrival to first token")
        self.itl = Histogram(
            "unikv_inter_token_latency_seconds", "Time between two tokens of a completion"
        )
        self.e2e = Histogram("unikv_e2e_request_latency_seconds", "Arrival to the last token")
        self.registry.register(_HandlerCollector(self))
        if loop is not None:  # None: the handler figures alone (tests)
            self.registry.register(_EngineCollector(loop, llm))

    def finished(self, reason: str, num: int = 1) -> None:
        self.requests[reason] = self.requests.get(reason, 0) + num


class _HandlerCollector:
    def __init__(self, metrics: ServingMetrics) -> None:
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        m = self.m
        yield CounterMetricFamily(
            "unikv_prompt_tokens", "Prompt tokens of accepted completions", m.prompt_tokens
        )
        yield CounterMetricFamily(
            "unikv_generation_tokens", "Generated tokens sent to clients", m.generation_tokens
        )
        done = CounterMetricFamily(
            "unikv_request_success", "Finished completions", labels=["finish_reason"]
        )
        for reason, num in dict(m.requests).items():
            done.add_metric([reason], num)
        yield done
        for hist in (m.ttft, m.itl, m.e2e):
            yield hist.family()


class RequestClock:
    """Latency bookkeeping of one HTTP request's completions (event loop thread)."""

    def __init__(self, metrics: ServingMetrics, start: float) -> None:
        self.metrics, self.start = metrics, start
        self.last: dict[tuple[int, int], float] = {}  # (prompt, index) -> last token time

    def tokens(self, key: tuple[int, int], num: int, now: float) -> None:
        """``num`` tokens of completion ``key`` reached the client at ``now``."""
        if not num:
            return
        m = self.metrics
        m.generation_tokens += num
        last = self.last.get(key)
        if last is None:
            m.ttft.observe(now - self.start)
        else:
            m.itl.observe((now - last) / num)
        self.last[key] = now

    def finished(self, reason: str, now: float) -> None:
        self.metrics.finished(reason)
        self.metrics.e2e.observe(now - self.start)
