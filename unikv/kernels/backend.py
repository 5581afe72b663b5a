"""One typed kernel backend, chosen once (docs/design.md section 5).

``get_backend(device, name)`` is the only selector. It returns a frozen
``KernelBackend`` holding every op the pool, the allocator and the runner call:
Triton kernels on CUDA (or on the CPU under ``TRITON_INTERPRET=1`` when asked
for by name), their pure-torch references elsewhere. Each op has the same
signature in both backends, so the per-step path never branches on device.

``plan_decode`` is decode attention's launch plan, FlashInfer's plan/run split:
the step planner makes it once per step and sub-pool (from host ints only), and
every layer hands ``DecodePlan.launch`` to ``decode_attention``. ``plan_rows`` is
the row-shaped ops' plan (``RowsPlan``: the GEMV routing, the MoE's dense table or
sparse loop and its tile bucket, the FP8 GEMM's variant by rows), made once per step
from its row count; the decoder holds it for the step (``stepping``) and every
linear, MoE and FP8 GEMM takes it as its ``rows`` argument.

Every variant below the backend is decided here, once per ``get_backend``, from the
device and the A/B switches read then (``Flags``): the MoE (Triton, the Hopper
kernel for MXFP4 experts, or the torch reference), the fresh-prompt attention
(Triton, SDPA or the Hopper kernel). A model never picks a kernel: its modules take
the backend at construction (``building``, set by the loader) and call its ops.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch

from unikv import env
from unikv.kernels.attention.protocols import (
    DecodeAttention,
    ExtendAttention,
    PlanDecode,
    PlanExtend,
    RopeStoreDecodeAttention,
    RopeStoreKV,
    StoreDecodeAttention,
    StoreKV,
)
from unikv.kernels.linear.protocols import (
    AddRMSNorm,
    AddRMSNormLinear,
    AddRMSNormLinearArgmax,
    AddRMSNormQuant,
    Argmax,
    EmbedRMSNormLinear,
    Fp8ActQuant,
    Fp8Linear,
    Fp8LinearQuantized,
    Fp8PaddedRows,
    GatedRMSNorm,
    GeluTanhMul,
    Linear,
    MoEFp8,
    PlanRows,
    QKRMSNorm,
    ReluSquare,
    ReluSquareLinear,
    RMSNorm,
    RopePairs,
    RopeQK,
    SandwichRMSNorm,
    SigmoidMul,
    SiluMul,
    SiluMulLinear,
)
from unikv.kernels.linear.ref import resolve_feedback  # placeholder ids (every backend)
from unikv.kernels.mla.protocols import MLAAttention, StoreMLA, StoreMLAAttention
from unikv.kernels.moe.protocols import MoE, MoERepack, MoERepackedRun
from unikv.kernels.moe.ref import (
    DENSE_MAX_TOKENS,  # the MoE's graph bound (models, engine)
    dense_rows,
)
from unikv.kernels.recurrent.protocols import CausalConv1d, GatedDeltaRule, Mamba2SSD
from unikv.kernels.tables.protocols import (
    BuildBlockTable,
    CopyPages,
    ExportFlashinfer,
    PrepareStep,
    TranslateIds,
    UpdateTables,
)

KV_OPS = ("store_kv", "rope_store_kv", "decode_attention", "rope_store_decode_attention",
          "store_decode_attention", "extend_attention", "copy_pages")  # fmt: skip
TABLE_OPS = ("build_block_table", "export_flashinfer", "update_tables", "translate_ids")
STEP_OPS = ("prepare_step", "plan_decode", "plan_extend", "plan_rows")
RECURRENT_OPS = ("causal_conv1d", "gated_delta_rule", "mamba2_ssd")
MLA_OPS = ("store_mla", "mla_attention", "store_mla_attention")
ELEMENTWISE_OPS = ("rms_norm", "add_rms_norm", "rope_qk", "silu_mul", "gelu_tanh_mul",
                   "gated_rms_norm", "qk_rms_norm")  # fmt: skip
SANDWICH_OPS = ("sandwich_rms_norm",)  # kernels/linear/sandwich.py (Gemma's post + pre norms)
ACTIVATION_OPS = ("sigmoid_mul", "relu_square")  # kernels/linear/activation.py
ROPE_PAIR_OPS = ("rope_pairs",)  # kernels/linear/rope_pairs.py (DeepSeek's MLA rope)
SAMPLING_OPS = ("argmax",)
LINEAR_OPS = ("linear", "silu_mul_linear", "add_rms_norm_linear", "embed_rms_norm_linear",
              "add_rms_norm_linear_argmax", "relu_square_linear")  # fmt: skip
MOE_OPS = ("moe", "moe_repacked")
QUANT_OPS = ("fp8_linear", "fp8_padded_rows", "moe_fp8", "add_rms_norm_quant", "fp8_act_quant",
             "fp8_linear_quantized")  # fmt: skip
OPS = (KV_OPS + TABLE_OPS + STEP_OPS + RECURRENT_OPS + MLA_OPS + ELEMENTWISE_OPS
       + SANDWICH_OPS + ACTIVATION_OPS + ROPE_PAIR_OPS + SAMPLING_OPS + LINEAR_OPS + MOE_OPS
       + QUANT_OPS)  # fmt: skip

# what models take from the kernels: this module only
__all__ = ["DENSE_MAX_TOKENS", "OPS", "Flags", "KernelBackend", "MoERepacked", "RowsPlan",
           "building", "dense_rows", "get_backend", "model_ops", "resolve_feedback",
           "step_rows", "stepping"]  # fmt: skip


class MoERepacked(NamedTuple):
    """A fused MoE that runs MXFP4 experts re-packed once, at load, into its own order
    (``KernelBackend.moe_repacked``).

    name: the variant ("hopper"); pack(gate_up_blocks, gate_up_scales, down_blocks,
    down_scales, gate_up) re-packs the four uint8 tensors in place and returns the
    kernel's operand (their views); run(x, topk_weights, topk_ids, packed, **kw) takes
    ``moe``'s keywords (b1, b2, activation, gate_up, alpha, limit)."""

    name: str
    pack: Callable[..., object]
    run: MoERepackedRun


@dataclass(frozen=True)
class KernelBackend:
    """Every kernel op, from one implementation family (``name``). Each field's type is
    the op's signature and shapes, stated once in its family's ``protocols`` module."""

    name: str
    store_kv: StoreKV
    rope_store_kv: RopeStoreKV
    decode_attention: DecodeAttention
    rope_store_decode_attention: RopeStoreDecodeAttention
    store_decode_attention: StoreDecodeAttention
    extend_attention: ExtendAttention
    copy_pages: CopyPages
    build_block_table: BuildBlockTable
    export_flashinfer: ExportFlashinfer
    update_tables: UpdateTables
    translate_ids: TranslateIds
    prepare_step: PrepareStep
    plan_decode: PlanDecode
    plan_extend: PlanExtend
    plan_rows: PlanRows
    causal_conv1d: CausalConv1d
    gated_delta_rule: GatedDeltaRule
    mamba2_ssd: Mamba2SSD
    store_mla: StoreMLA
    mla_attention: MLAAttention
    store_mla_attention: StoreMLAAttention
    rms_norm: RMSNorm
    add_rms_norm: AddRMSNorm
    rope_qk: RopeQK
    silu_mul: SiluMul
    gelu_tanh_mul: GeluTanhMul
    gated_rms_norm: GatedRMSNorm
    qk_rms_norm: QKRMSNorm
    sandwich_rms_norm: SandwichRMSNorm
    sigmoid_mul: SigmoidMul
    relu_square: ReluSquare
    rope_pairs: RopePairs
    argmax: Argmax
    linear: Linear
    silu_mul_linear: SiluMulLinear
    add_rms_norm_linear: AddRMSNormLinear
    embed_rms_norm_linear: EmbedRMSNormLinear
    add_rms_norm_linear_argmax: AddRMSNormLinearArgmax
    relu_square_linear: ReluSquareLinear
    # the fused MoE over experts in the checkpoint's layout: Triton (``kernels/moe/
    # fused.moe``: the kernel, or the dense loop where its table says) or the reference
    moe: MoE
    # (dtype, hidden, intermediate) of an MXFP4 expert layer -> the ``MoERepacked``
    # variant that runs it, or None (``moe`` on the checkpoint's layout); asked once per
    # layer at load, from what ``get_backend`` decided
    moe_repacked: MoERepack
    # a linear whose weight is kept in block-scaled FP8: the Triton GEMM (its variant
    # planned per row count, ``fp8_gemm.plan``) or the torch reference (dequantise, then
    # multiply in fp32)
    fp8_linear: Fp8Linear
    # (n, k, block) -> the rows an FP8 weight is held in (zero rows past n) so that
    # ``fp8_linear``'s fastest prefill variant takes it: ``fp8_gemm.padded_rows`` where
    # ``torch._scaled_mm`` runs, else n; asked once per layer at load
    fp8_padded_rows: Fp8PaddedRows
    # the fused MoE over block-scaled FP8 experts: Triton (``kernels/moe/fp8.moe_fp8``:
    # each weight tile dequantised in registers inside the fused kernels) or the torch
    # reference (``fp8_gemm_ref.moe_fp8``: the experts dequantised per call, then ``moe``)
    moe_fp8: MoEFp8
    # an FP8 linear's pre-norm with its activation quantisation in one pass (Triton:
    # ``norm_quant.py``; the reference: ``add_rms_norm`` then ``quantize_act``), how
    # ``fp8_linear`` quantises x at a step's rows (None: it does not; the torch
    # backend's never does), and the GEMM from x so quantised (``fp8_gemm``)
    add_rms_norm_quant: AddRMSNormQuant
    fp8_act_quant: Fp8ActQuant
    fp8_linear_quantized: Fp8LinearQuantized


assert tuple(f.name for f in fields(KernelBackend))[1:] == OPS, "KernelBackend lists OPS"


@dataclass(frozen=True)
class DecodePlan:
    """Decode attention's launch plan for one step of one sub-pool.

    num_splits: KV splits per request (1: the split kernel normalises itself);
    workspace_numel: fp32 scratch elements the split kernel needs (0: none);
    workspace: a view of the caller's fp32 buffer of that size, or None (the
    kernel allocates its own; the planner sizes its buffer from this);
    launch: the keyword arguments ``decode_attention`` takes from this plan."""

    num_splits: int = 1
    workspace_numel: int = 0
    workspace: torch.Tensor | None = None
    launch: Mapping[str, object] = field(default_factory=dict)


def plan_decode_triton(
    batch: int,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    page_size: int,
    max_len: int,
    device: torch.device,
    workspace: torch.Tensor | None = None,
) -> DecodePlan:
    """The split count, tile config and workspace of the Triton ``decode_attention``
    for ``batch`` requests whose visible keys number at most ``max_len`` (the block
    table's capacity, capped by the window). Host ints only: no device access.
    workspace: None, or an fp32 buffer of >= ``workspace_numel`` elements."""
    from unikv.kernels.attention import decode

    splits = decode.choose_num_splits(batch, num_kv_heads, max_len, device) if batch else 1
    config = decode.choose_config(head_dim, page_size, max_len, splits)
    need = decode.workspace_numel(batch, num_q_heads, v_head_dim, splits) if splits > 1 else 0
    launch = {"num_splits": splits, "config": config}
    if workspace is not None:
        if workspace.dtype != torch.float32 or workspace.numel() < need:
            raise ValueError(
                f"plan_decode: workspace must be fp32 with >= {need} elements, got "
                f"{workspace.dtype} x {workspace.numel()}; size it from workspace_numel"
            )
        workspace = workspace[: max(need, 1)]
        launch["workspace"] = workspace
    return DecodePlan(splits, need, workspace, launch)


def plan_decode_torch(
    batch: int,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    page_size: int,
    max_len: int,
    device: torch.device,
    workspace: torch.Tensor | None = None,
) -> DecodePlan:
    """The torch reference plans nothing: one split, no workspace, no launch
    arguments (it takes ``plan_decode_triton``'s arguments and ignores them)."""
    return DecodePlan()


@dataclass(frozen=True)
class ExtendPlan:
    """The fresh-prompt attention's launch plan for one step (or the fresh part of a
    split step) of one sub-pool: the variant that prompt length takes, decided by the
    step planner from host ints, never per layer.

    launch: the keyword arguments ``extend_attention`` takes with ``fresh_kv`` from this
    plan: ``hopper`` (the Gluon kernel for a long prompt on sm_90) and ``sdpa`` (one
    prompt through SDPA), each present only where the backend has that variant."""

    launch: Mapping[str, object] = field(default_factory=dict)


def plan_extend_triton(
    num_requests: int,
    *,
    max_q_len: int,
    head_dim: int,
    hopper_min_q_len: Mapping[int, int] | None = None,
    sdpa_min_tokens: int | None = None,
) -> ExtendPlan:
    """The Triton backend's fresh-prompt plan. hopper_min_q_len: the Gluon kernel's
    shortest prompt per head dim (``fresh_hopper.MIN_Q_LEN``), bound by ``get_backend``
    where that kernel runs (sm_90, ``UNIKV_EXTEND_HOPPER``), else None; sdpa_min_tokens:
    SDPA's shortest prompt (``sdpa.MIN_TOKENS``), bound where ``UNIKV_EXTEND_SDPA`` is
    on, else None. The ops still check the layer's own conditions (dtype, widths,
    window, sinks, soft-cap, TMA alignment): those hold for every step of a layer."""
    launch: dict[str, object] = {}
    if hopper_min_q_len is not None:
        launch["hopper"] = max_q_len >= hopper_min_q_len.get(head_dim, 1 << 62)
    if sdpa_min_tokens is not None:
        launch["sdpa"] = num_requests == 1 and max_q_len >= sdpa_min_tokens
    return ExtendPlan(launch)


def plan_extend_torch(num_requests: int, *, max_q_len: int, head_dim: int) -> ExtendPlan:
    """The torch reference has one extend path: nothing to plan."""
    return ExtendPlan()


@dataclass(frozen=True)
class RowsPlan:
    """The row-shaped ops' variants for one step, decided by the step planner from its
    row count (host ints), never per layer: a CUDA graph's plan is its captured size's,
    so a replay runs the variants of its captured batch.

    rows: the rows the ops see (a step's tokens, padded lanes included; the LM head's
    rows for the head's plan). gemv: the linears run the Triton GEMV (``gemv.
    route_rows``; the op still checks the layer's dtype and strides). moe_dense: the
    reference MoE's dense table (fixed shapes, no sync) rather than the sparse loop
    (``moe_ref.dense_rows``). moe_bucket: the fused MoE's table bucket (``fused.
    bucket``; 0: the torch backend). fp8: the FP8 GEMM's choice by rows (``fp8_gemm.
    Fp8Rows``: tile class, w8a8, ``_scaled_mm``), None on the torch backend. moe_w8a8:
    the fused MoE over FP8 experts quantises its activations (``moe/fp8.w8a8_rows``;
    False on the torch backend)."""

    rows: int = 0
    gemv: bool = False
    moe_dense: bool = True
    moe_bucket: int = 0
    fp8: object = None
    moe_w8a8: bool = False


def plan_rows_triton(
    rows: int,
    *,
    route_rows: Callable[[int], bool],
    moe_bucket: Callable[[int], int],
    fp8_rows: Callable[[int, bool], object],
    scaled_mm: bool = False,
    moe_w8a8: Callable[[int], bool] | None = None,
) -> RowsPlan:
    """The Triton backend's ``RowsPlan`` of ``rows`` rows. The rules are the kernels'
    own (``gemv.route_rows``, ``fused.bucket``, ``fp8_gemm.row_choice``,
    ``moe/fp8.w8a8_rows``), bound by ``get_backend`` with ``scaled_mm`` (its probe found
    ``torch._scaled_mm`` usable)."""
    w8a8 = moe_w8a8 is not None and moe_w8a8(rows)
    return RowsPlan(rows, route_rows(rows), dense_rows(rows), moe_bucket(rows),
                    fp8_rows(rows, scaled_mm), w8a8)  # fmt: skip


def plan_rows_torch(rows: int) -> RowsPlan:
    """The torch references' ``RowsPlan``: no GEMV, no FP8 kernel, the MoE's dense
    table or sparse loop by ``moe_ref.dense_rows``."""
    return RowsPlan(rows, moe_dense=dense_rows(rows))


@dataclass(frozen=True)
class Flags:
    """What a backend's variants are decided from, read once per ``get_backend`` (never
    on the per-step path).

    cuda: the device is a GPU; sm90: an sm_90 GPU (the Gluon kernels compile for it
    only; probed here, once per device); moe_hopper: ``UNIKV_MOE_HOPPER`` is not "0"
    (off: MXFP4 experts stay in the checkpoint's layout on the Triton kernel, the A/B);
    extend_hopper: ``extend_hopper.ENABLED`` (``UNIKV_EXTEND_HOPPER``, read at import);
    extend_sdpa: ``extend_sdpa.ENABLED`` (``UNIKV_EXTEND_SDPA``, read at import);
    fp8_scaled_mm: this torch runs ``torch._scaled_mm`` with block scales on the GPU
    (``fp8_gemm.scaled_mm_supported``, probed once per device): FP8 linears' prefill
    rows go to it (``fp8_gemm.plan``)."""

    cuda: bool = False
    sm90: bool = False
    moe_hopper: bool = True
    extend_hopper: bool = True
    extend_sdpa: bool = False
    fp8_scaled_mm: bool = False


@functools.cache
def _sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def flags_for(device: torch.device | str, name: str) -> Flags:
    """The ``Flags`` of a ``name`` backend on ``device``: the capability is probed (and
    the Triton modules' switches read) only for Triton on CUDA."""
    device = torch.device(device)
    if name != "triton" or device.type != "cuda":
        return Flags()
    from unikv.kernels.attention import fresh_hopper as extend_hopper
    from unikv.kernels.attention import sdpa as extend_sdpa
    from unikv.kernels.linear import fp8_gemm

    _probe_capabilities(device)
    return Flags(
        cuda=True,
        sm90=_sm90(device),
        moe_hopper=env.FLAGS.moe_hopper,
        extend_hopper=extend_hopper.ENABLED,
        extend_sdpa=extend_sdpa.ENABLED,
        fp8_scaled_mm=fp8_gemm.scaled_mm_supported(device),
    )


def _probe_capabilities(device: torch.device) -> None:
    """Fill the kernels' cached capability probes (PDL, TMA, the MLA decode plan's
    table) here, when the backend is built, under the device keys the launches ask
    with, so that no step is the first to ask the device."""
    if not torch.cuda.is_available():
        return  # a test's faked CUDA device: nothing to probe
    from unikv.kernels.mla import plan as mla_plan
    from unikv.kernels.runtime import checks, pdl

    index = device.index if device.index is not None else torch.cuda.current_device()
    pdl._capability(torch.device("cuda", index))
    checks._tma_device(torch.device("cuda", index))
    mla_plan._capability(index)


def _no_repack(dtype: torch.dtype, hidden: int, inter: int) -> MoERepacked | None:
    """The torch reference and the Triton kernel run MXFP4 experts as the checkpoint
    stores them: nothing to re-pack."""
    return None


def _hopper_repack(dtype: torch.dtype, hidden: int, inter: int) -> MoERepacked | None:
    """On an sm_90 GPU: the Gluon kernel (``moe_hopper``) for bf16 activations and
    hidden / intermediate sizes in whole K blocks of 64, else None (the Triton kernel)."""
    from unikv.kernels.moe import hopper as moe_hopper

    if not moe_hopper.usable(dtype, hidden, inter):
        return None
    return MoERepacked("hopper", moe_hopper.repack_in_place, moe_hopper.moe)


def _hopper_min_q_len() -> dict[int, int]:
    """The Gluon fresh-prompt kernel's shortest prompt per head dim (imported only
    where that kernel runs)."""
    from unikv.kernels.attention import fresh_hopper

    return dict(fresh_hopper.MIN_Q_LEN)


def _triton(flags: Flags) -> KernelBackend:
    from unikv.kernels.runtime.interpret import patch_interpreter

    patch_interpreter()
    # imported lazily: Triton is only needed here
    from unikv.kernels.attention import decode, extend, rope_store, store
    from unikv.kernels.attention import sdpa as extend_sdpa
    from unikv.kernels.linear import (
        activation,
        argmax,
        elementwise,
        fp8_gemm,
        fp8_gemm_ref,
        gemv,
        norm_quant,
        rope_pairs,
        sandwich,
    )
    from unikv.kernels.mla import decode as mla_decode
    from unikv.kernels.mla import prefill as mla
    from unikv.kernels.moe import fp8 as moe_fp8
    from unikv.kernels.moe import fused as moe
    from unikv.kernels.recurrent import triton_ops as recurrent
    from unikv.kernels.tables import block_table, page_copy, step_tables, table_update

    # on CUDA a step of one fresh prompt may go to SDPA (cuDNN), the rest to Triton; on
    # sm_90 long fresh prompts go to the Gluon kernel: which step takes which is the
    # step's ExtendPlan (``plan_extend``, bound here to the variants this backend has)
    extend_op = extend_sdpa.extend_attention if flags.extend_sdpa else extend.extend_attention
    plan_extend = functools.partial(
        plan_extend_triton,
        hopper_min_q_len=_hopper_min_q_len() if flags.sm90 and flags.extend_hopper else None,
        sdpa_min_tokens=extend_sdpa.MIN_TOKENS if flags.extend_sdpa else None,
    )
    plan_rows = functools.partial(
        plan_rows_triton,
        route_rows=gemv.route_rows,
        moe_bucket=moe.bucket,
        fp8_rows=fp8_gemm.row_choice,
        scaled_mm=flags.fp8_scaled_mm,
        moe_w8a8=moe_fp8.w8a8_rows,
    )
    return KernelBackend(
        name="triton",
        store_kv=store.store_kv,
        rope_store_kv=rope_store.rope_store_kv,
        decode_attention=decode.decode_attention,
        rope_store_decode_attention=decode.rope_store_decode_attention,
        store_decode_attention=decode.store_decode_attention,
        extend_attention=extend_op,
        copy_pages=page_copy.copy_pages,
        build_block_table=block_table.build_block_table,
        export_flashinfer=block_table.export_flashinfer,
        update_tables=table_update.update_tables,
        translate_ids=table_update.translate_ids,
        prepare_step=step_tables.prepare,
        plan_decode=plan_decode_triton,
        plan_extend=plan_extend,
        plan_rows=plan_rows,
        causal_conv1d=recurrent.causal_conv1d,
        gated_delta_rule=recurrent.gated_delta_rule,
        mamba2_ssd=recurrent.mamba2_ssd,
        store_mla=mla.store_mla,
        mla_attention=mla_decode.mla_attention,  # decode tiles heads; prefill: mla.py
        store_mla_attention=mla_decode.store_mla_attention,  # decode: the store in the launch
        **{op: getattr(elementwise, op) for op in ELEMENTWISE_OPS},
        sandwich_rms_norm=sandwich.sandwich_rms_norm,
        **{op: getattr(activation, op) for op in ACTIVATION_OPS},
        rope_pairs=rope_pairs.rope_pairs,
        argmax=argmax.argmax,
        **{op: getattr(gemv, op) for op in LINEAR_OPS},
        moe=moe.moe,
        moe_repacked=_hopper_repack if flags.sm90 and flags.moe_hopper else _no_repack,
        fp8_linear=(
            functools.partial(fp8_gemm.fp8_linear, scaled_mm=True)
            if flags.fp8_scaled_mm
            else fp8_gemm.fp8_linear
        ),
        fp8_padded_rows=fp8_gemm.padded_rows if flags.fp8_scaled_mm else fp8_gemm_ref.padded_rows,
        moe_fp8=moe_fp8.moe_fp8,
        add_rms_norm_quant=norm_quant.add_rms_norm_quant,
        fp8_act_quant=functools.partial(fp8_gemm.fp8_act_quant, scaled_mm=flags.fp8_scaled_mm),
        fp8_linear_quantized=functools.partial(
            fp8_gemm.fp8_linear_quantized, scaled_mm=flags.fp8_scaled_mm
        ),
    )


def _torch() -> KernelBackend:
    from unikv.kernels.attention import ref as reference
    from unikv.kernels.linear import fp8_gemm_ref
    from unikv.kernels.linear import ref as elementwise_ref
    from unikv.kernels.mla import ref as mla_ref
    from unikv.kernels.moe import ref as moe_ref
    from unikv.kernels.recurrent import ref as recurrent_ref
    from unikv.kernels.tables import ref as tables_ref

    return KernelBackend(
        name="torch",
        store_kv=reference.store_kv,
        rope_store_kv=reference.rope_store_kv,
        decode_attention=reference.decode_attention,
        rope_store_decode_attention=reference.rope_store_decode_attention,
        store_decode_attention=reference.store_decode_attention,
        extend_attention=reference.extend_attention,
        copy_pages=reference.copy_pages,
        build_block_table=reference.build_block_table,
        export_flashinfer=reference.export_flashinfer,
        update_tables=tables_ref.update_tables_ref,
        translate_ids=tables_ref.translate_ids_ref,
        prepare_step=tables_ref.prepare_ref,
        plan_decode=plan_decode_torch,
        plan_extend=plan_extend_torch,
        plan_rows=plan_rows_torch,
        causal_conv1d=recurrent_ref.causal_conv1d,
        gated_delta_rule=recurrent_ref.gated_delta_rule,
        mamba2_ssd=recurrent_ref.mamba2_ssd,
        store_mla=mla_ref.store_mla,
        mla_attention=mla_ref.mla_attention,
        store_mla_attention=mla_ref.store_mla_attention,
        **{op: getattr(elementwise_ref, op) for op in ELEMENTWISE_OPS + ACTIVATION_OPS},
        sandwich_rms_norm=elementwise_ref.sandwich_rms_norm,
        rope_pairs=elementwise_ref.rope_pairs,
        argmax=reference.argmax,
        **{op: getattr(elementwise_ref, op) for op in LINEAR_OPS},
        moe=moe_ref.fused_moe,
        moe_repacked=_no_repack,
        fp8_linear=fp8_gemm_ref.fp8_linear,
        fp8_padded_rows=fp8_gemm_ref.padded_rows,
        moe_fp8=functools.partial(fp8_gemm_ref.moe_fp8, moe=moe_ref.fused_moe),
        add_rms_norm_quant=elementwise_ref.add_rms_norm_quant,
        fp8_act_quant=fp8_gemm_ref.fp8_act_quant,
        fp8_linear_quantized=fp8_gemm_ref.fp8_linear_quantized,
    )


_CACHE: dict[tuple[str, Flags], KernelBackend] = {}


def get_backend(device: torch.device | str, backend: str | None = None) -> KernelBackend:
    """The kernel backend for ``device``, every variant decided here (``Flags``).

    backend: None (by device: ``"triton"`` on CUDA, ``"torch"`` elsewhere), ``"triton"``
    (force Triton, e.g. under ``TRITON_INTERPRET=1`` on CPU) or ``"torch"`` (force
    the references, on any device: no Triton module is imported, the MoE included)."""
    name = backend
    if name is None:
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name not in ("triton", "torch"):
        raise ValueError(
            f"backend must be None, 'triton' or 'torch', got {name!r}; "
            "None picks Triton on CUDA and the torch references elsewhere"
        )
    flags = flags_for(device, name)
    key = (name, flags)
    if key not in _CACHE:
        _CACHE[key] = _triton(flags) if name == "triton" else _torch()
    return _CACHE[key]


# -- the backend a model's modules are built with ---------------------------------------

_BUILDING: contextvars.ContextVar[KernelBackend | None] = contextvars.ContextVar(
    "unikv_building_ops", default=None
)


@contextlib.contextmanager
def building(ops: KernelBackend | None) -> Iterator[KernelBackend]:
    """Build a model inside this: every module made in it takes ``ops`` (``model_ops``),
    fixed for its life. The loader wraps each model's construction in it; None keeps
    the enclosing one (the torch references outside any)."""
    if ops is None:
        yield model_ops()
        return
    token = _BUILDING.set(ops)
    try:
        yield ops
    finally:
        _BUILDING.reset(token)


def model_ops(ops: KernelBackend | None = None) -> KernelBackend:
    """The backend a module being built calls: ``ops`` when given, else the enclosing
    ``building``'s, else the torch references (a model built outside the loader)."""
    return ops or _BUILDING.get() or get_backend("cpu", "torch")


# -- the row plan of the step a model is running -----------------------------------------

_STEP_ROWS: contextvars.ContextVar[RowsPlan | None] = contextvars.ContextVar(
    "unikv_step_rows", default=None
)


@contextlib.contextmanager
def stepping(rows: RowsPlan | None) -> Iterator[RowsPlan | None]:
    """Run a model's step inside this: every linear, MoE and FP8 GEMM its modules call
    takes ``rows`` (``step_rows``), the step's plan (``StepPlan.rows``). The decoder
    enters it once per forward from its step object; None (a test's step object, a
    tool): the ops derive the plan from their shapes by the same rules."""
    token = _STEP_ROWS.set(rows)
    try:
        yield rows
    finally:
        _STEP_ROWS.reset(token)


def step_rows() -> RowsPlan | None:
    """The ``RowsPlan`` of the step being run (``stepping``), or None outside one."""
    return _STEP_ROWS.get()
