"""Where the tiny gpt-oss (window 6) leaves transformers on CUDA, fp32.

Prints, per configuration, which of five prompts give transformers' greedy tokens
and the worst teacher-forced logit error of the engine's sampled rows against
transformers on the engine's own sequence:

- transformers on CPU vs on CUDA (is the oracle itself device-dependent?);
- the engine on CUDA at page 4 and 16, with the Triton MoE and with the MoE's
  torch reference swapped into every layer (is it the fused MoE?), Triton and torch
  attention backends, and the engine on CPU;
- the layer-0 experts on random rows, kernel vs reference, at several T.

Run on the GPU machine: ``python3 benchmarks/diag_gpt_oss.py``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from engine_fixtures import StepLogits, save_tiny_model
from gpu_fixtures import seeded_prompts

from unikv.engine import LLM, SamplingParams
from unikv.engine.demo import hf_greedy
from unikv.kernels.moe import fused as moe
from unikv.kernels.moe import ref as moe_ref

NEW = 24
PROMPTS = seeded_prompts([3, 17, 30, 45, 64], 7)


def hf(path, device):
    import transformers as tf

    m = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    return m.to(device).eval()


def teacher(model, seq):
    with torch.no_grad():
        return model(torch.tensor([seq], device=model.device)).logits[0].float().cpu()


def engine_run(path, device, ps, ref_moe=False, **kw):
    llm = LLM(path, device=device, dtype=torch.float32, page_size=ps, max_num_seqs=8,
              max_model_len=256, max_num_batched_tokens=32, kv_cache_bytes=64 << 20, **kw)  # fmt: skip
    if ref_moe:
        for mod in llm.model.modules():
            if hasattr(mod, "kernel") and hasattr(mod, "operands"):
                mod.kernel = moe_ref.fused_moe
    rows = StepLogits()  # each sampled token's logits row, by (request id, position)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0.0), on_step=rows)
    first = llm.requests.next_id - len(outs)
    return outs, rows.rows, first


def main():
    path = tempfile.mkdtemp()
    save_tiny_model("gpt_oss", path)
    cpu_hf, cuda_hf = hf(path, "cpu"), hf(path, "cuda")
    want_cpu = [hf_greedy(cpu_hf, p, NEW) for p in PROMPTS]
    want = [hf_greedy(cuda_hf, p, NEW) for p in PROMPTS]
    print("transformers cpu == cuda:", [a == b for a, b in zip(want_cpu, want, strict=True)])
    cases = [("cuda", 4, False, {}), ("cuda", 4, True, {}), ("cuda", 16, False, {}),
             ("cuda", 16, True, {}), ("cuda", 4, False, {"backend": "torch"}),
             ("cuda", 4, True, {"backend": "torch"}), ("cuda", 4, False, {"cuda_graphs": False}),
             ("cpu", 4, False, {}), ("cpu", 16, False, {})]  # fmt: skip
    for device, ps, ref_moe, kw in cases:
        outs, rows, first = engine_run(path, device, ps, ref_moe, **kw)
        same = [o.output_ids == w for o, w in zip(outs, want, strict=True)]
        worst, where = 0.0, None
        for k, o in enumerate(outs):
            seq = o.prompt_ids + o.output_ids
            ref = teacher(cuda_hf, seq)
            for j in range(len(o.output_ids)):
                p = len(o.prompt_ids) + j
                err = (rows[(first + k, p)].float().cpu() - ref[p - 1]).abs().max().item()
                if err > worst:
                    worst, where = err, (k, p)
        print(f"{device} ps {ps} ref_moe {ref_moe} {kw}: same {same} worst row err "
              f"{worst:.3g} at (request, position) {where}", flush=True)  # fmt: skip
    # the layer-0 experts alone, kernel vs reference
    llm = LLM(path, device="cuda", dtype=torch.float32, page_size=16, kv_cache_bytes=64 << 20)
    exp = next(m for m in llm.model.modules() if hasattr(m, "operands"))
    router = next(m for m in llm.model.modules() if hasattr(m, "top_k"))
    for t in (1, 5, 16, 32, 100):
        x = torch.randn(t, exp.down_proj_bias.shape[1], device="cuda")
        scores, idx = router(x)
        kw = dict(exp.operands(), b1=exp.gate_up_proj_bias, activation="gpt_oss",
                  gate_up="interleaved", alpha=exp.alpha, limit=exp.limit)  # fmt: skip
        a = moe.moe(x, scores, idx, **kw)
        b = moe_ref.fused_moe(x, scores, idx, **kw)
        print(f"experts T {t}: max |kernel - ref| {(a - b).abs().max().item():.3g} "
              f"(|ref| max {b.abs().max().item():.3g})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
