"""Compile Triton kernels for the H200 (sm_90a) on a host without a GPU.

``triton.compile`` runs the whole NVIDIA pipeline on the CPU (TTIR -> TTGIR -> LLVM ->
PTX) and the wheel's ``ptxas`` assembles it, so a kernel's registers, spills, shared
memory, wgmma use and software pipelining (``async_copy_global_to_local`` in the
TTGIR) are known before any device time is spent. The arguments are specialised as
the JIT would at a given call: ints equal to 1 become constexprs, ints divisible by
16 and every pointer get ``tt.divisibility`` 16 (without that, strides look
unaligned and no load is pipelined), ``do_not_specialize`` ints get neither.

    python benchmarks/aot_sm90.py            # every MoE config at gpt-oss's shape
    python benchmarks/aot_sm90.py --gemv     # the one-request GEMV's launches (JSON)
    python benchmarks/aot_sm90.py --step     # the rest of its decode chain (JSON)
    python benchmarks/aot_sm90.py --hopper   # the Hopper MXFP4 MoE's table (JSON)
    python benchmarks/aot_sm90.py --fp8      # the FP8 GEMM's split-K decode launches (JSON)
    python benchmarks/aot_sm90.py --json '[[[16, 64, 128, 1, 4, 3, true], true]]'
        # the given (config, mxfp4) cases: one JSON list of [gate_up, down] results
        # (mxfp4 "fp8": the block-scaled FP8 experts' launches; "w8a8": theirs with
        # FP8 activations, ``fp8.moe_fp8``'s prefill variant; "fp8odd": 16 x 24 blocks)

Run it without ``TRITON_INTERPRET`` (the interpreter replaces ``triton.jit`` functions,
which then cannot be compiled): the tests start it in a subprocess.

``moe_kernels(cfg, mxfp4)`` gives the two MoE launches at gpt-oss's expert shape
(32 experts, d = I = 2880, top-4, interleaved gate/up, biases); the tests compile
configs through it (``tests/kernels/test_kernels_sm90_compile.py``).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_sm90(
    fn, values: dict, constexprs: dict, num_warps: int, num_stages: int, **options
) -> dict:
    """Compile ``fn`` (a ``triton.jit`` function) for sm_90a. values: every non-constexpr
    argument by name: a pointer as its Triton type string ("*bf16"), else an int or a
    float (specialised as the JIT would). -> {regs, spill_bytes, smem, async_copies,
    wgmma, pdl_wait / pdl_trigger: those PTX instructions' counts,
    loads_before_wait, stores_before_wait, trigger_before_wait}."""
    nospec = set(getattr(fn, "do_not_specialize", ()) or ())
    nospec |= {fn.arg_names[i] for i in nospec if isinstance(i, int)}
    sig, cons, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        value = values[name]
        if isinstance(value, str):  # a pointer ("*bf16") or a tensor descriptor's type
            sig[name] = value
            if value.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        elif name not in nospec and value == 1:
            sig[name], cons[name] = "constexpr", 1
        else:
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"  # as the JIT types it
            if name not in nospec and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel (kernels/moe/hopper.py)
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn=fn, signature=sig, constexprs=cons, attrs=attrs)
    else:
        src = ASTSource(fn=fn, signature=sig, constexprs=cons, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, **options}
    logs: list[str] = []
    with _assembling_with_log(logs):
        kernel = triton.compile(src, target=TARGET, options=options)
    ttgir, ptx_text = kernel.asm["ttgir"], kernel.asm["ptx"]
    info = logs[0] if logs else _ptxas(ptx_text)[1]  # none: Triton's cache had the kernel
    return {
        "regs": int(re.search(r"Used (\d+) registers", info).group(1)),
        "spill_bytes": int(re.search(r"(\d+) bytes spill stores", info).group(1)),
        "smem": kernel.metadata.shared,
        "async_copies": len(re.findall("async_copy_global_to_local", ttgir)),
        "wgmma": "warp_group_dot" in ttgir,
        "setmaxnreg": sorted(
            {int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx_text)}
        ),
        "unsynced_arrives": _unsynced_arrives(ptx_text),
        "pdl_wait": ptx_text.count("griddepcontrol.wait"),
        "pdl_trigger": ptx_text.count("griddepcontrol.launch_dependents"),
        **_before_wait(ptx_text),
        **_arrival(ptx_text),
    }


def _ptxas(ptx: str) -> tuple[bytes, str]:
    """``ptx`` assembled for sm_90a: (the cubin, ``ptxas -v``'s log: registers, spills)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "k.ptx")
        path.write_text(ptx)
        info = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", str(path), "-o", f"{path}.o"],
                              capture_output=True, text=True, check=True).stderr  # fmt: skip
        return Path(f"{path}.o").read_bytes(), info


@contextlib.contextmanager
def _assembling_with_log(logs: list[str]):
    """Triton's last stage (ptxas, its log discarded) replaced by ``_ptxas``, its log
    appended to ``logs``: each kernel is assembled once, not once there and again for
    the log. Where Triton has no stages hook, nothing changes (``logs`` stays empty)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if not hasattr(runtime, "add_stages_inspection_hook"):
        yield
        return
    previous = runtime.add_stages_inspection_hook

    def assemble(ptx: str, metadata: dict) -> bytes:
        cubin, info = _ptxas(ptx)
        logs.append(info)
        return cubin

    def hook(backend, stages, options, language, capability) -> None:
        if previous is not None:
            previous(backend, stages, options, language, capability)
        assert "cubin" in stages, f"Triton's NVIDIA stages without a cubin: {list(stages)}"
        stages["cubin"] = assemble

    runtime.add_stages_inspection_hook = hook
    try:
        yield
    finally:
        runtime.add_stages_inspection_hook = previous


def _unsynced_arrives(ptx: str) -> int:
    """Plain mbarrier arrivals (one thread's, releasing a buffer) not preceded within a
    few instructions by a barrier over the partition's warps (``bar.sync id, n``): one
    thread arriving while other warps may still read the buffer."""
    lines = [x.strip() for x in ptx.splitlines() if x.strip() and not x.strip().startswith("//")]
    bad = 0
    for i, line in enumerate(lines):
        if "mbarrier.arrive.shared::cta.b64" in line and "expect_tx" not in line:
            bad += not any(
                x.startswith(("bar.sync", "barrier.sync")) for x in lines[max(0, i - 4) : i]
            )
    return bad


def _before_wait(ptx: str) -> dict:
    """PDL's contract in the PTX (``kernels/runtime/pdl.py``): the global loads (and async
    copies), the stores (and atomics) and the triggers placed before the first
    ``griddepcontrol.wait`` (all of the kernel's when it has none)."""
    head = ptx.split("griddepcontrol.wait")[0]
    return {"loads_before_wait": len(re.findall(r"\b(?:ld\.global|cp\.async\.c)", head)),
            "stores_before_wait": len(re.findall(r"\b(?:st\.global|atom\.global|red\.global)", head)),
            "trigger_before_wait": "griddepcontrol.launch_dependents" in head}  # fmt: skip


def _arrival(ptx: str) -> dict:
    """A split-K arrival (``fp8_gemm``'s fused reduction) in the PTX: the acq_rel GPU-scope
    atomics, whether a CTA barrier (``bar.sync``) lies between the last global store
    before the first such atomic and that atomic (every thread's partial stored before
    one thread releases), and the L2-only loads (``ld.global.cg``: the partials read
    back) after it."""
    lines = [x.strip() for x in ptx.splitlines() if x.strip() and not x.strip().startswith("//")]
    at = [i for i, x in enumerate(lines) if re.search(r"atom\.global\.gpu\.acq_rel", x)]
    if not at:
        return {"acq_rel_atomics": 0, "barrier_before_arrival": False, "cg_loads_after": 0}
    stores = [i for i, x in enumerate(lines[: at[0]]) if "st.global" in x]
    between = lines[stores[-1] if stores else 0 : at[0]]
    return {"acq_rel_atomics": len(at),
            "barrier_before_arrival": any(x.startswith(("bar.sync", "barrier.sync")) for x in between),
            "cg_loads_after": sum("ld.global.cg" in x for x in lines[at[0]:])}  # fmt: skip


def fp8_gemm_kernels() -> dict[str, tuple]:
    """The FP8 GEMM's decode launches (``kernels/linear/fp8_gemm.py``, the plan's tiles)
    at DeepSeek-V3's small-N shapes, by name: the split-K reduction inside the launch
    (bf16 with bias: kv_a at 1 row, q_a at 16; fp32 x, IEEE dots: kv_a at 1 row) and the
    former torch-summed launch (kv_a at 1 row)."""
    from unikv.kernels.linear import fp8_gemm

    out = {}
    for name, (m, n, fp32, fused) in {"kv_a_m1": (1, 576, False, True),
                                      "q_a_m16": (16, 1536, False, True),
                                      "kv_a_m1_fp32": (1, 576, True, True),
                                      "kv_a_m1_torch_sum": (1, 576, False, False)}.items():  # fmt: skip
        k = 7168
        cfg = fp8_gemm.plan(m, n, k, (128, 128), fp32)
        per = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k  # _launch's
        splits = triton.cdiv(k, per)
        act = "*fp32" if fp32 else "*bf16"
        values = {"x_ptr": act, "xs_ptr": act, "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                  "b_ptr": act, "y_ptr": act if fused else "*fp32", "ws_ptr": "*fp32",
                  "count_ptr": "*i32", "M": m, "N": n, "K": k, "k_per_split": per,
                  "stride_xm": k, "stride_xsm": k, "stride_wn": k, "stride_sn": k // 128,
                  "stride_ym": n, "stride_ys": 0 if fused else m * n}  # fmt: skip
        cons = {"BN": 128, "BK": 128, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                "BLOCK_K": cfg.block_k, "GROUP_M": 8, "PER_K_SCALE": cfg.per_k_scale,
                "W8A8": False, "HAS_BIAS": fused, "IEEE": fp32, "FUSED_SPLIT": fused,
                "SPLITS": splits if fused else 1}  # fmt: skip
        out[name] = (fp8_gemm._fp8_gemm_kernel, values, cons, cfg.num_warps, cfg.num_stages)
    return out


# gpt-oss's expert shape
EXPERTS, HIDDEN, INTER, TOP_K, ROWS = 32, 2880, 2880, 4, 1024


def _weights(mxfp4: bool, n: int, k: int) -> dict:
    """Strides of one (E, n, k) expert weight: packed MXFP4 blocks and scales, or bf16."""
    if mxfp4:
        return {"w_ptr": "*u8", "s_ptr": "*u8", "s_we": n * k // 2, "s_wn": k // 2, "s_wk": 1,
                "s_se": n * k // 32, "s_sn": k // 32}  # fmt: skip
    return {"w_ptr": "*bf16", "s_ptr": "*bf16", "s_we": n * k, "s_wn": k, "s_wk": 1,
            "s_se": 0, "s_sn": 0}  # fmt: skip


def _fp8_weights(n: int, k: int, bn: int = 128, bk: int = 128) -> dict:
    """Strides of one (E, n, k) block-scaled FP8 expert weight and its fp32 scales
    (bn x bk blocks; the gate/up stack's two parts blocked on their own)."""
    return {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "s_we": n * k, "s_wn": k, "s_wk": 1,
            "s_se": -(-n // bn) * -(-k // bk), "s_sn": -(-k // bk)}  # fmt: skip


def moe_kernels(cfg, mxfp4) -> list[tuple]:
    """[(kernel, values, constexprs, warps, stages)] of ``moe.fused_moe``'s gate/up and
    down launches for ``cfg`` at gpt-oss's shape (gpt-oss activation, biases); ``mxfp4``
    "fp8": ``fp8.moe_fp8``'s at that shape (block-scaled FP8 experts in 128 x 128 blocks,
    SwiGLU with gate and up concatenated, no biases); "w8a8": those launches with FP8
    activations and their group scales (split_k 1, as ``fused.launch`` runs them);
    "fp8odd": 16 x 24 blocks (the per-element scale mode, at ``fused.fp8_config``'s
    launch); "fp8odd-raw": those at the table's launch as it is."""
    from unikv.kernels.moe.fused import Fp8Blocks, block_m_for, fp8_config, fp8_mode, mxfp4_mode
    from unikv.kernels.moe.fused_kernels import _down_kernel, _gate_up_kernel

    w8a8 = mxfp4 == "w8a8"
    odd = mxfp4 in ("fp8odd", "fp8odd-raw")
    fp8 = mxfp4 in ("fp8", "w8a8") or odd
    bn, bk = (16, 24) if odd else (128, 128)
    # odd blocks at odd widths (no stride a multiple of 16: the JIT's worst layout, as
    # a small checkpoint's; the GPU failure above was one)
    hidden, inter = (120, 88) if odd else (HIDDEN, INTER)
    scale_mode = (3 if w8a8 else fp8_mode(cfg, Fp8Blocks(bn, bk))) if fp8 else 0
    if w8a8:
        cfg = cfg._replace(split_k=1)
    elif mxfp4 != "fp8odd-raw" and fp8:
        cfg = fp8_config(cfg, scale_mode)
    block_m = cfg.block_m or block_m_for(ROWS, EXPERTS)
    common = {"BLOCK_M": block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
              "SPLIT_K": cfg.split_k, "SWAP": bool(cfg.swap), "ASM": True,
              "MXFP4": mxfp4_mode(cfg, mxfp4 is True),
              "HAS_BIAS": not fp8, "IEEE": False, "ACT": 0 if fp8 else 1,
              "FP8": scale_mode, "BN": bn if fp8 else 1, "BK": bk if fp8 else 1}  # fmt: skip
    act = {"row_step": 1 if fp8 else 2, "up_offset": inter if fp8 else 1, "alpha": 1.702,
           "limit": 7.0}  # fmt: skip
    ids = {"sorted_ids_ptr": "*i32", "block_experts_ptr": "*i32", "num_assign": ROWS}
    w1 = _fp8_weights(2 * inter, hidden, bn, bk) if fp8 else _weights(mxfp4, 2 * inter, hidden)
    w1["s_se"] *= 1 + fp8  # gate's and up's scale rows: 2 * ceil(I / bn)
    w2 = _fp8_weights(hidden, inter, bn, bk) if fp8 else _weights(mxfp4, hidden, inter)
    scales = {"xs_ptr": "*fp32", "s_xsm": -(-hidden // 128)} if w8a8 else {"xs_ptr": "*bf16",
                                                                          "s_xsm": 0}  # fmt: skip
    a_scales = {"as_ptr": "*fp32", "s_asm": -(-inter // 128)} if w8a8 else {"as_ptr": "*fp32",
                                                                           "s_asm": 0}  # fmt: skip
    act_type = "*fp8e4nv" if w8a8 else "*bf16"
    gate = {"x_ptr": act_type, "b_ptr": "*bf16", "out_ptr": "*bf16", "top_k": TOP_K,
            "K": hidden, "I": inter, "s_xm": hidden, "s_xk": 1, "s_be": 2 * inter, "s_bn": 1,
            "s_om": inter, "s_on": 1, "s_up": -(-inter // bn) if fp8 else 0, **ids, **act,
            **w1, **scales}  # fmt: skip
    down = {"a_ptr": act_type, **a_scales, "b_ptr": "*bf16", "b1_ptr": "*bf16", "tw_ptr": "*bf16",
            "y_ptr": "*fp32", "N": hidden, "K": inter, "s_am": inter, "s_ak": 1,
            "s_be": hidden, "s_bn": 1, "s_b1e": hidden, "s_b1n": 1, "s_ym": hidden, "s_yn": 1,
            **ids, **act, **w2}  # fmt: skip
    down_cons = {**common, "ACT_IN_A": cfg.split_k > 1, "HAS_B1": False, "DTYPE": tl.bfloat16}
    quant_out = w8a8 and cfg.block_n % 128 == 0  # the activation quantised in gate/up
    gate["os_ptr"], gate["s_osm"] = ("*fp32", -(-inter // 128)) if quant_out else ("*bf16", 0)
    if quant_out:
        gate["out_ptr"] = "*fp8e4nv"
    gate_cons = {**common, "QUANT_OUT": quant_out, "DTYPE": tl.bfloat16}
    return [
        (_gate_up_kernel, gate, gate_cons, cfg.num_warps, cfg.num_stages),
        (_down_kernel, down, down_cons, cfg.num_warps, cfg.num_stages),
    ]


# the GPU tests' 16-row, whole-block tile (tests/kernels/test_kernels_moe_hopper.py), beside the table
TEST_TILE = (16, 3, False, 4)


def hopper_kernels(block_t: int, stages: int, one_mul: bool, half: bool = False,
                   warps: int = 4) -> list[tuple]:  # fmt: skip
    """The Hopper MXFP4 MoE's two launches (``kernels/moe/hopper.py``) at gpt-oss's
    expert shape, 256 tokens: (fn, values, constexprs, num_warps, num_stages) each."""
    from unikv.kernels.moe import hopper as moe_hopper

    d = i = 2880
    cons = {**moe_hopper.layouts(block_t, warps), "BLOCK_T": block_t, "STAGES": stages,
            "ONE_MUL": one_mul, "HALF": half, "HAS_BIAS": True}  # fmt: skip
    common = {"w_ptr": "*u8", "s_ptr": "*i32", "b_ptr": "*bf16", "sorted_ids_ptr": "*i32",
              "block_experts_ptr": "*i32", "num_assign": ROWS, "s_be": 2 * i, "s_bn": 1}  # fmt: skip
    gate_up = {**common, "x_ptr": "*bf16", "out_ptr": "*bf16", "top_k": 4, "K": d, "I": i,
               "KB": d // 64, "s_xm": d, "s_xk": 1, "s_om": i, "s_on": 1, "row_step": 2,
               "up_offset": 1, "alpha": 1.702, "limit": 7.0}  # fmt: skip
    down = {**common, "a_ptr": "*bf16", "tw_ptr": "*bf16", "y_ptr": "*fp32", "N": d, "K": i,
            "KB": i // 64, "s_am": i, "s_ak": 1, "s_be": d, "s_ym": d, "s_yn": 1}  # fmt: skip
    return [
        (moe_hopper.gate_up_kernel, gate_up, {**cons, "ACT": 1}, warps, 1),
        (moe_hopper.down_kernel, down, cons, warps, 1),
    ]


def extend_hopper_kernel(dim: int = 128, sinks: bool = False) -> tuple:
    """The Hopper fresh-prompt attention (``kernels/attention/fresh_hopper.py``) at 32 / 8 heads:
    (fn, values, constexprs, num_warps, num_stages, maxnreg)."""
    from unikv.kernels.attention import fresh_hopper as eh

    def desc(rows: int) -> str:
        layout = eh.gl.NVMMASharedLayout.get_default_for([rows, dim], eh.gl.bfloat16)
        return f"tensordesc<bf16[{rows}, {dim}],{layout}>"

    values = {"q_desc": desc(64), "k_desc": desc(eh.BLOCK_N), "v_desc": desc(eh.BLOCK_N),
              "q_indptr": "*i32", "sinks": "*fp32", "out": "*bf16", "o_st": 32 * dim,
              "o_sh": dim, "qk_scale": 0.5}  # fmt: skip
    cons = {"GROUP": 4, "D": dim, "DV": dim, "BLOCK_N": eh.BLOCK_N, "STAGES": eh.STAGES,
            "HAS_SINKS": sinks}  # fmt: skip
    return eh.fresh_kernel, values, cons, 4, 1, eh.MAXNREG


def gemv_kernels() -> dict[str, tuple]:
    """The one-request GEMV's launches (``kernels/linear/gemv.py``) at the Llama-3.2-1B shape,
    by name: plain qkv, SwiGLU inside down, the pre-norm inside qkv (with and without
    a residual, and with the embedding gathered inside, also through the feedback
    buffer), the LM head with the greedy
    argmax inside, each as the Hopper launch compiles it (PDL on: the wait and the
    trigger)."""
    from unikv.kernels.linear import gemv

    block_n, block_k, warps, stages = gemv.CONFIG
    ptrs = {n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "r_ptr", "nw_ptr",
                                 "r_out_ptr")}  # fmt: skip
    ptrs["ids_ptr"] = ptrs["keys_ptr"] = ptrs["feed_ptr"] = "*i64"
    base = {"M": 1, "BLOCK_N": block_n, "BLOCK_K": block_k, "NUM_STAGES": stages,
            "EVEN_K": True, "HAS_BIAS": False, "ACT": False, "NORM": False, "HAS_RES": False,
            "GATHER": False, "FEED": False, "ARGMAX": False, "PDL": True}  # fmt: skip
    cases = {"qkv": (3072, 2048, {}), "down_silu": (2048, 8192, {"ACT": True}),
             "qkv_norm": (3072, 2048, {"NORM": True}),
             "qkv_add_norm": (3072, 2048, {"NORM": True, "HAS_RES": True}),
             "qkv_embed_norm": (3072, 2048, {"NORM": True, "GATHER": True}),
             "qkv_embed_norm_feed": (3072, 2048, {"NORM": True, "GATHER": True, "FEED": True}),
             "lm_head_norm_argmax": (128256, 2048, {"NORM": True, "HAS_RES": True,
                                                     "ARGMAX": True})}  # fmt: skip
    out = {}
    for name, (n, k, flags) in cases.items():
        values = {**ptrs, "N": n, "K": k, "s_xm": 2 * k if flags.get("ACT") else k,
                  "s_wn": k, "s_ym": n, "s_rm": k, "eps": 1e-5, "offset": 0.0}  # fmt: skip
        out[name] = (gemv._gemv_kernel, values, {**base, **flags}, warps, stages)
    return out


def step_kernels() -> dict[str, tuple]:
    """The rest of one request's decode chain at the Llama-3.2-1B shape (32 / 8 heads,
    head dim 64, page 16, bf16), each as the Hopper launch compiles it (PDL on): rope +
    store, the decode split (and with rope + store inside, and with the pre-wait loads
    of one request's step too, with or without the rope), its merge, the argmax's chunk and merge, and the fused argmax's finish."""
    from unikv.kernels.attention import decode, rope_store
    from unikv.kernels.linear import argmax

    bf16 = "*bf16"
    rope = {"q": bf16, "k": bf16, "v": bf16, "k_cache": bf16, "v_cache": bf16,
            "ids": "*i64", "cos": "*fp32", "sin": "*fp32", "pos": "*i64", "sq0": 3072,
            "sq1": 64, "sk0": 3072, "sk1": 64, "sv0": 3072, "sv1": 64, "sc0": 32,
            "kc_sb": 8192, "kc_sn": 512, "kc_sh": 64, "vc_sb": 8192, "vc_sn": 512,
            "vc_sh": 64, "HQ": 32, "HALF": 32}  # fmt: skip
    rope_cons = {"H": 8, "D": 64, "DV": 64, "PS": 16, "BLOCK_HQ": 32, "BLOCK_H": 8,
                 "BLOCK_R": 32, "BLOCK_P": 0, "BLOCK_DV": 64, "PDL": True}  # fmt: skip
    split = {"q": bf16, "k_cache": bf16, "v_cache": bf16, "block_table": "*i32",
             "seq_lens": "*i32", "sinks": "*fp32", "out": bf16, "ws_acc": "*fp32",
             "ws_lse": "*fp32", "sm_scale": 0.125, "soft_cap": 0.0, "window": 0,
             "q_sb": 2048, "q_sh": 64, "k_sb": 8192, "k_sn": 512, "k_sh": 64, "v_sb": 8192,
             "v_sn": 512, "v_sh": 64, "bt_sb": 64, "o_sb": 2048, "o_sh": 64, "k_new": bf16,
             "v_new": bf16, "write_ids": "*i64", "cos": "*fp32", "sin": "*fp32",
             "pos": "*i64", "kn_sb": 3072, "kn_sh": 64, "vn_sb": 3072, "vn_sh": 64,
             "sc0": 32, "HALF": 32}  # fmt: skip
    block_n, warps, stages = decode.CONFIGS[64]
    split_cons = {"GROUP": 4, "BLOCK_G": 16, "D": 64, "DV": 64, "BLOCK_D": 64, "BLOCK_DV": 64,
                  "PAGE_SIZE": 16, "BLOCK_N": block_n, "NUM_SPLITS": 64, "HAS_WINDOW": False,
                  "HAS_SINKS": False, "HAS_CAP": False, "NUM_STAGES": stages,
                  "PRECISION": "tf32", "ROPE": False, "PDL": True,
                  "PRELOAD": False, "STORE": False}  # fmt: skip
    rope_split = {**split_cons, "ROPE": True}
    merge = {"ws_acc": "*fp32", "ws_lse": "*fp32", "sinks": "*fp32", "out": bf16,
             "o_sb": 2048, "o_sh": 64, "HQ": 32}  # fmt: skip
    merge_tiles = decode.merge_launch(66, 64)  # one request's 66 splits
    merge_cons = {"DV": 64, "BLOCK_DV": 64, "NUM_SPLITS": 66, "HAS_SINKS": False, "PDL": True,
                  "BLOCK_S": merge_tiles["BLOCK_S"], "CHUNK_S": merge_tiles["CHUNK_S"]}  # fmt: skip
    chunk = {"x": "*fp32", "s_row": 128256, "V": 128256, "chunk": 1024, "best_v": "*fp32",
             "best_i": "*i32", "out": "*i64", "splits": 126}  # fmt: skip
    pick = {"best_v": "*fp32", "best_i": "*i32", "out": "*i64", "V": 128256, "splits": 126}
    chunk_cons = {"DIRECT": False, "BLOCK": argmax.BLOCK, "PDL": True}
    pick_cons = {"BLOCK_S": argmax.MERGE_BLOCK, "PDL": True}
    finish = {"keys": "*i64", "out": "*i64", "rows": 1, "init": argmax.KEY_INIT}
    return {
        "rope_store": (rope_store._rope_store_kv_kernel, rope, rope_cons, 4, 3),
        "decode_split": (decode._decode_split_kernel, split, split_cons, warps, stages),
        "decode_split_rope": (decode._decode_split_kernel, split, rope_split, warps, stages),
        "decode_split_rope_preload": (
            decode._decode_split_kernel,
            split,
            {**rope_split, "PRELOAD": True},
            warps,
            stages,
        ),
        # the K/V store without rope inside (NemotronH's attention), one request's step
        "decode_split_store_preload": (
            decode._decode_split_kernel,
            split,
            {**split_cons, "STORE": True, "PRELOAD": True},
            warps,
            stages,
        ),
        "decode_merge": (
            decode._decode_merge_kernel,
            merge,
            merge_cons,
            merge_tiles["num_warps"],
            3,
        ),
        "argmax_chunk": (argmax._argmax_chunk_kernel, chunk, chunk_cons, 4, 3),
        "argmax_merge": (argmax._argmax_merge_kernel, pick, pick_cons, 1, 3),
        "argmax_finish": (argmax._argmax_finish_kernel, finish, {"BLOCK": 16, "PDL": True}, 1, 3),
    }


def main() -> None:
    import argparse
    import json

    from unikv.kernels.moe import fused as moe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="[[config, mxfp4], ...] -> JSON results")
    parser.add_argument("--gemv", action="store_true", help="the GEMV's launches -> JSON")
    parser.add_argument("--hopper", action="store_true",
                        help="the Hopper MXFP4 MoE's table entries -> JSON")  # fmt: skip
    parser.add_argument("--extend", action="store_true",
                        help="the Hopper fresh-prompt attention (D 64, 128) -> JSON")  # fmt: skip
    parser.add_argument("--step", action="store_true",
                        help="the rest of one request's decode chain -> JSON")  # fmt: skip
    parser.add_argument("--fp8", action="store_true",
                        help="the FP8 GEMM's split-K decode launches -> JSON")  # fmt: skip
    args = parser.parse_args()
    if args.gemv or args.step or args.fp8:
        launches = (
            gemv_kernels() if args.gemv else step_kernels() if args.step else fp8_gemm_kernels()
        )
        print(json.dumps({name: compile_sm90(*launch) for name, launch in launches.items()}))
        return
    if args.extend:
        out = {}
        for dim in (64, 128):
            for sinks in (False, True):
                *launch, maxnreg = extend_hopper_kernel(dim, sinks)
                out[f"d{dim}{':sinks' * sinks}"] = compile_sm90(*launch, maxnreg=maxnreg)
        print(json.dumps(out))
        return
    if args.hopper:
        from unikv.kernels.moe import hopper as moe_hopper

        out = {}
        tiles = {**moe_hopper.TABLE, "gpu_tests": TEST_TILE}  # + the GPU tests' 16-row tile
        for bucket, (block_t, stages, half, warps) in tiles.items():
            for one_mul in (True, False):
                launches = hopper_kernels(block_t, stages, one_mul, half, warps)
                key = f"{bucket}:{block_t}x{stages}x{warps}{':half' * half}{':one' * one_mul}"
                out[key] = [compile_sm90(*launch) for launch in launches]
        print(json.dumps(out))
        return
    if args.json is not None:
        cases = [(moe.Config(*cfg), mx if isinstance(mx, str) else bool(mx))
                 for cfg, mx in json.loads(args.json)]  # fmt: skip
        out = []
        for cfg, mxfp4 in cases:
            try:
                out.append([compile_sm90(*launch) for launch in moe_kernels(cfg, mxfp4)])
            except Exception as exc:  # noqa: BLE001 - the caller reports it
                out.append({"error": repr(exc)[:2000]})
        print(json.dumps(out))
        return
    configs = sorted({c for cs in moe.CANDIDATES.values() for c in cs}
                     | {c for c in moe.TABLE.values() if c is not moe.LOOP})  # fmt: skip
    print("format config: gate_up | down  (registers, spill bytes, smem KiB, pipelined copies)")
    for cfg in configs:
        for mxfp4 in (True, False):
            try:
                rows = [compile_sm90(*launch) for launch in moe_kernels(cfg, mxfp4)]
                text = " | ".join(f"{r['regs']}r {r['spill_bytes']}sp {r['smem'] // 1024}K "
                                  f"{r['async_copies']}a" for r in rows)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - reported, the others still compile
                text = f"FAILED {exc!r:.300}"
            print(f"{'mxfp4' if mxfp4 else 'bf16 '} {tuple(cfg)}: {text}", flush=True)


if __name__ == "__main__":
    main()
