"""Shared memory of the fused MoE's FP8 launches, compiled for sm_90 on any machine
(Triton's own compiler and ptxas; no GPU): one JSON line per (table entry, FP8 mode,
kernel) on stdout. Run without TRITON_INTERPRET (the interpreter replaces the kernels);
``test_kernels_moe_smem.py`` runs it in a subprocess."""

from __future__ import annotations

import json
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from unikv.kernels.moe import fused
from unikv.kernels.moe.fused_kernels import _down_kernel, _gate_up_kernel

FLOATS = {"alpha", "limit"}
PTR = {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "sorted_ids_ptr": "*i32", "block_experts_ptr": "*i32",
       "y_ptr": "*fp32", "tw_ptr": "*fp32"}  # fmt: skip


def shared_bytes(kernel, constexprs: dict, num_warps: int, num_stages: int) -> int:
    """The compiled kernel's static shared memory at this launch (bf16 activations)."""
    names = kernel.arg_names
    sig = {}
    for name in names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = PTR.get(name, "*bf16")
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    consts = {(names.index(k),): v for k, v in constexprs.items()}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).metadata.shared


def launches(cfg: fused.Config, mode: int, blocks: tuple[int, int]) -> dict[str, dict]:
    common = {"MXFP4": 0, "HAS_BIAS": False, "IEEE": False, "SPLIT_K": cfg.split_k, "ACT": 0,
              "BLOCK_M": cfg.block_m or 16, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
              "SWAP": bool(cfg.swap), "ASM": True, "FP8": mode, "BN": blocks[0], "BK": blocks[1]}  # fmt: skip
    down = dict(common, ACT_IN_A=False, HAS_B1=False, DTYPE=tl.bfloat16)
    return {"gate_up": common, "down": down}


def main(argv: list[str]) -> None:
    raw = "--raw" in argv  # the table's launch as it is, without ``fused.fp8_config``
    only = [int(a.split("=")[1]) for a in argv if a.startswith("--bucket=")]
    only_blocks = [
        tuple(map(int, a.split("=")[1].split("x"))) for a in argv if a.startswith("--blocks=")
    ]
    for (bucket, mxfp4), cfg in fused.TABLE.items():
        if mxfp4 or cfg is None or (only and bucket not in only):
            continue
        for blocks in only_blocks or ((128, 128), (16, 24)):
            mode = fused.fp8_mode(cfg, fused.Fp8Blocks(*blocks))
            run = cfg if raw else fused.fp8_config(cfg, mode)
            for name, consts in launches(run, mode, blocks).items():
                kernel = _gate_up_kernel if name == "gate_up" else _down_kernel
                smem = shared_bytes(kernel, consts, run.num_warps, run.num_stages)
                row = {"bucket": bucket, "blocks": blocks, "mode": mode, "kernel": name}
                print(json.dumps(dict(row, stages=run.num_stages, shared=smem)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
