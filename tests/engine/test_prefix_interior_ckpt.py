"""Prompt-end checkpoints taken inside a prefill chunk (issue 41): a prompt's last chunk
runs on past its last whole page, the recurrent ops write the state after that row
into the reserved checkpoint slot (``StepPlan.ckpt_at``), and later prompts hit it.

End to end on CPU (fp32, torch reference kernels): tiny Qwen3.5 and Qwen3-Next (Gated
DeltaNet) and NemotronH (Mamba-2), pages 1, 4 and 16, a step budget (13 tokens) that
cuts prompts mid-page. Greedy tokens with the cache (a first run, then a second whose
prompts hit) equal transformers' ``generate`` on the same weights (the independent
oracle) and the run without the cache; the second run hits every prompt's whole pages;
some of the steps carried a checkpoint row inside a chunk (a spy on the planner's
``checkpoint_rows``), so the hits restored checkpoints written there.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import (  # noqa: F401
    VOCAB,
    hf_greedy,
    one_thread,
    save_tiny_hybrid,
    save_tiny_nemotron_h,
)
from prefix_fixtures import prefix_llm

from unikv.engine import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 4
BUDGET = 13  # tokens a step: chunks end mid-page


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next", "nemotron_h"])
def model(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    if request.param == "nemotron_h":
        return path, save_tiny_nemotron_h(path, "M*M-")
    return path, save_tiny_hybrid(request.param, path)


def _prompts(ps: int) -> list[list[int]]:
    """A repeat pair over a shared head, a longer extension, and an unrelated prompt:
    lengths off the page grid, so each prompt's last whole page lies inside a chunk."""
    g = torch.Generator().manual_seed(ps)
    head = torch.randint(0, VOCAB, (2 * ps + 3,), generator=g).tolist()
    tail = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()
    return [head + tail(ps + 2), head + tail(3), head + tail(2 * ps + 1), tail(3 * ps + 2)]


class RowSpy:
    """Counts the steps whose plan carries checkpoint rows inside their chunks."""

    def __init__(self, llm) -> None:
        prefix = llm.alloc.prefix
        rows = prefix.checkpoint_rows
        self.inside = 0

        def spied(*args, **kwargs):
            out = rows(*args, **kwargs)
            if out is not None and out[1] is not None:
                self.inside += int((out[2] >= 0).sum())
            return out

        prefix.checkpoint_rows = spied


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_hits_after_checkpoints_inside_chunks_give_transformers_tokens(model, ps):
    path, hf = model
    prompts = _prompts(ps)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    kw = {"max_num_batched_tokens": BUDGET, "max_model_len": 96}
    plain = prefix_llm(path, ps, False, **kw).generate(prompts, params)
    assert [o.output_ids for o in plain] == want
    llm = prefix_llm(path, ps, True, **kw)
    spy = RowSpy(llm)
    first = llm.generate(prompts, params)
    assert [o.output_ids for o in first] == want
    assert spy.inside > 0, "some checkpoints were written inside their chunk"
    again = llm.generate(prompts, params)
    assert [o.output_ids for o in again] == want
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // ps * ps for p in prompts]
    assert not llm.alloc.parts.prefix.states.direct, "no reservation outlives its step"
    llm.alloc.check_integrity()
