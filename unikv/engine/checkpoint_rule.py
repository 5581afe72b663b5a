"""When a decode page boundary of a hybrid request earns a state checkpoint (issue 41).

A checkpoint at a decode boundary ``b`` is what the next turn of a chat hits when
the request stops before its next boundary (a later one supersedes it otherwise).
A hit there instead of at the request's previous checkpoint ``p`` saves
recomputing ``b - p`` tokens. So (``CheckpointRule.take``, a pure function):

    take  <=>  reuse * tokens / prefill_tokens_per_s
                 >  copy_s + held * pressure * state_tokens / prefill_tokens_per_s
                           / (1 - checkpoints / (1 - batch))

- ``reuse``: the chance it is the request's last boundary (``reuse_at``): 1 when
  its ``max_tokens`` ends before the next one (the turn end), else ``page_size``
  over the tokens it may still decode (a stop point uniform over what is left);
- ``tokens``: the tokens since the request's previous checkpoint (or its hit):
  the rule declines a boundary, the gap grows, and a later one pays;
- ``copy_s``: one state-slot copy with its launches and host work, measured once at
  start-up (``measure_copy_s``; CPU: ``CPU_COPY_S``, fixed, so tests are
  deterministic);
- ``prefill_tokens_per_s``: the recompute rate, measured once at start-up too
  (``measure_prefill_tokens_per_s``: the model's linear layers timed on a prefill
  chunk's rows; CPU: the engine's fixed FLOP estimate);
- ``held``: the checkpoint adds a slot the cache keeps (a request's first decode
  checkpoint with no prompt-end one to supersede; a rolling one replaces its
  predecessor); ``pressure``: 1 once the cache has evicted (what a slot displaces
  would have been reused), 0 while the pool has room; ``state_tokens``: one state
  slot's bytes as tokens of the token sub-pools' pages it displaces;
- ``checkpoints``, ``batch``: the fractions of the pool the cache's checkpoints and the
  running requests hold (host ints, ``PrefixCaching.pool_fractions``). The room the
  batch leaves (``1 - batch``) is what cached pages and checkpoints share; as the
  checkpoints fill it, each new one displaces scarcer bytes (cached pages, then the
  next decode admission), so its hold cost grows as ``1 / (1 - checkpoints / room)``,
  and once they hold all of it a held one is declined (the bytes held, not the copies,
  were the cost in the simulation: checkpoints held 33-47 % of the pool). In
  ``sim_prefix_hybrid_chat`` at 1.25x it changed no decision (hit rate 51.4 %, 393
  copies, as before): every decode checkpoint there rolls over its request's
  prompt-end one (not ``held``), so the bytes are the one turn-end slot per
  conversation that the next turn's hit needs.

``every_page``: the earlier rule (a checkpoint at every decode boundary), kept for
same-run A/B in the simulation. The other checkpoint points (the junction where a
prompt leaves the cached run it matched, the prompt's last whole page) are placed
unconditionally: reuse there is likely (``engine/prefix_policy.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

FLOAT_WEIGHTS = (torch.float16, torch.bfloat16, torch.float32)  # timed with F.linear
CPU_COPY_S = 0.0  # a memcpy of a state slot: nothing next to a CPU forward
LAUNCH_S = 20e-6  # host work and launches of one checkpoint (share, walk, bind, copy)


@dataclass(frozen=True)
class CheckpointRule:
    """The decode-checkpoint cost rule (module docstring)."""

    copy_s: float = CPU_COPY_S
    prefill_tokens_per_s: float = 1e4
    state_tokens: float = 0.0
    every_page: bool = False

    def __post_init__(self) -> None:
        if self.copy_s < 0 or self.prefill_tokens_per_s <= 0 or self.state_tokens < 0:
            raise ValueError(
                "CheckpointRule needs copy_s >= 0, prefill_tokens_per_s > 0 and "
                f"state_tokens >= 0, got {self.copy_s}, {self.prefill_tokens_per_s}, "
                f"{self.state_tokens}"
            )

    def take(
        self,
        reuse: float,
        tokens: int,
        held: bool,
        pressure: float,
        checkpoints: float = 0.0,
        batch: float = 0.0,
    ) -> bool:
        """Whether a checkpoint hit with probability ``reuse``, saving ``tokens`` of
        recompute, is worth its copy and (``held``) the bytes it keeps under
        ``pressure`` (0..1) while the checkpoints hold ``checkpoints`` and the running
        requests ``batch`` of the pool (fractions)."""
        if self.every_page:
            return True
        gain = reuse * tokens / self.prefill_tokens_per_s
        hold = 0.0
        if held and pressure:
            room = 1.0 - batch  # what the cache's pages and checkpoints share
            if checkpoints >= room:
                return False  # the checkpoints hold all of it: one more shrinks the batch
            scarcity = 1.0 / (1.0 - checkpoints / room)
            hold = pressure * self.state_tokens / self.prefill_tokens_per_s * scarcity
        return gain > self.copy_s + hold

    @staticmethod
    def reuse_at(boundary: int, end: int, page_size: int) -> float:
        """The chance that ``boundary`` (tokens computed) is a request's last whole
        page: it computes ``end`` tokens at most (prompt + max new tokens - 1) and
        stops uniformly over what is left."""
        left = end - boundary
        return 1.0 if left < page_size else page_size / left


def state_tokens(configs) -> float:
    """One state slot's bytes as tokens of the token sub-pools' pages (``configs``:
    the pool's sub-pools or their configs: a spec and a page size each): the cached tokens a checkpoint displaces."""
    state = sum(c.spec.page_bytes(c.page_size) for c in configs if c.spec.kind == "mamba")
    per_token = sum(
        c.spec.page_bytes(c.page_size) / c.page_size for c in configs if c.spec.kind != "mamba"
    )
    return state / per_token if per_token else 0.0


def measure_prefill_tokens_per_s(
    model: torch.nn.Module, device: torch.device, tokens: int, estimate: float, clock=None
) -> float:
    """The recompute cost's rate, measured once at start-up (CUDA; ``clock``: a
    ``() -> seconds`` that brackets the timed launches, given on CPU by tests): every
    distinct linear weight of ``model`` (``lm_head`` aside: a prefill takes the logits
    of its last rows only) run on ``tokens`` rows (at most 2048) after one untimed
    pass, the fastest of three launches, each shape counted as often as the model
    holds it (float weights only); the FLOP rate that gives, over 2 FLOPs per weight per token. The GEMMs are most of a
    prefill's work; attention and the recurrent scans are not timed, so this is an
    upper bound on the rate (a lower bound on what a recompute costs). Without a
    device to time (CPU, no ``clock``): ``estimate`` (fixed, so tests are
    deterministic)."""
    weights = sum(p.numel() for p in model.parameters())
    if (device.type != "cuda" and clock is None) or weights == 0 or tokens <= 0:
        return estimate
    shapes: dict[tuple, list] = {}
    for name, mod in model.named_modules():
        if (
            isinstance(mod, torch.nn.Linear)
            and name.split(".")[-1] != "lm_head"
            and mod.weight.dtype in FLOAT_WEIGHTS  # (a quantised weight has its own op)
        ):
            key = (tuple(mod.weight.shape), mod.weight.dtype)
            shapes.setdefault(key, [mod, 0])[1] += 1
    if not shapes:
        return estimate
    rows = min(tokens, 2048)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _device: None)
    clock = time.perf_counter if clock is None else clock
    flops = seconds = 0.0
    with torch.inference_mode():
        for mod, count in shapes.values():
            x = torch.zeros(rows, mod.in_features, dtype=mod.weight.dtype, device=device)
            torch.nn.functional.linear(x, mod.weight)  # untimed: the kernel's choice
            sync(device)
            best = float("inf")
            for _ in range(3):  # the fastest of three launches
                start = clock()
                torch.nn.functional.linear(x, mod.weight)
                sync(device)
                best = min(best, clock() - start)
            seconds += best * count
            flops += 2.0 * rows * mod.weight.numel() * count
    if seconds <= 0:
        return estimate
    return flops / seconds / (2.0 * weights)


def measure_copy_s(device: torch.device, num_bytes: int) -> float:
    """One state-slot copy of ``num_bytes`` on ``device`` plus ``LAUNCH_S`` (CUDA:
    one warm-up and ten timed device copies, start-up only: it syncs); on CPU
    ``CPU_COPY_S``."""
    if device.type != "cuda" or num_bytes <= 0:
        return CPU_COPY_S
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / 10 + LAUNCH_S
