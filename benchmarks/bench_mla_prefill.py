"""MLA prefill, absorbed vs expanded, through unikv's real step objects: one
DeepSeek-V3-shaped attention layer (``unikv/presets/deepseek-v3.json``: 128 heads,
q_lora 1536, rank 512 + rope 64, nope 128, v 128, YaRN), bf16 on CUDA.

    python benchmarks/bench_mla_prefill.py [--out benchmarks/results/mla_prefill_h200.json]

Section ``extend``: the layer's whole forward (``MLAttention.forward``: projections,
rope, latent store, attention, W_UV / o_proj) over an ``ExtendAttention`` with
``mla_form`` forced to "absorbed" (unikv's MLA kernel over the latent view) and to
"expanded" (one gather, one kv_b_proj GEMM, unikv's extend kernel), and with the
rule (``mla_form`` None: ``engine.attention.mla_prefill_costs``) whose pick is
recorded. Shapes: fresh prefills of 1k, 4k and 16k tokens; 8 requests of 4k cached
+ 512 new tokens; and, to place the crossover the rule predicts (~55 new tokens per
request at these widths), 8 x (4k cached + n new) for n in 8..128. The cached rows
are random latent rows on randomly permuted pages of a one-layer MLA pool (page 16);
a fresh step object per call (the gather index is built inside the timed region).
Both forms' outputs are compared (relative error) before anything is timed.

Recorded per row: ``absorbed_us``, ``expanded_us``, ``rule_us``, ``rule_form``,
``expanded_over_absorbed`` (time ratio; < 1: expanded is faster), ``rule_is_faster``
(the rule picked the faster form) and ``err_expanded_vs_absorbed``. The JSON goes to
``--out`` and, when the environment sets ``$OUT``, to ``$OUT/<its file name>``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import bench_us, environment, save_json
from unikv.engine.attention import ExtendAttention, MLALayerCache
from unikv.engine.plan import StepPlan, SubPoolStep
from unikv.ids import KernelIds
from unikv.kernels import get_backend
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MLASpec

ROOT = Path(__file__).resolve().parents[1]
PAGE_SIZE = 16
EXTEND = [(1, 0, 1024), (1, 0, 4096), (1, 0, 16384), (8, 4096, 512)]
CROSSOVER = [(8, 4096, n) for n in (8, 16, 32, 64, 128)]
REL_TOL = 2e-2  # relative (norm) error allowed between the two bf16 forms


def v3_layer(device: torch.device):
    """DeepSeek-V3's attention layer 0 (random weights, std 0.02) in bf16, and its
    model config."""
    import transformers

    from unikv.models import model_config_from_hf
    from unikv.models.deepseek import DeepseekRotary, MLAttention

    raw = json.loads((ROOT / "unikv/presets/deepseek-v3.json").read_text())
    for key in ("_source", "quantization_config"):
        raw.pop(key, None)
    raw["num_hidden_layers"] = 1
    config = model_config_from_hf(transformers.DeepseekV3Config(**raw))
    e = config.extra
    rotary = DeepseekRotary(config.rope, e["qk_rope_head_dim"], 32768, e["rope_layout"])
    rotary.build(device)
    layer = MLAttention(config, 0, rotary).to(device, torch.bfloat16)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if not name.endswith("layernorm.weight"):
                param.normal_(0, 0.02)
    return layer, config


class Step:
    """B requests of ``cached`` cached + ``new`` new tokens on permuted pages of a
    one-layer MLA pool; ``plan`` is the StepPlan an extend step of them would get."""

    def __init__(self, config, bsz: int, cached: int, new: int, device: torch.device):
        e = config.extra
        spec = MLASpec(1, e["kv_lora_rank"], e["qk_rope_head_dim"], dtype=torch.bfloat16)
        pages = math.ceil((cached + new) / PAGE_SIZE)
        cfg = [SubPoolConfig("mla", spec, page_size=PAGE_SIZE)]
        self.pool = UnifiedPool(cfg, pool_bytes_for(cfg, {"mla": bsz * pages}), device)
        sub = self.pool["mla"]
        perm = torch.randperm(sub.usable_pages, device=device)[: bsz * pages] + sub.first_page
        table = (perm.view(bsz, pages) * sub.blocks_per_page).int()
        self.cache = MLALayerCache("mla", sub.views[0], PAGE_SIZE)
        pos = torch.arange(cached + new, device=device)
        ids = table[:, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE  # (B, L)
        width = spec.kv_lora_rank + spec.rope_dim
        self.cache.latent[ids[:, :cached].reshape(-1)] = torch.randn(
            bsz * cached, width, device=device, dtype=torch.bfloat16
        )
        i32 = {"dtype": torch.int32, "device": device}
        self.positions = pos[cached:].repeat(bsz)  # (T,) int64
        num_tokens = bsz * new
        self.plan = StepPlan(
            is_decode=False,
            input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
            positions=self.positions,
            logits_indices=torch.arange(1, bsz + 1, device=device) * new - 1,
            seq_lens=torch.full((bsz,), cached + new, **i32),
            q_indptr=torch.arange(bsz + 1, **i32) * new,
            max_q_len=new,
            subpools={"mla": SubPoolStep(KernelIds(ids[:, cached:].reshape(-1), "mla"), table)},
        )
        self.x = torch.randn(num_tokens, config.hidden_size, device=device, dtype=torch.bfloat16)

    def run(self, layer, backend, form: str | None):
        attn = ExtendAttention([self.cache], self.plan, backend, 1.0, mla_form=form)
        out = layer(self.x, self.positions, attn)
        return out, attn.mla_form


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def extend_row(layer, config, backend, bsz, cached, new, device) -> dict:
    step = Step(config, bsz, cached, new, device)
    row = {"B": bsz, "cached": cached, "new": new, "H": config.num_heads, "page_size": PAGE_SIZE}
    with torch.inference_mode():
        absorbed, _ = step.run(layer, backend, "absorbed")
        expanded, _ = step.run(layer, backend, "expanded")
        _, row["rule_form"] = step.run(layer, backend, None)
        row["err_expanded_vs_absorbed"] = rel_err(expanded, absorbed)
        assert row["err_expanded_vs_absorbed"] < REL_TOL, f"the forms disagree: {row}"
        for form in ("absorbed", "expanded", None):
            row[f"{form or 'rule'}_us"] = bench_us(lambda f=form: step.run(layer, backend, f))
    row["expanded_over_absorbed"] = row["expanded_us"] / row["absorbed_us"]
    faster = "expanded" if row["expanded_us"] < row["absorbed_us"] else "absorbed"
    row["rule_is_faster"] = row["rule_form"] == faster
    print(row, flush=True)
    step.pool = None
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/mla_prefill_h200.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mla_prefill.py needs a CUDA GPU (bf16 Triton kernels)")
    device = torch.device("cuda")
    torch.manual_seed(0)
    backend = get_backend(device)
    layer, config = v3_layer(device)
    payload = {"env": environment(), "page_size": PAGE_SIZE, "extend": []}
    for shape in EXTEND + CROSSOVER:
        payload["extend"].append(extend_row(layer, config, backend, *shape, device))
    save_json(args.out, payload)
    if os.environ.get("OUT"):
        save_json(Path(os.environ["OUT"]) / Path(args.out).name, payload)


if __name__ == "__main__":
    main()
