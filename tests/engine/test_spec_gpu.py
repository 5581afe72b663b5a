"""Speculative decoding on a CUDA GPU (``pytest -m gpu``): Triton kernels, CUDA-graph
decode steps between eager verify steps, fp32 (exact): greedy tokens with ngram
speculation at k = 3 equal the same engine's without it, for a tiny Llama and
gpt-oss (windows, sinks), with drafts both accepted and rejected; at bf16 the
forced-acceptance mode emits k + 1 tokens a verify step."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import VOCAB, save_tiny_model

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    pattern = torch.randint(0, VOCAB, (5,), generator=g).tolist()
    return [pattern * 4 + [7], torch.randint(0, VOCAB, (30,), generator=g).tolist(), [3, 4] * 9]


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_speculation_equals_plain_on_gpu(arch, page_size, tmp_path):
    save_tiny_model(arch, str(tmp_path))
    kw = {"device": "cuda", "dtype": torch.float32, "page_size": page_size, "max_num_seqs": 8,
          "max_model_len": 128, "kv_cache_bytes": 64 << 20}  # fmt: skip
    params = SamplingParams(max_tokens=40, temperature=0.0)
    want = [o.output_ids for o in LLM(str(tmp_path), **kw).generate(_prompts(), params)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(str(tmp_path), speculative_config=spec, **kw)
    assert [o.output_ids for o in llm.generate(_prompts(), params)] == want
    s = llm.stats
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens
    llm.alloc.check_integrity()


def test_forced_acceptance_on_gpu(tmp_path):
    save_tiny_model("llama", str(tmp_path))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "force_accept": True}
    from unikv.engine.speculative.config import allow_forced_acceptance

    with allow_forced_acceptance():  # a benchmark mode, refused outside this block
        llm = LLM(str(tmp_path), device="cuda", dtype=torch.bfloat16, speculative_config=spec,
                  max_model_len=128, kv_cache_bytes=64 << 20)  # fmt: skip
    out = llm.generate([_prompts()[1]], SamplingParams(max_tokens=33, temperature=0.0))
    assert len(out[0].output_ids) == 33
    assert llm.stats.spec_mean_accepted_length == 4.0 and llm.stats.spec_verify_steps == 8


@pytest.mark.parametrize("page_size", [1, 16])
def test_mtp_and_eagle3_equal_plain_on_gpu(page_size, tmp_path):
    """The draft heads over the target's exported hidden states (copied inside the
    decode and verify graphs): greedy tokens with ``mtp`` (tiny DeepSeek-V3, MiMo) and
    ``eagle3`` (tiny Llama, 6 layers) at k = 3 equal plain decoding's, and every
    draft equals the head's draft from a CPU run of the same engine (the rows the
    graphs wrote are the true ones)."""
    from mtp_fixtures import save_tiny_deepseek_mtp, save_tiny_eagle3, save_tiny_mimo_mtp

    save_tiny_deepseek_mtp(str(tmp_path / "ds"))
    save_tiny_mimo_mtp(str(tmp_path / "mimo"))
    hf = save_tiny_model("llama", str(tmp_path / "llama"), num_hidden_layers=6)
    save_tiny_eagle3(str(tmp_path / "head"), hf.config)
    cases = [
        ("ds", {"method": "mtp", "num_speculative_tokens": 3}),
        ("mimo", {"method": "mtp", "num_speculative_tokens": 3}),
        ("llama", {"method": "eagle3", "model": str(tmp_path / "head"),
                   "num_speculative_tokens": 3}),
    ]  # fmt: skip
    params = SamplingParams(max_tokens=40, temperature=0.0)
    for name, spec in cases:
        path = str(tmp_path / name)
        drafts = {}
        for device in ("cpu", "cuda"):
            kw = {"device": device, "dtype": torch.float32, "page_size": page_size,
                  "max_num_seqs": 8, "max_model_len": 128, "kv_cache_bytes": 64 << 20}  # fmt: skip
            want = [o.output_ids for o in LLM(path, **kw).generate(_prompts(), params)]
            llm = LLM(path, speculative_config=spec, **kw)
            seen, propose = [], llm.runner.draft.propose

            def spy(requests, counts, ids, seen=seen, propose=propose):
                out = propose(requests, counts, ids)  # on the device, request-major
                flat, at = out.tolist(), 0
                for r, n in zip(requests, counts.tolist()):
                    seen.append((r.request_id, len(r.output_ids), flat[at : at + n]))
                    at += n
                return out

            llm.runner.draft.propose = spy
            assert [o.output_ids for o in llm.generate(_prompts(), params)] == want
            assert llm.stats.spec_draft_tokens > 0
            llm.alloc.check_integrity()
            drafts[device] = seen
        cpu, cuda = ({(r, n): d for r, n, d in drafts[x]} for x in ("cpu", "cuda"))
        same = sum(cuda.get(key) == d for key, d in cpu.items())  # (request, its outputs)
        assert same >= 0.9 * len(cpu), (same, len(cpu))
