"""Benchmark the host tier: offload / reload GB/s against the pinned-copy ceiling.

    python benchmarks/bench_io.py --device cuda [--quick] [--out benchmarks/results/io_h200.json]
    python benchmarks/bench_io.py --device cpu   (small sizes: checks that it runs)

For page envelopes from 64 KiB to 16 MiB (an MHA sub-pool of 16 layers x 8 KV
heads x D128 bf16 = 64 KiB per token; page_size 1..256), on both copy paths
(direct: one copy per envelope; gather: index_select into staging + one copy
per run of host slots), it times offload alone (D2H), reload alone (H2D) and
both at once (two side streams), each over random scattered physical pages,
and reports GB/s and % of the pinned H2D / D2H ceiling (2 GiB copies measured
in the same run; target >= 90 % for envelopes >= 2 MiB). Every configuration
is checked byte-for-byte (offload -> reload into other pages) before it is
timed. Finally it times a decode attention kernel alone and while an offload
and a reload run on the side streams.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import itertools

from benchmarks.common import environment, save_json
from unikv.ids import PhysicalPageIds
from unikv.io import HostTier
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
TOKEN_SPEC = MHASpec(16, 8, 128, dtype=torch.bfloat16)  # 64 KiB per token
PATHS = {"direct": 0, "gather": 1 << 62}  # direct_min_bytes forcing each path
PROFILES = {  # sizes, bytes moved per timing, ceiling bytes, reps
    "cuda": ([64 * KIB, 256 * KIB, MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB], GIB, 2 * GIB, 5),
    "cuda-quick": ([64 * KIB, MIB, 2 * MIB, 16 * MIB], 256 * MIB, 512 * MIB, 3),
    "cpu": ([64 * KIB, 256 * KIB, MIB], 8 * MIB, 16 * MIB, 2),
}


class Clock:
    """Median milliseconds of ``launch()``, which starts copies (possibly on side
    streams) and returns the handles (anything with ``wait()``) to wait for."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time_ms(self, launch, reps: int, cleanup=None, warmup: int = 1) -> float:
        times = []
        for i in range(warmup + reps):
            if self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                handles = launch()
                for h in handles:
                    h.wait()  # the current stream waits on the device, not the host
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                handles = launch()
                ms = (time.perf_counter() - t0) * 1e3
            if cleanup is not None:
                cleanup(handles)
            if i >= warmup:
                times.append(ms)
        return statistics.median(times)


class _Event:
    """An event recorded on a stream, with the ``wait()`` the clock expects."""

    def __init__(self, stream) -> None:
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


def ceilings(device: torch.device, nbytes: int, reps: int, clock: Clock) -> dict:
    """Pinned H2D, D2H and both at once (two streams), GB/s per direction."""
    cuda = device.type == "cuda"
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev_a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dev_b = torch.empty_like(dev_a)
    streams = (torch.cuda.Stream(), torch.cuda.Stream()) if cuda else (None, None)

    def on(stream, fn):
        if stream is None:
            fn()
            return []
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        return [_Event(stream)]

    d2h = lambda: on(streams[0], lambda: host_a.copy_(dev_a, non_blocking=True))
    h2d = lambda: on(streams[1], lambda: dev_b.copy_(host_b, non_blocking=True))
    out = {
        "bytes": nbytes,
        "d2h_ms": clock.time_ms(d2h, reps),
        "h2d_ms": clock.time_ms(h2d, reps),
        "both_ms": clock.time_ms(lambda: d2h() + h2d(), reps),
    }
    for key in ("d2h", "h2d", "both"):
        out[f"{key}_GBps"] = nbytes / out[f"{key}_ms"] / 1e6  # per direction for "both"
    return out


def make_pool(envelope: int, num_pages: int, device: torch.device, seed: int) -> UnifiedPool:
    """One MHA sub-pool whose page envelope is ``envelope`` bytes, random bytes."""
    config = SubPoolConfig("kv", TOKEN_SPEC, page_size=envelope // TOKEN_SPEC.entry_bytes)
    assert config.spec.page_bytes(config.page_size) == envelope, "envelope must be 64 KiB * 2^k"
    pool = UnifiedPool([config], pool_bytes_for([config], {"kv": num_pages}), device)
    gen = torch.Generator(device=device).manual_seed(seed)
    pool.buffer.copy_(
        torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, device=device, generator=gen)
    )
    return pool


def _ids(pages: torch.Tensor) -> PhysicalPageIds:
    return PhysicalPageIds(pages, "kv")


def bench_envelope(envelope: int, moved: int, reps: int, device, clock, ceil) -> list[dict]:
    """Both copy paths for one envelope size over random scattered pages."""
    n = max(1, moved // envelope)
    pool = make_pool(envelope, 2 * n, device, seed=envelope)
    sub = pool["kv"]
    perm = torch.randperm(sub.usable_pages)[: 2 * n] + sub.first_page  # random scattered pages
    set_a, set_b = perm[:n], perm[n:]  # host (CPU) page ids: no sync on the direct path
    rows = []
    for path, direct_min in PATHS.items():
        tier = HostTier(pool, "kv", 2 * n, direct_min_bytes=direct_min)
        times = _time_tier(tier, set_a, set_b, reps, clock)
        rows.append(_row(envelope, sub.page_size, path, n, times, ceil))
    return rows


def _time_tier(tier: HostTier, set_a, set_b, reps: int, clock: Clock) -> dict:
    """Check offload A -> reload into B byte for byte, then time offload alone,
    reload alone and both at once (offload A while reloading into B)."""
    rows = tier.pool.buffer[: tier.subpool.num_pages * tier.page_bytes].view(-1, tier.page_bytes)
    device = tier.pool.device
    expected = rows.index_select(0, set_a.to(device))
    held = tier.offload(_ids(set_a))
    tier.reload(held.host_slots, _ids(set_b)).synchronize()
    assert torch.equal(rows.index_select(0, set_b.to(device)), expected), "reload bytes differ"
    del expected

    def free(handles: list) -> None:
        tier.free(handles[0].host_slots)  # the first handle is the offload

    def offload(pages: torch.Tensor):
        return tier.offload(_ids(pages), check=False)

    def reload():
        return tier.reload(held.host_slots, _ids(set_b), check=False)

    return {
        "offload_ms": clock.time_ms(lambda: [offload(set_b)], reps, free),
        "reload_ms": clock.time_ms(lambda: [reload()], reps),
        "both_ms": clock.time_ms(lambda: [offload(set_a), reload()], reps, free),
    }


def _row(envelope: int, page_size: int, path: str, n: int, times: dict, ceil: dict) -> dict:
    nbytes = n * envelope
    row = {
        "envelope_bytes": envelope,
        "page_size": page_size,
        "path": path,
        "pages": n,
        "bytes_per_direction": nbytes,
        **times,
        "offload_GBps": nbytes / times["offload_ms"] / 1e6,
        "reload_GBps": nbytes / times["reload_ms"] / 1e6,
        "both_GBps_per_direction": nbytes / times["both_ms"] / 1e6,
    }
    row["offload_pct_of_d2h"] = 100 * row["offload_GBps"] / ceil["d2h_GBps"]
    row["reload_pct_of_h2d"] = 100 * row["reload_GBps"] / ceil["h2d_GBps"]
    row["both_pct_of_both"] = 100 * row["both_GBps_per_direction"] / ceil["both_GBps"]
    low = min(row["offload_pct_of_d2h"], row["reload_pct_of_h2d"])
    row["meets_90pct"] = envelope < 2 * MIB or low >= 90.0
    print(
        f"{envelope // KIB:6d} KiB {path:6s} x{n:5d}: offload {row['offload_GBps']:6.1f} GB/s "
        f"({row['offload_pct_of_d2h']:5.1f} %)  reload {row['reload_GBps']:6.1f} GB/s "
        f"({row['reload_pct_of_h2d']:5.1f} %)  both {row['both_GBps_per_direction']:6.1f} GB/s "
        f"per direction ({row['both_pct_of_both']:5.1f} % of both-at-once)",
        flush=True,
    )
    return row


def decode_setup(device: torch.device) -> tuple[dict, callable]:
    """A paged decode step over a pool (B16 x 4k, GQA 32/8, D128, bf16, page 16 on
    CUDA; tiny fp32 on CPU): unikv's kernel if available, else torch SDPA on
    contiguous KV. The kernel's output is checked against SDPA before timing."""
    cuda = device.type == "cuda"
    batch, seq, hq, hkv, dim, ps = (16, 4096, 32, 8, 128, 16) if cuda else (2, 256, 4, 2, 64, 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    config = SubPoolConfig("kv", MHASpec(1, hkv, dim, dtype=dtype), page_size=ps)
    num_pages = batch * seq // ps
    pool = UnifiedPool([config], pool_bytes_for([config], {"kv": num_pages}), device)
    sub = pool["kv"]
    k_view, v_view = sub.views[0]  # (N, H, D) dense views: every row of the buffer
    k_view.normal_()
    pages = torch.randperm(sub.usable_pages, device=device)[:num_pages] + sub.first_page
    block_table = (pages * sub.blocks_per_page).view(batch, seq // ps).to(torch.int32)
    seq_lens = torch.full((batch,), seq, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, dim, dtype=dtype, device=device)
    k4, v4 = sub.paged_views[0]  # (num_pages, ps, H, D): the (page, slot) oracle
    k = k4.index_select(0, pages).reshape(batch, seq, hkv, dim).transpose(1, 2).contiguous()
    v = v4.index_select(0, pages).reshape(batch, seq, hkv, dim).transpose(1, 2).contiguous()
    sdpa = lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)
    shape = {
        "batch": batch,
        "seq_len": seq,
        "q_heads": hq,
        "kv_heads": hkv,
        "head_dim": dim,
        "page_size": ps,
        "dtype": str(dtype),
        "kv_bytes": 2 * k.numel() * k.element_size(),
    }
    try:
        from unikv.kernels import get_backend

        ops = get_backend(device)
        fn = lambda: ops.decode_attention(
            q, k_view, v_view, block_table, seq_lens, page_size=ps, sm_scale=dim**-0.5
        )
        torch.testing.assert_close(fn(), sdpa()[:, :, 0], atol=2e-2, rtol=2e-2)
        return {**shape, "kernel": f"unikv.kernels decode_attention ({ops.name})"}, fn
    except Exception as e:  # noqa: BLE001 - the kernels may not be there yet
        print(f"unikv decode kernel unavailable ({type(e).__name__}: {e}); timing torch SDPA")
        return {**shape, "kernel": "torch SDPA on contiguous KV", "why_not_unikv": str(e)}, sdpa


def _rep_times_ms(fn, reps: int, cuda: bool) -> list[float]:
    """Per-call milliseconds of ``reps`` back-to-back calls (events on the current stream)."""
    if not cuda:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    events[0].record()
    for i in range(reps):
        fn()
        events[i + 1].record()
    events[-1].synchronize()
    return [a.elapsed_time(b) for a, b in itertools.pairwise(events)]


def _decode_during_cuda(decode, launch, count: int) -> tuple[list[float], float, list]:
    """Times of decode calls launched right after ``launch()``'s copies, keeping
    only the calls that finished before the copies did; and the copies' ms."""
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    handles = launch()
    side = torch.cuda.Stream()
    for h in handles:
        side.wait_event(h.event)
    copies_end = torch.cuda.Event(enable_timing=True)
    copies_end.record(side)  # fires when every copy has finished
    events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
    events[0].record()
    for i in range(count):
        decode()
        events[i + 1].record()
    torch.cuda.synchronize()
    io_ms = start.elapsed_time(copies_end)
    inside = [
        a.elapsed_time(b) for a, b in itertools.pairwise(events) if start.elapsed_time(b) <= io_ms
    ]
    return inside, io_ms, handles


def decode_effect(device, envelope: int, moved: int, reps: int, clock: Clock) -> dict:
    """Decode step time alone vs while an offload and a reload run on side streams."""
    cuda = device.type == "cuda"
    shape, decode = decode_setup(device)
    for _ in range(3):
        decode()  # compile / warm up
    alone = statistics.median(_rep_times_ms(decode, 50, cuda))
    n = max(1, moved // envelope)
    pool = make_pool(envelope, 2 * n, device, seed=1)
    sub = pool["kv"]
    perm = torch.randperm(sub.usable_pages)[: 2 * n] + sub.first_page
    set_a, set_b = perm[:n], perm[n:]
    tier = HostTier(pool, "kv", 2 * n)
    held = tier.offload(_ids(set_a))
    held.synchronize()
    launch = lambda: [
        tier.offload(_ids(set_a), check=False),
        tier.reload(held.host_slots, _ids(set_b), check=False),
    ]
    free = lambda handles: tier.free(handles[0].host_slots)
    copy_ms = clock.time_ms(launch, reps, free)
    count = max(10, min(4000, int(copy_ms / max(alone, 1e-3))))
    if cuda:  # only the decode calls that ran while the copies did
        during, io_ms, handles = _decode_during_cuda(decode, launch, count)
    else:  # CPU copies are synchronous: nothing overlaps, this only exercises the code
        handles = launch()
        during, io_ms = _rep_times_ms(decode, 10, cuda), copy_ms
    free(handles)
    concurrent = statistics.median(during) if during else float("nan")
    result = {
        **shape,
        "decode_alone_ms": alone,
        "decode_during_io_ms": concurrent,
        "slowdown": concurrent / alone,
        "decode_calls_during_io": len(during),
        "io_envelope_bytes": envelope,
        "io_bytes_per_direction": n * envelope,
        "io_both_ms_alone": copy_ms,
        "io_both_ms_with_decode": io_ms,
    }
    print(
        f"decode ({shape['kernel']}): alone {alone * 1e3:.1f} us, during offload+reload "
        f"{concurrent * 1e3:.1f} us ({result['slowdown']:.3f}x over {len(during)} calls); "
        f"offload+reload {copy_ms:.2f} ms alone, {io_ms:.2f} ms beside decode",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, smaller copies")
    parser.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/io_<gpu|cpu>.json)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available; use --device cpu")
    profile = "cpu" if device.type == "cpu" else ("cuda-quick" if args.quick else "cuda")
    sizes, moved, ceiling_bytes, reps = PROFILES[profile]
    clock = Clock(device)
    env = environment()
    print(env, flush=True)
    ceil = ceilings(device, ceiling_bytes, reps, clock)
    print(
        f"ceiling ({ceiling_bytes / GIB:.2f} GiB pinned): D2H {ceil['d2h_GBps']:.1f} GB/s, "
        f"H2D {ceil['h2d_GBps']:.1f} GB/s, both at once {ceil['both_GBps']:.1f} GB/s per direction",
        flush=True,
    )
    rows = [r for size in sizes for r in bench_envelope(size, moved, reps, device, clock, ceil)]
    decode = decode_effect(
        device, 2 * MIB if device.type == "cuda" else 64 * KIB, moved, reps, clock
    )
    judged = [r for r in rows if r["path"] == "direct" and r["envelope_bytes"] >= 2 * MIB]
    target = all(r["meets_90pct"] for r in judged) if judged else None
    verdict = {True: "met", False: "MISSED", None: "not measured (no envelope >= 2 MiB)"}[target]
    print(f"target (direct path, >= 90 % of pinned for envelopes >= 2 MiB): {verdict}")
    out = args.out or f"benchmarks/results/io_{'h200' if device.type == 'cuda' else 'cpu'}.json"
    save_json(
        out,
        {
            "benchmark": "bench_io",
            "profile": profile,
            **env,
            "ceiling": ceil,
            "offload_reload": rows,
            "decode_during_io": decode,
            "target_met_direct": target,
        },
    )


if __name__ == "__main__":
    main()
