"""A speculative step's host cost (issue 42): the n-gram lookup kept per request
(``NgramIndex``) equals the full scan (``propose_ngram``), and a speculative engine
whose lookups find nothing runs the plain engine's step: the same ops per step, and
nothing of ``speculative/`` but the lookup."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_fixtures import VOCAB, one_thread, save_tiny_model  # noqa: F401  (a fixture)
from hypothesis import given, settings
from hypothesis import strategies as st
from test_spec_rule_ops import step_costs

from unikv.engine.speculative.ngram import NgramIndex, propose_ngram


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=80),
    n_min=st.integers(1, 3),
    extra=st.integers(0, 2),
    k=st.integers(1, 5),
    split=st.integers(0, 80),
)
def test_index_equals_full_scan(tokens, n_min, extra, k, split):
    """After every appended token (the first ``split`` at once, through the bulk path
    when long), the index's draft is the full scan's; ``may_match_next`` is True
    exactly when some next token gives a draft."""
    n_max = n_min + extra
    index = NgramIndex(n_min, n_max)
    index.BULK = 4  # exercise the bulk path on short histories
    split = min(split, len(tokens))
    if split:
        index.extend(tokens[:split])
    for p in range(max(split, 1), len(tokens) + 1):
        if p > split:
            index.extend(tokens[p - 1 : p])
        history = np.asarray(tokens[:p], np.int64)
        assert index.propose(k) == propose_ngram(history, k, n_min, n_max).tolist()
        assert index.found() == bool(len(propose_ngram(history, k, n_min, n_max)))
        some = any(len(propose_ngram(np.append(history, t), k, n_min, n_max)) for t in range(4))
        assert index.may_match_next() == some


LOOKUP = {"Speculator.may_find", "Speculator.lookup"}  # the n-gram lookup's entries


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_step_without_drafts_is_the_plain_step(tmp_path, monkeypatch, device):
    """Two requests whose n-gram lookups (6-grams) find nothing: every step but the
    last (the requests leave the speculator) dispatches the plain engine's ops, one
    step in flight as it keeps, and enters ``speculative/`` only through the lookup
    (on CUDA: the ops launched outside the decode graphs, which both replay)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from unikv.engine import LLM, SamplingParams

    path = str(Path(tmp_path) / "llama")
    save_tiny_model("llama", path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randperm(VOCAB, generator=g)[:12].tolist() for _ in range(2)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = {"device": device, "dtype": torch.float32, "page_size": 4, "max_num_seqs": 4,
          "max_num_batched_tokens": 64, "max_model_len": 64, "kv_cache_bytes": 16 << 20}  # fmt: skip
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 6,
            "prompt_lookup_max": 6}  # fmt: skip
    plain_llm = LLM(path, **kw)
    plain = step_costs(plain_llm, prompts, params, monkeypatch)
    llm = LLM(path, speculative_config=spec, **kw)
    spec_costs = step_costs(llm, prompts, params, monkeypatch)
    assert llm.stats.spec_verify_steps == 0, "the test's premise: no lookup finds a draft"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)
    ]
    assert [c[:3] for c in spec_costs[:-1]] == [c[:3] for c in plain[:-1]]
    decodes = [c for c in spec_costs[:-1] if c[0] == "DECODE"]
    assert len(decodes) >= 7 and all(c[1] == 2 for c in decodes)
    for _, _, _, entered in decodes:
        assert set(entered) <= LOOKUP, f"a step without drafts entered {dict(entered)}"


def test_speculator_lookup_follows_the_request():
    """``Speculator.lookup`` / ``may_find`` on one request as a loop moves it: a step in
    flight (a ``Pending`` last token), its resolution, a cut of its outputs (a stop
    string); each draft equals ``propose_ngram`` of the history at that point."""
    from unikv.engine import SamplingParams
    from unikv.engine.request import Pending, Request
    from unikv.engine.speculative.config import speculative_config_of
    from unikv.engine.speculative.engine import Speculator

    keys = {"method": "ngram", "num_speculative_tokens": 3}
    config = speculative_config_of({**keys, "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    spec = Speculator(config, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=32, temperature=0.0)
    r = Request(0, [5, 6, 7, 8, 1, 2], params, 0, frozenset(), 64, output_ids=[5])

    def want(r) -> list[int]:
        history = np.asarray(r.prompt_ids + r.output_ids, np.int64)
        return propose_ngram(history, 3, 2, 3).tolist()

    def drafted(r) -> list[int]:  # the verify step's drafts (the lookup's, reused)
        drafts, ids, _ = spec.drafts([r], lambda num_new: num_new)
        assert ids.tolist() == [1 + len(drafts[0])]
        return drafts[0].tolist()

    def decoding(r):  # as a loop holds it: one token (maybe a placeholder) pending
        r.num_cached = r.seq_len - 1
        return [r]

    assert not spec.lookup(decoding(r)) and not spec.may_find(decoding(r))  # (5,): nothing
    r.output_ids.append(Pending.of(0))  # a step in flight: its token could be 6
    assert spec.may_find(decoding(r)) and not spec.lookup([r])  # (never reads a placeholder)
    r.num_cached = 0
    assert not spec.may_find([r])  # still prefilling: the step is no pure decode
    r.output_ids[-1] = 6
    assert spec.lookup(decoding(r)) and drafted(r) == want(r) == [7, 8, 1]
    r.output_ids.append(Pending.of(0))
    assert spec.may_find(decoding(r))  # (5, 6) was followed by 7
    r.output_ids[-1] = 9
    assert not spec.lookup(decoding(r)) and want(r) == []
    del r.output_ids[1:]  # a stop string cut the outputs: the index is rebuilt
    r.output_ids += [6, 7]
    assert spec.lookup(decoding(r)) and drafted(r) == want(r) == [8, 1, 2]
    spec.release(r, write=False)
    assert r.request_id not in spec.indexes


@pytest.mark.parametrize("counts", [(3, 3, 3), (3, 1, 2), (0, 2, 1)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_step_equals_a_naive_gather(counts, temperature):
    """``verify_step``'s one-upload block (a view of the logits when every request has
    K drafts) gives what the acceptance functions give on rows and drafts gathered
    one by one (request b's row j at ``start_b + min(j, n_b)``, drafts padded with 0)."""
    from types import SimpleNamespace

    from unikv.engine import SamplingParams
    from unikv.engine.speculative.step import verify_step
    from unikv.engine.speculative.verify import greedy_accept, rejection_accept

    g = torch.Generator().manual_seed(sum(counts) + int(temperature * 10))
    vocab, width = 11, max(counts)
    params = SamplingParams(temperature=temperature, top_k=5, top_p=0.9)
    reqs = [
        SimpleNamespace(params=params, seed=100 + b, output_ids=[1] * (2 + b))
        for b in range(len(counts))
    ]
    drafts = [torch.randint(0, vocab, (n,), generator=g).numpy() for n in counts]
    num_new = [1 + n for n in counts]
    batch = SimpleNamespace(requests=reqs, drafts=drafts, num_new=num_new, draft_tokens=None)
    logits = torch.randn(sum(num_new), vocab, generator=g)
    got = verify_step(batch, logits)
    starts = np.cumsum([0] + num_new[:-1])
    rows = [[s + min(j, n) for j in range(width + 1)] for s, n in zip(starts, counts)]
    scored = torch.stack([logits[r] for r in rows])
    padded = torch.zeros(len(counts), width, dtype=torch.int64)
    for b, d in enumerate(drafts):
        padded[b, : len(d)] = torch.from_numpy(d)
    num = torch.tensor(counts)
    if temperature == 0:
        want = greedy_accept(scored, padded, num)
    else:
        want = rejection_accept(
            scored, padded, num, temperature=torch.full((3,), temperature),
            top_k=torch.full((3,), 5), top_p=torch.full((3,), 0.9), min_p=None,
            seeds=torch.tensor([100, 101, 102]), steps=torch.tensor([2, 3, 4]),
        )  # fmt: skip
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
