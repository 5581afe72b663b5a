"""Qwen3.5 and Qwen3-Next MTP drafts on a CUDA GPU (``pytest -m gpu``): the MTP layer's
K/V in the ``draft_full`` sub-pool, the target's hidden states exported inside its
decode and verify graphs, the Gated DeltaNet state per draft position in Triton.

- fp32: greedy tokens with ``mtp`` at k = 3 equal the same engine's without it, and
  the drafts equal a CPU run's of the same engine (near-ties aside: TF32 in the
  chunked recurrent kernels), so the rows the graphs wrote are the true ones.
- bf16, forced acceptance (built inside ``allow_forced_acceptance``): every verify
  step emits k + 1 tokens.
"""

from __future__ import annotations

import pytest
import torch
from qwen_mtp_fixtures import save_tiny_qwen_mtp

from unikv.engine import LLM, SamplingParams
from unikv.engine.speculative.config import allow_forced_acceptance

pytestmark = pytest.mark.gpu
SPEC = {"method": "mtp", "num_speculative_tokens": 3}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (30, 7, 18)]


def _spy(llm: LLM) -> list:
    seen, propose = [], llm.runner.draft.propose

    def spy(requests, counts, ids):
        out = propose(requests, counts, ids)  # on the device, request-major
        flat, at = out.tolist(), 0
        for r, n in zip(requests, counts.tolist()):
            seen.append((r.request_id, len(r.output_ids), flat[at : at + n]))
            at += n
        return out

    llm.runner.draft.propose = spy
    return seen


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_qwen_mtp_equals_plain_on_gpu(arch, page_size, tmp_path):
    save_tiny_qwen_mtp(arch, str(tmp_path))
    params = SamplingParams(max_tokens=24, temperature=0.0)
    drafts = {}
    for device in ("cpu", "cuda"):
        kw = {"device": device, "dtype": torch.float32, "page_size": page_size,
              "max_num_seqs": 8, "max_model_len": 128, "kv_cache_bytes": 64 << 20}  # fmt: skip
        want = [o.output_ids for o in LLM(str(tmp_path), **kw).generate(_prompts(), params)]
        llm = LLM(str(tmp_path), speculative_config=SPEC, **kw)
        assert "draft_full" in llm.pool.subpools
        seen = _spy(llm)
        assert [o.output_ids for o in llm.generate(_prompts(), params)] == want
        assert llm.stats.spec_draft_tokens > 0
        llm.alloc.check_integrity()
        drafts[device] = seen
    cpu, cuda = ({(r, n): d for r, n, d in drafts[x]} for x in ("cpu", "cuda"))
    same = sum(cuda.get(key) == d for key, d in cpu.items())  # (request, its outputs)
    assert same >= 0.9 * len(cpu), (same, len(cpu))


def test_qwen_mtp_forced_acceptance_on_gpu(tmp_path):
    save_tiny_qwen_mtp("qwen3_5", str(tmp_path))
    with allow_forced_acceptance():  # a benchmark mode, refused outside this block
        llm = LLM(str(tmp_path), device="cuda", dtype=torch.bfloat16, max_model_len=128,
                  kv_cache_bytes=64 << 20, speculative_config={**SPEC, "force_accept": True})  # fmt: skip
    out = llm.generate([_prompts()[1]], SamplingParams(max_tokens=33, temperature=0.0))
    assert len(out[0].output_ids) == 33
    assert llm.stats.spec_mean_accepted_length == 4.0 and llm.stats.spec_verify_steps == 8
    llm.alloc.check_integrity()
