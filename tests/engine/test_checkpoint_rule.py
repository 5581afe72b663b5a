"""The decode-checkpoint cost rule (``engine/checkpoint_rule.py``), a pure function:
a table of inputs and the decisions worked out by hand (also with the pool fractions the
checkpoints and the running batch hold), the chance a boundary is the
turn end, a state slot's bytes as displaced tokens, and the rule inside the prefix
policy (a boundary it declines is not checkpointed; the last one is), and the
recompute rate measured at start-up."""

from __future__ import annotations

import time

import pytest
import torch
from allocator_fixtures import full_config, mamba_config

from unikv.engine.checkpoint_rule import (
    CheckpointRule,
    measure_copy_s,
    measure_prefill_tokens_per_s,
    state_tokens,
)

# prefill 1000 tok/s, a copy 10 ms, a state slot 50 tokens of pages:
# gain = reuse * tokens / 1000; cost = 0.010 (+ 0.050 when held under pressure)
RULE = CheckpointRule(copy_s=0.010, prefill_tokens_per_s=1000.0, state_tokens=50.0)


@pytest.mark.parametrize(
    "reuse, tokens, held, pressure, take",
    [
        (1.0, 16, False, 0.0, True),  # 0.016 > 0.010
        (0.5, 16, False, 0.0, False),  # 0.008 < 0.010: declined ...
        (0.5, 32, False, 0.0, True),  # ... the gap grew: 0.016 > 0.010
        (1.0, 10, False, 1.0, False),  # 0.010 = 0.010: not strictly worth it
        (1.0, 16, True, 0.0, True),  # a new slot, but the pool has room
        (1.0, 16, True, 1.0, False),  # 0.016 < 0.010 + 0.050
        (1.0, 64, True, 1.0, True),  # 0.064 > 0.060
        (0.25, 64, True, 0.5, False),  # 0.016 < 0.010 + 0.025
        (0.0, 1000, False, 0.0, False),  # never hit: never worth a copy
    ],
)
def test_the_rule_decides_as_worked_out_by_hand(reuse, tokens, held, pressure, take):
    assert RULE.take(reuse, tokens, held, pressure) is take


@pytest.mark.parametrize(
    "tokens, held, pressure, checkpoints, batch, take",
    [
        (64, True, 1.0, 0.0, 0.0, True),  # as above: 0.064 > 0.010 + 0.050
        (64, True, 1.0, 0.0, 0.5, True),  # a batch alone changes nothing: 0.064 > 0.060
        # checkpoints hold half the room the batch leaves: the hold doubles,
        (64, True, 1.0, 0.25, 0.5, False),  # 0.064 < 0.010 + 0.100
        (200, True, 1.0, 0.25, 0.5, True),  # 0.200 > 0.110
        (10**6, True, 1.0, 0.5, 0.5, False),  # they fill the room: a held one, never
        (64, False, 1.0, 0.5, 0.5, True),  # a rolling one holds no new slot: 0.064 > 0.010
        (64, True, 0.0, 0.9, 0.05, True),  # no pressure: the room is free
    ],
)
def test_the_bytes_held_weigh_as_worked_out_by_hand(
    tokens, held, pressure, checkpoints, batch, take
):
    assert RULE.take(1.0, tokens, held, pressure, checkpoints, batch) is take


def test_every_page_takes_each_boundary_and_bad_inputs_are_refused():
    every = CheckpointRule(copy_s=1.0, prefill_tokens_per_s=1.0, every_page=True)
    assert every.take(0.0, 0, True, 1.0)
    with pytest.raises(ValueError, match="prefill_tokens_per_s > 0"):
        CheckpointRule(prefill_tokens_per_s=0.0)
    with pytest.raises(ValueError, match="copy_s >= 0"):
        CheckpointRule(copy_s=-1.0)


@pytest.mark.parametrize(
    "boundary, end, ps, reuse",
    [
        (112, 127, 16, 1.0),  # max_tokens ends before 128: the turn end
        (96, 127, 16, 16 / 31),  # 31 tokens left, a stop uniform over them
        (80, 127, 16, 16 / 47),
        (111, 127, 16, 1.0),  # exactly one page left
        (12, 17, 4, 4 / 5),
        (16, 17, 4, 1.0),
    ],
)
def test_the_chance_a_boundary_is_the_turn_end(boundary, end, ps, reuse):
    assert CheckpointRule.reuse_at(boundary, end, ps) == pytest.approx(reuse)


def test_a_state_slot_in_displaced_tokens():
    # full: 1 layer, 1 KV head of dim 2, fp32, K and V: 16 bytes a token; the Mamba
    # slot holds a conv state of 3 and a temporal state of 5 fp32: 32 bytes
    assert state_tokens([full_config(4), mamba_config()]) == pytest.approx(32 / 16)
    assert state_tokens([full_config(4)]) == 0.0
    assert state_tokens([mamba_config()]) == 0.0  # nothing to displace


def test_cpu_copy_cost_is_the_fixed_default():
    import torch

    from unikv.engine.checkpoint_rule import CPU_COPY_S

    assert measure_copy_s(torch.device("cpu"), 1 << 20) == CPU_COPY_S


class _Stack(torch.nn.Module):
    """``layers`` equal linear maps (one weight shape, repeated) and an lm_head."""

    def __init__(self, layers: int, width: int, vocab: int = 0) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(width, width, bias=False) for _ in range(layers)
        )
        if vocab:
            self.lm_head = torch.nn.Linear(width, vocab, bias=False)


def _ticks():
    """A clock that advances one second per reading: each timed launch takes 1 s."""
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    return clock


def test_the_recompute_rate_is_measured_at_start_up():
    """With every launch timed at 1 s, a prefill of ``rows`` tokens through N equal
    linears takes N seconds (each layer once; one shape timed once, counted N times),
    so the measured rate is rows / N tokens/s; more layers, slower; rows are capped at
    a chunk of 2048. On CPU without a clock, the engine's estimate, unchanged."""
    cpu = torch.device("cpu")
    for layers in (1, 3):
        rate = measure_prefill_tokens_per_s(_Stack(layers, 8), cpu, 64, 1e4, clock=_ticks())
        assert rate == pytest.approx(64 / layers)
    capped = measure_prefill_tokens_per_s(_Stack(2, 8), cpu, 10_000, 1e4, clock=_ticks())
    assert capped == pytest.approx(2048 / 2)
    # the lm_head is not timed (a prefill's logits are its last rows'), but its weights
    # are the model's: equal widths, so the 2 timed layers hold 2/3 of them
    head = measure_prefill_tokens_per_s(_Stack(2, 8, vocab=8), cpu, 64, 1e4, clock=_ticks())
    assert head == pytest.approx(64 / 3)
    assert measure_prefill_tokens_per_s(_Stack(2, 8), cpu, 64, 1e4) == 1e4
    real = measure_prefill_tokens_per_s(_Stack(2, 64), cpu, 256, 1e4, clock=time.perf_counter)
    assert 0 < real < float("inf")


class _Peer:
    """A tensor-parallel group of this rank and one slower peer (``min_int`` as the
    group's all-reduce answers it: the smaller of this rank's value and the peer's)."""

    def __init__(self, *values: int) -> None:
        self.values = list(values)  # the peer's, in call order

    def min_int(self, value: int, device) -> int:
        return min(value, self.values.pop(0))


def test_tensor_parallel_ranks_take_the_slowest_figures():
    """The rule steers the schedule, one on every rank: under tensor parallelism each
    rank takes the group's slowest recompute rate and copy time (a peer at 500
    tokens/s and 5 ms per copy against this rank's 1e4 and 0)."""
    from unikv.engine.build import _checkpoint_rule
    from unikv.pool import UnifiedPool

    pool = UnifiedPool([full_config(4), mamba_config()], 1 << 16)
    cpu, model = torch.device("cpu"), _Stack(1, 8)
    alone = _checkpoint_rule(pool, cpu, model, 64, 1e4)
    assert (alone.prefill_tokens_per_s, alone.copy_s) == (1e4, 0.0)
    rule = _checkpoint_rule(pool, cpu, model, 64, 1e4, _Peer(500, -5_000_000))
    assert (rule.prefill_tokens_per_s, rule.copy_s) == (500.0, 0.005)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_recompute_rate_is_measured_on_the_gpu():
    """CUDA, no clock given: the device's own timing. Eight layers of 4096 x 4096 in
    bf16 on a 2048-token chunk: the GEMM rate lies between 10 TFLOP/s and 2 PFLOP/s
    (any GPU the engine runs on; the fixed estimate is 300 TFLOP/s), so the rate is
    that over 2 FLOPs per weight; twice the layers, about half the rate."""
    cuda = torch.device("cuda")
    small = _Stack(8, 4096).to(cuda, torch.bfloat16)
    large = _Stack(16, 4096).to(cuda, torch.bfloat16)
    weights = 8 * 4096 * 4096
    rate = measure_prefill_tokens_per_s(small, cuda, 2048, 1.0)
    assert 1e13 / (2 * weights) < rate < 2e15 / (2 * weights)
    assert measure_prefill_tokens_per_s(large, cuda, 2048, 1.0) == pytest.approx(rate / 2, rel=0.4)
