"""The MoE kernels and the one-request GEMV compiled for the H200 (sm_90a) on this CPU
host: every MoE table entry and the swapped-operand candidates at gpt-oss's shape (and
the tiles the block-scaled FP8 experts' plan picks, at that shape), the
GEMV's variants at Llama-3.2-1B's, with the JIT's specialisation
(``benchmarks/aot_sm90.py``, in a subprocess without the interpreter). The interpreter
runs a kernel's semantics but never compiles it; this catches what only the GPU compile
would (a layout or shape the NVIDIA backend refuses, ptxas errors) and a K loop whose
loads stop being software-pipelined (no ``async_copy_global_to_local``), before any
device time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unikv.kernels.moe import fp8 as moe_fp8
from unikv.kernels.moe import fused as moe
from unikv.kernels.moe import hopper as moe_hopper

ROOT = Path(__file__).resolve().parents[2]

from benchmarks import aot_sm90

pytestmark = pytest.mark.skipif(not os.path.exists(aot_sm90.PTXAS), reason="needs Triton's ptxas")

NEW = [c for cs in moe.CANDIDATES.values() for c in cs if c.swap]
CONFIGS = sorted(set(NEW) | {c for c in moe.TABLE.values() if c is not moe.LOOP})
# block-scaled FP8 experts (``kernels/moe/fp8.py``): every tile its plan can pick for
# 16-bit activations, at 128 x 128 blocks (the K tile inside one scale block)
FP8_CONFIGS = sorted({moe_fp8.plan(b, torch.bfloat16) for b in moe.BUCKETS} - {moe.LOOP})
# and every tile its plan can pick for W8A8 (FP8 activations: FP8 x FP8 wgmma)
W8A8_CONFIGS = sorted({moe_fp8.plan(b, torch.bfloat16, w8a8=True) for b in moe.BUCKETS
                       if moe_fp8.w8a8_rows(b)} - {moe.LOOP})  # fmt: skip
CASES = [(c, mx) for c in CONFIGS for mx in (True, False)] + [(c, "fp8") for c in FP8_CONFIGS]
CASES += [(c, "w8a8") for c in W8A8_CONFIGS]
# odd scale blocks (16 x 24: a K tile spans two blocks, the per-element scale mode) at
# the launch ``fused.fp8_config`` gives them: the table's three stages needed 340 KB on
# the H100 (test_models_fp8's bf16 GPU cases, OutOfResources at 43ff8cf)
CASES += [(c, "fp8odd") for c in FP8_CONFIGS]


def test_compiles_for_sm90_with_pipelined_loads(tmp_path):
    """One subprocess compiles every case (one test: a parametrized set would compile
    them once per xdist worker)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # real compiles, not cache hits
    cases = json.dumps([[list(c), mx] for c, mx in CASES])
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "aot_sm90.py"), "--json", cases],
                         check=False, capture_output=True, text=True, env=env, timeout=1200)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.splitlines()[-1])
    bad = []
    for (cfg, mxfp4), result in zip(CASES, results, strict=True):
        if not isinstance(result, list):
            bad.append((cfg, mxfp4, result))  # the compile error
            continue
        block_m = cfg.block_m or moe.block_m_for(aot_sm90.ROWS, aot_sm90.EXPERTS)
        for name, got in zip(("gate_up", "down"), result, strict=True):
            ok = got["async_copies"] > 0 or mxfp4 == "fp8odd"  # pipelined (odd: one stage)
            ok &= got["smem"] <= 227 * 1024  # fits an H200 SM's shared memory
            if cfg.swap or block_m >= 64:  # 64 MMA rows: a warpgroup's wgmma
                ok &= got["wgmma"]
            if not ok:
                bad.append((cfg, mxfp4, name, got))
    assert not bad, bad
    assert len(results) == len(CASES) > 20  # every table entry and swap candidate, all formats


def test_gemv_compiles_for_sm90_with_pipelined_weight_loads(tmp_path):
    """The one-request GEMV (plain, SwiGLU inside, the pre-norm inside with and without
    a residual, the embedding gathered inside, also through the feedback buffer, the LM head with the greedy argmax
    inside; PDL on) for sm_90a at the Llama-3.2-1B shape: each streams its weight
    tiles through pipelined async copies, spills nothing, fits an SM's shared memory
    and keeps PDL's contract."""
    results = _compiled("--gemv", tmp_path)
    assert sorted(results) == ["down_silu", "lm_head_norm_argmax", "qkv", "qkv_add_norm",
                               "qkv_embed_norm", "qkv_embed_norm_feed", "qkv_norm"]  # fmt: skip
    bad = {name: r for name, r in results.items()
           if not (r["async_copies"] > 0 and r["spill_bytes"] == 0 and r["smem"] <= 227 * 1024
                   and _keeps_pdl_contract(r, trigger=True))}  # fmt: skip
    assert not bad, bad


def _compiled(flag: str, tmp_path) -> dict:
    """``aot_sm90.py FLAG``'s JSON, compiled in a subprocess without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "aot_sm90.py"), flag],
                         check=False, capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def _keeps_pdl_contract(result: dict, trigger: bool) -> bool:
    """kernels/runtime/pdl.py's contract in a compiled kernel: one wait, no global load or store
    before it, and (``trigger``) one trigger, placed after it."""
    return (result["pdl_wait"] == 1 and result["stores_before_wait"] == 0
            and result["loads_before_wait"] == 0 and not result["trigger_before_wait"]
            and result["pdl_trigger"] == int(trigger))  # fmt: skip


def test_decode_chain_keeps_the_pdl_contract_for_sm90(tmp_path):
    """The rest of one request's decode chain (rope + store, the decode split, alone,
    with rope + store inside, and with the pre-wait loads too, with or without the rope,
    its merge, the argmax's
    two launches and the fused argmax's finish), compiled with PDL on for sm_90a: each
    program waits before its first global load or store, and the kernels a next one
    follows trigger only after that wait (the argmax's merge and finish, last of the
    step, do not)."""
    results = _compiled("--step", tmp_path)
    names = ["argmax_chunk", "argmax_finish", "argmax_merge", "decode_merge", "decode_split",
             "decode_split_rope", "decode_split_rope_preload", "decode_split_store_preload",
             "rope_store"]  # fmt: skip
    assert sorted(results) == names
    # one request's step loads its split's range and first tile before the wait
    # (decode.PRELOAD, pdl.py's step 1 exception) and stores nothing there (the new
    # K/V row, rotated or not, is stored after it)
    for name in ("decode_split_rope_preload", "decode_split_store_preload"):
        pre = results.pop(name)
        assert pre["loads_before_wait"] > 0 and pre["stores_before_wait"] == 0, (name, pre)
        assert pre["pdl_wait"] == 1 and pre["pdl_trigger"] == 1 and not pre["trigger_before_wait"]
        assert not pre["spill_bytes"], (name, pre)
    bad = {name: r for name, r in results.items()
           if not _keeps_pdl_contract(r, trigger=name not in ("argmax_merge", "argmax_finish")) or r["spill_bytes"]}  # fmt: skip
    assert not bad, bad


def test_fp8_gemm_split_k_arrival_is_ordered_for_sm90(tmp_path):
    """The FP8 GEMM's decode launches (``fp8_gemm``: the split-K partials reduced inside
    the launch) compiled for sm_90a: the K loop's loads pipelined, no spills; in the
    fused launches one acq_rel GPU-scope atomic (the tile's arrival) with a CTA barrier
    between the partial's last global store and it (every thread's partial stored
    before the one thread's release) and the partials read back from L2 (``.cg``),
    every split's in straight-line code (two 16-byte loads a thread per 16 x 64 fp32
    partial); the torch-summed launch has no atomic."""
    results = _compiled("--fp8", tmp_path)
    assert sorted(results) == ["kv_a_m1", "kv_a_m1_fp32", "kv_a_m1_torch_sum", "q_a_m16"]
    for name, got in results.items():
        assert got["spill_bytes"] == 0 and got["async_copies"] > 0, (name, got)
        if name.endswith("torch_sum"):
            assert got["acq_rel_atomics"] == 0, got
            continue
        assert got["acq_rel_atomics"] == 1 and got["barrier_before_arrival"], (name, got)
    assert results["kv_a_m1"]["cg_loads_after"] == 2 * 14  # 14 splits (K 7168 / 512)
    assert results["q_a_m16"]["cg_loads_after"] == 2 * 10  # 10 splits of 768


def test_hopper_moe_compiles_for_sm90(tmp_path):
    """The Hopper MXFP4 MoE (Gluon) at every table entry and the GPU tests' 16-row tile,
    both decodes: it compiles for sm_90a (the fragments' register layout equal to
    wgmma's A operand, or the compile fails), without spills, its copies asynchronous,
    its products wgmma, its shared memory within an H200 SM's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "aot_sm90.py"), "--hopper"],
                         check=False, capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.splitlines()[-1])
    assert len(results) == 2 * (len(moe_hopper.TABLE) + 1)  # + the GPU tests' 16-row tile
    for key, launches in results.items():
        for got in launches:
            ok = got["spill_bytes"] == 0 and got["async_copies"] > 0 and got["wgmma"]
            assert ok and got["smem"] <= 227 * 1024, (key, got)


def test_hopper_extend_compiles_for_sm90(tmp_path):
    """The Hopper fresh-prompt attention (Gluon, ``kernels/attention/fresh_hopper.py``) at D 64 and
    128, with and without sinks: it compiles for sm_90a without spills, its products
    wgmma, its shared memory within an SM's, the registers split between the consumer
    warpgroups (240) and the producer (24), and every buffer release (one thread's
    mbarrier arrival) after a barrier over its warpgroup, so no warp of it still reads
    the buffer the producer refills."""
    from unikv.kernels.attention import fresh_hopper as extend_hopper

    results = _compiled("--extend", tmp_path)
    assert sorted(results) == ["d128", "d128:sinks", "d64", "d64:sinks"]
    regs = {int(extend_hopper.CONSUMER_REGS), int(extend_hopper.PRODUCER_REGS)}
    for key, got in results.items():
        ok = got["spill_bytes"] == 0 and got["wgmma"] and got["smem"] <= 227 * 1024
        assert ok and regs <= set(got["setmaxnreg"]) and got["unsynced_arrives"] == 0, (key, got)


def test_the_shared_memory_check_sees_the_launch_that_failed_on_the_gpu(tmp_path):
    """The 16-bit table's 8-token entry, which the FP8 launch took before ``fp8.TABLE``
    had entries, at 16 x 24 scale blocks (three stages, without ``fused.fp8_config``)
    needs more than an SM's 227 KB: the OutOfResources the H100 raised (session 23),
    seen here by the compile above's smem bound."""
    cfg = moe.plan(8, False, torch.bfloat16)
    assert cfg.num_stages > 1
    cases = json.dumps([[list(cfg), "fp8odd-raw"]])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "aot_sm90.py"), "--json", cases],
                         check=False, capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (result,) = json.loads(run.stdout.splitlines()[-1])
    assert max(r["smem"] for r in result) > 227 * 1024, result
