"""What the kernels assume about a model's widths, checked once at start-up (issue 38).

``fit_backend(backend, configs, model_config)`` runs when the engine is built, where the
pool's specs (row widths, dtypes, page sizes) and the model's widths are known. It
returns the backend the engine runs: the same one when the Triton kernels take every
width, else a copy whose ops for the widths they cannot take are the torch references
(same signatures, no host sync: CUDA-graph safe). It raises ``ValueError`` naming the
config field for a shape no path runs. Nothing here runs per step.

The assumptions, and where each is kept:

- **Row alignment (every cache reader).** A cache row is ``row_stride`` elements, any
  number of bytes (MLA fp32, rank 24 + rope 6: 120 bytes). The kernels address a row as
  ``entry * block_stride + slot * row_stride`` (``_ids.row_offset``) and let Triton
  derive the alignment from the strides it specialises on (ints divisible by 16,
  pointers 16-byte aligned). They never compute ``kernel_row(...) * row_stride``:
  Triton 3.6 takes the divisibility of ``entry * ps + slot`` (ps) for every row, so at
  ps >= 2 a 120-byte row got 16-byte vector loads: ``misaligned address`` and a dead
  CUDA context. ``tests/ptx_alignment.py`` compiles every cache reader at odd strides
  for sm_90a and checks each load's width against the strides (CPU CI). No width is
  refused for alignment.
- **TMA descriptors** (the fused MLA decode's ``tma`` variant, the Hopper / TMA
  fresh-prompt kernels): 16-byte-aligned base, row stride and column offset, tiles of at
  most 256 columns. Their launchers test this on the host before building a descriptor
  (``mla_decode_fused.tma_ok``, ``_checks.tma_ok``) and take the pointer path otherwise.
- **Dot shapes.** ``tl.dot`` needs K >= 16. The MLA tiles pad rank and rope to >= 16
  columns. The MHA decode / extend kernels tile a head as ``next_pow2(head_dim)``
  columns, so head_dim <= 8 does not compile: such a sub-pool's attention ops
  (``ATTENTION_OPS``) run the torch references. The expanded MLA prefill calls
  ``extend_attention`` with head dim ``qk_nope_head_dim + qk_rope_head_dim``: the same rule.
- **Rope pairs.** Rope rotates pairs of dims: an odd ``qk_rope_head_dim`` is refused
  here; an odd rotated MHA width (``head_dim``, or ``head_dim * partial_rotary_factor``)
  when the model is built (``models/rope.rotary_dim``), naming the field.
- **Rows one program holds** (the Triton backend). The row norms hold a whole row in
  registers, ``next_pow2`` columns, at most ``elementwise.MAX_ROW``: ``rms_norm``,
  ``add_rms_norm`` and ``sandwich_rms_norm`` a ``hidden_size`` row, ``qk_rms_norm`` a
  ``head_dim`` row. A wider field is refused here, naming it (the torch backend takes
  any width); the kernels check it again per call.
- **No width rule.** The GEMV (any K and N: the K tail masked, ``EVEN_K``; 16-bit
  weights contiguous along K, else the op runs cuBLAS, decided from host values),
  ``silu_mul`` / ``gelu_tanh_mul`` (any intermediate size, blocks masked), ``rope_qk``
  and the fused rope + store (any head count, ``next_pow2`` blocks masked) and the
  greedy argmax (any vocabulary) take every width.
"""

from __future__ import annotations

import dataclasses

from unikv.specs import MHASpec, MLASpec

MIN_DOT_K = 16  # tl.dot's smallest K (Triton 3.6, NVIDIA): "K >= 16"
# an op and the plan whose launch arguments it takes fall back together
ATTENTION_OPS = ("decode_attention", "rope_store_decode_attention", "store_decode_attention",
                 "extend_attention", "plan_decode", "plan_extend")  # fmt: skip


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def attention_dims(configs, model_config=None) -> dict[str, int]:
    """The head dims the attention kernels tile, by where they come from: each MHA
    sub-pool's ``head_dim``, and an MLA model's expanded prefill head
    (``qk_nope_head_dim + qk_rope_head_dim``)."""
    dims = {}
    for c in configs:
        if isinstance(c.spec, MHASpec):
            dims[f"sub-pool {c.name!r} head_dim"] = c.spec.head_dim
        elif isinstance(c.spec, MLASpec) and model_config is not None:
            extra = model_config.extra
            if "qk_nope_head_dim" in extra:
                dims["qk_nope_head_dim + qk_rope_head_dim"] = (
                    extra["qk_nope_head_dim"] + extra["qk_rope_head_dim"]
                )
    return dims


def row_widths(model_config) -> dict[str, int]:
    """Config field -> the row width the Triton row norms hold in one program
    (``hidden_size``: rms_norm, add_rms_norm, sandwich_rms_norm; ``head_dim``:
    qk_rms_norm)."""
    if model_config is None:
        return {}
    return {"hidden_size": model_config.hidden_size, "head_dim": model_config.head_dim}


def check_row_widths(model_config) -> None:
    """ValueError, naming the config field, for a row wider than one Triton norm
    program holds (``elementwise.MAX_ROW``)."""
    from unikv.kernels.linear.elementwise import MAX_ROW  # (imports Triton)

    for name, width in row_widths(model_config).items():
        if width > MAX_ROW:
            raise ValueError(
                f"{name} is {width}: the Triton norm kernels hold a row in one program, at "
                f"most {MAX_ROW} values; run backend='torch' or a model with {name} <= {MAX_ROW}"
            )


def check_widths(configs, model_config=None) -> None:
    """ValueError, naming the config field, for widths no kernel path runs."""
    for c in configs:
        if isinstance(c.spec, MLASpec) and c.spec.rope_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim is {c.spec.rope_dim}: rope rotates pairs of dims, so it must "
                "be even; fix qk_rope_head_dim in config.json"
            )


def triton_fallbacks(configs, model_config=None) -> dict[str, str]:
    """Ops the Triton kernels cannot run at these widths -> why (empty: all of them run)."""
    small = {k: d for k, d in attention_dims(configs, model_config).items() if _pow2(d) < MIN_DOT_K}
    if not small:
        return {}
    why = ", ".join(f"{k} {d}" for k, d in small.items())
    reason = (
        f"{why}: the Triton attention kernels tile a head as next_pow2(head_dim) columns and "
        f"tl.dot needs >= {MIN_DOT_K}; these ops run the torch references"
    )
    return dict.fromkeys(ATTENTION_OPS, reason)


def fit_backend(backend, configs, model_config=None):
    """``backend``, or a copy running the torch references for the ops whose Triton
    kernels cannot take these widths (``triton_fallbacks``); ValueError for widths no
    path runs (``check_widths``). Once, at start-up."""
    check_widths(configs, model_config)
    if backend.name != "triton":
        return backend
    check_row_widths(model_config)
    fallbacks = triton_fallbacks(configs, model_config)
    if not fallbacks:
        return backend
    from unikv.kernels.backend import get_backend

    ref = get_backend("cpu", "torch")  # the references run on any device
    return dataclasses.replace(backend, **{op: getattr(ref, op) for op in fallbacks})
