"""Prometheus metrics of ``unikv serve`` (prometheus-client, one registry per app).

vLLM's names and labels where the meaning is the same, so vLLM's dashboards
and autoscalers read them unchanged; unikv's own pool figures under ``unikv:``.
Every series has a ``model_name`` label: with several models served (``unikv
serve --model A --model B``) each model's series are exported side by side
(``Merged``), one family each.
``docs/grafana-unikv.json``: a dashboard over them.

Read at scrape time by a function that runs in the engine loop's thread between
two steps (``EngineLoop.call``), so a scrape never sees the allocator mid-update:

    vllm:num_requests_running, vllm:num_requests_waiting
    vllm:kv_cache_usage_perc              bytes in use / the pool's bytes (0..1)
    vllm:num_preemptions_total
    unikv:engine_steps_total, unikv:engine_prefill_steps_total   (steps planned; with prefill)
    vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total   (tokens)
    unikv:subpool_live_pages{subpool,kind}    pages in use (Mamba: state slots)
    unikv:subpool_cached_pages{subpool,kind}  evictable prefix-cache pages (free)
    unikv:subpool_usable_pages / _live_bytes / _usage_ratio {subpool,kind}
    unikv:pool_bytes, unikv:prefix_cache_pages, unikv:prefix_cache_evicted_pages_total,
    unikv:prefix_cache_host_* (with a host tier)
    vllm:spec_decode_num_drafts_total, _num_draft_tokens_total, _num_accepted_tokens_total,
    unikv:spec_decode_draft_seconds_total, unikv:spec_decode_verify_steps_total
        (with speculative decoding: acceptance rate = accepted / draft tokens)
    unikv:engine_step_phase_seconds{phase}, unikv:engine_step_phase_max_seconds{phase}
        host time per engine step by phase (``unikv.engine.step_times``)

A cached page no request holds can be evicted at once, so it counts as free
(as vLLM counts unreferenced cached blocks): ``live_pages`` and the usage leave
it out, and ``cached_pages`` shows it. An idle server reads 0 in use.

Observed by the HTTP handlers as the deltas reach them (what a client sees):

    vllm:prompt_tokens_total, vllm:generation_tokens_total
    vllm:request_success_total{finished_reason}
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
    vllm:request_time_per_output_token_seconds, vllm:e2e_request_latency_seconds

They are plain ints and bucket lists kept by the event loop's thread (no lock
per token), exported at scrape time under prometheus-client's names.

With several API processes (``unikv serve --api-server-count N``) each keeps
its own figures and publishes them (``SharedFigures``: one float64 row per
process in a small shared file, written at each request's start and end and
every ``PUBLISH_S``); a scrape of any process exports the sum over all of
them: its own live figures plus the others' last published rows. The engine's
figures come from the one engine process. Per process (0 = the first):

    unikv:api_server_requests_total{api_server,pid}   requests it took
"""

from __future__ import annotations

import os
from bisect import bisect_left
from itertools import accumulate

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2)
LATENCY_BUCKETS += (0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
SHARED_REASONS = ("stop", "length", "abort", "error")  # the finish reasons API processes share
PUBLISH_S = 1.0  # how often an API process of several publishes its figures (also per request)


# speculative decoding (with ``--speculative-config``): vLLM's names, then unikv's
SPEC_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "verify_requests", "Requests' verify steps (draft runs)"),
    ("vllm:spec_decode_num_draft_tokens", "draft_tokens", "Draft tokens scored"),
    ("vllm:spec_decode_num_accepted_tokens", "accepted_tokens", "Draft tokens accepted"),
    ("unikv:spec_decode_draft_seconds", "draft_seconds", "Host seconds proposing drafts"),
    ("unikv:spec_decode_verify_steps", "verify_steps", "Steps that verified drafts"),
    ("unikv:spec_decode_ahead_steps", "ahead_steps", "Verify steps planned ahead (pipeline)"),
    ("unikv:spec_decode_ahead_dropped", "ahead_dropped", "Verify steps planned ahead, thrown away"),
    ("unikv:spec_decode_head_hole_rows", "head_hole_rows", "Draft head rows left as holes, zeroed"),
    ("unikv:spec_decode_head_hole_hits", "head_hole_hits", "Prefix hits over draft head holes"),
)


def engine_snapshot(core) -> dict:
    """Pool and scheduler counts of ``core`` (anything with the engine's
    ``scheduler``, ``pool`` and ``alloc``); call in the engine loop's thread."""
    sched, pool, alloc = core.scheduler, core.pool, core.alloc
    subpools = {}
    for name, sub in pool.subpools.items():
        held = alloc.view.live_pages(name)
        cached = min(alloc.prefix.cached_pages(name), held)
        subpools[name] = {
            "kind": sub.spec.kind,
            "live_pages": held - cached,
            "cached_pages": cached,
            "usable_pages": sub.usable_pages,
            "live_bytes": (held - cached) * sub.page_bytes,
        }
    return {
        "subpools": subpools,
        "pool_bytes": pool.total_bytes,
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "preemptions": sched.num_preemptions,
        "steps": sched.num_steps,  # steps planned, and those with prefill rows
        "prefill_steps": sched.num_prefill_steps,
        "prefix": alloc.prefix.counters(),
        "spec": sched.spec.counters.as_dict() if sched.spec is not None else None,
    }


def _gauge(name: str, doc: str, model: str, value) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _counter(name: str, doc: str, model: str, value) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], value)
    return family


class _EngineCollector:
    def __init__(self, snapshot, model: str) -> None:
        self.snapshot, self.model = snapshot, model

    def describe(self):
        return []  # gauges are made at scrape time

    def collect(self):
        snap = self.snapshot()
        model, pool_bytes = self.model, max(snap["pool_bytes"], 1)
        used = sum(s["live_bytes"] for s in snap["subpools"].values())
        yield _gauge("vllm:num_requests_running", "Requests holding pages", model,
                     snap["running"])  # fmt: skip
        yield _gauge(
            "vllm:num_requests_waiting",
            "Requests waiting for admission (new or preempted)",
            model,
            snap["waiting"],
        )
        yield _gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage: bytes in use (evictable cached pages excluded) over the pool's, "
            "1 = full",
            model,
            used / pool_bytes,
        )
        yield _counter("vllm:num_preemptions", "Requests preempted (recompute or swap)", model,
                       snap["preemptions"])  # fmt: skip
        yield _counter("unikv:engine_steps", "Engine steps planned", model, snap["steps"])
        yield _counter("unikv:engine_prefill_steps", "Engine steps with prefill rows", model,
                       snap["prefill_steps"])  # fmt: skip
        prefix = snap["prefix"]
        yield _counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                       model, prefix["query_tokens"])  # fmt: skip
        yield _counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                       model, prefix["hit_tokens"])  # fmt: skip
        labels = ["subpool", "kind", "model_name"]
        families = {
            key: GaugeMetricFamily(f"unikv:subpool_{key}", text, labels=labels)
            for key, text in (
                ("live_pages", "Pages in use per sub-pool (Mamba: state slots), cached excluded"),
                ("cached_pages", "Evictable prefix-cache pages per sub-pool (free on demand)"),
                ("usable_pages", "Pages a sub-pool could hold with the whole pool"),
                ("live_bytes", "Bytes of the pages in use per sub-pool"),
                ("usage_ratio", "Bytes in use of a sub-pool over the pool's bytes"),
            )
        }  # fmt: skip
        for name, s in snap["subpools"].items():
            values = dict(s, usage_ratio=s["live_bytes"] / pool_bytes)
            for key, family in families.items():
                family.add_metric([name, s["kind"], model], values[key])
        yield from families.values()
        yield _gauge("unikv:pool_bytes", "The pool's byte budget", model, snap["pool_bytes"])
        for key, text in (
            ("evicted_pages", "Prefix-cache pages evicted"),
            ("host_spilled_pages", "Prefix-cache pages spilled to the host tier"),
            ("host_hit_tokens", "Prompt tokens served by reloading host-tier pages"),
            ("host_reloaded_pages", "Host-tier pages reloaded on a hit"),
            ("host_evicted_pages", "Host-tier pages dropped"),
        ):
            if key in prefix:  # the host tier's counters exist when one is attached
                yield _counter(f"unikv:prefix_cache_{key}", text, model, prefix[key])
        yield _gauge("unikv:prefix_cache_pages", "Pages the prefix cache holds (evictable included)",
                     model, prefix["pages"])  # fmt: skip
        spec = snap["spec"]
        for name, key, text in () if spec is None else SPEC_COUNTERS:
            yield _counter(name, text, model, spec[key])
        if snap.get("step_times"):
            yield from _step_families(snap["step_times"], model)


def _step_families(times: dict, model: str):
    """The engine's host time per step phase (``unikv.engine.step_times``): one
    histogram per phase, and each phase's largest figure so far."""
    les = [floatToGoString(b) for b in times["edges_s"]] + ["+Inf"]
    hist = HistogramMetricFamily(
        "unikv:engine_step_phase_seconds",
        "Host seconds per engine step, by phase (plan, launch, wait, output, step; io: "
        "the engine process's input between steps; gc: collector pauses)",
        labels=["phase", "model_name"],
    )
    top = GaugeMetricFamily("unikv:engine_step_phase_max_seconds",
                            "The largest host seconds of a step phase so far",
                            labels=["phase", "model_name"])  # fmt: skip
    for phase, h in times["phases"].items():
        hist.add_metric([phase, model], list(zip(les, accumulate(h["counts"]))), h["sum_s"])
        top.add_metric([phase, model], h["max_s"])
    yield hist
    yield top


class Histogram:
    """Bucket counts of one histogram, written by one thread (the event loop):
    plain ints, no lock (prometheus-client takes two per observation)."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS,
                 model: str | None = None):  # fmt: skip
        self.name, self.doc, self.bounds, self.model = name, doc, tuple(buckets), model
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.sum += value

    def family(
        self, counts: list | None = None, total: float | None = None
    ) -> HistogramMetricFamily:
        """The exported family: this histogram's figures, or ``counts`` and ``total``
        (the sum over API processes)."""
        if counts is None:
            counts, total = list(self.counts), self.sum  # a copy: the loop keeps writing
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        labels = [] if self.model is None else ["model_name"]
        family = HistogramMetricFamily(self.name, self.doc, labels=labels)
        values = [] if self.model is None else [self.model]
        family.add_metric(values, list(zip(les, accumulate(counts))), total)
        return family


class ServingMetrics:
    """The app's registry and the handler-side counters and histograms.

    The handlers' figures are plain ints and bucket lists updated by the event
    loop's thread only (no lock per token) and exported at scrape time."""

    def __init__(self, loop, core, model_name: str = "unikv", snapshot=None) -> None:
        """``loop``: the engine loop of this process (None: ``snapshot`` or none);
        ``core``: its engine (``build.Engine``: scheduler, pool, allocator)."""
        disable_created_metrics()  # no *_created series (as vLLM)
        self.registry = CollectorRegistry()
        self.model = model_name
        self.prompt_tokens = 0  # of accepted completions
        self.generation_tokens = 0  # sent to clients
        self.requests: dict[str, int] = {}  # finished completions by finish reason
        m = model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token",
                              model=m)  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between two tokens of a completion", model=m
        )
        self.tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Per completion: (last token - first token) / (tokens - 1)",
            model=m,
        )
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to the last token",
                             model=m)  # fmt: skip
        self.hists = (self.ttft, self.itl, self.tpot, self.e2e)
        self.http_requests = 0  # completion requests this process took
        self.shared: SharedFigures | None = None  # several API processes: their rows
        self.registry.register(_HandlerCollector(self))
        if snapshot is None and loop is not None:  # the engine loop of this process

            def snapshot():
                snap = loop.call(lambda: engine_snapshot(core)).result(timeout=10)
                snap["waiting"] += loop.num_queued
                if loop.times is not None:
                    snap["step_times"] = loop.times.snapshot()
                return snap

        if snapshot is not None:  # None: the handler figures alone (tests)
            self.registry.register(_EngineCollector(snapshot, model_name))

    def finished(self, reason: str, num: int = 1) -> None:
        self.requests[reason] = self.requests.get(reason, 0) + num

    def share(self, path: str, index: int, count: int) -> None:
        """Export the sum over ``count`` API processes, this one ``index`` (their
        rows in the file ``path``, made by whichever comes first)."""
        self.shared = SharedFigures(path, index, count, len(self.row()))
        self.publish()

    def publish(self) -> None:
        """This process's figures into its shared row (no-op with one API process)."""
        if self.shared is not None:
            self.shared.write(self.row())

    def row(self) -> list[float]:
        """This process's figures as one row (``SharedFigures``'s layout)."""
        row = [float(os.getpid()), self.http_requests, self.prompt_tokens, self.generation_tokens]
        row += [self.requests.get(r, 0) for r in SHARED_REASONS]
        for hist in self.hists:
            row += hist.counts
            row.append(hist.sum)
        return row


class SharedFigures:
    """The handler figures of every API process of one server: ``count`` rows of
    ``width`` float64s in a file mapped by each (``/dev/shm``-like speed; the file
    lives in the server's temporary directory). Each process writes only its own
    row (``index``).

    A row is read whole or not at all (a sequence lock): each row has one more
    cell before it, its version, odd while its writer writes. A reader copies a
    row between two equal even versions; after ``READ_TRIES`` tries (a writer
    busy all along, or killed mid-write) it keeps the last whole copy it read of
    that row (zeros before any), so a scrape never mixes two writes' figures."""

    READ_TRIES = 64

    def __init__(self, path: str, index: int, count: int, width: int) -> None:
        import mmap

        assert 0 <= index < count, "SharedFigures: an API process's row is one of count"
        self.stride = width + 1  # the version cell, then the row
        size = count * self.stride * 8
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # zeros; every process asks the same size
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.raw = memoryview(self.map)  # bytes (a row's copy) and float64 cells
        self.cells = self.raw.cast("d")
        self.index, self.count, self.width = index, count, width
        self.last = [[0.0] * width for _ in range(count)]  # each row's last whole copy

    def write(self, row: list[float]) -> None:
        from array import array

        assert len(row) == self.width, "SharedFigures: a row is width figures"
        at = self.index * self.stride
        cells = self.cells
        version = cells[at]
        cells[at] = version + 1  # odd: being written
        cells[at + 1 : at + self.stride] = array("d", row)
        cells[at] = version + 2  # even: whole

    def read(self, k: int) -> list[float]:
        """Row ``k`` as one writer left it whole (see the class docstring)."""
        from array import array

        at, cells = k * self.stride, self.cells
        for _ in range(self.READ_TRIES):
            before = cells[at]
            if before % 2:
                continue
            copy = array("d")
            copy.frombytes(self.raw[(at + 1) * 8 : (at + self.stride) * 8])  # one memcpy
            if cells[at] == before:
                self.last[k] = copy.tolist()
                break
        return self.last[k]

    def rows(self) -> list[list[float]]:
        return [self.read(k) for k in range(self.count)]


class _HandlerCollector:
    def __init__(self, metrics: ServingMetrics) -> None:
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        m = self.m
        own = m.row()
        rows = [own]
        if m.shared is not None:
            m.shared.write(own)
            rows = m.shared.rows()
            rows[m.shared.index] = own
        total = [sum(col) for col in zip(*rows, strict=True)]
        yield _counter("vllm:prompt_tokens", "Prompt tokens of accepted completions", m.model,
                       total[2])  # fmt: skip
        yield _counter("vllm:generation_tokens", "Generated tokens sent to clients", m.model,
                       total[3])  # fmt: skip
        done = CounterMetricFamily(
            "vllm:request_success", "Finished completions", labels=["finished_reason", "model_name"]
        )
        reasons = dict(m.requests)  # this process's own (any reason), then the others' shared
        for k, reason in enumerate(SHARED_REASONS):
            reasons[reason] = reasons.get(reason, 0) + total[4 + k] - own[4 + k]
        for reason, num in reasons.items():
            if num or reason in m.requests:
                done.add_metric([reason, m.model], num)
        yield done
        at = 4 + len(SHARED_REASONS)
        for hist in m.hists:
            width = len(hist.counts)
            yield hist.family(total[at : at + width], total[at + width])
            at += width + 1
        per = CounterMetricFamily("unikv:api_server_requests",
                                  "Requests taken by each API process (--api-server-count)",
                                  labels=["api_server", "pid", "model_name"])  # fmt: skip
        for k, row in enumerate(rows):
            if row[0]:  # (a process that has not published yet: no pid)
                per.add_metric([str(k), str(int(row[0])), m.model], row[1])
        yield per


class Merged:
    """What ``/metrics`` exports: every served model's registry as one (a registry
    to ``generate_latest``): each family once, with every model's samples (told
    apart by ``model_name``), in the first registry's order."""

    def __init__(self, registries: list) -> None:
        self.registries = registries

    def collect(self):
        families: dict[str, object] = {}
        for registry in self.registries:
            for family in registry.collect():
                have = families.get(family.name)
                if have is None:
                    families[family.name] = family
                else:
                    assert have.type == family.type, f"/metrics: {family.name} is one type"
                    have.samples.extend(family.samples)
        return iter(families.values())


class RequestClock:
    """Latency bookkeeping of one HTTP request's completions (event loop thread)."""

    def __init__(self, metrics: ServingMetrics, start: float) -> None:
        self.metrics, self.start = metrics, start
        self.last: dict[tuple[int, int], float] = {}  # (prompt, index) -> last token time
        self.first: dict[tuple[int, int], tuple[float, int]] = {}  # -> (first time, tokens)

    def tokens(self, key: tuple[int, int], num: int, now: float) -> None:
        """``num`` tokens of completion ``key`` reached the client at ``now``."""
        if not num:
            return
        m = self.metrics
        m.generation_tokens += num
        last = self.last.get(key)
        if last is None:
            m.ttft.observe(now - self.start)
            self.first[key] = (now, num)
        else:
            m.itl.observe((now - last) / num)
            first, count = self.first[key]
            self.first[key] = (first, count + num)
        self.last[key] = now

    def finished(self, reason: str, now: float, key: tuple[int, int] | None = None) -> None:
        self.metrics.finished(reason)
        self.metrics.e2e.observe(now - self.start)
        first, count = self.first.get(key, (now, 0))
        if count > 1:
            self.metrics.tpot.observe((self.last[key] - first) / (count - 1))
