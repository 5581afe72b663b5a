"""Speculative decoding with a draft model (``method: "draft_model"``) on CPU (fp32):
the draft's K/V live in ``draft_*`` sub-pools of the target's one pool.

- The target as its own draft: every greedy draft is accepted (acceptance exactly
  1), which holds only if the draft's K/V rows, written through the pool by its own
  forwards, are the target's: an independent check of the draft's cache.
- A perturbed copy of the target as the draft (some drafts accepted, some not):
  greedy tokens equal the same engine without speculation and transformers', at
  k = 1, 3 and 5 over page sizes 1, 4 and 16, with prefix caching (the next turns
  hit pages whose draft rows were written too) and in a pool that preempts.
- A Llama draft under gpt-oss (full + sliding window: the draft's band floats),
  DeepSeek-V3 (MLA) and MiMo targets: same tokens as without speculation.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    assert_pages_returned,
    hf_greedy,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_deepseek,
    save_tiny_model,
)

from unikv.engine import LLM, SamplingParams
from unikv.hf_config import specs_from_hf_config
from unikv.placement import pool_bytes_for, worst_case_pages

pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 16


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(6)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 19, 12)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """target llama, its perturbed copy (the draft), and the hf target."""
    target = str(tmp_path_factory.mktemp("llama"))
    hf = save_tiny_model("llama", target)
    draft = str(tmp_path_factory.mktemp("llama_draft"))
    hf_draft = save_tiny_model("llama", draft)
    with torch.no_grad():  # the target's weights, nudged: drafts agree often, not always
        g = torch.Generator().manual_seed(1)
        for p, q in zip(hf_draft.parameters(), hf.parameters()):
            p.copy_(q + torch.randn(q.shape, generator=g) * 0.01)
    hf_draft.save_pretrained(draft)
    return {"target": target, "draft": draft, "hf": hf}


def make_llm(path: str, draft: str | None, ps: int, k: int = 3, **kw) -> LLM:
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k} if draft else None
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64, **kw}
    return LLM(path, device="cpu", dtype=torch.float32, page_size=ps, debug=True,
               speculative_config=spec, **kw)  # fmt: skip


def test_target_as_its_own_draft_accepts_everything(models):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    llm = make_llm(models["target"], models["target"], 4, k=3)
    assert {"full", "draft_full"} == set(llm.pool.subpools)
    out = llm.generate(prompts(), params)
    assert [o.output_ids for o in out] == [
        hf_greedy(models["hf"], p, NEW_TOKENS) for p in prompts()
    ]
    s = llm.stats
    assert s.spec_verify_steps > 0 and s.spec_accepted_tokens == s.spec_draft_tokens > 0
    assert_pages_returned(llm)


def test_perturbed_draft_equals_plain_decoding(models):
    target, draft = models["target"], models["draft"]
    items, params = prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    plain = make_llm(target, None, 4)
    want = [o.output_ids for o in plain.generate(items, params)]
    assert want == [hf_greedy(models["hf"], p, NEW_TOKENS) for p in items]
    drafted = accepted = 0

    llm = make_llm(target, draft, 1, k=1)
    assert [o.output_ids for o in llm.generate(items, params)] == want
    drafted, accepted = (
        drafted + llm.stats.spec_draft_tokens,
        accepted + llm.stats.spec_accepted_tokens,
    )

    llm = make_llm(target, draft, 16, k=3, enable_prefix_caching=True)
    assert [o.output_ids for o in llm.generate(items, params)] == want
    drafted, accepted = (
        drafted + llm.stats.spec_draft_tokens,
        accepted + llm.stats.spec_accepted_tokens,
    )
    turns = [p + w + [1] for p, w in zip(items, want)]
    again = llm.generate(turns, params)
    assert [o.output_ids for o in again] == [o.output_ids for o in plain.generate(turns, params)]
    assert max(o.num_cached_tokens for o in again) >= 16
    assert llm.stats.spec_accepted_tokens > 0  # the hit pages' draft rows are the draft's
    assert_pages_returned(llm)

    configs = specs_from_hf_config(target, page_size=4, dtype=torch.float32)
    configs += specs_from_hf_config(draft, page_size=4, dtype=torch.float32)
    pages = worst_case_pages(configs[0].spec, 4, 64, 32) + 1
    budget = pool_bytes_for(configs[:1], {"full": 2 * pages})  # target + draft pages
    llm = make_llm(target, draft, 4, k=5, kv_cache_bytes=budget)
    out = llm.generate(items + items[::-1], params)
    assert [o.output_ids for o in out] == want + want[::-1]
    assert llm.stats.preemptions > 0
    drafted, accepted = (
        drafted + llm.stats.spec_draft_tokens,
        accepted + llm.stats.spec_accepted_tokens,
    )
    assert_pages_returned(llm)
    assert 0 < accepted < drafted


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "mimo"])
def test_llama_draft_under_other_families(models, family, tmp_path):
    path = str(tmp_path)
    if family == "gpt_oss":
        save_tiny_model("gpt_oss", path)
    elif family == "deepseek_v3":
        save_tiny_deepseek(3, path)
    else:
        from test_engine_mimo import save_tiny_mimo

        save_tiny_mimo(path)
    items, params = prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [o.output_ids for o in make_llm(path, None, 4).generate(items, params)]
    llm = make_llm(path, models["target"], 4, k=3)
    assert "draft_full" in llm.pool.subpools
    assert [o.output_ids for o in llm.generate(items, params)] == want
    assert llm.stats.spec_draft_tokens > llm.stats.spec_accepted_tokens
    assert_pages_returned(llm)


def test_stop_string_inside_a_verify_step(tmp_path):
    """Several tokens accepted in one step (the target as its own draft): a stop
    string one of them completes ends the outputs at that token, ids and text as
    decoding one token at a time gives them; an abort-free serving loop thread runs
    the same (``engine.start``)."""
    from serving_fixtures import save_instruct_llama

    path = str(tmp_path)
    save_instruct_llama(path)
    kw = {"device": "cpu", "dtype": torch.float32, "page_size": 4, "max_model_len": 96}
    plain = LLM(path, **kw)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 5}
    llm = LLM(path, speculative_config=spec, **kw)
    base = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    (free,) = plain.generate(["hello there"], base)
    tokenizer = plain.get_tokenizer()
    stops = []  # the first new text of a token at output 2 to 15 (not seen before it)
    for end in range(2, 16):
        before = tokenizer.decode(free.output_ids[:end])
        piece = tokenizer.decode(free.output_ids[: end + 1])[len(before) :]
        if piece.strip() and piece.isprintable() and piece not in before and len(stops) < 3:
            stops.append(piece)
    assert stops, "no usable stop string in the free run"
    for stop in stops:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
        (want,) = plain.generate(["hello there"], params)
        (got,) = llm.generate(["hello there"], params)
        assert got.output_ids == want.output_ids and got.outputs[0].text == want.outputs[0].text
        assert got.outputs[0].finish_reason == "stop"
        assert llm.stats.spec_mean_accepted_length > 2
    llm.engine.start()  # the serving loop's own thread
    try:
        (got,) = llm.generate(["hello there"], base)
    finally:
        llm.engine.shutdown()
    assert got.output_ids == free.output_ids
