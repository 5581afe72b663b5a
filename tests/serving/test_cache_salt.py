"""``cache_salt`` in the engine (vLLM's per-request field): requests with
different salts share no prefix-cache page; the same salt hits. Full attention
and a recurrent hybrid (its hit also needs a state checkpoint, found by the
salted chain).

Oracles: the first run, a miss computed from scratch (tokens of every later run,
hits included), and the hits of an unsalted repeat (a salted chain must not
serve it); the server test compares the text with transformers'."""

from __future__ import annotations

import pytest
from engine_fixtures import one_thread, save_tiny_hybrid, save_tiny_model  # noqa: F401

from unikv.engine import LLM, SamplingParams
from unikv.engine.inline import run_inline

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = list(range(10, 31))  # 21 tokens: 5 whole pages of 4


def _run(llm: LLM, salt: str | None) -> tuple[list[int], int]:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    group = llm.make_group(PROMPT, params, cache_salt=salt)
    run_inline(llm.engine, [group], False)
    request = group.requests[0]
    return list(request.output_ids), request.num_cached_tokens


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_salts_share_no_prefix_pages(tmp_path, kind):
    save = save_tiny_hybrid if kind == "qwen3_5" else save_tiny_model
    save(kind, str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", page_size=4, max_model_len=64, max_num_seqs=2,
              enable_prefix_caching=True)  # fmt: skip
    # (the hybrid keeps few state checkpoints: each repeat follows its first soon)
    runs = [_run(llm, salt) for salt in ("a", "b", "a", None, None)]
    assert [tokens for tokens, _ in runs] == [runs[0][0]] * 5 and len(runs[0][0]) == 4
    hits = [cached for _, cached in runs]
    assert hits[0] == hits[1] == hits[3] == 0  # a new salt (or none) hits nothing
    assert hits[2] > 0 and hits[4] > 0  # a repeat of one hits
    with pytest.raises(ValueError, match="cache_salt"):
        llm.make_group(PROMPT, SamplingParams(), cache_salt="")
