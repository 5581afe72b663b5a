"""Benchmark the elastic pool: issue 44's five targets in ONE run.

    python benchmarks/bench_elastic.py --device cuda   (H100: under 120 s; writes
        benchmarks/results/elastic_<gpu>.json unless --out says where)
    python benchmarks/bench_elastic.py --device cpu --out X.json   (small sizes, CI)

| row | measure | target |
|---|---|---|
| grow_shrink | ``alloc.resize`` by ``--step`` (1 GiB), nothing to move: median ms | <= 10 ms |
| moves | a shrink that moves live pages: the page copy's GB/s (read + written) against a torch copy of the same bytes in the same run | >= 80 % |
| handed_back | free memory (``torch.cuda.mem_get_info``, plus any change of torch's caching allocator's reserve) after - before a shrink, against the bytes the backing released | within one chunk |
| after_capture | the pool sized after load, warm-up and capture (``kv_cache_margin_bytes``) against today's estimate (``memory_fraction`` less the activation reserve) | more bytes |
| hot_idle | two models, one hot and one idle, one budget (``MultiLLM``) against a fixed half-half split: the hot model's mean running requests per step | >= 1.5x |

- Every timed op is warmed up first (one untimed grow/shrink cycle; a small
  shrink with moves compiles the page copy) and timed with CUDA events (CPU:
  ``time.perf_counter``).
- grow_shrink also times the same 1 GiB at 2 and 32 MiB chunks (``chunk_sweep``), for
  the choice of a default chunk; the target is judged at the default
  (``backing.CUDA_CHUNK_BYTES``, 8 MiB since 2 MiB took 18.6 ms).
- moves: the copy is timed by events around the pool's page-copy op (handed to
  the pool as ``copy_pages``); the whole shrink (planning, the copy, the
  release of the chunks above) is reported beside it (``shrink_ms``).
- Every moved page is checked byte for byte; the hot model's tokens are compared
  between the two splits (``tokens_equal``; fp32).
- The JSON's ``targets`` holds each figure, its target and their ratio
  (``ratio_to_target``: >= 1 is met for every row); the summary prints one line
  per target. after_capture needs CUDA (``skipped`` on CPU).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, save_json
from unikv.allocator import PoolAllocator
from unikv.backing import CHUNK_BYTES, EmulatedBacking, make_backing
from unikv.kernels.backend import get_backend
from unikv.pool import SubPoolConfig, UnifiedPool
from unikv.specs import MHASpec

MIB, GIB = 1 << 20, 1 << 30
SPEC = MHASpec(16, 8, 128, dtype=torch.bfloat16)  # 64 KiB per token
PS = 16  # 1 MiB pages


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_ms(device: torch.device, fn) -> tuple[float, object]:
    """(ms, fn's value): CUDA events around ``fn`` (its host work included: the
    device idles until the end event); perf_counter on CPU."""
    _sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), out


def _free(device: torch.device) -> int:
    """Free device memory (``cudaMemGetInfo``) plus what torch's caching allocator
    holds: a block it took meanwhile (a small id upload) is not the pool's doing."""
    _sync(device)
    if device.type != "cuda":
        return 0
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)


class _TimedCopy:
    """The backend's page copy with CUDA events around each call (``ms`` summed)."""

    def __init__(self, device: torch.device) -> None:
        self.op, self.device, self.ms, self.calls = get_backend(device).copy_pages, device, 0.0, 0

    def __call__(self, buffer, src, dst, page_bytes, **kw) -> None:
        ms, _ = _timed_ms(self.device, lambda: self.op(buffer, src, dst, page_bytes, **kw))
        self.ms += ms
        self.calls += 1


def _pool(device: torch.device, total: int, most: int, chunk: int | None = None, copy=None):
    configs = [SubPoolConfig("full", SPEC, page_size=PS)]
    cpu = device.type == "cpu"
    backing = EmulatedBacking(chunk or CHUNK_BYTES) if cpu else make_backing(device, chunk)
    pool = UnifiedPool(configs, total, device, max_bytes=most, backing=backing, copy_pages=copy)
    pages = most // pool["full"].page_bytes
    alloc = PoolAllocator(pool, max_requests=2, max_context=pages * PS)
    return pool, alloc


def grow_shrink(device: torch.device, base: int, step: int, reps: int, chunk: int | None) -> dict:
    """Median ms of resizing ``base -> base + step -> base`` with nothing live, after
    one untimed cycle; free memory before and after each shrink and grow."""
    pool, alloc = _pool(device, base, base + step, chunk)
    alloc.resize(base + step)  # warm-up: the driver's first maps, the fill kernel
    alloc.resize(base)
    grow, shrink, handed, taken, errors = [], [], [], [], []
    for _ in range(reps):
        for size, out, seen in ((base + step, grow, taken), (base, shrink, handed)):
            free, held = _free(device), pool.backing.committed_bytes
            ms, _ = _timed_ms(device, lambda size=size: alloc.resize(size))
            out.append(ms)
            seen.append(abs(_free(device) - free))
            errors.append(abs(seen[-1] - abs(pool.backing.committed_bytes - held)))
    alloc.check_integrity()
    result = {
        "step_bytes": step,
        "chunk_bytes": pool.backing.chunk,
        "reps": reps,
        "grow_ms": statistics.median(grow),
        "shrink_ms": statistics.median(shrink),
        "grow_ms_all": grow,
        "shrink_ms_all": shrink,
    }
    if device.type == "cuda":
        result["handed_back_bytes"] = handed
        result["taken_bytes"] = taken
        result["driver_error_bytes"] = max(errors)  # against the backing's own count
    pool.backing.close()
    return result


def shrink_with_moves(device: torch.device, live: int) -> dict:
    """A request holding ``live`` bytes at the top of the DOWN band, a freed one
    below it: shrinking by ``live`` moves every page of the first into the holes.
    The page copy is timed on its own (``_TimedCopy``) and the whole shrink too."""
    copy = _TimedCopy(device)
    pool, alloc = _pool(device, 2 * live + 64 * MIB, 2 * live + 64 * MIB, copy=copy)
    pb = pool["full"].page_bytes
    tokens = live // pb * PS
    a, b = alloc.new_request(), alloc.new_request()
    for slot in (a, b):
        assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([tokens])) is not None
    book = alloc.parts.books["full"]
    held = {v: int(book.v2p_host[v]) for v in np.flatnonzero(book.v2p_host[1:] > 0) + 1}
    owner = alloc.parts.vspace.owner
    gen = torch.Generator(device=device).manual_seed(0)
    want = {}
    for v, p in held.items():  # distinct bytes per page
        env = pool.page_envelope("full", p)
        env.copy_(torch.randint(0, 255, env.shape, dtype=torch.uint8, device=device, generator=gen))
        if owner[v] == a:
            want[v] = env.clone()
    alloc.free_request(b)
    free, held = _free(device), pool.backing.committed_bytes
    shrink_ms, moved = _timed_ms(device, lambda: alloc.resize(pool.total_bytes - live))
    handed, released = _free(device) - free, held - pool.backing.committed_bytes
    alloc.check_integrity()
    for v, data in want.items():
        assert torch.equal(pool.page_envelope("full", int(book.v2p_host[v])), data), v
    moved_bytes = moved * pb
    result = {
        "moved_pages": moved,
        "moved_bytes": moved_bytes,
        "copy_ms": copy.ms,
        "copy_calls": copy.calls,
        "shrink_ms": shrink_ms,
        "copy_GBps_read_plus_written": 2 * moved_bytes / copy.ms / 1e6,
        "shrink_GBps_read_plus_written": 2 * moved_bytes / shrink_ms / 1e6,
        "released_bytes": released,
        "handed_back_bytes": handed,
    }
    pool.backing.close()
    return result


def copy_ceiling(device: torch.device, nbytes: int, reps: int = 5) -> dict:
    """A torch device-to-device copy of ``nbytes`` (warmed up; median of ``reps``):
    GB/s of bytes read + written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [_timed_ms(device, lambda: dst.copy_(src))[0] for _ in range(reps)]
    src = dst = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ms = statistics.median(times)
    return {"bytes": nbytes, "ms": ms, "GBps_read_plus_written": 2 * nbytes / ms / 1e6}


def after_capture(device: torch.device, margin: int, max_num_seqs: int) -> dict:
    """Today's estimate (a fixed pool: ``memory_fraction`` of the free memory less
    the activation reserve) against the pool sized after load, warm-up and graph
    capture with ``margin`` bytes left free: both pools' bytes and the free memory
    each left, the same tiny model and options."""
    import tempfile
    from pathlib import Path

    from benchmarks.bench_e2e import model_config, save_model
    from unikv.engine import LLM

    path = Path(tempfile.mkdtemp(prefix="unikv-capture-")) / "llama"
    cfg = model_config("llama", tiny=True)
    save_model("llama", path, "cpu", torch.float32, tiny=True, cfg=cfg)  # hot_idle's kernels
    kw = {"device": device, "dtype": torch.float32, "max_num_seqs": max_num_seqs,
          "max_model_len": cfg["max_position_embeddings"], "enable_prefix_caching": False}  # fmt: skip
    out: dict = {"margin_bytes": margin, "max_num_seqs": max_num_seqs}
    for name, extra in (("estimate", {}), ("after_capture", {"kv_cache_margin_bytes": margin})):
        gc.collect()
        torch.cuda.empty_cache()
        _sync(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        llm = LLM(str(path), **kw, **extra)
        out[name] = {
            "free_before_bytes": free_before,
            "pool_bytes": llm.pool.total_bytes,
            "free_after_bytes": (_sync(device), torch.cuda.mem_get_info(device)[0])[1],
            "graphs": llm.runner.graphs is not None,
            "build_s": time.perf_counter() - start,
        }
        llm.close()
        if llm.pool.backing is not None:  # the elastic pool's chunks and range, now
            _sync(device)
            llm.pool.backing.close()
        del llm
    gc.collect()
    torch.cuda.empty_cache()
    before = [out[n]["free_before_bytes"] for n in ("estimate", "after_capture")]
    out["comparable"] = abs(before[0] - before[1]) <= GIB  # else the first LLM's memory stayed
    out["ratio"] = out["after_capture"]["pool_bytes"] / out["estimate"]["pool_bytes"]
    out["more_bytes"] = out["after_capture"]["pool_bytes"] - out["estimate"]["pool_bytes"]
    return out


def hot_idle(
    device: torch.device, burst: int, prompt: int, new: int, chunk: int = 0, batched: int = 256
) -> dict:
    """The hot/idle experiment (module docstring): tiny random-init Llamas (bench_e2e's
    tiny config), a budget that holds every request of the hot model's burst when
    the idle model shrinks to its floor, and about half of them in a fixed half.
    ``chunk``: the backing's (default: 2 MiB on CUDA, 4 KiB on CPU)."""
    import math
    import tempfile
    from pathlib import Path

    from benchmarks.bench_e2e import model_config, save_model
    from unikv.engine import SamplingParams
    from unikv.engine.multi import MultiLLM
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    ps, context = 16, prompt + new
    dtype = torch.float32  # tokens compared across the two splits: no bf16 near-ties
    root = Path(tempfile.mkdtemp(prefix="unikv-hot-idle-"))
    cfg = dict(model_config("llama", tiny=True), max_position_embeddings=context)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    paths = {}
    for name in ("hot", "idle"):
        paths[name] = str(root / name)
        save_model("llama", root / name, "cpu", dtype, tiny=True, cfg=cfg)
    configs = specs_from_hf_config(paths["hot"], page_size=ps, dtype=dtype)
    per_request = math.ceil(context / ps) + 1
    chunk = chunk or (CHUNK_BYTES if device.type == "cuda" else 4096)
    pad = max(c.spec.view_tail_pad_bytes(ps) for c in configs)

    def committed(requests: int) -> int:  # a pool's chunks when it holds that many
        need = pool_bytes_for(configs, {c.name: requests * per_request for c in configs})
        return -(-(need + pad) // chunk) * chunk

    # the budget: the whole burst in the hot model's pool while the idle one sits at
    # its floor (about one request's pages; a chunk more for the rounding), so that the
    # shared split runs the burst in one wave; a fixed half then holds about half of it
    total = committed(burst) + committed(1) + chunk
    kw = {
        "device": device,
        "dtype": dtype,
        "page_size": ps,
        "max_num_seqs": burst,
        "max_model_len": context,
        "max_num_batched_tokens": batched,
        "enable_prefix_caching": False,
        "cuda_graphs": False,
    }  # fmt: skip (concurrency, not speed)
    vocab = cfg["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (burst, prompt), generator=g).tolist()
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    out: dict = {"burst": burst, "prompt_tokens": prompt, "new_tokens": new,
                 "total_kv_bytes": total, "chunk_bytes": chunk,
                 "max_num_batched_tokens": batched}  # fmt: skip
    tokens = {}
    for mode, elastic in (("fixed_half", False), ("shared", True)):
        multi = MultiLLM(paths, total_kv_bytes=total, elastic=elastic, chunk=chunk, **kw)
        running: list[int] = []
        hot = multi["hot"]
        start = time.perf_counter()

        def count(_llm, batch, _logits, seen=running) -> None:
            seen.append(len(batch.requests))

        res = hot.generate(prompts, params, on_step=count)
        _sync(device)
        seconds = time.perf_counter() - start
        tokens[mode] = [o.outputs[0].token_ids for o in res]
        out[mode] = {
            "mean_concurrency": statistics.mean(running),
            "peak_concurrency": max(running),
            "steps": len(running),
            "seconds": seconds,
            "committed_after": multi.committed(),
            "preemptions": hot.scheduler.num_preemptions,
        }
        multi.close()
        _sync(device)
        multi.backing.close()  # its chunks and range now, not at garbage collection
        del multi, hot
    out["tokens_equal"] = tokens["shared"] == tokens["fixed_half"]
    ratio = out["shared"]["mean_concurrency"] / out["fixed_half"]["mean_concurrency"]
    out["concurrency_ratio"], out["target_ratio"] = ratio, 1.5
    return out


def _target(figure: float, unit: str, target: str, ratio: float, **extra) -> dict:
    return {"figure": figure, "unit": unit, "target": target, "ratio_to_target": ratio,
            "met": ratio >= 1, **extra}  # fmt: skip


def targets(p: dict, device: torch.device) -> dict:
    """Each target's figure, its bound and ``ratio_to_target`` (>= 1: met); a row
    whose measurement failed says so (``error``)."""
    step = f"ms per {STEP_MIB[device.type]} MiB"
    makers = {
        "grow": lambda: _target(p["grow_shrink"]["grow_ms"], step, "<= 10",
                                10.0 / p["grow_shrink"]["grow_ms"]),
        "shrink": lambda: _target(p["grow_shrink"]["shrink_ms"], step, "<= 10",
                                  10.0 / p["grow_shrink"]["shrink_ms"]),
        "moves_bandwidth": lambda: _target(p["moves"]["fraction_of_ceiling"],
                                           "of the copy ceiling", ">= 0.8",
                                           p["moves"]["fraction_of_ceiling"] / 0.8),
        "hot_idle_concurrency": lambda: _target(p["hot_idle"]["concurrency_ratio"],
                                                "x fixed half", ">= 1.5",
                                                p["hot_idle"]["concurrency_ratio"] / 1.5),
        "handed_back": lambda: _handed_back(p),
        "after_capture": lambda: _after_capture_row(p["after_capture"]),
    }  # fmt: skip
    out = {}
    for name, make in makers.items():
        if device.type != "cuda" and name in ("handed_back", "after_capture"):
            out[name] = {"skipped": "needs CUDA"}
            continue
        try:
            out[name] = make()
        except (KeyError, TypeError, ZeroDivisionError) as err:  # its row failed
            out[name] = {"error": f"no figure ({type(err).__name__}: {err})"}
    return out


def _after_capture_row(ac: dict) -> dict:
    if not ac["comparable"]:
        return {"error": "the two LLMs started from different free memory (the first one's "
                         f"was not given back): {ac['estimate']['free_before_bytes']} and "
                         f"{ac['after_capture']['free_before_bytes']} bytes"}  # fmt: skip
    ratio = ac["ratio"]  # strictly more bytes: a ratio of exactly 1 is not met
    return _target(ratio, "x today's estimate", "> 1 (more usable bytes)",
                   ratio if ratio > 1 else 0.0,
                   bytes=[ac["estimate"]["pool_bytes"], ac["after_capture"]["pool_bytes"]])  # fmt: skip


def _handed_back(p: dict) -> dict:
    gs, mv = p["grow_shrink"], p["moves"]
    chunk = gs["chunk_bytes"]
    err = max(gs["driver_error_bytes"], abs(mv["handed_back_bytes"] - mv["released_bytes"]))
    return _target(err, "bytes off the bytes released", f"<= one chunk ({chunk})",
                   chunk / max(err, 1))  # fmt: skip


def summary(rows: dict) -> list[str]:
    lines = []
    for name, row in rows.items():
        if "skipped" in row or "error" in row:
            lines.append(f"{name}: {row.get('skipped') or 'ERROR ' + row['error']}")
            continue
        verdict = "met" if row["met"] else "MISSED"
        lines.append(f"{name}: {verdict}: {row['figure']:.4g} {row['unit']} (target "
                     f"{row['target']}; ratio to target {row['ratio_to_target']:.3g})")  # fmt: skip
    return lines


STEP_MIB = {"cuda": 1024, "cpu": 16}  # grow/shrink step, the moves' live bytes


def _row(payload: dict, name: str, fn) -> None:
    """``payload[name] = fn()`` with its seconds; a failure is recorded (and printed)
    and the run goes on, so one broken row does not cost the others' figures."""
    import traceback

    start = time.perf_counter()
    try:
        payload[name] = fn()
    except Exception as err:  # noqa: BLE001  (reported in the JSON and the summary)
        traceback.print_exc()
        payload[name] = {"error": f"{type(err).__name__}: {err}"}
    payload.setdefault("row_seconds", {})[name] = time.perf_counter() - start


def _moves(device: torch.device, live: int) -> dict:
    shrink_with_moves(device, 16 * MIB)  # warm-up: compiles the page copy
    moves = shrink_with_moves(device, live)
    moves["ceiling"] = copy_ceiling(device, moves["moved_bytes"])
    ceiling = moves["ceiling"]["GBps_read_plus_written"]
    moves["fraction_of_ceiling"] = moves["copy_GBps_read_plus_written"] / ceiling
    moves["shrink_fraction_of_ceiling"] = moves["shrink_GBps_read_plus_written"] / ceiling
    return moves


def _default_out(device: torch.device) -> str:
    import re

    found = re.search(r"\b([A-Z]\d{2,4})\b", torch.cuda.get_device_name(device))
    gpu = found.group(1).lower() if found else "cuda"
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        f"elastic_{gpu}.json")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="default (CUDA): results/elastic_<gpu>.json")
    parser.add_argument("--reps", type=int, default=None, help="grow/shrink reps (10 / 3)")
    parser.add_argument("--burst", type=int, default=None, help="hot requests (default 64 / 8)")
    parser.add_argument("--margin", type=int, default=GIB, help="after_capture's margin, bytes")
    parser.add_argument("--only-hot-idle", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    step = STEP_MIB[device.type] * MIB
    base, live = step, 4 * step if cuda else step
    reps = args.reps or (10 if cuda else 3)
    payload: dict = {"environment": environment() if cuda else {"device": "cpu"}}
    started = time.perf_counter()
    burst = args.burst or (64 if cuda else 8)
    # CUDA: long prompts, short answers, a prefill budget for half the burst at once:
    # a request's pages are taken at admission, so the fixed half admits about half
    # the burst and the rest waits (a CPU run of the same shape at a 2 MiB chunk:
    # 1.83x; 128 + 128 tokens at 256 a step left ramps and recomputed preemptions
    # in both means: 1.41x)
    shape = (224, 32, 0, 4096) if cuda else (16, 16, 0, 256)
    _row(payload, "hot_idle", lambda: hot_idle(device, burst, *shape))
    if args.only_hot_idle:
        print(payload)
        if args.out:
            save_json(args.out, payload)
        return 0
    if cuda:  # before the pools below: it sizes pools from the free memory
        _row(payload, "after_capture", lambda: after_capture(device, args.margin, 64))
    _row(payload, "grow_shrink", lambda: grow_shrink(device, base, step, reps, None))
    _row(payload, "chunk_sweep", lambda: {
        str(chunk): {k: v for k, v in grow_shrink(device, base, step, 3, chunk).items()
                     if k in ("chunk_bytes", "grow_ms", "shrink_ms")}
        for chunk in (2 * MIB, 32 * MIB)
    })  # fmt: skip
    _row(payload, "moves", lambda: _moves(device, live))
    payload["targets"] = targets(payload, device)
    payload["seconds"] = time.perf_counter() - started
    lines = summary(payload["targets"])
    payload["summary"] = lines
    out = args.out or (_default_out(device) if cuda else None)
    if out:
        save_json(out, payload)
    print("\n".join(lines))
    print(f"bench_elastic: {payload['seconds']:.1f} s")
    return 0 if all("error" not in row for row in payload["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
