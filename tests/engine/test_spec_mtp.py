"""Speculative decoding with the checkpoint's own MTP layer (``method: "mtp"``) on a
tiny DeepSeek-V3 (MLA + MoE) checkpoint, and on a tiny MiMo-V2-Flash (its layout:
a sliding-window MTP layer), CPU fp32.

- Every draft the engine proposes equals transformers' ``MtpModel`` chain computed
  from scratch over the request's tokens: the target's final hidden states and the
  tokens after them, then the layer's own outputs for the chained drafts. This holds
  only if the MTP rows in the pool (``draft_mla``, written after every plain and
  verify step, rejected rows trimmed) are the true ones.
- Greedy outputs with ``mtp`` at k = 1 and 3 equal the same engine without
  speculation and transformers', at pages 1 and 16, with prefix caching (a second
  turn hits pages whose MTP rows were written too) and in a pool that preempts.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import assert_pages_returned, hf_greedy, one_thread  # noqa: F401
from mtp_fixtures import (
    hf_mtp,
    mimo_mtp_rows,
    mtp_rows,
    save_tiny_deepseek_mtp,
    save_tiny_mimo_mtp,
)

from unikv.engine import LLM, SamplingParams
from unikv.hf_config import specs_from_hf_config
from unikv.placement import pool_bytes_for, worst_case_pages

pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 14


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("deepseek_mtp"))
    save_tiny_deepseek_mtp(path)
    hf, mtp = hf_mtp(path)
    return path, hf, mtp


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(6)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 19, 12)]


def make_llm(path: str, k: int | None, ps: int, **kw) -> LLM:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64, **kw}
    return LLM(path, device="cpu", dtype=torch.float32, page_size=ps, debug=True,
               speculative_config=spec, **kw)  # fmt: skip


@torch.no_grad()
def oracle_drafts(hf, mtp, ids: list[int], count: int) -> list[int]:
    """transformers' MTP chain for a request whose tokens are ``ids`` (the last one
    pending): row j takes (h_j, ids[j + 1]); draft 1 from the last row; draft i + 1
    from a row of (the previous row's output, draft i)."""
    hidden = hf(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states[-1][0]
    tokens, drafts = ids[1:], []
    for _ in range(count):
        g = mtp_rows(hf, mtp, tokens, hidden)
        drafts.append(int(hf.lm_head(g[-1]).argmax()))
        tokens, hidden = tokens + drafts[-1:], torch.cat([hidden, g[-1:]])
    return drafts


def test_drafts_are_transformers_mtp_chain(checkpoint):
    path, hf, mtp = checkpoint
    llm = make_llm(path, 3, 4)
    assert set(llm.pool.subpools) == {"mla", "draft_mla"}
    seen = []
    propose = llm.runner.draft.propose

    def spy(requests, counts, virtual_ids):
        out = propose(requests, counts, virtual_ids)  # on the device, request-major
        flat, at = out.tolist(), 0
        for r, n in zip(requests, counts.tolist()):
            seen.append((r.prompt_ids + r.output_ids, flat[at : at + n]))
            at += n
        return out

    llm.runner.draft.propose = spy
    items = prompts()[:2]
    out = llm.generate(items, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert [o.output_ids for o in out] == [hf_greedy(hf, p, NEW_TOKENS) for p in items]
    assert len(seen) >= 8 and any(len(d) == 3 for _, d in seen)
    for ids, drafts in seen:
        assert drafts == oracle_drafts(hf, mtp, ids, len(drafts))
    assert_pages_returned(llm)


def test_mtp_greedy_equals_plain_decoding(checkpoint):
    path, hf, _ = checkpoint
    items, params = prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    plain = make_llm(path, None, 16)
    want = [o.output_ids for o in plain.generate(items, params)]
    assert want == [hf_greedy(hf, p, NEW_TOKENS) for p in items]

    llm = make_llm(path, 1, 1)
    assert [o.output_ids for o in llm.generate(items, params)] == want
    assert llm.stats.spec_draft_tokens > 0
    assert_pages_returned(llm)

    llm = make_llm(path, 3, 16, enable_prefix_caching=True)
    assert [o.output_ids for o in llm.generate(items, params)] == want
    turns = [p + w + [1] for p, w in zip(items, want)]
    again = llm.generate(turns, params)
    assert [o.output_ids for o in again] == [o.output_ids for o in plain.generate(turns, params)]
    assert max(o.num_cached_tokens for o in again) >= 16
    assert llm.stats.spec_draft_tokens > 0
    assert_pages_returned(llm)

    for k, ps in ((3, 1), (1, 16)):  # 1.5x one request's worst case: it preempts
        (config,) = specs_from_hf_config(path, page_size=ps, dtype=torch.float32)
        pages = 3 * (worst_case_pages(config.spec, ps, 64, 32) + 1) // 2
        llm = make_llm(path, k, ps, kv_cache_bytes=pool_bytes_for([config], {"mla": pages}))
        out = llm.generate(items + items[::-1], params)
        assert [o.output_ids for o in out] == want + want[::-1]
        assert llm.stats.preemptions > 0 and llm.stats.spec_draft_tokens > 0
        assert_pages_returned(llm)
    # swap preemption: the swapped request's MTP rows travel with its pages; its first
    # draft (kept per slot) is not trusted after it returns (it drafts nothing once)
    llm = make_llm(path, 3, 16, kv_cache_bytes=pool_bytes_for([config], {"mla": pages}),
                   preemption="swap", swap_host_bytes=1 << 22)  # fmt: skip
    assert [o.output_ids for o in llm.generate(items + items[::-1], params)] == want + want[::-1]
    assert llm.stats.preemptions > 0 and llm.stats.spec_draft_tokens > 0


@torch.no_grad()
def mimo_oracle_drafts(hf, block, mtp, ids: list[int], count: int) -> list[int]:
    """``oracle_drafts`` for MiMo-V2-Flash's MTP layer (``mtp_fixtures.mimo_mtp_rows``)."""
    hidden = hf(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states[-1][0]
    tokens, drafts = ids[1:], []
    for _ in range(count):
        g = mimo_mtp_rows(hf, block, mtp, tokens, hidden)
        drafts.append(int(hf.lm_head(g[-1]).argmax()))
        tokens, hidden = tokens + drafts[-1:], torch.cat([hidden, g[-1:]])
    return drafts


def test_mimo_mtp_drafts_and_outputs(tmp_path):
    """MiMo-V2-Flash (full + sliding layers, the MTP layer a sliding one whose K/V
    are a ``draft_swa`` sub-pool floating between the two bands): drafts equal the
    transformers-layer chain; greedy outputs equal plain decoding and transformers'
    at k = 3 (pages 4, prefix caching) and k = 1 (pages 1)."""
    path = str(tmp_path)
    hf, block, mtp = save_tiny_mimo_mtp(path)
    items, params = prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [o.output_ids for o in make_llm(path, None, 4).generate(items, params)]
    assert want == [hf_greedy(hf, p, NEW_TOKENS) for p in items]
    llm = make_llm(path, 3, 4, enable_prefix_caching=True)
    assert set(llm.pool.subpools) == {"full", "swa", "draft_swa"}
    seen, propose = [], llm.runner.draft.propose

    def spy(requests, counts, virtual_ids):
        out = propose(requests, counts, virtual_ids)  # on the device, request-major
        flat, at = out.tolist(), 0
        for r, n in zip(requests, counts.tolist()):
            seen.append((r.prompt_ids + r.output_ids, flat[at : at + n]))
            at += n
        return out

    llm.runner.draft.propose = spy
    assert [o.output_ids for o in llm.generate(items, params)] == want
    assert len(seen) >= 8 and any(len(d) == 3 for _, d in seen)
    for ids, drafts in seen[:12]:
        assert drafts == mimo_oracle_drafts(hf, block, mtp, ids, len(drafts))
    assert_pages_returned(llm)
    llm = make_llm(path, 1, 1)
    assert [o.output_ids for o in llm.generate(items, params)] == want
    assert llm.stats.spec_draft_tokens > 0
    assert_pages_returned(llm)
