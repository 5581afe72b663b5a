"""A long fresh prompt through the engine on the H200: its prefill step runs the Gluon
attention (``kernels/attention/fresh_hopper.py``, taken from ``MIN_Q_LEN`` tokens), and the
run is checked against transformers on the same weights (``pytest -m gpu``).

The tiny models get head dim 128 (the kernel takes 128 from 1,024 tokens, 64 from
8,192) and room for a 2,100-token prompt in one chunk. gpt-oss's full-attention layers carry its sinks
(its sliding layers keep the Triton kernel). The check is teacher-forced, as in
``test_engine_gpu``: every token is its row's argmax, within a near-tie of
transformers-bf16's argmax (Llama), and the engine's bf16 rows are as close to
transformers-fp32 as transformers-bf16's own (1.5x + 0.02).
"""

from __future__ import annotations

import pytest
import torch
from gpu_fixtures import gpu_llm, seeded_prompts, teacher_forced

pytestmark = pytest.mark.gpu

PROMPT, NEW, CHUNK = 2100, 6, 2304
OVERRIDES = {
    "llama": {"hidden_size": 512, "max_position_embeddings": 4096},  # 4 heads of 128
    "gpt_oss": {"head_dim": 128, "max_position_embeddings": 4096},
}


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="the Gluon attention runs on sm_90 only",
)
@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_long_fresh_prompt_through_the_hopper_attention(arch, tmp_path, monkeypatch):
    import transformers as tf
    from engine_fixtures import save_tiny_model

    from unikv.engine import SamplingParams
    from unikv.kernels.attention import fresh_hopper as extend_hopper

    save_tiny_model(arch, str(tmp_path), **OVERRIDES[arch])
    calls = []
    real = extend_hopper.fresh_attention
    monkeypatch.setattr(
        extend_hopper, "fresh_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    rows = {}

    def record(llm, batch, logits):
        for i, r in enumerate(batch.requests):
            if r.num_pending == 1:
                rows[r.seq_len - 1] = logits[i].float().cpu()

    llm = gpu_llm(str(tmp_path), torch.bfloat16, max_num_seqs=1, max_model_len=CHUNK,
                  max_num_batched_tokens=CHUNK)  # fmt: skip
    prompt = seeded_prompts([PROMPT])[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW, temperature=0.0), on_step=record)[0]
    assert calls, "the 2,100-token prefill never ran the Hopper attention"
    seq = out.prompt_ids + out.output_ids

    def hf(dtype):
        kw = {"experts_implementation": "eager"} if arch == "gpt_oss" else {}
        model = tf.AutoModelForCausalLM.from_pretrained(
            str(tmp_path), dtype=dtype, attn_implementation="eager", **kw
        )
        return model.cuda().eval()

    ref16, ref32 = teacher_forced(hf(torch.bfloat16), seq), teacher_forced(hf(torch.float32), seq)
    ours_err, hf_err = [], []
    for j, token in enumerate(out.output_ids):
        p = PROMPT + j
        ours = rows[p]
        assert token == int(ours.argmax()), f"token {j}: not its logits' argmax"
        ours_err.append((ours - ref32[p - 1]).abs().max().item())
        hf_err.append((ref16[p - 1] - ref32[p - 1]).abs().max().item())
        if arch == "llama":
            gap = (ref16[p - 1].max() - ref16[p - 1, token]).item()
            assert gap <= 0.1, f"token {j}: not transformers' argmax (gap {gap})"
    ours_mean, hf_mean = sum(ours_err) / len(ours_err), sum(hf_err) / len(hf_err)
    assert ours_mean <= 1.5 * hf_mean + 0.02, (ours_mean, hf_mean)
