"""The batched sampler against the definition of each sampling rule.

Oracles: argmax for greedy; the exact softmax distribution (restricted and
renormalised for top-k / top-p, computed independently here with Python
sorting) for sampling, compared with empirical frequencies over many seeds;
and the sampler's own output on a single row for batch independence.
"""

from __future__ import annotations

import math

import pytest
import torch

from unikv.engine.sampling import SamplingParams, gumbel_noise, hash32, sample

VOCAB = 6
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -3.0])
N = 6000  # samples per distribution check


def _draw(temperature=1.0, top_k=0, top_p=1.0, n=N, logits=LOGITS):
    rows = logits.expand(n, -1).clone()
    return sample(
        rows,
        torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.int64),
        torch.full((n,), top_p),
        torch.arange(n, dtype=torch.int64) * 7919 + 3,
        torch.zeros(n, dtype=torch.int64),
    )


def _expected(temperature=1.0, top_k=0, top_p=1.0) -> list[float]:
    """The target distribution, from the definitions (plain Python)."""
    weights = [math.exp(x / temperature) for x in LOGITS.tolist()]
    order = sorted(range(VOCAB), key=lambda i: -weights[i])
    if top_k:
        order = order[:top_k]
    total = sum(weights[i] for i in order)
    kept, mass = [], 0.0
    for i in order:  # smallest prefix whose mass reaches top_p
        kept.append(i)
        mass += weights[i] / total
        if mass >= top_p:
            break
    z = sum(weights[i] for i in kept)
    return [weights[i] / z if i in kept else 0.0 for i in range(VOCAB)]


def _check_frequencies(tokens: torch.Tensor, expected: list[float]) -> None:
    freq = torch.bincount(tokens, minlength=VOCAB).double() / len(tokens)
    for i, p in enumerate(expected):
        if p == 0:
            assert freq[i] == 0, f"token {i} is outside the allowed set but was sampled"
        else:
            sigma = math.sqrt(p * (1 - p) / len(tokens))
            assert abs(freq[i] - p) < 5 * sigma + 1e-3, (
                f"token {i}: freq {freq[i]:.4f} vs p {p:.4f}"
            )


def test_greedy_is_argmax():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    out = sample(
        logits,
        torch.zeros(16),
        torch.zeros(16, dtype=torch.int64),
        torch.ones(16),
        torch.arange(16),
        torch.zeros(16, dtype=torch.int64),
    )
    assert torch.equal(out, logits.argmax(-1))


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 0, 1.0),
        (0.5, 0, 1.0),
        (2.0, 0, 1.0),
        (1.0, 3, 1.0),
        (1.0, 0, 0.7),
        (1.5, 4, 0.8),
    ],
)
def test_sampled_distribution_matches_definition(temperature, top_k, top_p):
    _check_frequencies(_draw(temperature, top_k, top_p), _expected(temperature, top_k, top_p))


def test_top_k_one_is_greedy_at_any_temperature():
    tokens = _draw(temperature=5.0, top_k=1, n=200)
    assert (tokens == LOGITS.argmax()).all()


def test_row_result_does_not_depend_on_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 40, generator=g)
    temp, top_k, top_p = (
        torch.tensor([0.7, 1.0, 0.0, 1.3, 0.9]),
        torch.tensor([0, 5, 0, 0, 10]),
        torch.tensor([1.0, 1.0, 1.0, 0.9, 0.5]),
    )
    seeds, steps = torch.tensor([11, 12, 13, 2**40 + 5, -7]), torch.tensor([0, 3, 9, 1, 2])
    batched = sample(logits, temp, top_k, top_p, seeds, steps)
    for i in range(5):
        alone = sample(
            logits[i : i + 1],
            temp[i : i + 1],
            top_k[i : i + 1],
            top_p[i : i + 1],
            seeds[i : i + 1],
            steps[i : i + 1],
        )
        assert alone.item() == batched[i].item()


def test_noise_depends_on_seed_and_step_only():
    a = gumbel_noise(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]), 64)
    b = gumbel_noise(torch.tensor([6, 5]), torch.tensor([0, 0]), 64)
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])


def test_hash32_matches_a_python_reference():
    def ref(x):  # lowbias32 on Python ints
        x &= 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = [0, 1, 2, 12345, 0xFFFFFFFF, 0x80000000, 0xDEADBEEF, 2**31 - 1]
    assert hash32(torch.tensor(xs)).tolist() == [ref(x) for x in xs]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"temperature": float("inf")},
        {"top_k": -2},  # -1 = off, as vLLM
        {"seed": 2**63},  # int64 at most, as vLLM
        {"seed": -(2**63) - 1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"max_tokens": 0},
        {"seed": 1.5},
    ],
)
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
