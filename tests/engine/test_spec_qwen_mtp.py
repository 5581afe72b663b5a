"""Speculative decoding with the checkpoint's own MTP layer (``method: "mtp"``) on
tiny Qwen3.5 (dense, MoE) and Qwen3-Next checkpoints (Gated DeltaNet + gated
attention; the MTP layer a gated full-attention layer whose K/V are a ``draft_full``
sub-pool of the same pool), CPU fp32.

- Every draft the engine proposes equals the MTP chain computed from scratch: the
  target's final hidden states from transformers, then the layer written from the
  checkpoint's tensors (``qwen_mtp_fixtures.qwen_mtp_rows``). This holds only if
  the MTP rows in the pool (written after every plain and verify step, rejected
  rows trimmed) are the true ones.
- Greedy outputs with ``mtp`` equal the same engine without speculation and
  transformers'. A random MTP layer's drafts are all rejected; a steered run puts
  the true tokens in the first j drafts, so verify steps accept in part and the
  chain is checked after each partial accept.
- Forced acceptance (a benchmark mode: every draft accepted, so the tokens are not
  the model's) runs only inside ``allow_forced_acceptance``; there every draft is
  accepted and the drafts still equal the chain over the tokens the request holds.
- Under preemption (recompute, swap: the MTP rows travel with the pages) the
  outputs are unchanged.
- The batch-size rule (``speculative_disable_by_batch_size``): no step with more
  decoding requests than the limit drafts; the tokens are unchanged.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import assert_pages_returned, hf_greedy, one_thread  # noqa: F401
from qwen_mtp_fixtures import ARCHS, qwen_mtp_rows, save_tiny_qwen_mtp

from unikv.engine import LLM, SamplingParams
from unikv.engine.speculative.config import allow_forced_acceptance

pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """arch -> (path, transformers model, MTP block, MTP tensors), made once each."""
    out = {}

    def get(arch: str):
        if arch not in out:
            path = str(tmp_path_factory.mktemp(arch))
            out[arch] = (path, *save_tiny_qwen_mtp(arch, path))
        return out[arch]

    return get


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(6)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 19, 12)]


def make_llm(path: str, k: int | None, ps: int, **kw) -> LLM:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    if k and kw.pop("force", False):
        spec["force_accept"] = True
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64, **kw}
    return LLM(path, device="cpu", dtype=torch.float32, page_size=ps, debug=True,
               speculative_config=spec, **kw)  # fmt: skip


@torch.no_grad()
def one_request_pool(path: str, k: int, ps: int, length: int) -> int:
    """Pool bytes for one request of ``length`` tokens (the MTP layer's ``draft_full``
    as many pages) and two requests' state slots with their k draft positions each."""
    from unikv.engine.speculative.mtp import mtp_subpool_configs
    from unikv.hf_config import specs_from_hf_config
    from unikv.placement import pool_bytes_for, worst_case_pages

    configs = specs_from_hf_config(path, page_size=ps, dtype=torch.float32)
    configs += mtp_subpool_configs(configs, "full")
    pages = {  # (pool_bytes_for adds one page or slot to each)
        c.name: 2 * (1 + k) - 1 if c.spec.kind == "mamba" else
        worst_case_pages(c.spec, ps, length, 32) - 1
        for c in configs
    }  # fmt: skip
    return pool_bytes_for(configs, pages)


def oracle_drafts(hf, block, mtp, ids: list[int], count: int) -> list[int]:
    """The MTP chain for a request whose tokens are ``ids`` (the last one pending):
    row j takes (h_j, ids[j + 1]); draft 1 from the last row; draft i + 1 from a row
    of (the previous row's output, draft i)."""
    hidden = hf.model(torch.tensor([ids[:-1]])).last_hidden_state[0]
    tokens, drafts = ids[1:], []
    for _ in range(count):
        g = qwen_mtp_rows(hf, block, mtp, tokens, hidden)
        drafts.append(int(hf.lm_head(g[-1]).argmax()))
        tokens, hidden = tokens + drafts[-1:], torch.cat([hidden, g[-1:]])
    return drafts


def spy_drafts(llm: LLM) -> list:
    """Record (the request's tokens, its drafts) of every proposal, and the number
    of requests of each proposing step."""
    seen, propose = [], llm.runner.draft.propose

    def spy(requests, counts, virtual_ids):
        out = propose(requests, counts, virtual_ids)  # on the device, request-major
        flat, at = out.tolist(), 0
        for r, n in zip(requests, counts.tolist()):
            seen.append((r.prompt_ids + r.output_ids, flat[at : at + n], len(requests)))
            at += n
        return out

    llm.runner.draft.propose = spy
    return seen


@pytest.mark.parametrize("arch", ARCHS)
def test_qwen_mtp_drafts_and_greedy_outputs(arch, saved):
    """k = 3, pages 4: drafts equal the from-scratch chain; greedy outputs equal
    plain decoding's and transformers'."""
    path, hf, block, mtp = saved(arch)
    items, params = prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [o.output_ids for o in make_llm(path, None, 4).generate(items, params)]
    assert want == [hf_greedy(hf, p, NEW_TOKENS) for p in items]
    llm = make_llm(path, 3, 4)
    assert set(llm.pool.subpools) == {"full", "mamba", "draft_full"}
    seen = spy_drafts(llm)
    assert [o.output_ids for o in llm.generate(items, params)] == want
    assert llm.stats.spec_draft_tokens > 0
    assert len(seen) >= 6 and any(len(d) == 3 for _, d, _ in seen)
    for ids, drafts, _ in seen[:8]:
        assert drafts == oracle_drafts(hf, block, mtp, ids, len(drafts))
    assert_pages_returned(llm)


def test_qwen_mtp_k1_pages1_and_prefix_hit(saved):
    """k = 1 at pages 1, then k = 3 with prefix caching: a second turn over the
    first's outputs hits cached pages (its MTP rows were written too) and still
    decodes as plain decoding does."""
    path = saved("qwen3_5")[0]
    items, params = prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    plain = make_llm(path, None, 4, enable_prefix_caching=True)
    want = [o.output_ids for o in plain.generate(items, params)]
    llm = make_llm(path, 1, 1)
    assert [o.output_ids for o in llm.generate(items, params)] == want
    assert llm.stats.spec_draft_tokens > 0
    assert_pages_returned(llm)
    llm = make_llm(path, 3, 4, enable_prefix_caching=True)
    assert [o.output_ids for o in llm.generate(items, params)] == want
    turns = [p + w + [1] for p, w in zip(items, want)]
    again = llm.generate(turns, params)
    assert [o.output_ids for o in again] == [o.output_ids for o in plain.generate(turns, params)]
    assert min(o.num_cached_tokens for o in again) >= 16  # every turn hit its first
    assert llm.stats.spec_draft_tokens > 0


def test_qwen_mtp_partial_acceptance(saved):
    """Drafts accepted in part: each proposal's first j drafts (j cycling over
    0 .. k - 1; all k: the forced test) are replaced by the true next tokens, so
    verify steps keep j + 1 rows or more and trim the rest (the MTP rows and the
    state slots with them). Outputs equal plain
    decoding's, and the MTP's own drafts of every next step still equal the chain
    over the tokens held (the rows kept after a partial accept are the true ones)."""
    path, hf, block, mtp = saved("qwen3_5")
    items, params = prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [o.output_ids for o in make_llm(path, None, 4).generate(items, params)]
    truth = {tuple(p): w for p, w in zip(items, want)}
    llm = make_llm(path, 3, 4)
    seen, propose = [], llm.runner.draft.propose

    def steer(requests, counts, virtual_ids):
        out = propose(requests, counts, virtual_ids)
        flat, at = out.tolist(), 0
        steered = list(flat)
        for r, n in zip(requests, counts.tolist()):
            seen.append((r.prompt_ids + r.output_ids, flat[at : at + n]))
            m = len(r.output_ids)  # the pending token is output m - 1
            good = truth[tuple(r.prompt_ids)][m : m + (m % n if n else 0)]
            steered[at : at + len(good)] = good
            at += n
        return torch.tensor(steered, dtype=out.dtype, device=out.device)

    llm.runner.draft.propose = steer
    assert [o.output_ids for o in llm.generate(items, params)] == want
    s = llm.stats
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens
    for ids, drafts in seen:
        assert drafts == oracle_drafts(hf, block, mtp, ids, len(drafts))
    assert_pages_returned(llm)


@pytest.mark.parametrize("moe", [False, True])
def test_qwen_mtp_on_the_multimodal_checkpoint(moe, tmp_path):
    """The released Qwen3.5 checkpoints are multimodal wrappers (the decoder under
    ``model.language_model.``, ``mtp.*`` at the top): the MTP layer loads from there
    and greedy text outputs equal plain decoding's."""
    path = str(tmp_path)
    save_tiny_qwen_mtp("qwen3_5_moe" if moe else "qwen3_5", path, mm=True)
    items, params = prompts()[:2], SamplingParams(max_tokens=8, temperature=0.0)
    want = [o.output_ids for o in make_llm(path, None, 4).generate(items, params)]
    llm = make_llm(path, 3, 4)
    assert "draft_full" in llm.pool.subpools
    assert [o.output_ids for o in llm.generate(items, params)] == want
    assert llm.stats.spec_draft_tokens > 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_qwen_mtp_under_preemption(saved, preemption):
    """A pool of one request's pages (the MTP layer's ``draft_full`` as many) and two
    requests' state slots: requests are preempted (recomputed, or swapped with their
    MTP rows) and the outputs still equal plain decoding's."""
    path, k, ps, length = saved("qwen3_5")[0], 3, 4, 40
    items, params = prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [o.output_ids for o in make_llm(path, None, ps).generate(items, params)]
    kw = {"kv_cache_bytes": one_request_pool(path, k, ps, length), "max_model_len": length,
          "preemption": preemption}  # fmt: skip
    if preemption == "swap":
        kw["swap_host_bytes"] = 1 << 22
    llm = make_llm(path, k, ps, **kw)
    out = llm.generate(items + items[::-1], params)
    assert [o.output_ids for o in out] == want + want[::-1]
    s = llm.stats
    assert s.preemptions > 0 and s.spec_draft_tokens > 0
    if preemption == "swap":
        assert s.swapped_out > 0 and s.swapped_in > 0
    assert_pages_returned(llm)


def test_forced_acceptance_is_a_benchmark_mode(saved):
    """Refused by LLM (and EngineConfig, and ``unikv serve``'s parser) outside
    ``allow_forced_acceptance``; inside, every MTP draft is accepted (k + 1 tokens
    a verify step) and each draft is still the chain over the request's tokens."""
    from unikv.engine.config import EngineConfig
    from unikv.serving.cli import _parser

    path, hf, block, mtp = saved("qwen3_5")
    with pytest.raises(ValueError, match="benchmark-only mode"):
        make_llm(path, 3, 4, force=True)
    forced = '{"method": "mtp", "num_speculative_tokens": 3, "force_accept": true}'
    args = _parser().parse_args(["--model", path, "--speculative-config", forced])
    with pytest.raises(ValueError, match="benchmark-only mode"):
        EngineConfig.from_cli(args)
    with allow_forced_acceptance():
        llm = make_llm(path, 3, 4, force=True)
    seen = spy_drafts(llm)
    out = llm.generate([prompts()[0]], SamplingParams(max_tokens=13, temperature=0.0))
    assert len(out[0].output_ids) == 13
    s = llm.stats
    assert s.spec_verify_steps == 3 and s.spec_mean_accepted_length == 4.0
    assert out[0].output_ids[1:4] == seen[0][1]  # the first drafts, all kept
    for ids, drafts, _ in seen:
        assert drafts == oracle_drafts(hf, block, mtp, ids, len(drafts))
    assert_pages_returned(llm)


def test_batch_size_rule_through_the_engine_option(saved):
    """``speculative_disable_by_batch_size=2`` (the config's default is 32): steps
    with three decoding requests draft nothing (counted), steps with two or one do;
    tokens equal plain decoding's."""
    path, _, _, _ = saved("qwen3_next")
    items = prompts()
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (4, 8, 14)]
    want = [o.output_ids for o in make_llm(path, None, 4).generate(items, params)]
    llm = make_llm(path, 3, 4, speculative_disable_by_batch_size=2)
    assert llm.speculative_config.disable_by_batch_size == 2
    seen = spy_drafts(llm)
    assert [o.output_ids for o in llm.generate(items, params)] == want
    assert llm.scheduler.spec.counters.skipped_by_batch_size > 0
    assert seen and max(n for _, _, n in seen) <= 2
