"""Speculative decoding on recurrent hybrids on a CUDA GPU (``pytest -m gpu``): the
Triton recurrent kernels write the per-draft-position state slots, verify steps run
under CUDA graphs (drafts padded to k, padded lanes at the sink), fp32 (exact).

Greedy tokens with speculation at k = 3 equal the same engine's without it, which meets
transformers' (on the GPU, up to near-ties) for Qwen3.5 and NemotronH, at page sizes 1 and 16, drafts accepted and
rejected (``test_spec_recurrent.Oracle``), the verify steps replayed from graphs;
and at bf16 the forced-acceptance mode emits k + 1 tokens a verify step."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import VOCAB, hf_greedy, save_tiny_hybrid, save_tiny_nemotron_h
from gpu_fixtures import assert_greedy_up_to_ties
from test_spec_recurrent import Oracle, check_speculated

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
NEW_TOKENS = 24
FP32_TIE = 2e-3  # TF32 accumulation in fla's and the engine's chunked recurrent kernels


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (30, 7, 18)]


def _save(family: str, path: str):
    if family == "qwen3_5":
        return save_tiny_hybrid("qwen3_5", path)
    return save_tiny_nemotron_h(path, "M*M-M*-")


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_speculation_equals_plain_on_gpu(family, page_size, tmp_path):
    # transformers on the GPU: with fla-core installed its Gated DeltaNet runs fla's
    # Triton kernels, which take no CPU tensors (the H100 run at 6bbcfba); fla's chunked
    # kernels accumulate in TF32, so the plain engine meets it up to near-ties, and the
    # speculating engine must equal the plain one exactly
    hf = _save(family, str(tmp_path)).to("cuda")
    items = _prompts()
    hf_want = [hf_greedy(hf, p, NEW_TOKENS) for p in items]
    kw = {"device": "cuda", "dtype": torch.float32, "page_size": page_size, "max_num_seqs": 8,
          "max_model_len": 128, "kv_cache_bytes": 64 << 20}  # fmt: skip
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    plain = LLM(str(tmp_path), **kw).generate(items, params)
    assert_greedy_up_to_ties(hf, items, plain, hf_want, FP32_TIE)
    want = [o.output_ids for o in plain]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(str(tmp_path), speculative_config=spec, **kw)
    graphs = llm.runner.verify_graphs
    assert graphs is not None and graphs.graphs, "verify steps are captured"
    replays = []
    rows_for = graphs.rows_for
    graphs.rows_for = lambda batch: replays.append(rows_for(batch)) or replays[-1]
    Oracle(llm, {tuple(p): w for p, w in zip(items, want)})
    assert [o.output_ids for o in llm.generate(items, params)] == want
    check_speculated(llm)
    # (a verify step near max_tokens has fewer than k drafts: it runs eagerly)
    assert sum(r is not None for r in replays) > len(replays) // 2, "verify graphs replayed"
    llm.alloc.check_integrity()


def test_forced_acceptance_on_gpu(tmp_path):
    save_tiny_hybrid("qwen3_5", str(tmp_path))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "force_accept": True}
    from unikv.engine.speculative.config import allow_forced_acceptance

    with allow_forced_acceptance():  # a benchmark mode, refused outside this block
        llm = LLM(str(tmp_path), device="cuda", dtype=torch.bfloat16, speculative_config=spec,
                  max_model_len=128, kv_cache_bytes=64 << 20)  # fmt: skip
    out = llm.generate([_prompts()[0]], SamplingParams(max_tokens=33, temperature=0.0))
    assert len(out[0].output_ids) == 33
    assert llm.stats.spec_mean_accepted_length == 4.0 and llm.stats.spec_verify_steps == 8
