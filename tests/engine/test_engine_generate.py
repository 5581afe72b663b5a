"""The engine end to end on CPU (fp32, torch reference kernels) against
transformers on the same weights.

For Llama, Qwen3, Mistral (window 7) and gpt-oss (window 6, sinks, MoE):
greedy tokens identical to transformers' ``generate`` for 32 new tokens over a
batch of prompts of 3 to 45 tokens (longer than the windows), at page sizes 1,
4 and 16 (the windows are multiples of neither 4 nor 16), with chunked
prefill (16-token steps). Every logit row the engine sampled from is also
compared with transformers' teacher-forced logits at the same position:
max abs error < 1e-4 (fp32; logits have std ~0.8). A tight pool forces
preemption by recompute, with the same tokens.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    assert_pages_returned,
    hf_greedy,
    hf_logits,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_model,
)

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = ["llama", "qwen3", "mistral", "gpt_oss"]
PROMPT_LENS = [3, 17, 30, 45]
NEW_TOKENS = 32
ATOL = 1e-4


class Reference:
    """A saved tiny model, its prompts and transformers' greedy outputs."""

    def __init__(self, arch: str, path: str) -> None:
        self.arch, self.path = arch, path
        self.hf = save_tiny_model(arch, path)
        g = torch.Generator().manual_seed(7)
        self.prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
        self.greedy = [hf_greedy(self.hf, p, NEW_TOKENS) for p in self.prompts]


@pytest.fixture(scope="module", params=ARCHS)
def ref(request, tmp_path_factory) -> Reference:
    return Reference(request.param, str(tmp_path_factory.mktemp(request.param)))


class LogitRecorder:
    """Step hook: keeps the logits row of every sampled token, by (request, position)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, llm, batch, logits) -> None:
        for i, r in enumerate(batch.requests):
            if r.num_pending == 1:  # this step sampled r's newest token
                self.rows[(r.request_id, r.seq_len - 1)] = logits[i].clone()


def _check_logits(ref: Reference, llm: LLM, outputs, recorder: LogitRecorder) -> None:
    first_id = llm.requests.next_id - len(outputs)
    for k, out in enumerate(outputs):
        full = hf_logits(ref.hf, out.prompt_ids + out.output_ids)  # (L, V)
        rows = {p: row for (rid, p), row in recorder.rows.items() if rid == first_id + k}
        assert len(rows) == len(out.output_ids)
        for p, row in rows.items():
            err = (row - full[p - 1]).abs().max().item()
            assert err < ATOL, f"request {k} position {p}: logits differ by {err}"


def _llm(ref: Reference, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 16)
    kw.setdefault("max_model_len", 128)
    return LLM(ref.path, device="cpu", max_num_seqs=8, **kw)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_matches_transformers(ref, page_size):
    llm = _llm(ref, page_size=page_size)
    recorder = LogitRecorder()
    outputs = llm.generate(
        ref.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), on_step=recorder
    )
    assert [o.output_ids for o in outputs] == ref.greedy
    _check_logits(ref, llm, outputs, recorder)
    assert_pages_returned(llm)


def test_small_pool_preempts_or_recycles_with_same_tokens(ref):
    """A pool much smaller than the batch's prompt + output tokens. With a
    full-attention band, requests outgrow it and are preempted (recompute);
    Mistral's SWA-only pool is admitted by its window-bounded worst case, so it
    recycles window pages instead and never needs to preempt."""
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    configs = specs_from_hf_config(ref.path, page_size=4, dtype=torch.float32)
    pages = 10 if ref.arch == "mistral" else 30  # 40 or 120 tokens per band
    budget = pool_bytes_for(configs, {c.name: pages for c in configs})
    llm = _llm(ref, page_size=4, kv_cache_bytes=budget, max_model_len=80)
    outputs = llm.generate(ref.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert [o.output_ids for o in outputs] == ref.greedy
    served = sum(PROMPT_LENS) + len(PROMPT_LENS) * NEW_TOKENS
    entry = sum(s.spec.entry_bytes for s in llm.pool.subpools.values())  # one token, all layers
    assert served > llm.pool.total_bytes // entry
    if ref.arch == "mistral":
        assert llm.stats.preemptions == 0
    else:
        assert llm.stats.preemptions > 0
    llm.alloc.check_integrity()


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively (test_engine_gpu)")
@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_triton_kernels_under_the_interpreter(arch, tmp_path):
    """The engine on the Triton kernels (TRITON_INTERPRET=1 on CPU, set by
    conftest): same greedy tokens as transformers, windows and sinks included."""
    hf = save_tiny_model(arch, str(tmp_path))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (30, 3)]
    llm = LLM(
        str(tmp_path),
        device="cpu",
        backend="triton",
        page_size=4,
        max_model_len=64,
        max_num_batched_tokens=16,
    )
    assert llm.backend.name == "triton"
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert [o.output_ids for o in outputs] == [hf_greedy(hf, p, 8) for p in prompts]
