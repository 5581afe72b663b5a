"""The widest global load of the cache-reading kernels, compiled for sm_90a on this host.

Triton vectorises a load when its alignment analysis proves the address a multiple of
the vector's bytes. Issue 38's crash was a proof that did not hold: the MLA kernels
addressed a latent row as ``kernel_row(entry, pos, ps) * row_stride``, and Triton 3.6
took the divisibility of ``entry * ps + pos % ps`` (ps, true of a page's first slot
only) for every row, so at ps >= 2 and a 120-byte row (fp32, rank 24 + rope 6) it
emitted 16-byte loads at 8-byte-aligned rows: ``misaligned address``, a dead CUDA
context. ``_ids.row_offset`` (``entry * (ps * stride) + slot * stride``) is analysed
correctly.

Each case compiles one kernel as the JIT specialises a call (every pointer 16-byte
aligned, ints divisible by 16 marked so, ints equal to 1 constant) with every stride
set to ``stride`` elements, and reports the widest ``ld.global`` in bytes (of the PTX:
the compile stops there, no ptxas; a specialisation is compiled once, as strides 26, 30
and 31 specialise alike: none is divisible by 16 or equal to 1). A load is
sound iff it is at most ``max(4, gcd(16, stride * itemsize))`` bytes (a 4-byte load
is one int32 table entry or one fp32 / two 16-bit elements of a 4-byte-aligned row).

Run without ``TRITON_INTERPRET`` (``tests/kernels/test_odd_widths.py`` starts it in a
subprocess): ``python tests/ptx_alignment.py`` prints one JSON list of
``[name, stride, itemsize, widest_bytes]`` (widest_bytes is the error's text where
the kernel does not compile: ``python tests/ptx_alignment.py mla|mha|all``).
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys

DTYPES = {"fp32": 4, "bf16": 2}


def compile_ptx(
    fn, values: dict, constexprs: dict, num_warps: int = 4, stage: str = "ptx", **options
) -> str:
    """PTX of ``fn`` for sm_90a (or an earlier ``stage``'s text: "ttgir"), arguments
    specialised as the JIT would (values: pointers as type strings, ints, floats;
    ``None`` values are constexprs); ``options``: the launch's compile options."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    nospec = set(getattr(fn, "do_not_specialize", ()) or ())
    nospec |= {fn.arg_names[i] for i in nospec if isinstance(i, int)}
    sig, cons, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        value = values.get(name)
        if name in constexprs or value is None:
            sig[name] = "constexpr"
            cons.setdefault(name, None)
        elif isinstance(value, str):
            sig[name] = value
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        elif name not in nospec and value == 1:
            sig[name], cons[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if name not in nospec and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    opts = {"num_warps": num_warps, "num_stages": 1, **options}
    key = (fn, repr([sorted(d.items(), key=str) for d in (sig, cons, attrs, opts)]), stage)
    if key not in _COMPILED:  # the strides that specialise alike compile once
        src = ASTSource(fn=fn, signature=sig, constexprs=cons, attrs=attrs)
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
            _COMPILED[key] = kernel.asm[stage]
        except Exception as e:  # noqa: BLE001  (kept: the same shape fails alike)
            _COMPILED[key] = e
    if isinstance(_COMPILED[key], Exception):
        raise _COMPILED[key]
    return _COMPILED[key]


_COMPILED: dict = {}


def _ptx_only(backend, stages, options, language, capability) -> None:
    """Stop at the PTX (the loads are read there): no ptxas run for a cubin."""
    stages["cubin"] = lambda src, metadata: b""


def widest_load(ptx: str) -> int:
    """Bytes of the widest ``ld.global`` (vector count x element bits / 8)."""
    widest = 0
    for m in re.finditer(r"ld\.global((?:\.[\w:]+)*)", ptx):
        parts = m.group(1).split(".")
        vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        bits = next((int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bsuf]\d+", p)), 8)
        widest = max(widest, vec * bits // 8)
    return widest


def cx(**kw) -> dict:
    """A kernel's constexprs (or arguments) by name."""
    return kw


def sound_bytes(stride: int, itemsize: int) -> int:
    return max(4, math.gcd(16, stride * itemsize))


def _mla_values(dt: str, stride: int) -> dict:
    ptrs = cx(
        q_lat=f"*{dt}",
        q_rope=f"*{dt}",
        cache=f"*{dt}",
        block_table="*i32",
        q_indptr="*i32",
        seq_lens="*i32",
        out=f"*{dt}",
        ws_acc="*fp32",
        ws_lse="*fp32",
        lat_new=f"*{dt}",
        rope_new=f"*{dt}",
        write_ids="*i32",
    )
    ints = ("ql_st", "ql_sh", "qr_st", "qr_sh", "c_sn", "bt_sb", "o_st", "o_sh", "ln_st", "rn_st")
    return {**ptrs, **{n: stride for n in ints}, "sm_scale": 0.1, "num_splits": 2}


def cases():
    """(name, fn, values, constexprs, num_warps, stride, itemsize) of every MLA cache
    reader (extend, decode split, decode fused gather / one-page tiles, the decodes with the
    new row stored inside: ``_store``) and the store,
    at odd strides (the crash's 30 and 26 elements, an odd 31) and aligned ones."""
    from unikv.kernels.attention import store
    from unikv.kernels.mla import decode as mla_decode
    from unikv.kernels.mla import decode_fused as mla_decode_fused
    from unikv.kernels.mla import prefill as mla

    rank, rope = 24, 6
    for dt, item in DTYPES.items():
        prec = "ieee" if dt == "fp32" else "tf32"
        for stride in (26, 30, 31, 32):
            vals = _mla_values(dt, stride)
            for ps in (1, 4, 16):
                yield (
                    f"mla_extend/{dt}/ps{ps}",
                    mla._mla_kernel,
                    vals,
                    cx(
                        H=4,
                        RANK=rank,
                        ROPE=rope,
                        BLOCK_R=32,
                        BLOCK_P=16,
                        PAGE_SIZE=ps,
                        BLOCK_M=16,
                        BLOCK_N=16,
                        NUM_SPLITS=1,
                        NUM_STAGES=1,
                        PRECISION=prec,
                    ),
                    4,
                    stride,
                    item,
                )
                for num_v, store_row in ((1, False), (2, False), (2, True)):
                    yield (
                        f"mla_decode_split{num_v}{'_store' * store_row}/{dt}/ps{ps}",
                        mla_decode._split_kernel,
                        vals,
                        cx(
                            H=4,
                            RANK=rank,
                            ROPE=rope,
                            BLOCK_V=32 // num_v,
                            BLOCK_P=16,
                            NUM_V=num_v,
                            PAGE_SIZE=ps,
                            BLOCK_H=16,
                            BLOCK_N=16,
                            SPLIT=True,
                            NUM_STAGES=1,
                            PRECISION=prec,
                            STORE=store_row,
                        ),
                        4,
                        stride,
                        item,
                    )
            for (ps, block_n), store_row in itertools.product(
                ((4, 16), (16, 16), (64, 64)), (False, True)
            ):
                yield (
                    f"mla_decode_fused{'_store' * store_row}/{dt}/ps{ps}/n{block_n}",
                    mla_decode_fused._fused_kernel,
                    vals,
                    cx(
                        H=4,
                        RANK=rank,
                        ROPE=rope,
                        BLOCK_V=16,
                        BLOCK_P=16,
                        PAGE_SIZE=ps,
                        BLOCK_H=16,
                        BLOCK_N=block_n,
                        NUM_STAGES=1,
                        PRECISION=prec,
                        CONTIG=ps % block_n == 0,
                        TMA=False,
                        STORE=store_row,
                    ),
                    4,
                    stride,
                    item,
                )
            store_vals = cx(
                k_cache=f"*{dt}", v_cache=f"*{dt}", ids="*i32", k=f"*{dt}", v=f"*{dt}", T=7
            )
            store_vals.update(
                {n: stride for n in ("kc_sb", "kc_sn", "vc_sb", "vc_sn", "k_st", "v_st")}
            )
            store_vals.update(kc_sh=rank, vc_sh=rope, k_sh=rank, v_sh=rope)
            yield (
                f"store_mla/{dt}",
                store._store_kv_kernel,
                store_vals,
                cx(
                    H=1,
                    D=rank,
                    DV=rope,
                    PS=1,
                    BLOCK_T=8,
                    BLOCK_D=32,
                    BLOCK_DV=8,
                    BLOCK_CK=32,
                    BLOCK_CV=8,
                ),
                4,
                stride,
                item,
            )


def _generic(fn, ptrs: dict, floats: tuple, stride: int, extra: dict) -> dict:
    """Every runtime argument of ``fn``: pointers (name -> type), floats, else ``stride``."""
    vals = {}
    for p in fn.params:
        if p.is_constexpr:
            continue
        name = p.name
        vals[name] = ptrs.get(name) or (0.5 if name in floats else extra.get(name, stride))
    return vals


def mha_cases():
    """The MHA cache readers and writers at head dims 6 and 40 (issue 38's odd widths):
    extend and decode attention (decode with its in-launch rope + store), the rope +
    store and the store, every stride ``stride`` elements."""
    from unikv.kernels.attention import decode, extend, rope_store, store

    for dt, item in DTYPES.items():
        prec = "ieee" if dt == "fp32" else "tf32"
        for dim in (6, 40):
            bd = 1 << (dim - 1).bit_length()
            for stride in (dim, 31):
                t = {
                    n: f"*{dt}"
                    for n in ("q", "k_cache", "v_cache", "out", "sinks", "k_new", "v_new", "k", "v")
                }
                t.update(
                    block_table="*i32",
                    seq_lens="*i32",
                    q_indptr="*i32",
                    ws_acc="*fp32",
                    ws_lse="*fp32",
                    write_ids="*i32",
                    ids="*i32",
                    cos="*fp32",
                    sin="*fp32",
                    pos="*i32",
                )
                for ps in (1, 4, 16):
                    vals = _generic(
                        extend._extend_kernel, t, ("sm_scale", "soft_cap"), stride, {"window": 0}
                    )
                    yield (
                        f"extend/{dt}/d{dim}/ps{ps}",
                        extend._extend_kernel,
                        vals,
                        cx(
                            GROUP=2,
                            D=dim,
                            DV=dim,
                            BLOCK_D=bd,
                            BLOCK_DV=bd,
                            PAGE_SIZE=ps,
                            BLOCK_M=64,
                            BLOCK_N=32,
                            HAS_WINDOW=False,
                            HAS_SINKS=False,
                            HAS_CAP=False,
                            NUM_STAGES=1,
                            PRECISION=prec,
                        ),
                        4,
                        stride,
                        item,
                    )
                    for rope, store_row in ((False, False), (True, False), (False, True)):
                        vals = _generic(
                            decode._decode_split_kernel,
                            t,
                            ("sm_scale", "soft_cap"),
                            stride,
                            {"window": 0, "HALF": dim // 2},
                        )
                        tag = "_rope" if rope else "_store" if store_row else ""
                        yield (
                            f"decode{tag}/{dt}/d{dim}/ps{ps}",
                            decode._decode_split_kernel,
                            vals,
                            cx(
                                GROUP=2,
                                BLOCK_G=16,
                                D=dim,
                                DV=dim,
                                BLOCK_D=bd,
                                BLOCK_DV=bd,
                                PAGE_SIZE=ps,
                                BLOCK_N=32,
                                NUM_SPLITS=2,
                                HAS_WINDOW=False,
                                HAS_SINKS=False,
                                HAS_CAP=False,
                                NUM_STAGES=1,
                                PRECISION=prec,
                                ROPE=rope,
                                PDL=False,
                                PRELOAD=False,
                                STORE=store_row,
                            ),
                            4,
                            stride,
                            item,
                        )
                vals = _generic(
                    rope_store._rope_store_kv_kernel, t, (), stride, {"HQ": 4, "HALF": dim // 2}
                )
                half = dim // 2
                yield (
                    f"rope_store/{dt}/d{dim}",
                    rope_store._rope_store_kv_kernel,
                    vals,
                    cx(
                        H=2,
                        D=dim,
                        DV=dim,
                        PS=4,
                        BLOCK_HQ=4,
                        BLOCK_H=2,
                        BLOCK_R=1 << (half - 1).bit_length(),
                        BLOCK_P=0,
                        BLOCK_DV=bd,
                        PDL=False,
                    ),
                    4,
                    stride,
                    item,
                )
                vals = _generic(store._store_kv_kernel, t, (), stride, {"T": 7})
                yield (
                    f"store/{dt}/d{dim}",
                    store._store_kv_kernel,
                    vals,
                    cx(
                        H=2,
                        D=dim,
                        DV=dim,
                        PS=4,
                        BLOCK_T=8,
                        BLOCK_D=bd,
                        BLOCK_DV=bd,
                        BLOCK_CK=2 * bd,
                        BLOCK_CV=2 * bd,
                    ),
                    4,
                    stride,
                    item,
                )


def main() -> None:
    from triton import knobs

    if hasattr(knobs.runtime, "add_stages_inspection_hook"):
        knobs.runtime.add_stages_inspection_hook = _ptx_only
    out = []
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    chosen = {"mla": [cases], "mha": [mha_cases], "all": [cases, mha_cases]}[which]
    for name, fn, vals, cons, warps, stride, item in (c for f in chosen for c in f()):
        try:
            widest = widest_load(compile_ptx(fn, vals, cons, warps))
        except Exception as e:  # noqa: BLE001  (a shape the kernel does not compile)
            widest = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
        out.append([name, stride, item, widest])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
