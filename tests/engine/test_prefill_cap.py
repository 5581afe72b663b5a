"""``max_prefill_tokens_decoding``: while requests decode, a step's prefill rows
take at most that many tokens (an arriving prompt's prefill does not make one
decode step many times longer); a step of prefills alone takes the whole
``max_num_batched_tokens``.

Oracles: the rows of every planned batch, classified by a naive count of the
tokens each request was fed before (a row is prefill while fewer than its
prompt's tokens were fed), and transformers' greedy tokens for the same prompts
(``GreedyReference``).
"""

from __future__ import annotations

import pytest
from engine_fixtures import (
    GreedyReference,
    engine_llm,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_model,
)

from unikv.engine import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
BUDGET, CAP = 32, 5


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    hf = save_tiny_model("llama", path)
    return GreedyReference(hf, path, [30, 20, 25, 12, 17], new_tokens=6)


def _planned(llm) -> list[tuple[int, int]]:
    """Spy on the planner: per batch (decode rows, prefill tokens), by a naive count
    of the tokens each request was fed before."""
    fed: dict[int, int] = {}
    steps: list[tuple[int, int]] = []
    inner = llm.scheduler.schedule

    def spy():
        batch = inner()
        decodes = prefill = 0
        for r, n in zip(batch.requests, batch.num_new):
            before = fed.get(r.request_id, 0)
            if before < len(r.prompt_ids):
                prefill += n
            else:
                decodes += 1
            fed[r.request_id] = before + n
        steps.append((decodes, prefill))
        return batch

    llm.scheduler.schedule = spy
    return steps


def _run(ref, llm):
    steps = _planned(llm)
    params = SamplingParams(max_tokens=ref.new_tokens, temperature=0.0)
    outputs = llm.generate(ref.prompts, params)
    assert [o.output_ids for o in outputs] == ref.greedy  # transformers' tokens
    return steps


def test_prefill_capped_while_requests_decode(ref):
    llm = engine_llm(ref, max_num_batched_tokens=BUDGET, max_prefill_tokens_decoding=CAP,
                     enable_prefix_caching=False)  # fmt: skip
    steps = _run(ref, llm)
    mixed = [p for d, p in steps if d and p]
    assert mixed, "some step prefilled beside decodes (the case under test)"
    assert max(mixed) <= CAP, steps
    assert max(mixed) == CAP  # the cap is used, not just respected
    alone = [p for d, p in steps if not d]
    assert alone[0] == BUDGET  # prefills alone: the whole budget
    assert llm.scheduler.num_steps == len(steps)
    assert llm.scheduler.num_prefill_steps == sum(p > 0 for _, p in steps)


def test_without_the_cap_decodes_leave_prefill_the_rest_of_the_budget(ref):
    """The default (vLLM's ``max_num_batched_tokens``): decode rows first, prefill
    chunks up to the budget less those rows; the cap's run above plans more steps."""
    llm = engine_llm(ref, max_num_batched_tokens=BUDGET, enable_prefix_caching=False)
    steps = _run(ref, llm)
    mixed = [(d, p) for d, p in steps if d and p]
    assert mixed and max(p for _, p in mixed) > CAP
    assert all(d + p <= BUDGET for d, p in steps)
    assert any(d + p == BUDGET for d, p in mixed)  # a mixed step filled the budget
