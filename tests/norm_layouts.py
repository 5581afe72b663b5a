"""The register layout of each row norm's sum of squares, compiled for sm_90a on this host.

A row norm's fp32 sum of squares is added in an order set by its register layout: each
thread sums the elements it holds, then the threads' partial sums meet. Triton picks
the layout from the memory ops around the row, so two kernels that compute one norm
agree bit for bit only if they reduce in the same layout. ``norm_quant``'s fused
pre-norm stores FP8 codes, one byte each: Triton widened that kernel's row to 16
elements a thread, while ``_rms_norm_kernel`` (bf16 loads and stores, 8 a thread)
kept 8, and on the H100 the fused codes then differed from norm-then-``quantize_act``
(4,101 x 7,168). The interpreter sums both rows alike, so only a compile shows it.

Each case compiles a kernel as the JIT specialises a call and stops at the PTX (no
ptxas): ``python tests/norm_layouts.py`` prints one JSON list of ``[kernel,
N, dtype, has_res, w_fp32, layout]``, where layout is the text of the blocked layout
of the sum's operand (the one ``tt.reduce`` whose result is a scalar f32). Run without
``TRITON_INTERPRET`` (``tests/kernels/test_kernels_norm_quant.py`` starts it in a
subprocess).
"""

from __future__ import annotations

import json
import re

from ptx_alignment import _ptx_only, compile_ptx

# (N, GROUP): DeepSeek-V3's hidden and q LoRA rank, Qwen3-32B's hidden, gpt-oss's (not a
# power of two, another group), a row narrower than one 128-group
WIDTHS = [(7168, 128), (1536, 128), (5120, 128), (2880, 64), (96, 32)]
# (residual, fp32 weight): the pre-norm of a block with its residual add (Llama's weight
# rule) and the first block's norm alone (Gemma's fp32 weight rule)
FLAGS = [(True, False), (False, True)]


def sum_layout(ttgir: str) -> str:
    """The blocked layout (its definition's text) of the operand of the reduction whose
    result is one f32: the row's sum of squares."""
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<\{.*\}>)$", ttgir, re.MULTILINE))
    found = re.findall(r"\}\) : \(tensor<\d+xf32, (#\w+)>\) -> f32", ttgir)
    assert len(found) == 1, f"one scalar f32 reduction expected, found {found}"
    return aliases[found[0]]


def cases():
    from unikv.kernels.linear import elementwise, norm_quant
    from unikv.kernels.runtime.checks import next_pow2

    for (n, group), dt, (has_res, w_fp32) in (
        (w, dt, f) for w in WIDTHS for dt in ("bf16", "fp16") for f in FLAGS
    ):  # fmt: skip
        block = next_pow2(n)
        warps = min(16, max(1, block // 256))  # both launches' warps
        flags = {"HAS_RES": has_res, "W_FP32": w_fp32}
        ptrs = {"x": f"*{dt}", "res": f"*{dt}", "w": f"*{dt}", "eps": 1e-6, "offset": 0.0}
        groups = -(-n // group)
        norm = {**ptrs, "out": f"*{dt}", "n1": 1, "sx0": n, "sx1": 0, "sr0": n, "N": n}
        fused = {**ptrs, "q": "*fp8e4nv", "s": "*fp32", "sx0": n, "sr0": n, "sq0": n,
                 "ss0": groups, "ss1": 1, "N": n, "n_groups": groups}  # fmt: skip
        yield ("rms_norm", n, dt, has_res, w_fp32,
               (elementwise._rms_norm_kernel, norm, {**flags, "BLOCK": block}, warps))  # fmt: skip
        yield ("add_rms_norm_quant", n, dt, has_res, w_fp32,
               (norm_quant._add_rms_norm_quant_kernel, fused,
                {**flags, "BLOCK": max(block, group), "GROUP": group}, warps))  # fmt: skip


def main() -> None:
    from triton import knobs

    knobs.runtime.add_stages_inspection_hook = _ptx_only
    out = []
    for name, n, dt, has_res, w_fp32, (fn, values, cons, warps) in cases():
        ttgir = compile_ptx(fn, values, cons, warps, "ttgir", enable_fp_fusion=False)
        out.append([name, n, dt, has_res, w_fp32, sum_layout(ttgir)])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
