"""KV kernels over the unified pool: Triton on CUDA, pure-torch references on CPU.

``get_backend(device)`` picks the implementation ONCE (at construction time of
whoever calls it); the per-step path then calls the returned functions with no
device or layout branching. Every op has the same signature in both backends.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from unikv.kernels import mla_ref, recurrent_ref, reference

RECURRENT_OPS = ("causal_conv1d", "gated_delta_rule", "mamba2_ssd")
MLA_OPS = ("store_mla", "mla_attention")
OPS = (
    "store_kv",
    "decode_attention",
    "extend_attention",
    "copy_pages",
    "build_block_table",
    "export_flashinfer",
    *RECURRENT_OPS,
    *MLA_OPS,
)


def _triton_ops() -> SimpleNamespace:
    from unikv.kernels._interpret import patch_interpreter

    patch_interpreter()
    from unikv.kernels import (  # imported lazily: Triton is only needed here
        block_table,
        decode,
        extend,
        mla,
        page_copy,
        recurrent,
        store,
    )

    return SimpleNamespace(
        name="triton",
        store_kv=store.store_kv,
        decode_attention=decode.decode_attention,
        extend_attention=extend.extend_attention,
        copy_pages=page_copy.copy_pages,
        build_block_table=block_table.build_block_table,
        export_flashinfer=block_table.export_flashinfer,
        causal_conv1d=recurrent.causal_conv1d,
        gated_delta_rule=recurrent.gated_delta_rule,
        mamba2_ssd=recurrent.mamba2_ssd,
        store_mla=mla.store_mla,
        mla_attention=mla.mla_attention,
    )


def get_backend(device: torch.device | str, backend: str | None = None) -> SimpleNamespace:
    """The kernel set for ``device``: Triton on CUDA, the torch reference elsewhere.

    backend: None (pick by device), ``"triton"`` (force Triton, e.g. under
    ``TRITON_INTERPRET=1`` on CPU) or ``"torch"`` (force the reference).
    Returns a namespace with ``store_kv, decode_attention, extend_attention,
    copy_pages, build_block_table, export_flashinfer``, the recurrent-state ops
    ``causal_conv1d, gated_delta_rule, mamba2_ssd``, the MLA ops ``store_mla,
    mla_attention`` and ``name``.
    """
    if backend is None:
        backend = "triton" if torch.device(device).type == "cuda" else "torch"
    if backend == "triton":
        return _triton_ops()
    if backend == "torch":
        own = RECURRENT_OPS + MLA_OPS
        refs = {op: getattr(reference, op) for op in OPS if op not in own}
        refs.update({op: getattr(recurrent_ref, op) for op in RECURRENT_OPS})
        refs.update({op: getattr(mla_ref, op) for op in MLA_OPS})
        return SimpleNamespace(name="torch", **refs)
    raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")


__all__ = ["OPS", "get_backend", "reference"]
