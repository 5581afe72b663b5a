"""Prefix caching: the same workloads with and without ``enable_prefix_caching``.

Models (``--models``, random init, ``--dtype``, default bf16; ``--tiny``: their
few-KB versions, a CPU smoke test of this script):
- ``llama``: the Llama-3.2-1B shape of ``bench_e2e.py``;
- ``hybrid``: ``bench_hybrid.py``'s Qwen3.5 layer shapes (hidden 4096, Gated
  DeltaNet 16 x 128 key / 32 x 128 value heads, gated full attention 16 / 8 x 256),
  cut to 4 layers (3 GDN + 1 full) and a 32k vocab so it builds in seconds; prefix
  hits there restore state checkpoints;
- ``swa``: gpt-oss-20b's attention (hidden 2880, 64 query / 8 KV heads x 64, sinks,
  sliding window 128 on every other layer, full attention on the rest, yarn rope),
  cut to 4 layers (2 sliding + 2 full), 8 experts (top 4) and a 32k vocab: the
  windowed family whose caching default (issue 41) a same-run A/B settles; hits there
  need the window pages of their last prompt page (``--tiny``: a 4-token window).

Workloads (random token ids, fixed seed, greedy, EOS ignored):
- ``system``: ``--requests`` requests, one shared ``--system-len``-token system
  prompt (2048) plus a ``--suffix-len``-token user suffix (32) each, all at t0;
- ``chat``: ``--conversations`` conversations of ``--turns`` turns; each turn's
  prompt is the previous turn's prompt and answer plus a new ``--message-len``
  -token message; one ``generate`` per turn over every conversation.

Both runs start with a cold cache: each runs its workload once untimed on one LLM
(it compiles every step shape and every cache path: hits, checkpoints, restores,
evictions), then timed on a fresh LLM (a reset cache would keep the first pass's
pool layout). Chat turns extend each conversation with the run's own answers, as
a client does (answers are ``--new-tokens`` long either way, EOS ignored, so both
runs do the same work. Built from the other run's answers, as before e779800's
H200 run, the cache run's own cached answers match the next prompt only where
bf16 flips left both runs alike: that run hit 10 % on the hybrid chat, where the
scheduler-level simulation of the same workload with its own answers hits 47 %). The
tokens of the two runs are compared before any figure is reported (chat: its
first turn, the one both runs see alike in bf16): in fp32 a mismatch is an
error; in bf16 the run without the cache computes each prefix in other batch
compositions (GEMM tiling differs with M), so greedy tokens can flip legitimately:
``token_agreement`` reports the fraction of identical tokens and of identical
first tokens, and only a first-token agreement below 0.9 is an error (a real
bug is far lower). Per-phase wall times are printed and saved. Reported per workload and
run: prefix hit rate (hit tokens / looked-up tokens), prefill tokens saved,
TTFT p50/p99, output tokens/s and wall time; and the ratios cache / no cache.
The cost breakdown (issue 41: where the cache path spends what its hits save), per
run: ``checkpoint_copies`` and ``checkpoint_copy_seconds`` (every state-checkpoint
copy launch, timed by CUDA events around each, read at the end: a step's takes share
one launch, ``alloc.prefix.batched``; a restore's requests one),
``checkpoint_takes_copied`` / ``checkpoint_takes_written`` (takes by a slot copy, and
those the prefill chunk that ended there wrote itself, no copy: ``StepPlan.ckpt_slots``),
``evicted_pages`` / ``evicted_windows`` / ``evicted_checkpoints``,
``prefill_tokens`` (computed), ``fresh_prefill_tokens`` (what a token-granular
cache of unlimited size would still compute) and ``recomputed_tokens`` (their
difference: partial pages, evicted prefixes, missing checkpoints, preemption
recompute), ``prefill_seconds`` / ``decode_seconds`` (wall time of steps with and
without prefill rows), ``mean_decode_batch`` (requests per decode-only step: what
the bytes the cache holds take from the batch) and ``checkpoint_pool_fraction_at_end``;
the per decode step host split (``PhaseClock``): ``decode_step_host_ms`` by phase of
the engine step (schedule, launch, settle: the wait for the previous step's tokens,
complete, and the cache path's ``after_step`` inside it), the same per step with prefill
rows (``prefill_step_host_ms``), ``decode_step_table_writes``,
and the run's ``forward_waits`` (host syncs on the forward fences), ``forward_orders``
(compactions on a shortfall ordered after the forward on the device instead, issue 41),
``page_moves``, and the allocator's pinned upload ring on CUDA: ``upload_ring_slots``
(what it grew to instead of waiting for a queued copy) and ``upload_ring_waits`` (the
host syncs it made at its bound; both 0 on CPU, which has no ring).
``spill`` (the host tier, ``io/prefix_host.py``): ``--spill-pages`` cached
pages of the model's pool evicted to the host tier and reloaded by a hit, timed
(synchronised) against plain pinned copies of the same bytes in the same run;
spill and reload bandwidth in GB/s and their ratio to the pinned copies (the
reload's time excludes the hit's lookup, ``match_seconds``, which a device hit pays
as well); ``split``: each one's host seconds before its first copy was enqueued, the
copies' own seconds (CUDA events on the tier's stream) and the rest; and
``tier_rows_d2h`` / ``tier_rows_h2d``: one plain copy between the pool's rows and the
tier's own host slots (is it the copy, or the path around it). ``--workloads spill``
alone writes the model's config only (no weights).
Saved as JSON (``--out``).

``--fifo``: the cache run admits waiting requests in arrival order, as before issue 41's
hits first (``PrefixCaching.pick``), for an A/B of the admission order.
Both LLMs of a workload get the same pool: ``--pool-factor`` (1.25) times the bytes
of its requests' worst case at once (a hybrid's state checkpoints compete for it).

Usage: ``python benchmarks/bench_prefix.py --device cuda [--models llama,hybrid,swa]
[--dtype bfloat16|float32] [--pool-factor 1.25] [--out results.json]``; ``--tiny`` on CPU;
``--narrow`` (hybrid): every head of the model as on the GPU (the same pool geometry:
pages, state slots, so the same pressure and cache path) on a 128-wide residual stream
and a 4k vocabulary, the workload as given: on CPU, the host cost of each step at the
GPU run's step count and batch (``--device cpu --narrow --models hybrid --workloads
chat --dtype float32``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_e2e import _free, _StepClock, latency, make_prompts, save_model

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# --narrow: the residual stream, MLP and vocabulary of a CPU run (the heads stay)
NARROW = {"hidden_size": 128, "intermediate_size": 256, "vocab_size": 4096}
MIN_FIRST_TOKEN_AGREEMENT = 0.9  # bf16: below this the cache is wrong, not rounding


def _llm(path: Path, args, caching: bool, max_len: int, n: int):
    from unikv.engine import LLM
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for, worst_case_pages

    configs = specs_from_hf_config(path, page_size=args.page_size, dtype=args.dtype)
    pages = {
        c.name: n * worst_case_pages(c.spec, c.page_size, max_len, args.chunk) for c in configs
    }
    return LLM(
        str(path), device=args.device, dtype=args.dtype, page_size=args.page_size,
        kv_cache_bytes=int(pool_bytes_for(configs, pages) * args.pool_factor), max_num_seqs=n,
        max_num_batched_tokens=args.chunk, max_model_len=max_len,
        enable_prefix_caching=caching,
    )  # fmt: skip


def _timed(llm, prompts, new_tokens: int, phases=None) -> tuple[list[list[int]], dict]:
    from unikv.engine import SamplingParams

    clock = _StepClock()
    fed = [0]

    def on_step(llm_, batch, logits) -> None:
        fed[0] += sum(batch.num_new)
        clock(llm_, batch, logits)
        if phases is not None:
            phases.step(batch.is_decode)

    outputs = llm.generate(
        prompts,
        SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0),
        on_step=on_step,
    )
    wall = time.perf_counter() - clock.t0
    ttft = [times[0] - clock.t0 for times in clock.stamps.values()]
    made = sum(len(o.output_ids) for o in outputs)
    res = {"seconds": wall, "output_tokens": made, "ttft": ttft}
    res["cached_tokens"] = sum(o.num_cached_tokens for o in outputs)
    # every fed token is a prefill token but the decode ones (each output but the last)
    res["prefill_tokens"] = fed[0] - sum(max(len(o.output_ids) - 1, 0) for o in outputs)
    res["steps"] = clock.steps
    return [o.output_ids for o in outputs], res


class PhaseClock:
    """Host seconds of each phase of every engine step (``EngineLoop.step``:
    ``schedule``, ``launch``, ``settle``: the previous step's tokens, a wait for the
    device, ``complete``: the step applied, ``after_step`` (inside ``complete``): the
    cache path's checkpoints and shares), per step, attributed at ``on_step``; plus
    the forward-fence waits (``FenceQueue.wait_forward``: compaction's host sync),
    stream orderings (``FenceQueue.order_forward``), page moves (``TableWriter.moves``)
    of the run, and the device table writes (each
    an upload and a launch, ``TableWriter.write``) per decode step. Wraps the live
    objects' methods."""

    PHASES = ("schedule", "launch", "settle", "complete", "after_step")

    def __init__(self, llm) -> None:
        loop, sched = llm.engine, llm.scheduler
        self.now = dict.fromkeys(self.PHASES, 0.0)
        self.decode = dict.fromkeys(self.PHASES, 0.0)
        self.other = dict.fromkeys(self.PHASES, 0.0)
        self.waits = self.orders = 0
        self.writes = [0, 0]  # table writes since the last step, in decode steps
        self.writer = llm.alloc.parts.writer
        self.moves0 = self.writer.moves
        write = self.writer.write

        def counted_write(*args, **kwargs):
            self.writes[0] += 1
            return write(*args, **kwargs)

        self.writer.write = counted_write
        for obj, attr, phase in (
            (sched, "schedule", "schedule"), (loop.runner, "launch", "launch"),
            (loop, "_settle", "settle"), (sched, "complete_ahead", "complete"),
            (sched, "complete_verify", "complete"), (sched.prefix, "after_step", "after_step"),
        ):  # fmt: skip
            setattr(obj, attr, self._timed(getattr(obj, attr), phase))
        fences = llm.alloc.parts.fences
        wait, order = fences.wait_forward, fences.order_forward

        def counted() -> None:
            self.waits += 1
            wait()

        def counted_order():
            self.orders += 1
            return order()

        fences.wait_forward, fences.order_forward = counted, counted_order

    def _timed(self, fn, phase: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[phase] += time.perf_counter() - start

        return timed

    def step(self, is_decode: bool) -> None:
        """``on_step``: the phases since the last step were this step's."""
        into = self.decode if is_decode else self.other
        for k, v in self.now.items():
            into[k] += v
            self.now[k] = 0.0
        self.writes[1] += self.writes[0] if is_decode else 0
        self.writes[0] = 0

    def figures(self, decode_steps: int, prefill_steps: int) -> dict:
        per = {k: 1e3 * v / max(decode_steps, 1) for k, v in self.decode.items()}
        mixed = {k: 1e3 * v / max(prefill_steps, 1) for k, v in self.other.items()}
        return {
            "decode_step_host_ms": per,  # after_step is part of complete
            "prefill_step_host_ms": mixed,  # the steps with prefill rows, the same phases
            "decode_step_table_writes": self.writes[1] / max(decode_steps, 1),
            "forward_waits": self.waits,
            "forward_orders": self.orders,  # compaction ordered after it: no host sync
            "page_moves": self.writer.moves - self.moves0,
            # the allocator's pinned upload ring (CUDA): slots it grew to instead of
            # waiting, and the host syncs it made at its bound (one engine per run)
            "upload_ring_slots": len(getattr(self.writer.upload, "pinned", ())),
            "upload_ring_waits": getattr(self.writer.upload, "waits", 0),
        }


class CopyClock:
    """Times the state-checkpoint copies (takes and restores: ``StateCheckpoints._copy``)
    of one LLM: CUDA events around each copy on the current stream, read once at the
    end (no sync per copy); on CPU the copy is synchronous and timed directly."""

    def __init__(self, llm) -> None:
        self.states = llm.alloc.parts.prefix.states
        self.cuda = llm.device.type == "cuda"
        self.events: list = []
        self.cpu_s = 0.0
        self.copies = 0
        if self.states is None:
            return
        inner = self.states._copy

        def timed(src, dst) -> None:
            self.copies += 1
            if self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                inner(src, dst)
                end.record()
                self.events.append((start, end))
            else:
                t = time.perf_counter()
                inner(src, dst)
                self.cpu_s += time.perf_counter() - t

        self.states._copy = timed

    def seconds(self) -> float:
        if self.events:
            torch.cuda.synchronize()
        return self.cpu_s + sum(a.elapsed_time(b) for a, b in self.events) / 1e3


def fresh_tokens(prompts: list[list[int]], seen: set) -> int:
    """Prompt tokens whose prefix (the token and all before it) no earlier feed held:
    what a cache of unlimited size, at token granularity, would still prefill.
    ``seen`` (prefix hashes) gains the prompts' prefixes."""
    fresh = 0
    for p in prompts:
        h = 0
        for t in p:
            h = hash((h, t))
            if h not in seen:
                seen.add(h)
                fresh += 1
    return fresh


def breakdown(steps: list, prefill: int, fresh: int, copy_s: float, copies: int) -> dict:
    """Where a run's time and work went (``steps``: (seconds, is_decode, batch size))."""
    decode = [(s, b) for s, d, b in steps if d]
    mixed = [(s, b) for s, d, b in steps if not d]
    return {
        "prefill_tokens": prefill,
        "fresh_prefill_tokens": fresh,
        "recomputed_tokens": prefill - fresh,  # misses of seen prefixes, preemption recompute
        "decode_steps": len(decode),
        "prefill_steps": len(mixed),
        "decode_seconds": sum(s for s, _ in decode),
        "prefill_seconds": sum(s for s, _ in mixed),
        "mean_decode_batch": sum(b for _, b in decode) / max(len(decode), 1),
        "mean_batch": sum(b for _, _, b in steps) / max(len(steps), 1),
        "checkpoint_copies": copies,
        "checkpoint_copy_seconds": copy_s,
    }


def _system_turns(args, vocab: int) -> list[list[list[int]]]:
    system = make_prompts(1, args.system_len, vocab, seed=1)[0]
    suffixes = make_prompts(args.requests, args.suffix_len, vocab, seed=2)
    return [[system + s for s in suffixes]]


def save_hybrid(path: Path, args) -> None:
    """``bench_hybrid.py``'s Qwen3.5-shaped config, 4 layers and a 32k vocab
    (``--tiny``: its few-KB twin; ``--narrow``: its heads on a narrow residual
    stream), random init (seed 0), saved to ``path``."""

    from benchmarks.bench_hybrid import hf_config

    config = hf_config("qwen3_5", args.tiny)
    if not args.tiny:
        layers = ["linear_attention"] * 3 + ["full_attention"]
        cut = {"num_hidden_layers": 4, "layer_types": layers, "vocab_size": 32768}
        if args.narrow:  # the same cache geometry (pages, state slots), little compute
            cut.update(NARROW, initializer_range=0.1)
        config = type(config).from_dict({**config.to_dict(), **cut})
    _save_random(config, path, args)


def swa_config(tiny: bool, narrow: bool):
    """The ``swa`` model's transformers config (module docstring; ``tiny``: its
    few-KB twin, ``narrow``: its heads on a narrow residual stream)."""
    import transformers as tf

    rope = {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096,
    }  # fmt: skip
    kw = {
        "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
        "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
        "num_local_experts": 8, "num_experts_per_tok": 4, "vocab_size": 32768,
        "max_position_embeddings": 32768, "rope_parameters": rope,
        "eos_token_id": None, "bos_token_id": None, "pad_token_id": 0,
    }  # fmt: skip
    if tiny:
        kw.update(
            hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
            vocab_size=512,
        )  # fmt: skip
    elif narrow:
        kw.update(NARROW, initializer_range=0.1)
    return tf.GptOssConfig(**kw)


def save_swa(path: Path, args) -> None:
    """The ``swa`` model (``swa_config``), random init (seed 0), saved to ``path``."""
    _save_random(swa_config(args.tiny, args.narrow), path, args)


def _save_random(config, path: Path, args) -> None:
    """A transformers model of ``config``, random init (seed 0), saved to ``path``."""
    import transformers as tf

    torch.manual_seed(0)
    with torch.device(args.device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=args.dtype)
    model.save_pretrained(path)
    del model
    _free()


def agreement(a: list, b: list) -> dict:
    """Fractions of identical tokens (position by position) and of identical first
    tokens between two runs' outputs (turns of requests of token lists)."""
    pairs = [(x, y) for ta, tb in zip(a, b) for x, y in zip(ta, tb)]
    same = sum(p == q for x, y in pairs for p, q in zip(x, y))
    total = sum(max(len(x), len(y)) for x, y in pairs)
    first = sum(x[:1] == y[:1] for x, y in pairs)
    return {"tokens": same / max(total, 1), "first_tokens": first / max(len(pairs), 1)}


def run(path: Path, args, caching: bool, workload: str, vocab: int) -> tuple[list, dict]:
    """One workload, run twice: untimed on one LLM (it compiles every step shape and
    cache path), then timed on a fresh one (a pool with the same history as a
    cold server's); (tokens of every turn, figures). Chat turns extend each
    conversation with the run's own answers, as a client does."""
    chat = workload == "chat"
    n = args.conversations if chat else args.requests
    if chat:
        max_len = args.turns * (args.message_len + args.new_tokens) + 8
    else:
        max_len = args.system_len + args.suffix_len + args.new_tokens + 8
    turns = _system_turns(args, vocab) if not chat else None
    for _ in range(2):  # the first pass is the warm-up
        llm = None
        _free()
        llm = _llm(path, args, caching, max_len, n)
        llm.scheduler.prefix.hits_first = not args.fifo  # (an attribute of either policy)
        copies, phases = CopyClock(llm), PhaseClock(llm)
        before = dict(llm.alloc.prefix.counters())
        states = llm.alloc.parts.prefix.states
        counts = (
            (states.evicted, states.saved, states.restored, states.copied, states.written)
            if states
            else (0,) * 5
        )
        preempted = llm.scheduler.num_preemptions
        tokens, ttft, seconds, made = [], [], 0.0, 0
        steps, prefill, fresh, seen = [], 0, 0, set()
        history = [[] for _ in range(n)]
        for t in range(args.turns if chat else 1):
            if chat:
                messages = make_prompts(n, args.message_len, vocab, seed=10 + t)
                prompts = [h + m for h, m in zip(history, messages)]
            else:
                prompts = turns[0]
            fresh += fresh_tokens(prompts, seen)
            out, res = _timed(llm, prompts, args.new_tokens, phases)
            tokens.append(out)
            history = [p + o for p, o in zip(prompts, out)]
            fresh_tokens([h[:-1] for h in history], seen)  # the answers were fed too
            ttft += res["ttft"]
            seconds += res["seconds"]
            made += res["output_tokens"]
            steps += res["steps"]
            prefill += res["prefill_tokens"]
    stats = {k: v - before.get(k, 0) for k, v in llm.alloc.prefix.counters().items()}
    figures = {
        "hit_rate": stats["hit_tokens"] / max(stats["query_tokens"], 1),
        "prefill_tokens_saved": stats["hit_tokens"],
        "evicted_pages": stats["evicted_pages"],
        "evicted_windows": stats["evicted_windows"],
        "evicted_checkpoints": (states.evicted - counts[0]) if states else 0,
        "checkpoint_takes": (states.saved - counts[1]) if states else 0,
        "checkpoint_restores": (states.restored - counts[2]) if states else 0,
        "checkpoint_takes_copied": (states.copied - counts[3]) if states else 0,
        "checkpoint_takes_written": (states.written - counts[4]) if states else 0,
        "checkpoints_held_at_end": stats.get("checkpoints", 0),
        "checkpoint_pool_fraction_at_end": _checkpoint_fraction(llm),
        "seconds": seconds,
        "output_tokens_per_s": made / seconds,
        "preemptions": llm.scheduler.num_preemptions - preempted,
        **latency(ttft, []),
        **breakdown(steps, prefill, fresh, copies.seconds(), copies.copies),
    }
    figures.update(phases.figures(figures["decode_steps"], figures["prefill_steps"]))
    del llm
    _free()
    return tokens, figures


def _checkpoint_fraction(llm) -> float:
    """The fraction of the pool's bytes the cache's state checkpoints hold now."""
    states = llm.alloc.parts.prefix.states
    if states is None:
        return 0.0
    slot = llm.pool[states.book.name].page_bytes
    return len(states.by_node) * slot / llm.pool.total_bytes


class LaunchClock:
    """Times the host tiers' copy launches (``HostTier._launch``) from a start time
    on: host seconds until the first copy was enqueued, and the copies' own seconds
    (CUDA events on the tier's side stream around each launch, read after the sync;
    on CPU the copies are synchronous and timed directly)."""

    def __init__(self, tiers, cuda: bool) -> None:
        self.cuda, self.start, self.first = cuda, 0.0, None
        self.events: list = []
        self.cpu_s, self.launches = 0.0, 0
        for tier in tiers:
            tier._launch = self._wrap(tier._launch)

    def reset(self) -> None:
        self.start, self.first, self.events, self.cpu_s, self.launches = (
            time.perf_counter(), None, [], 0.0, 0,
        )  # fmt: skip

    def _wrap(self, inner):
        def launch(stream, copy, pages, slots, writers):
            self.launches += 1
            if self.first is None:
                self.first = time.perf_counter()
            if not self.cuda:
                t = time.perf_counter()
                out = inner(stream, copy, pages, slots, writers)
                self.cpu_s += time.perf_counter() - t
                return out
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record(stream)
            out = inner(stream, copy, pages, slots, writers)
            end.record(stream)
            self.events.append((start, end))
            return out

        return launch

    def split(self, total: float) -> dict:
        """(after the sync) the host seconds before the first copy, the copy seconds,
        and the rest of ``total`` (host work after the copies were enqueued)."""
        copy = self.cpu_s + sum(a.elapsed_time(b) for a, b in self.events) / 1e3
        before = (self.first - self.start) if self.first is not None else total
        return {
            "seconds": total, "host_before_copy_s": before, "copy_s": copy,
            "rest_s": max(total - before - copy, 0.0), "copy_launches": self.launches,
        }  # fmt: skip


def spill_bandwidth(path: Path, args) -> dict:
    """Spill ``args.spill_pages`` cached pages to the host tier and reload them by a
    hit; GB/s of both against plain pinned D2H / H2D copies of the same bytes."""
    import numpy as np

    from unikv.allocator import PoolAllocator
    from unikv.hf_config import specs_from_hf_config
    from unikv.io.prefix_host import ReloadPolicy
    from unikv.io.prefix_host_setup import enable_prefix_host
    from unikv.pool import UnifiedPool, pool_bytes_for

    n, ps = args.spill_pages, args.page_size
    configs = specs_from_hf_config(path, page_size=ps, dtype=args.dtype)
    pool = UnifiedPool(
        configs, pool_bytes_for(configs, {c.name: n + 6 for c in configs}), args.device
    )
    alloc = PoolAllocator(pool, max_requests=2, max_context=(n + 1) * ps)
    page_bytes = sum(pool[c.name].page_bytes for c in configs)
    host = enable_prefix_host(alloc, (n + 4) * page_bytes, ReloadPolicy(mode="always"))
    prefix = alloc.parts.prefix
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    clock = LaunchClock(host.tiers.values(), args.device == "cuda")
    split = {}

    def cycle(tokens: np.ndarray) -> tuple[float, float]:
        """Cache ``tokens``' whole pages, spill them all, reload them by a hit: seconds."""
        pages = (len(tokens) - 1) // ps
        slot = alloc.new_request()
        alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([len(tokens)]))
        alloc.prefix.insert(slot, tokens)
        alloc.free_request(slot)
        sync()
        clock.reset()
        alloc.parts.writer.write(prefix.evict(prefix.num_evictable))  # one copy per envelope
        sync()
        spill = time.perf_counter() - clock.start
        split["spill"] = clock.split(spill)
        start = time.perf_counter()
        found = alloc.prefix.match(tokens)  # the lookup: a device hit pays it too
        looked = time.perf_counter() - start
        clock.reset()
        hit = alloc.prefix.reload(found)
        sync()
        reload = time.perf_counter() - clock.start
        split["reload"] = clock.split(reload)
        assert hit.num_tokens == pages * ps, hit
        return spill, reload, looked

    cycle(np.arange(2 * ps + 1) + 10**6)  # warm-up: compiles the copy and table kernels
    assert alloc.prefix.reset() >= 0 and not host.nodes
    spill, reload, looked = cycle(np.arange(n * ps + 1))
    total = n * page_bytes
    dev = torch.empty(total, dtype=torch.uint8, device=args.device)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=args.device == "cuda")
    times = {}
    for name, dst, src in (("d2h", pinned, dev), ("h2d", dev, pinned)):
        dst.copy_(src)
        sync()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        times[name] = time.perf_counter() - start
    from unikv.io.envelopes import page_rows

    for name, back in (("tier_rows_d2h", False), ("tier_rows_h2d", True)):
        seconds = 0.0  # the same bytes between the pool's rows and the tier's own host
        for tier in host.tiers.values():  # slots (all free now), one plain copy each
            rows, slots = page_rows(pool, tier.name)[1 : n + 1], tier.host[:n]
            dst, src = (rows, slots) if back else (slots, rows)
            sync()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync()
            seconds += time.perf_counter() - start
        times[name] = seconds
    gbs = {k: total / v / 1e9 for k, v in (("spill", spill), ("reload", reload), *times.items())}
    return {
        "pages": n, "bytes": total, "gb_per_s": gbs, "counters": host.counters(),
        "match_seconds": looked,  # the lookup before the reload (not in "reload")
        "split": split,  # host seconds before the first copy, copy seconds, the rest
        "spill_over_pinned_d2h": gbs["spill"] / gbs["d2h"],
        "reload_over_pinned_h2d": gbs["reload"] / gbs["h2d"],
    }  # fmt: skip


def run_model(model: str, path: Path, args, phases: dict) -> dict:
    """Every workload of ``args.workloads`` on ``model``; its figures (wall times
    of each phase into ``phases``)."""
    start = time.perf_counter()
    if args.workloads == "spill":  # the spill row reads the config only: no weights
        from benchmarks.bench_e2e import model_config

        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(
            json.dumps(model_config("llama", args.tiny or args.narrow))
        )
    elif model == "llama":
        save_model("llama", path, args.device, args.dtype, args.tiny or args.narrow)
    elif model == "swa":
        save_swa(path, args)
    else:
        save_hybrid(path, args)
    phases[f"{model}/build"] = _phase(model, "build", start)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    out = {}
    for workload in args.workloads.split(","):
        start = time.perf_counter()
        if workload == "spill":
            if model == "llama":
                out["spill"] = spill_bandwidth(path, args)
                print(model, "spill", json.dumps(out["spill"], indent=1))
                phases[f"{model}/spill"] = _phase(model, "spill", start)
            continue
        off_tokens, off = run(path, args, False, workload, vocab)
        phases[f"{model}/{workload}/no_cache"] = _phase(model, f"{workload} no cache", start)
        start = time.perf_counter()
        on_tokens, on = run(path, args, True, workload, vocab)
        phases[f"{model}/{workload}/cache"] = _phase(model, f"{workload} cache", start)
        agree = agreement(on_tokens[:1], off_tokens[:1])  # turn 1: the same prompts
        if args.dtype == torch.float32 and on_tokens != off_tokens:
            raise SystemExit(f"{model} {workload}: fp32 tokens with the prefix cache differ")
        if agree["first_tokens"] < MIN_FIRST_TOKEN_AGREEMENT:
            raise SystemExit(
                f"{model} {workload}: first tokens with and without the prefix cache agree "
                f"for {agree['first_tokens']:.1%} of the requests only (< "
                f"{MIN_FIRST_TOKEN_AGREEMENT:.0%}: not bf16 rounding): {agree}"
            )
        ratio = {
            "output_tokens_per_s": on["output_tokens_per_s"] / off["output_tokens_per_s"],
            "ttft_p50": on["ttft_p50_ms"] / off["ttft_p50_ms"],
            "prefill_tokens": on["prefill_tokens"] / max(off["prefill_tokens"], 1),
            "mean_decode_batch": on["mean_decode_batch"] / max(off["mean_decode_batch"], 1e-9),
            "decode_seconds": on["decode_seconds"] / max(off["decode_seconds"], 1e-9),
            "prefill_seconds": on["prefill_seconds"] / max(off["prefill_seconds"], 1e-9),
        }
        out[workload] = {
            "no_cache": off, "cache": on, "cache_over_no_cache": ratio, "token_agreement": agree,
        }  # fmt: skip
        print(model, workload, json.dumps(out[workload], indent=1))
    return out


def _phase(model: str, what: str, start: float) -> float:
    seconds = time.perf_counter() - start
    print(f"phase {model} {what}: {seconds:.1f} s", flush=True)
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny model and workloads (CPU)")
    p.add_argument(
        "--narrow", action="store_true",
        help="the models' cache shapes on a narrow residual stream, the workload as given",
    )  # fmt: skip
    p.add_argument("--workloads", default="system,chat,spill")
    p.add_argument("--models", default="llama,hybrid", help="llama, hybrid, swa (spill: llama)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--message-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--spill-pages", type=int, default=512, help="pages the spill row moves")
    p.add_argument(
        "--pool-factor", type=float, default=1.25, help="pool bytes / the requests' worst case"
    )
    p.add_argument(
        "--fifo", action="store_true",
        help="admit waiting requests in arrival order (before issue 41's hits first)",
    )  # fmt: skip
    p.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args(argv)
    if args.tiny:
        args.requests, args.system_len, args.suffix_len = 6, 64, 8
        args.conversations, args.turns, args.message_len, args.new_tokens = 3, 3, 8, 8
        args.page_size, args.chunk, args.spill_pages = 4, 64, 16
    args.dtype = DTYPES[args.dtype]
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny models on a shared CPU: threads only oversubscribe
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "phase_seconds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            if model not in ("llama", "hybrid", "swa"):
                raise SystemExit(f"--models takes llama, hybrid and swa, got {model!r}")
            results[model] = run_model(model, Path(tmp) / model, args, results["phase_seconds"])
    print("phase seconds", json.dumps(results["phase_seconds"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
