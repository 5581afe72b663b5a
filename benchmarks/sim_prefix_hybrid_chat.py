"""bench_prefix's hybrid chat in the scheduler-level simulation (NO MODEL RUNS):
hit rate, prefill tokens saved and evictions of prefix caching on the Qwen3.5-shaped
hybrid of ``bench_prefix.py`` (3 Gated DeltaNet + 1 full-attention layer, hidden 4096,
bf16, page 16: a state slot is 50 pages' bytes), 16 conversations x 6 turns,
64-token messages and answers, a pool of ``--pool-factor`` (1.25) times the
requests' worst case, through ``bench_prefix_sim``'s loop (the engine's own
Scheduler, PoolAllocator and PrefixCache on a CPU pool; each turn extends the
conversation with its own planned answer).

Rows: a fresh pool (the first pass), and a second pass of the same workload after
``prefix.reset()`` on the same pool (what bench_prefix timed before it moved the
timed pass to a fresh LLM); each for the decode-checkpoint rules of ``--rules``
(same run): ``before`` (a checkpoint at each decode page boundary, the earlier
rule), ``after`` (``engine/checkpoint_rule.py`` with the H100 estimates ``gpu_rule``
makes for this shape) and ``supersede`` (the cost rule, and a previous turn's end
checkpoint demoted once the next turn takes its own: ``supersede_turns`` of
``engine/prefix_policy.py``, off by default) and ``fifo`` (the cost rule, waiting turns
admitted in arrival order: ``hits_first`` off, as before issue 41's hits-first
admission, ``PrefixCaching.pick``). Each row: hit rate, steps and steps with
prefill rows (each an eager extend step on a GPU), prefill tokens saved,
evicted pages, checkpoint copies, checkpoints evicted and those a take's room
evicted, those a later take of the same request superseded (re-keyed or dropped:
not evictions), the checkpoints' bytes held
(mean and peak over steps), and compaction's waits for the forward (``forward_waits``,
a host sync on a GPU) and ``page_moves``.

``--model``: ``qwen3_5`` (the default, above), ``nemotron_h`` (bench_hybrid's NemotronH:
6 Mamba-2 + 1 attention + 6 MLP layers) or ``gpt-oss-20b`` (its preset: full + sliding
window, no state, so the rules differ in nothing there).

    python benchmarks/sim_prefix_hybrid_chat.py [--pool-factor 1.25] [--model qwen3_5] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_prefix_sim as sim
from bench_hybrid import hf_config

from unikv.engine.checkpoint_rule import LAUNCH_S, CheckpointRule, state_tokens
from unikv.engine.request import Request
from unikv.engine.sampling import SamplingParams
from unikv.hf_config import model_specs_from_hf_config, specs_from_hf_config
from unikv.pool import pool_bytes_for, worst_case_pages

CONVERSATIONS, TURNS, MESSAGE, ANSWER = 16, 6, 64, 64
H100_COPY_BYTES_PER_S, H100_FLOPS = 2e12, 3e14  # device copy; sustained (as llm.py)


# --model: the Qwen3.5 shape of bench_prefix (3 Gated DeltaNet + 1 full attention),
# bench_hybrid's NemotronH (6 Mamba-2, 1 attention, 6 MLP layers) and gpt-oss-20b
# (full + sliding window, no state: the checkpoint rules change nothing there)
MODELS = ("qwen3_5", "nemotron_h", "gpt-oss-20b")


def _hf(model: str):
    config = hf_config(model, False)
    if model == "qwen3_5":
        layers = ["linear_attention"] * 3 + ["full_attention"]
        cut = {"num_hidden_layers": 4, "layer_types": layers, "vocab_size": 32768}
        config = type(config).from_dict({**config.to_dict(), **cut})
    return config


def hybrid_configs(model: str = "qwen3_5"):
    if model == "gpt-oss-20b":
        preset = ROOT / "unikv/presets/gpt-oss-20b.json"
        return list(model_specs_from_hf_config(preset, page_size=sim.PAGE).subpools)
    with tempfile.TemporaryDirectory() as d:
        _hf(model).save_pretrained(d)
        return specs_from_hf_config(d, page_size=sim.PAGE, dtype=torch.bfloat16)


def model_weights(model: str = "qwen3_5") -> int:
    """Parameters of the bench's hybrid (meta device: no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(_hf(model))
    return sum(p.numel() for p in built.parameters())


def gpu_rule(configs, model: str = "qwen3_5") -> CheckpointRule:
    """The cost rule with what ``LLM`` would measure on an H100 for this shape: a
    state-slot copy at 2 TB/s plus ``LAUNCH_S``, prefill at 3e14 FLOP/s / 2 per weight."""
    slots = [c.spec.page_bytes(c.page_size) for c in configs if c.spec.kind == "mamba"]
    if not slots:  # no state: no checkpoint to rule on
        return CheckpointRule()
    return CheckpointRule(
        copy_s=slots[0] / H100_COPY_BYTES_PER_S + LAUNCH_S,
        prefill_tokens_per_s=H100_FLOPS / (2 * model_weights(model)),
        state_tokens=state_tokens(configs),
    )


def chat_rounds(seed: int) -> list[list[sim.Turn]]:
    rng = np.random.default_rng(seed)
    history = [[] for _ in range(CONVERSATIONS)]
    rounds = []
    for _ in range(TURNS):
        row = []
        for c in range(CONVERSATIONS):
            prompt = history[c] + sim._ids(rng, MESSAGE)
            row.append(sim.Turn(prompt, sim._ids(rng, ANSWER), len(history[c])))
            history[c] = prompt + row[-1].output
        rounds.append(row)
    return rounds


class _NoStates:
    """The checkpoint counters of a pool without state (gpt-oss): all zero."""

    saved = evicted = evicted_by_takes = superseded = 0

    def __init__(self) -> None:
        self.by_node: dict = {}


class Engine:
    """One pool, allocator and scheduler (``bench_prefix_sim._engine``) for several passes."""

    def __init__(self, configs, budget: int, max_len: int, rule: CheckpointRule) -> None:
        sim.MAX_NUM_SEQS = CONVERSATIONS
        specs = type("Specs", (), {"subpools": configs})
        self.pool, self.alloc, self.sched = sim._engine(specs, budget, max_len)
        self.sched.prefix.rule = rule
        # compaction's waits for the forward (a host sync on a GPU) and its page moves
        fences, self.waits = self.alloc.parts.fences, 0
        wait = fences.wait_forward

        def counted() -> None:
            self.waits += 1
            wait()

        fences.wait_forward = counted
        self.max_len, self.next_id = max_len, 0
        self.slot_bytes = max((c.spec.page_bytes(c.page_size) for c in configs
                               if c.spec.kind == "mamba"), default=0)  # fmt: skip

    def run(self, rounds) -> dict:
        plans, trace, held = {}, sim._Trace(), []
        evicted = self.alloc.prefix.counters()["evicted_pages"]
        states = self.alloc.parts.prefix.states or _NoStates()
        by_takes = lambda: getattr(states, "evicted_by_takes", 0)  # (a newer counter)
        superseded = lambda: getattr(states, "superseded", 0)  # (newer still)
        saved, gone, taking, replaced = states.saved, states.evicted, by_takes(), superseded()
        waits, moves = self.waits, self.alloc.parts.writer.moves
        for round_ in rounds:
            for turn in round_:
                params = SamplingParams(
                    max_tokens=len(turn.output), ignore_eos=True, temperature=0.0
                )
                request = Request(self.next_id, list(turn.prompt), params, 0, frozenset(),
                                  self.max_len)  # fmt: skip
                plans[self.next_id], self.next_id = turn.output, self.next_id + 1
                self.sched.add(request)
            while self.sched.has_work():
                sim._step(self.pool, self.alloc, self.sched, plans, trace)
                held.append(len(states.by_node))
        return {
            "hit_rate": trace.admit[1] / max(trace.admit[2], 1),
            "prefill_tokens_saved": trace.admit[1],
            "evicted_pages": self.alloc.prefix.counters()["evicted_pages"] - evicted,
            "preemptions": self.sched.num_preemptions,
            "steps": trace.steps[0],
            "prefill_steps": trace.steps[1],  # steps with prefill rows (eager on a GPU)
            "checkpoint_copies": states.saved - saved,
            # checkpoints evicted (room made, or gone with their node), of them those a
            # take's room evicted, and those a take of the same request superseded
            # (re-keyed or dropped: not evictions since issue 41's item 2)
            "checkpoints_evicted": states.evicted - gone,
            "checkpoints_evicted_by_takes": by_takes() - taking,
            "checkpoints_superseded": superseded() - replaced,
            "forward_waits": self.waits - waits,
            "page_moves": self.alloc.parts.writer.moves - moves,
            "checkpoint_bytes_held_mean": float(np.mean(held)) * self.slot_bytes,
            "checkpoint_bytes_held_peak": int(max(held)) * self.slot_bytes,
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pool-factor", type=float, default=1.25)
    p.add_argument("--out", default=None)
    p.add_argument("--rules", default="before,after,supersede,fifo", help="comma-separated")
    p.add_argument("--model", default="qwen3_5", choices=MODELS)
    args = p.parse_args()
    configs = hybrid_configs(args.model)
    max_len = TURNS * (MESSAGE + ANSWER) + 8
    pages = {
        c.name: CONVERSATIONS * worst_case_pages(c.spec, c.page_size, max_len, sim.CHUNK)
        for c in configs
    }
    budget = int(pool_bytes_for(configs, pages) * args.pool_factor)
    cost = gpu_rule(configs, args.model)
    # before: every decode page; after: the cost rule (the default); supersede: the
    # cost rule with superseded turn ends demoted (``supersede_turns``, off by default)
    every = CheckpointRule(every_page=True)
    rules = {"before": (every, False), "after": (cost, False), "supersede": (cost, True),
             "fifo": (cost, False)}  # fmt: skip
    out = {"model": args.model, "pool_factor": args.pool_factor, "pool_bytes": budget}
    out["cost_rule"] = vars(cost)
    for name in args.rules.split(","):
        engine = Engine(configs, budget, max_len, rules[name][0])
        engine.sched.prefix.supersede_turns = rules[name][1]
        engine.sched.prefix.hits_first = name != "fifo"  # fifo: admission in arrival order
        out[name] = {"fresh": engine.run(chat_rounds(0))}
        engine.alloc.prefix.reset()
        out[name]["after_reset"] = engine.run(chat_rounds(0))
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
