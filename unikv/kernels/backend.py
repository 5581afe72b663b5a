"""One typed kernel backend, chosen once (docs/design.md section 5).

``get_backend(device, name)`` is the only selector. It returns a frozen
``KernelBackend`` holding every op the pool, the allocator and the runner call:
Triton kernels on CUDA (or on the CPU under ``TRITON_INTERPRET=1`` when asked
for by name), their pure-torch references elsewhere. Each op has the same
signature in both backends, so the per-step path never branches on device.

``plan_decode`` is decode attention's launch plan, FlashInfer's plan/run split:
the step planner makes it once per step and sub-pool (from host ints only), and
every layer hands ``DecodePlan.launch`` to ``decode_attention``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

import torch

Op = Callable[..., object]

KV_OPS = ("store_kv", "rope_store_kv", "decode_attention", "rope_store_decode_attention",
          "extend_attention", "copy_pages")  # fmt: skip
TABLE_OPS = ("build_block_table", "export_flashinfer", "update_tables", "translate_ids")
STEP_OPS = ("prepare_step", "plan_decode")
RECURRENT_OPS = ("causal_conv1d", "gated_delta_rule", "mamba2_ssd")
MLA_OPS = ("store_mla", "mla_attention")
ELEMENTWISE_OPS = ("rms_norm", "add_rms_norm", "rope_qk", "silu_mul")
SAMPLING_OPS = ("argmax",)
LINEAR_OPS = ("linear", "silu_mul_linear", "add_rms_norm_linear", "embed_rms_norm_linear",
              "add_rms_norm_linear_argmax")  # fmt: skip
OPS = (KV_OPS + TABLE_OPS + STEP_OPS + RECURRENT_OPS + MLA_OPS + ELEMENTWISE_OPS + SAMPLING_OPS
       + LINEAR_OPS)  # fmt: skip


@dataclass(frozen=True)
class KernelBackend:
    """Every kernel op, from one implementation family (``name``)."""

    name: str
    store_kv: Op
    rope_store_kv: Op
    decode_attention: Op
    rope_store_decode_attention: Op
    extend_attention: Op
    copy_pages: Op
    build_block_table: Op
    export_flashinfer: Op
    update_tables: Op
    translate_ids: Op
    prepare_step: Op
    plan_decode: Op
    causal_conv1d: Op
    gated_delta_rule: Op
    mamba2_ssd: Op
    store_mla: Op
    mla_attention: Op
    rms_norm: Op
    add_rms_norm: Op
    rope_qk: Op
    silu_mul: Op
    argmax: Op
    linear: Op
    silu_mul_linear: Op
    add_rms_norm_linear: Op
    embed_rms_norm_linear: Op
    add_rms_norm_linear_argmax: Op


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
    from unikv.kernels import decode

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


def plan_decode_torch(batch: int, **geometry: object) -> DecodePlan:
    """The torch reference plans nothing: one split, no workspace, no launch
    arguments (it takes ``plan_decode_triton``'s arguments and ignores them)."""
    return DecodePlan()


def _triton(cuda: bool = False) -> KernelBackend:
    from unikv.kernels._interpret import patch_interpreter

    patch_interpreter()
    from unikv.kernels import (  # imported lazily: Triton is only needed here
        argmax,
        block_table,
        decode,
        elementwise,
        extend,
        extend_sdpa,
        gemv,
        mla,
        mla_decode,
        page_copy,
        recurrent,
        rope_store,
        step_tables,
        store,
        table_update,
    )

    return KernelBackend(
        name="triton",
        store_kv=store.store_kv,
        rope_store_kv=rope_store.rope_store_kv,
        decode_attention=decode.decode_attention,
        rope_store_decode_attention=decode.rope_store_decode_attention,
        # on CUDA a step of one fresh prompt goes to SDPA (cuDNN), the rest to Triton
        extend_attention=(
            extend_sdpa.extend_attention
            if cuda and extend_sdpa.ENABLED
            else extend.extend_attention
        ),
        copy_pages=page_copy.copy_pages,
        build_block_table=block_table.build_block_table,
        export_flashinfer=block_table.export_flashinfer,
        update_tables=table_update.update_tables,
        translate_ids=table_update.translate_ids,
        prepare_step=step_tables.prepare,
        plan_decode=plan_decode_triton,
        causal_conv1d=recurrent.causal_conv1d,
        gated_delta_rule=recurrent.gated_delta_rule,
        mamba2_ssd=recurrent.mamba2_ssd,
        store_mla=mla.store_mla,
        mla_attention=mla_decode.mla_attention,  # decode tiles heads; prefill: mla.py
        **{op: getattr(elementwise, op) for op in ELEMENTWISE_OPS},
        argmax=argmax.argmax,
        **{op: getattr(gemv, op) for op in LINEAR_OPS},
    )


def _torch() -> KernelBackend:
    from unikv.kernels import elementwise_ref, mla_ref, recurrent_ref, reference, tables_ref

    return KernelBackend(
        name="torch",
        store_kv=reference.store_kv,
        rope_store_kv=reference.rope_store_kv,
        decode_attention=reference.decode_attention,
        rope_store_decode_attention=reference.rope_store_decode_attention,
        extend_attention=reference.extend_attention,
        copy_pages=reference.copy_pages,
        build_block_table=reference.build_block_table,
        export_flashinfer=reference.export_flashinfer,
        update_tables=tables_ref.update_tables_ref,
        translate_ids=tables_ref.translate_ids_ref,
        prepare_step=tables_ref.prepare_ref,
        plan_decode=plan_decode_torch,
        causal_conv1d=recurrent_ref.causal_conv1d,
        gated_delta_rule=recurrent_ref.gated_delta_rule,
        mamba2_ssd=recurrent_ref.mamba2_ssd,
        store_mla=mla_ref.store_mla,
        mla_attention=mla_ref.mla_attention,
        **{op: getattr(elementwise_ref, op) for op in ELEMENTWISE_OPS},
        argmax=reference.argmax,
        **{op: getattr(elementwise_ref, op) for op in LINEAR_OPS},
    )


_CACHE: dict[tuple[str, bool], KernelBackend] = {}  # (name, on CUDA)


def get_backend(device: torch.device | str, backend: str | None = None) -> KernelBackend:
    """The kernel backend for ``device``.

    backend: None (by device: ``"triton"`` on CUDA, ``"torch"`` elsewhere), ``"triton"``
    (force Triton, e.g. under ``TRITON_INTERPRET=1`` on CPU) or ``"torch"`` (force
    the references, on any device)."""
    name = backend
    if name is None:
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name not in ("triton", "torch"):
        raise ValueError(
            f"backend must be None, 'triton' or 'torch', got {name!r}; "
            "None picks Triton on CUDA and the torch references elsewhere"
        )
    key = (name, torch.device(device).type == "cuda")  # Triton on CUDA: extend_sdpa too
    if key not in _CACHE:
        _CACHE[key] = _triton(key[1]) if name == "triton" else _torch()
    return _CACHE[key]
