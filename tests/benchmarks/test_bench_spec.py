"""bench_spec's suite builds a Qwen3.5-shaped checkpoint with an MTP layer in the
released ``mtp.*`` layout: the engine's loader takes it (tiny, fp32, CPU), and the
layer's tensors are the ones the file holds, read back by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from unikv.models.loader import load_model, load_model_config
from unikv.models.mtp import load_mtp, mtp_count

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_suite_qwen_mtp_checkpoint_loads(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_spec

    assert bench_spec.parse_args([]).model is None  # no --model, no --mtp: the suite
    vocab = bench_spec.save_qwen_mtp_model(tmp_path, "cpu", torch.float32, True, 4)
    hf_config = load_model_config(str(tmp_path))[1]
    assert mtp_count(hf_config) == 1 and hf_config.num_hidden_layers == 4
    assert vocab == hf_config.vocab_size
    target = load_model(str(tmp_path))
    layer = load_mtp(str(tmp_path), target)
    with safe_open(str(tmp_path / "mtp-extra.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names and all(n.startswith("mtp.") for n in names)
        assert torch.equal(layer.eh_proj.weight, f.get_tensor("mtp.fc.weight"))
        assert torch.equal(layer.shared_head.norm.weight, f.get_tensor("mtp.norm.weight"))
        up = f.get_tensor("mtp.layers.0.mlp.up_proj.weight")
    assert any(torch.equal(p, up) for p in layer.block.mlp.parameters()) or any(
        up.shape[0] < p.shape[0] and torch.equal(p[-up.shape[0] :], up)
        for p in layer.block.mlp.parameters()
    )  # up_proj alone, or the upper half of a fused gate|up
    with pytest.raises(ValueError, match="keep a full-attention layer"):
        bench_spec.save_qwen_mtp_model(tmp_path / "x", "cpu", torch.float32, True, 3)


def test_suite_eagle3_head_loads(tmp_path, monkeypatch):
    """The suite's random EAGLE-3 head for its Llama target (``save_eagle3_head``)
    loads through the engine's loader, with the file's tensors and a ``d2t`` that
    maps every draft id onto a distinct target id."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_e2e
    import bench_spec

    from unikv.models.eagle3 import load_eagle3

    bench_e2e.save_model("llama", tmp_path / "t", "cpu", torch.float32, True)
    bench_spec.save_eagle3_head(tmp_path / "h", tmp_path / "t", torch.float32, 100)
    head = load_eagle3(str(tmp_path / "h"), load_model(str(tmp_path / "t")), 64)
    with safe_open(str(tmp_path / "h" / "model.safetensors"), framework="pt") as f:
        assert torch.equal(head.fc.weight, f.get_tensor("fc.weight"))
        assert torch.equal(head.lm_head.weight, f.get_tensor("lm_head.weight"))
        mapped = torch.arange(100) + f.get_tensor("d2t")
    assert torch.equal(head.d2t + torch.arange(100), mapped)
    assert mapped.unique().numel() == 100 and int(mapped.max()) < 256  # the tiny vocabulary
