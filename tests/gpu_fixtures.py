"""Shared pieces of the engine's GPU tests (``-m gpu``): seeded prompts,
transformers' models on the GPU (eager attention: its SDPA path drops Gemma-2's
soft-capping; eager experts), teacher-forced logits, and the per-token record of
a bf16 run against transformers in bf16 and fp32."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from engine_fixtures import VOCAB


def seeded_prompts(lens: list[int], seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def hf_model(path: str, dtype: torch.dtype):
    """transformers' model of the checkpoint at ``path`` on the GPU, eval mode."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )
    return model.cuda().eval()


def teacher_forced(hf, seq: list[int]) -> torch.Tensor:
    """(len(seq), vocab) fp32 logits of one full forward over ``seq``, on the host."""
    with torch.no_grad():
        return hf(torch.tensor([seq]).cuda()).logits[0].float().cpu()


@dataclass
class TokenCheck:
    """One engine token of a bf16 run, against transformers over the same sequence:
    max |logit difference| of the engine's row to transformers-fp32 and to
    transformers-bf16, transformers-bf16's own to fp32, and how far the engine's
    token lies below transformers-bf16's argmax (0 = the same token)."""

    request: int
    index: int
    ours_vs_fp32: float
    ours_vs_bf16: float
    hf16_vs_fp32: float
    gap: float


def bf16_token_checks(llm, hf16, hf32, prompts, max_tokens: int) -> list[TokenCheck]:
    """Generate greedily on ``llm`` (bf16) recording the logit row of every sampled
    token, then compare each with transformers' teacher-forced rows."""
    from unikv.engine import SamplingParams

    rows = {}

    def record(llm, batch, logits):
        for i, r in enumerate(batch.requests):
            if r.num_pending == 1:
                rows[(r.request_id, r.seq_len - 1)] = logits[i].float().cpu()

    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens), on_step=record)
    first = llm._next_id - len(outputs)
    checks = []
    for k, out in enumerate(outputs):
        seq = out.prompt_ids + out.output_ids
        ref16, ref32 = teacher_forced(hf16, seq), teacher_forced(hf32, seq)
        for j, token in enumerate(out.output_ids):
            p = len(out.prompt_ids) + j
            ours, r16, r32 = rows[(first + k, p)], ref16[p - 1], ref32[p - 1]
            checks.append(
                TokenCheck(
                    k,
                    j,
                    (ours - r32).abs().max().item(),
                    (ours - r16).abs().max().item(),
                    (r16 - r32).abs().max().item(),
                    (r16.max() - r16[token]).item(),
                )
            )
    return checks


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)
