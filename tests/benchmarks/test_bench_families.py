"""bench_families' roofline read from the loaded model and pool, against a second
description of the same bytes: the transformers model's own parameters and the
config's K/V widths (tiny Llama, tied embeddings, fp32)."""

from __future__ import annotations

import torch

from benchmarks import bench_e2e as e2e
from benchmarks import bench_families as fam


def test_roofline_bytes_are_the_models_weights_and_kv(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = fam.save_model("llama", tmp_path, "cpu", torch.float32, tiny=True)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())  # tied: once
    args = fam.parse_args(["--device", "cpu", "--tiny"])
    llm = e2e._unikv_llm(tmp_path, 4, 96, args)
    batch, context = 3, 40.0
    got = fam.work(llm, cfg, batch, context)
    assert got["weights"][0] == weights
    layers, heads, dim = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]
    assert got["kv"][0] == batch * context * layers * 2 * heads * dim * 4  # K and V, fp32
    assert got["state"] == (0, 0) and got["experts"][0] == 0
    roof = fam.roofline(llm, cfg, batch, context, (1e9, 1e12))
    assert roof["bytes"] == weights + got["kv"][0]
    assert roof["bytes_ms"] == roof["bytes"] / 1e9 * 1e3
