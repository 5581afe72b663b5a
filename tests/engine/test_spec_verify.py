"""Speculative decoding's host and tensor pieces against independent derivations.

- n-gram proposals equal a plain Python search of the history (most recent earlier
  occurrence of the longest suffix in [n_min, n_max]);
- greedy acceptance equals a per-request loop over the drafts;
- rejection sampling keeps the target's distribution: over 40,000 seeds on a
  6-token vocabulary, the first emitted token's frequencies match the target's
  softmax, and the second's (given the first draft was accepted) match the second
  row's, by chi-square with a generous bound, for one-hot (n-gram) drafts and for a
  draft distribution, with temperature and top-k; both accepts and rejects occur.
- ``speculative_config`` validation: vLLM's keys, clear errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unikv.engine.speculative import speculative_config_of
from unikv.engine.speculative.ngram import propose_ngram
from unikv.engine.speculative.verify import greedy_accept, rejection_accept


def naive_ngram(history: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    size = len(history)
    for n in range(n_max, n_min - 1, -1):
        if n >= size:
            continue
        suffix = history[size - n :]
        for start in range(size - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + k]
    return []


def test_ngram_matches_a_plain_search():
    g = np.random.default_rng(0)
    for trial in range(300):
        size = int(g.integers(1, 40))
        hist = g.integers(0, 4 if trial % 2 else 3, size).tolist()
        k, lo = int(g.integers(1, 6)), int(g.integers(1, 4))
        hi = lo + int(g.integers(0, 3))
        got = propose_ngram(np.array(hist, np.int64), k, lo, hi).tolist()
        assert got == naive_ngram(hist, k, lo, hi), (hist, k, lo, hi)
    assert propose_ngram(np.array([1, 2, 3, 1, 2], np.int64), 3, 1, 2).tolist() == [3, 1, 2]


def test_greedy_accept_matches_a_loop():
    g = torch.Generator().manual_seed(1)
    bsz, width, vocab = 64, 4, 5
    logits = torch.randn(bsz, width + 1, vocab, generator=g)
    target = logits.argmax(-1)
    drafts = torch.where(
        torch.rand(bsz, width, generator=g) < 0.7,
        target[:, :-1],
        torch.randint(0, vocab, (bsz, width), generator=g),
    )
    num = torch.randint(0, width + 1, (bsz,), generator=g)
    tokens, accepted = greedy_accept(logits, drafts, num)
    for b in range(bsz):
        want = []
        for j in range(int(num[b])):
            if int(drafts[b, j]) != int(target[b, j]):
                break
            want.append(int(drafts[b, j]))
        want.append(int(target[b, len(want)]))
        assert int(accepted[b]) == len(want) - 1
        assert tokens[b, : len(want)].tolist() == want
        assert (tokens[b, len(want) :] == -1).all()
    assert 0 < int(accepted.sum()) < int(num.sum())


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("draft_dist", [False, True])
@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 4)])
def test_rejection_sampling_keeps_the_target_distribution(draft_dist, temperature, top_k):
    g = torch.Generator().manual_seed(2)
    n, vocab, width = 40_000, 6, 2
    row_logits = torch.randn(width + 1, vocab, generator=g) * 1.5
    logits = row_logits.expand(n, -1, -1).contiguous()
    second_best = int(row_logits[1].argsort()[-2])  # inside the top-k set
    drafts = torch.tensor([[int(row_logits[0].argmax()), second_best]]).expand(n, -1).contiguous()
    q = None
    if draft_dist:  # a draft model's distributions, the drafts drawn from them
        qrow = torch.softmax(torch.randn(width, vocab, generator=g), -1)
        q = qrow.expand(n, -1, -1).contiguous()
        drafts = torch.multinomial(qrow.repeat(n, 1), 1, generator=g).reshape(n, width)
    ones = torch.ones(n)
    tokens, accepted = rejection_accept(
        logits, drafts, torch.full((n,), width), temperature=ones * temperature,
        top_k=torch.full((n,), top_k), top_p=ones, min_p=None,
        seeds=torch.arange(n) * 7919 + 13, steps=torch.zeros(n, dtype=torch.long), draft_probs=q,
    )  # fmt: skip

    def target(row: int) -> torch.Tensor:  # the target's own sampling distribution
        x = row_logits[row] / temperature
        if top_k:
            x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
        return torch.softmax(x, -1)

    first = torch.bincount(tokens[:, 0], minlength=vocab).float()
    assert chi_square(first, target(0)) < 40, (first, target(0) * n)
    took = accepted >= 1  # the first draft accepted: the second token is row 1's sample
    second = torch.bincount(tokens[took, 1], minlength=vocab).float()
    assert took.sum() > 1000
    assert chi_square(second, target(1)) < 40, (second, target(1) * took.sum())
    assert 0 < int(accepted.sum()) < 2 * n  # accepts and rejects both happened
    assert (accepted < 2).any() and (accepted == 2).any()


def test_rejection_at_temperature_zero_is_greedy():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(32, 4, 7, generator=g)
    drafts = torch.randint(0, 7, (32, 3), generator=g)
    drafts[:16] = logits[:16, :3].argmax(-1)
    num = torch.randint(0, 4, (32,), generator=g)
    zeros = torch.zeros(32)
    got = rejection_accept(
        logits, drafts, num, temperature=zeros, top_k=torch.zeros(32, dtype=torch.long),
        top_p=zeros + 1, min_p=None, seeds=torch.arange(32), steps=torch.arange(32),
    )  # fmt: skip
    want = greedy_accept(logits, drafts, num)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_config_validation():
    cfg = speculative_config_of('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min) == ("ngram", 3, 5)
    cfg = speculative_config_of(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
    )
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)
    cfg = speculative_config_of({"model": "/x", "num_speculative_tokens": 2})  # vLLM's inference
    assert (cfg.method, cfg.model, cfg.disable_by_batch_size) == ("draft_model", "/x", 32)
    cases = [
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "must be an int >= 1"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "must be one of"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "force_accept": 1}, "must be a bool"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown keys ['k']"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2}, "must be <= prompt_lookup_max"),
        ("{not json", "must be a JSON object"),
        ([1], "must be a dict"),
    ]  # fmt: skip
    for value, message in cases:
        with pytest.raises(ValueError, match=None) as err:
            speculative_config_of(value)
        assert message in str(err.value), (value, str(err.value))


def test_forced_acceptance_takes_every_draft():
    """The benchmark mode: every draft accepted, then the target's argmax after it."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 4, 9, generator=g)
    drafts = torch.randint(0, 9, (8, 3), generator=g)
    num = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0])
    tokens, accepted = greedy_accept(logits, drafts, num, force=True)
    assert torch.equal(accepted, num)
    for b in range(8):
        n = int(num[b])
        assert tokens[b, :n].tolist() == drafts[b, :n].tolist()
        assert int(tokens[b, n]) == int(logits[b, n].argmax())
