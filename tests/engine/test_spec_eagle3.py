"""Speculative decoding with an EAGLE-3 head (``method: "eagle3"``) on a tiny Llama
(6 layers), CPU fp32. The head is random, saved in the released layout
(``mtp_fixtures.save_tiny_eagle3``: fc, midlayer.*, norm, lm_head over a draft
vocabulary of 128 with ``d2t`` onto a random half of the target's 256 ids).

- The head's logits over a sequence equal a direct torch computation of the layer
  (``mtp_fixtures.eagle3_rows``: norms, q/k/v over [embedding | hidden], rope,
  causal GQA softmax, o_proj, SwiGLU, written out) on the target's hidden states
  from transformers (the residual streams entering layers 2, 3 and 3).
- Every draft the engine proposes equals that computation's chain (fc of the
  target's three hidden states, then the head's own outputs), which holds only if
  the head's rows in the pool (``draft_full``) are the true ones.
- Greedy outputs at k = 1 and 3 equal the engine without speculation and
  transformers', with prefix caching on, at pages 1 and 16.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import assert_pages_returned, hf_greedy, one_thread, save_tiny_model  # noqa: F401
from mtp_fixtures import eagle3_rows, eagle3_token, save_tiny_eagle3

from unikv.engine import LLM, SamplingParams
from unikv.kernels.backend import get_backend
from unikv.models.eagle3 import load_eagle3
from unikv.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 14
AUX = (2, 3, 3)  # (2, L // 2, L - 3) for L = 6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    target = str(tmp_path_factory.mktemp("llama6"))
    hf = save_tiny_model("llama", target, num_hidden_layers=6)
    head = str(tmp_path_factory.mktemp("eagle3"))
    return target, hf, head, save_tiny_eagle3(head, hf.config)


def make_llm(saved, k: int | None, ps: int, **kw) -> LLM:
    target, _, head, _ = saved
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k} if k else None
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64, **kw}
    return LLM(target, device="cpu", dtype=torch.float32, page_size=ps, debug=True,
               speculative_config=spec, **kw)  # fmt: skip


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(6)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 19, 12)]


@torch.no_grad()
def aux_hidden(hf, ids: list[int]) -> torch.Tensor:
    """The target's residual streams entering layers AUX, concatenated (T, 3 * hidden)."""
    states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in AUX], dim=-1)


class DenseAttention:
    """Causal attention over one whole sequence (q, k already rotated)."""

    def __call__(self, layer, q, k, v, sinks=None):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
        n = q.shape[0]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


@torch.no_grad()
def test_head_logits_match_a_direct_computation(saved):
    target_dir, hf, head_dir, t = saved
    target = load_model(target_dir)
    head = load_eagle3(head_dir, target, 64)
    assert head.export_layers == AUX
    ids = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    aux = aux_hidden(hf, ids)[:-1]
    embeds = target.model.embed_tokens(torch.tensor(ids[1:]))
    eps = hf.config.rms_norm_eps
    want = eagle3_rows(t, embeds, aux @ t["fc.weight"].T, eps)
    got = head(embeds, head.project(aux), torch.arange(len(ids) - 1), DenseAttention())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    logits = head.lm_head(head.norm(got))
    want_logits = (want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + eps)) * t["norm.weight"]
    torch.testing.assert_close(logits, want_logits @ t["lm_head.weight"].T, rtol=1e-4, atol=1e-4)
    tokens = head.tokens(got, target, get_backend("cpu", "torch"))
    assert tokens.tolist() == [eagle3_token(t, row, eps) for row in want]


@torch.no_grad()
def oracle_drafts(hf, t: dict, ids: list[int], count: int, holes=()) -> list[int]:
    """The head's chain for a request whose tokens are ``ids`` (the last pending);
    ``holes``: positions whose K/V read as zeros (``eagle3_rows``)."""
    eps = hf.config.rms_norm_eps
    hidden = aux_hidden(hf, ids[:-1]) @ t["fc.weight"].T
    tokens, drafts = ids[1:], []
    for _ in range(count):
        embeds = hf.model.embed_tokens(torch.tensor(tokens))
        g = eagle3_rows(t, embeds, hidden, eps, holes=holes)
        drafts.append(eagle3_token(t, g[-1], eps))
        tokens, hidden = tokens + drafts[-1:], torch.cat([hidden, g[-1:]])
    return drafts


def test_drafts_are_the_heads_chain(saved):
    _, hf, _, t = saved
    llm = make_llm(saved, 3, 4)
    assert set(llm.pool.subpools) == {"full", "draft_full"}
    seen, propose = [], llm.runner.draft.propose

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
        assert drafts == oracle_drafts(hf, t, ids, len(drafts))
    assert_pages_returned(llm)


def test_eagle3_greedy_equals_plain_decoding(saved):
    _, hf, _, _ = saved
    items, params = prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    plain = make_llm(saved, None, 16)
    want = [o.output_ids for o in plain.generate(items, params)]
    assert want == [hf_greedy(hf, p, NEW_TOKENS) for p in items]
    for k, ps in ((1, 1), (3, 16)):
        llm = make_llm(saved, k, ps, enable_prefix_caching=True)
        assert [o.output_ids for o in llm.generate(items, params)] == want
        turns = [p + w + [1] for p, w in zip(items, want)]
        again = llm.generate(turns, params)
        assert [o.output_ids for o in again] == [
            o.output_ids for o in plain.generate(turns, params)
        ]
        assert max(o.num_cached_tokens for o in again) >= 16
        assert llm.stats.spec_draft_tokens > 0
        assert_pages_returned(llm)
