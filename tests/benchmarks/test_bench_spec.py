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


def test_suite_ratios_are_the_hand_written_table(monkeypatch):
    """``suite_ratios`` (a loop) gives the JSON the suite's hand-written ratio table
    gave before it, key order included, on runs of distinct made-up rates."""
    monkeypatch.syspath_prepend(str(BENCH))
    import json

    import bench_spec

    rates = iter(range(3, 1000, 7))

    def runs(names: dict[str, tuple[str, ...]]) -> dict:
        return {
            run: {
                p: {
                    "decode_tokens_per_s": float(next(rates)),
                    "acceptance_rate": next(rates) / 997,
                    "ahead_dropped": next(rates),
                }
                for p in prompts
            }
            for run, prompts in names.items()
        }

    one, rep, batch = ("one",), ("rep",), ("batch",)
    llama = runs({"plain": ("one", "rep", "batch"), "forced": one, "forced_pipelined": one,
                  "ngram": rep, "ngram_pipelined": rep, "spec_rule": batch,
                  "spec_no_rule": batch, "draft_model_rule": batch, "eagle3_rule": batch})  # fmt: skip
    qwen = runs({"plain": ("one", "rep"), "plain_batch": batch, "forced": one, "mtp_forced": one,
                 "forced_pipelined": one, "ngram": rep, "ngram_pipelined": rep,
                 "mtp_rule": batch})  # fmt: skip
    n, b = 24, 64

    def rate(runs, name, label):
        return runs[name][label]["decode_tokens_per_s"]

    expected = {  # the table as it was written out by hand
        "llama_forced_speedup": rate(llama, "forced", "one") / rate(llama, "plain", "one"),
        "llama_forced_pipelined_speedup": rate(llama, "forced_pipelined", "one")
        / rate(llama, "plain", "one"),
        "llama_ngram_speedup": rate(llama, "ngram", "rep") / rate(llama, "plain", "rep"),
        "llama_ngram_pipelined_speedup": rate(llama, "ngram_pipelined", "rep")
        / rate(llama, "plain", "rep"),
        "llama_ngram_acceptance_rate": llama["ngram_pipelined"]["rep"]["acceptance_rate"],
        "llama_ngram_pipelined_dropped_per_100": 100 * llama["ngram_pipelined"]["rep"][
            "ahead_dropped"] / n,
        "qwen3_5_forced_speedup": rate(qwen, "forced", "one") / rate(qwen, "plain", "one"),
        "qwen3_5_forced_pipelined_speedup": rate(qwen, "forced_pipelined", "one")
        / rate(qwen, "plain", "one"),
        "qwen3_5_ngram_speedup": rate(qwen, "ngram", "rep") / rate(qwen, "plain", "rep"),
        "qwen3_5_ngram_pipelined_speedup": rate(qwen, "ngram_pipelined", "rep")
        / rate(qwen, "plain", "rep"),
        "qwen3_5_ngram_acceptance_rate": qwen["ngram_pipelined"]["rep"]["acceptance_rate"],
        "qwen3_5_mtp_forced_speedup": rate(qwen, "mtp_forced", "one") / rate(qwen, "plain", "one"),
        f"b{b}_rule_vs_plain": rate(llama, "spec_rule", "batch") / rate(llama, "plain", "batch"),
        f"b{b}_no_rule_vs_plain": rate(llama, "spec_no_rule", "batch")
        / rate(llama, "plain", "batch"),
        f"b{b}_draft_model_rule_vs_plain": rate(llama, "draft_model_rule", "batch")
        / rate(llama, "plain", "batch"),
        f"b{b}_eagle3_rule_vs_plain": rate(llama, "eagle3_rule", "batch")
        / rate(llama, "plain", "batch"),
        f"qwen3_5_b{b}_mtp_rule_vs_plain": rate(qwen, "mtp_rule", "batch")
        / rate(qwen, "plain_batch", "batch"),
    }  # fmt: skip
    got = bench_spec.suite_ratios({"llama": llama, "qwen3_5": qwen}, n, b)
    assert json.dumps(got) == json.dumps(expected)


def test_rule_only_alternates_plain_runs(monkeypatch):
    """``--rule-only``'s runs: the plain engine is measured first and again after
    each speculative run (built one at a time), and each ratio is the run's rate
    over the mean of the plain rates just before and after it (scripted rates)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_spec

    built, measured = [], []
    rates = {"plain": iter([100.0, 80.0, 120.0]), "a": iter([90.0]), "b": iter([110.0])}

    class Engine:
        def __init__(self, path, speculative_config=None, **kw):
            self.name = "plain" if speculative_config is None else speculative_config["m"]
            built.append(self.name)

    def rate(llm, batch, n):
        measured.append(llm.name)
        return next(rates[llm.name]), {"steps": n}

    monkeypatch.setattr(bench_spec, "LLM", Engine)
    monkeypatch.setattr(bench_spec, "decode_rate", rate)
    runs = bench_spec._alternated(Path("x"), {"a": {"m": "a"}, "b": {"m": "b"}}, [[1]], 4, {})
    assert built == ["plain", "a", "b"]
    assert measured == ["plain", "a", "plain", "b", "plain"]
    assert runs["a"]["vs_plain"] == 90.0 / 90.0 and runs["b"]["vs_plain"] == 110.0 / 100.0
    assert (runs["b"]["plain_before"], runs["b"]["plain_after"]) == (80.0, 120.0)
    assert runs["plain_batch"]["decode_tokens_per_s"] == 100.0
