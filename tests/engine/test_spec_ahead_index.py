"""A verify step planned ahead looks its candidates up in the request's kept n-gram
index (``NgramIndex.propose_ends``), not by a scan of its whole history each step:
the index's lookups equal the full scan's (``propose_ngram_ends``), and a pipelined
run scans no history window while it plans steps ahead."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_fixtures import VOCAB, hf_greedy, one_thread, save_tiny_model  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st

from unikv.engine import LLM, SamplingParams
from unikv.engine.speculative import ngram
from unikv.engine.speculative.ngram import NgramIndex, propose_ngram_ends


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    extra=st.lists(st.integers(0, 3), max_size=5),
    split=st.integers(1, 40),
    n_min=st.integers(1, 3),
    more=st.integers(0, 2),
    k=st.integers(1, 5),
)
def test_index_lookups_past_drafts_equal_the_full_scan(tokens, extra, split, n_min, more, k):
    """For each a, the lookup of the history plus ``extra[:a]`` (the drafts of the step
    in flight a step ahead may build on) equals ``propose_ngram_ends`` over the whole
    history (the index built in two parts, the first through the bulk path)."""
    index = NgramIndex(n_min, n_min + more)
    index.BULK = 4
    split = min(split, len(tokens))
    index.extend(tokens[:split])
    index.extend(tokens[split:])
    history = np.asarray(tokens + extra, np.int64)
    ends = list(range(len(tokens), len(history) + 1))
    want = propose_ngram_ends(history, ends, k, n_min, n_min + more)
    assert index.propose_ends(extra, k) == [w.tolist() for w in want]


@pytest.mark.usefixtures("one_thread")
def test_steps_planned_ahead_scan_no_history(tmp_path, monkeypatch):
    """Real n-gram drafts, three requests, pipelined: steps are planned ahead and kept,
    the tokens are transformers', and no history window is scanned (the lookups are
    the kept indexes'; the prompts are shorter than the index's bulk path)."""
    path = str(tmp_path / "llama")
    hf = save_tiny_model("llama", path)
    g = torch.Generator().manual_seed(9)
    items = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 13)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2, "pipeline": True}  # fmt: skip
    llm = LLM(path, device="cpu", dtype=torch.float32, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, max_model_len=96, speculative_config=spec)  # fmt: skip
    scans = []
    real = ngram.sliding_window_view
    monkeypatch.setattr(ngram, "sliding_window_view", lambda *a: scans.append(1) or real(*a))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = [o.output_ids for o in llm.generate(items, params)]
    assert got == [hf_greedy(hf, p, 40) for p in items]
    s = llm.stats
    assert s.spec_ahead_steps >= 4 and s.spec_ahead_dropped == 0
    assert not scans, f"{len(scans)} history scans while planning ahead"
