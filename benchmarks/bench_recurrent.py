"""Benchmark the recurrent-state ops (Gated DeltaNet, Mamba-2) over pool slot views.

    python benchmarks/bench_recurrent.py [--out benchmarks/results/recurrent_h200.json]
        [--sections decode,conv,sweep,prefill]

Shapes: Qwen3.5-like GDN (H 32, Dk = Dv = 128, conv C 8192, K 4) and NemotronH-like
Mamba-2 (H 128, P 64, N 128, G 8, conv C 10240), bf16 activations, fp32 states.
Decode (B 1/64/256): eager and CUDA-graph time against the memory roofline (state
bytes read + written plus activations, over the device copy bandwidth measured in
this run). Prefill (8 x 4k, 1 x 16k): the fla-core path's time, the time of its
slot gather + scatter alone (share of the step), the fused-recurrent Triton fallback,
and the varlen conv against its roofline. Outputs are checked before they are timed.

Each decode row also has ``stream_us``: the op's time inside one CUDA graph that runs
it on enough distinct copies of the case (own pool, slots and inputs) that their
bytes exceed the L2 several times over, divided by the copies: the kernel's time in a
decode step's graph, without the replay's fixed cost that ``graph_us`` carries (about
6 us, most of a small op's time). ``stream_roofline_fraction`` is taken from it.
``conv`` also checks the Triton conv against the torch reference on the device.
``sweep`` times the conv's block sizes (``conv.causal_conv1d``'s ``config``) at
decode B 64/256 and prefill 8 x 4k, for the defaults in ``kernels/recurrent/conv.py``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import GIB, bench_us, environment, graph_us, save_json
from unikv import layout
from unikv.kernels.recurrent import conv as conv_ops
from unikv.kernels.recurrent import fla_prefill as recurrent_fla
from unikv.kernels.recurrent import ref as recurrent_ref
from unikv.kernels.recurrent import triton_ops as recurrent
from unikv.specs import MambaSpec, StatePart

MODELS = {
    "gdn_qwen3.5": {"state": (32, 128, 128), "channels": 2 * 16 * 128 + 32 * 128},
    "ssd_nemotronh": {"state": (128, 64, 128), "channels": 128 * 64 + 2 * 8 * 128, "groups": 8},
}
WIDTH, NUM_SLOTS = 4, 260
DECODE_BATCHES = (1, 64, 256)
PREFILLS = {"8x4k": [4096] * 8, "1x16k": [16384]}
BF16 = torch.bfloat16
STREAM_BYTES = 512 * 2**20  # copies of a decode case in one graph: > 8x a 50 MB L2
MAX_COPIES = 24
DECODE_SWEEP = [{"block_c": c, "lanes": n, "num_warps": w}
                for c, n, w in ((128, 1, 4), (256, 1, 4), (256, 2, 4), (256, 4, 4), (512, 1, 4),
                                (512, 2, 4), (256, 4, 8), (512, 4, 8), (256, 8, 8),
                                (1024, 2, 8))]  # fmt: skip
PREFILL_SWEEP = [{"block_c": c, "block_t": t, "chunk_t": k, "num_warps": w}
                 for c, t, k, w in ((64, 32, 256, 4), (128, 16, 256, 4), (128, 32, 256, 4),
                                    (128, 32, 256, 8), (256, 16, 256, 4), (256, 32, 256, 8),
                                    (128, 16, 64, 4), (128, 16, 1024, 4))]  # fmt: skip


def d2d_GBps(nbytes: int = 2 * GIB) -> float:
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return nbytes / bench_us(lambda: b.copy_(a), 5, 30) / 1e3  # bytes read + written


class Case:
    """A one-layer Mamba sub-pool, a batch on random slots and bf16 inputs of T tokens."""

    def __init__(self, model: str, lens: list[int], num_slots: int = NUM_SLOTS):
        cfg = MODELS[model]
        self.kind, self.lens = model.split("_")[0], lens
        spec = MambaSpec(1, (StatePart((cfg["channels"], WIDTH), BF16),), StatePart(cfg["state"]))
        buffer = torch.zeros(num_slots * spec.entry_bytes, dtype=torch.uint8, device="cuda")
        views = layout.mamba_state_views(buffer, spec, num_slots)
        self.conv, self.state = views["conv0"][0], views["temporal"][0]
        self.state.normal_(0, 0.1)
        self.conv.normal_(0, 1.0)
        self.slots = (torch.randperm(num_slots - 1, device="cuda")[: len(lens)] + 1).long()
        self.q_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device="cuda")
        self.q_indptr[1:] = torch.tensor(lens, device="cuda").cumsum(0)
        self.max_q_len, num_tokens = max(lens), sum(lens)
        r = lambda *s: torch.randn(*s, device="cuda", dtype=BF16)
        c, (h, d1, d2) = cfg["channels"], cfg["state"]
        self.x, self.w, self.b = r(num_tokens, c), 0.5 * r(c, WIDTH), r(c)
        if self.kind == "gdn":
            g = torch.nn.functional.logsigmoid(torch.randn(num_tokens, h, device="cuda") + 3)
            beta = torch.rand(num_tokens, h, device="cuda", dtype=BF16)
            self.inputs = (
                r(num_tokens, h, d1),
                r(num_tokens, h, d1),
                r(num_tokens, h, d2),
                g,
                beta,
            )
            self.kw = {"scale": d1**-0.5, "use_qk_l2norm": True}
        else:
            grp = cfg["groups"]
            A = -torch.rand(h, device="cuda") - 0.5
            bc = (0.3 * r(num_tokens, grp, d2), 0.3 * r(num_tokens, grp, d2))
            self.inputs = (r(num_tokens, h, d1), r(num_tokens, h) - 2, A, *bc, r(h), r(h))
            self.kw = {"dt_softplus": True, "dt_limit": (0.0, float("inf"))}

    def conv_op(self, config: dict | None = None):
        return conv_ops.causal_conv1d(
            self.x, self.conv, self.slots, self.q_indptr, self.w, self.b,
            max_q_len=self.max_q_len, activation="silu", config=config,
        )  # fmt: skip

    def check_conv(self) -> float:
        """Relative error of the Triton conv (output and windows) against the torch
        reference on a copy of the batch's windows; asserts it is small."""
        saved = self.conv[self.slots].clone()
        got = self.conv_op()
        got_state = self.conv[self.slots].clone()
        self.conv[self.slots] = saved
        want = recurrent_ref.causal_conv1d(
            self.x, self.conv, self.slots, self.q_indptr, self.w, self.b,
            max_q_len=self.max_q_len, activation="silu",
        )  # fmt: skip
        err = max(_rel(got, want), _rel(got_state, self.conv[self.slots]))
        assert err < 1e-2, f"the Triton conv is off the torch reference: rel err {err:.2e}"
        return err

    def ssm_op(self):
        op = recurrent.gated_delta_rule if self.kind == "gdn" else recurrent.mamba2_ssd
        args = (*self.inputs, self.state, self.slots, self.q_indptr)
        return op(*args, max_q_len=self.max_q_len, **self.kw)

    def state_bytes(self) -> int:  # one slot's recurrent state, read once and written once
        return self.state[0].numel() * self.state.element_size() * 2

    def activation_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.inputs if t.dim() > 1) * 2


def conv_bytes(batch: int, channels: int) -> int:
    """A decode conv's minimum bf16 traffic: each window read and written, x read, out
    written."""
    return batch * channels * (WIDTH * 2 * 2 + 4)


def stream_us(fns: list) -> float:
    """Microseconds per call of one CUDA graph that calls every fn in ``fns`` once."""
    return graph_us(lambda: [fn() for fn in fns]) / len(fns)


def bench_decode(model: str, bw: float) -> list[dict]:
    rows = []
    for bsz in DECODE_BATCHES:
        case = Case(model, [1] * bsz)
        case.check_conv()
        ops = (
            ("conv", "conv_op", conv_bytes(bsz, case.conv.shape[1])),
            (case.kind, "ssm_op", bsz * case.state_bytes() + case.activation_bytes()),
        )
        for name, method, nbytes in ops:
            fn = getattr(case, method)
            eager, graph = bench_us(fn), graph_us(fn)
            copies = max(2, min(MAX_COPIES, -(-STREAM_BYTES // nbytes)))
            cases = [Case(model, [1] * bsz, num_slots=bsz + 1) for _ in range(copies)]
            stream = stream_us([getattr(c, method) for c in cases])
            del cases
            roof = nbytes / bw / 1e3
            rows.append(
                {"model": model, "op": name, "batch": bsz, "eager_us": eager, "graph_us": graph,
                 "bytes": nbytes, "roofline_us": roof, "roofline_fraction": roof / graph,
                 "stream_us": stream, "stream_copies": copies,
                 "stream_roofline_fraction": roof / stream}
            )  # fmt: skip
            print(f"decode {model:14s} {name:5s} B={bsz:3d} eager {eager:8.1f} us graph "
                  f"{graph:8.1f} us ({roof / graph:.0%}) in-graph stream {stream:7.1f} us "
                  f"roofline {roof:7.1f} us ({roof / stream:.0%})")  # fmt: skip
    return rows


def bench_sweep(model: str, bw: float) -> dict:
    """The conv's block sizes: decode (B 64 / 256, in-graph stream time) and prefill
    (8 x 4k): each config's time and share of the roofline; the best per shape."""
    out = {"decode": [], "prefill": []}
    channels = MODELS[model]["channels"]
    for bsz in (64, 256):
        nbytes = conv_bytes(bsz, channels)
        copies = max(2, min(MAX_COPIES, -(-STREAM_BYTES // nbytes)))
        cases = [Case(model, [1] * bsz, num_slots=bsz + 1) for _ in range(copies)]
        roof = nbytes / bw / 1e3
        default = conv_ops.decode_config(bsz, channels)
        for cfg in DECODE_SWEEP:
            us = stream_us([functools.partial(c.conv_op, cfg) for c in cases])
            out["decode"].append({"batch": bsz, **cfg, "us": us, "roofline_fraction": roof / us,
                                  "default": (cfg["block_c"], cfg["lanes"]) == default
                                  and cfg["num_warps"] == conv_ops.NUM_WARPS})  # fmt: skip
        del cases
    case = Case(model, PREFILLS["8x4k"])
    roof = case.x.numel() * 2 * 2 / bw / 1e3
    for cfg in PREFILL_SWEEP:
        us = bench_us(functools.partial(case.conv_op, cfg), 5, 50)
        out["prefill"].append({"shape": "8x4k", **cfg, "us": us, "roofline_fraction": roof / us})
    for kind, rows in out.items():
        for key in sorted({r.get("batch", r.get("shape")) for r in rows}, key=str):
            mine = [r for r in rows if r.get("batch", r.get("shape")) == key]
            best = min(mine, key=lambda r: r["us"])
            best["best"] = True
            print(f"sweep {model:14s} conv {kind:7s} {key!s:5s} best {best} of {len(mine)}")
    return out


def gather_scatter(case: Case):
    initial = case.state[case.slots].float()
    recurrent_fla._scatter(case.state, case.slots, case.q_indptr, initial, initial)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def conv_prefill_us(case: Case, bw: float) -> tuple[float, float]:
    """(varlen conv time, its roofline: x read once and the output written once)."""
    return bench_us(case.conv_op, 5, 50), case.x.numel() * 2 * 2 / bw / 1e3


def bench_conv(model: str, name: str, lens: list[int], bw: float) -> dict:
    case = Case(model, lens)
    err = case.check_conv()
    us, roof = conv_prefill_us(case, bw)
    print(f"conv prefill {model:14s} {name:6s} {us:7.1f} us ({roof / us:.0%} of roofline) "
          f"rel err vs torch {err:.1e}")  # fmt: skip
    return {"model": model, "shape": name, "conv_us": us, "conv_roofline_fraction": roof / us,
            "rel_err_vs_torch": err}  # fmt: skip


def bench_prefill(model: str, name: str, lens: list[int], bw: float) -> dict:
    case = Case(model, lens)
    saved = case.state[case.slots].clone()
    out_fla = case.ssm_op()
    case.state[case.slots] = saved
    fallback = recurrent_fla.use_fla
    recurrent_fla.use_fla = lambda device: False
    try:
        out_rec = case.ssm_op()
        state_rec = case.state[case.slots].clone()
        rec_us = bench_us(case.ssm_op, 1, 20)
    finally:
        recurrent_fla.use_fla = fallback
    case.state[case.slots] = saved
    case.ssm_op()
    row = {"model": model, "shape": name, "fla": recurrent_fla.use_fla(case.x.device)}
    row["fla_vs_recurrent_rel_err"] = {
        "out": _rel(out_fla, out_rec),
        "state": _rel(case.state[case.slots], state_rec),
    }
    step, gs = bench_us(case.ssm_op, 5, 50), bench_us(lambda: gather_scatter(case), 5, 50)
    conv, conv_roof = conv_prefill_us(case, bw)
    row.update(
        step_us=step, gather_scatter_us=gs, gather_scatter_share=gs / step,
        recurrent_fallback_us=rec_us, fla_speedup_over_fallback=rec_us / step,
        conv_us=conv, conv_roofline_us=conv_roof, conv_roofline_fraction=conv_roof / conv,
    )  # fmt: skip
    print(f"prefill {model:14s} {name:6s} step {step:9.1f} us gather+scatter {gs:7.1f} us "
          f"({gs / step:.1%}) fallback {rec_us:9.1f} us conv {conv:7.1f} us "
          f"({conv_roof / conv:.0%} of roofline) err {row['fla_vs_recurrent_rel_err']}")  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/recurrent_h200.json")
    parser.add_argument("--sections", default="decode,prefill")
    args = parser.parse_args()
    bw = d2d_GBps()
    result = {"env": environment(), "d2d_GBps": bw, "fla_available": recurrent_fla.fla_available()}
    print(f"d2d copy {bw:.0f} GB/s; fla-core available: {result['fla_available']}")
    if "decode" in args.sections:
        result["decode"] = [row for model in MODELS for row in bench_decode(model, bw)]
        save_json(args.out, result)
    if "conv" in args.sections:  # the varlen conv alone (no fla-core needed)
        result["conv_prefill"] = [
            bench_conv(model, name, lens, bw) for model in MODELS for name, lens in PREFILLS.items()
        ]
        save_json(args.out, result)
    if "sweep" in args.sections:  # the conv's block sizes
        result["conv_sweep"] = {model: bench_sweep(model, bw) for model in MODELS}
        save_json(args.out, result)
    if "prefill" in args.sections:
        result["prefill"] = [
            bench_prefill(model, name, lens, bw)
            for model in MODELS
            for name, lens in PREFILLS.items()
        ]
        save_json(args.out, result)


if __name__ == "__main__":
    main()
