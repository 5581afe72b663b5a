"""bench_breakdown's prefill phase: its GEMM FLOPs against the model's own Linear
weights, and the profile plumbing end to end on CPU (tiny models)."""

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from benchmarks import bench_breakdown as bd
from benchmarks import bench_e2e as e2e


def _linear_params(model: torch.nn.Module) -> tuple[int, int]:
    """(weights of every Linear but the lm_head, the lm_head's) of a transformers model."""
    body = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")
    )
    return body, model.lm_head.weight.numel()


def test_prefill_gemm_flops_match_the_models_linear_weights():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = e2e.model_config("llama", tiny=True)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    body, head = _linear_params(model)
    tokens, prompt = 96, 32  # three whole prompts: three logits rows
    _, flops = bd.prefill_work(cfg, tokens, prompt, 4)["gemm"]
    assert flops == 2 * tokens * body + 2 * 3 * head
    # the decode step of the same batch sends every row through the lm_head
    _, decode_flops = bd.step_work(cfg, tokens, prompt / 2, 4)["gemm"]
    assert decode_flops == 2 * tokens * (body + head)


def test_prefill_attention_moves_each_tokens_rows_once():
    """q, k, v in and the output out, once per token and layer: the widths of the
    model's own projections (k/v tiles stay on chip across a prompt's queries)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = e2e.model_config("llama", tiny=True)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    widths = sum(
        a.q_proj.out_features + a.k_proj.out_features + a.v_proj.out_features
        + a.o_proj.in_features
        for a in (layer.self_attn for layer in model.model.layers)
    )  # fmt: skip
    tokens, prompt, itemsize = 96, 32, 2
    nbytes, _ = bd.prefill_work(cfg, tokens, prompt, itemsize)["attention"]
    assert nbytes == tokens * widths * itemsize


def test_prefill_profile_runs_on_cpu(tmp_path):
    out = tmp_path / "bd.json"
    res = bd.main(
        ["--device", "cpu", "--tiny", "--models", "llama", "--phase", "prefill", "--out", str(out)]
    )
    entry = res["models"][0]
    assert "error" not in entry, entry.get("traceback")
    assert entry["phase"] == "prefill" and entry["classes"]["gemm"]["kernels"] > 0
    assert out.exists()


def test_prefill_graphs_ab_runs_on_cpu(tmp_path):
    """``--prefill-graphs ab``: the engine off then on over one saved model; the on
    run's extend steps went through the pieces; the A/B summary sets both side by side."""
    out = tmp_path / "bd.json"
    argv = ["--device", "cpu", "--tiny", "--models", "llama", "--phase", "prefill"]
    argv += ["--prefill-graphs", "ab", "--requests", "8", "--steps", "1", "--out", str(out)]
    res = bd.main(argv)
    off, on = res["models"]
    assert "error" not in off and "error" not in on, (off.get("traceback"), on.get("traceback"))
    assert (off["prefill_graphs"], on["prefill_graphs"]) == (False, True)
    assert "prefill_graph_replays" not in off and sum(on["prefill_graph_replays"].values()) > 0
    ab = res["prefill_graphs_ab"]["llama"]
    for side in (ab["off"], ab["on"]):
        assert side["step_wall_ms"] > 0 and side["ttft_p50_ms"] > 0
    assert ab["off"]["step_device_ms"] == off["step_device_ms"]


def test_idle_gaps_against_a_time_grid():
    """``idle_gaps`` on random overlapping intervals against a 0.01 us time grid: the
    busy time is the grid points some interval covers, the overlap the durations
    summed minus it, and each reported gap lies between the op that ended last and the
    op that starts next."""
    import numpy as np

    rng = np.random.default_rng(2)
    starts = np.sort(rng.uniform(0, 200, 60)).round(2)
    durs = rng.uniform(0.5, 6, 60).round(2)
    names = [f"k{i % 7}" for i in range(60)]
    trace = {"traceEvents": [{"cat": "kernel", "ph": "X", "ts": float(s), "dur": float(d),
                              "name": n} for s, d, n in zip(starts, durs, names)]}  # fmt: skip
    got = bd.idle_gaps(trace, steps=2, limit=100)
    grid = np.arange(0, 220, 0.01)
    covered = np.zeros(len(grid), bool)
    for s, d in zip(starts, durs):
        covered |= (grid >= s) & (grid < s + d)
    busy = covered.sum() * 0.01
    span = (starts + durs).max() - starts[0]
    assert abs(got["busy_us"] * 2 - busy) < 0.5
    assert abs(got["span_us"] * 2 - span) < 1e-6
    assert abs((got["overlap_us"] + got["busy_us"]) * 2 - durs.sum()) < 1e-6
    assert abs(got["idle_us"] * 2 - (span - busy)) < 0.5
    idle = sum(g["us"] for g in got["gaps"]) * 2
    assert idle <= got["idle_us"] * 2 + 1e-6 and got["idle_us"] * 2 - idle < 0.2 * 60
