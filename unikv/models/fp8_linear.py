"""Linears kept in block-scaled FP8 (``Fp8BlockLinear``), and the pass that makes them.

A quantised checkpoint (``models/fp8.py``) stores a linear as float8_e4m3fn
``<prefix>.weight`` (out, in) beside fp32 ``<prefix>.weight_scale_inv`` (ceil(out / bn),
ceil(in / bk)). ``keep_fp8`` replaces, before the weights load, every plain linear of
the model (``layers.Linear`` and the tensor-parallel column / row linears) whose
checkpoint weights all carry scales by an ``Fp8BlockLinear`` of the same shape: it
holds those bytes as they are (one byte a weight, the scales beside them) and runs the
kernel backend's ``fp8_linear`` (the Triton block-scaled GEMM on CUDA, the torch
reference elsewhere). A fused projection (q|k|v, gate|up) is kept in FP8 when each part
but the last spans whole row blocks, so the parts' scales concatenate as their rows do.

Dequantised at load instead (``loader._source_tensor``), as before:

- linears a module reads as a matrix: its class lists them in ``dense_linears``
  (DeepSeek's ``kv_b_proj``, absorbed into the queries; the LM head, fused with the
  final norm and argmax);
- a fused projection whose parts split a row block.

Routed experts (``models/moe.RoutedExperts``) whose checkpoint weights all carry scales
are kept in FP8 too (``RoutedExperts.keep_fp8``: the stacks hold the file's bytes and
scales, run by the backend's ``moe_fp8``); experts stored stacked by the family itself
(Granite-4.0-H's ``input_linear``) are dequantised at load.

Held padded: an owner that reads a linear's output only through views (it splits the
last dim: DeepSeek's ``qkv_a_proj``, 2112 rows, and ``kv_a_proj_with_mqa``, 576) names it
in ``strided_outputs``; after the weights load (``finish_loading``) such a linear's
weight and scales are re-held in the rows the backend's prefill GEMM wants
(``fp8_padded_rows``: whole 128-row blocks for ``torch._scaled_mm``), zero rows and unit
scales past the real ones, once; ``weight`` / ``weight_scale_inv`` stay the file's
values (views of the first rows) and its output is the real rows' view.

Quantised by its pre-norm: where an ``Fp8BlockLinear`` is a block's input GEMM
(``decoder.Block``: q|k|v, DeepSeek's q_a | kv_a, gate|up) and its prefill variant
quantises x (``input_quant``: the backend's ``fp8_act_quant`` at the step's rows), the
block runs its RMSNorm and that quantisation in one pass (``RMSNorm.fp8_linear``,
``add_rms_norm_quant``) and this linear from the codes (``forward_quantized``), so x is
read once; at other rows (decode) the norm and ``forward`` as before. Bit for bit the
unfused path's result (``tests/models/test_models_fp8_normquant.py``).

Tensor parallelism: a column-parallel FP8 linear shards its weight and scales by rows,
a row-parallel one by columns; a rank's slice must be whole blocks (a size that cuts a
scale block is refused here, before any weight loads). The scales then shard like the
weight (``parallel.shard_tensor``), one block row or column per bn rows or bk columns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from unikv.kernels.backend import KernelBackend, step_rows
from unikv.models.fp8 import SCALE_SUFFIX, Fp8Format
from unikv.models.layers import Linear
from unikv.models.moe import RoutedExperts
from unikv.models.parallel import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from unikv.kernels.linear.fp8_gemm_ref import Fp8Quant

PLAIN_LINEARS = (Linear, ColumnParallelLinear, RowParallelLinear)


class Fp8BlockLinear(nn.Module):
    """y = x @ W^T (+ bias), W = ``weight`` (out, in) float8_e4m3fn times
    ``weight_scale_inv`` (ceil(out / bn), ceil(in / bk)) fp32 per block (``block`` =
    (bn, bk)); ``bias`` in the model dtype. ``parallel``: None, "column" (this rank's
    rows) or "row" (this rank's columns: as ``parallel.RowParallelLinear``, the partial
    products all-reduced over ``tp`` unless ``reduce`` is False, the bias added where
    ``adds_bias``, so the group's sum counts it once). ``pads``: its owner reads the
    output through views only, so it may be held padded (module docstring)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None,
        block: tuple[int, int],
        ops: KernelBackend,
        *,
        device: torch.device,
        parallel: str | None = None,
        tp=None,
        reduce: bool = True,
        adds_bias: bool = True,
        pads: bool = False,
    ) -> None:
        super().__init__()
        assert not (pads and parallel == "row"), "a padded output is never all-reduced"
        bn, bk = block
        self.in_features, self.out_features, self.block = in_features, out_features, block
        fp8 = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        scales = torch.empty(
            math.ceil(out_features / bn), math.ceil(in_features / bk), device=device
        )
        self.weight = nn.Parameter(fp8, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.ops, self.parallel, self.tp = ops, parallel, tp
        self.reduce, self.adds_bias = reduce, adds_bias and bias is not None  # host bools
        self.pads, self.padded = pads, False  # host bools (``finish_loading``)
        # a pre-norm may quantise x for it (``input_quant``): its groups (bk) are a power
        # of two (``add_rms_norm_quant``) and its output is not a partial sum
        self.fuses_norm = bk & (bk - 1) == 0 and parallel != "row"
        self.register_buffer("held_weight", None, persistent=False)
        self.register_buffer("held_scale_inv", None, persistent=False)
        if parallel == "column":
            self.tp_shards = {"weight": 0, "weight_scale_inv": 0, "bias": 0}
        elif parallel == "row":
            self.tp_shards = {"weight": 1, "weight_scale_inv": 1}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel == "row":  # a host str fixed at construction
            out = self.ops.fp8_linear(
                x, self.weight, self.weight_scale_inv, block=self.block, rows=step_rows()
            )
            if self.reduce:
                out = self.tp.all_reduce(out)
            return out + self.bias if self.adds_bias else out
        weight, scale, real = self.held()  # padded: the real rows' view of the padded GEMM
        return self.ops.fp8_linear(
            x, weight, scale, self.bias, block=self.block, rows=step_rows(), out_features=real
        )

    def held(self) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """(weight, scales, real rows or None) the GEMM multiplies: the held padded
        ones and the file's rows where ``padded``, else the file's."""
        if self.padded:  # a host bool fixed at load
            return self.held_weight, self.held_scale_inv, self.out_features
        return self.weight, self.weight_scale_inv, None

    def input_quant(self, m: int, dtype: torch.dtype, rows) -> Fp8Quant | None:
        """How ``forward`` of m rows in ``dtype`` at the step's plan ``rows`` quantises
        x (the backend's ``fp8_act_quant``, host values only), or None."""
        return self.ops.fp8_act_quant(m, self.held()[0].shape[0], self.in_features, self.block,
                                      dtype, rows)  # fmt: skip

    def forward_quantized(self, xq: torch.Tensor, xs: torch.Tensor, dtype) -> torch.Tensor:
        """``forward`` of the x whose codes and scales are xq, xs (quantised as
        ``input_quant`` said, by the pre-norm), in ``dtype``."""
        assert self.parallel != "row", "a pre-norm quantises a column or plain linear's x"
        weight, scale, real = self.held()
        return self.ops.fp8_linear_quantized(
            xq, xs, weight, scale, self.bias, block=self.block, out_dtype=dtype,
            rows=step_rows(), out_features=real,
        )  # fmt: skip

    def finish_loading(self) -> None:
        """After the weights load (``loader.load_model``), where ``pads``: the weight and
        scales re-held in ``ops.fp8_padded_rows`` rows (zero weight rows, unit scale rows
        past the file's), ``weight`` and ``weight_scale_inv`` then views of their first
        rows (the file's values, the same storage); nothing where the backend wants no
        more rows."""
        n, k = self.weight.shape
        held = self.ops.fp8_padded_rows(n, k, self.block) if self.pads else n
        if self.padded or held == n:
            return
        assert held > n, "fp8_padded_rows returns at least the weight's rows"
        scales = self.weight_scale_inv
        weight = torch.zeros(held, k, dtype=self.weight.dtype, device=self.weight.device)
        scale = torch.ones(math.ceil(held / self.block[0]), scales.shape[1], device=scales.device)
        with torch.no_grad():
            weight[:n] = self.weight
            scale[: scales.shape[0]] = scales
        self.held_weight, self.held_scale_inv = weight, scale
        self.weight = nn.Parameter(weight[:n], requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale[: scales.shape[0]], requires_grad=False)
        self.padded = True

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"block={list(self.block)}, bias={self.bias is not None}"
        )


def _cuts_blocks(rows: list[int], bn: int) -> bool:
    """Parts of a fused projection that split a row block (all but the last must be
    whole blocks, or the concatenated scales would not line up with the rows)."""
    return any(r % bn for r in rows[:-1])


def _check_tp(name: str, module: Fp8BlockLinear, tp, full: list[int]) -> None:
    """ValueError where the tensor-parallel size cuts an FP8 scale block."""
    (bn, bk), size = module.block, tp.size
    dim, block = (0, bn) if module.parallel == "column" else (1, bk)
    bad = [n for n in full if n % size or (n // size) % block]
    if bad:
        raise ValueError(
            f"{name}: tensor parallelism of {size} cuts the FP8 weight's {block}-wide scale "
            f"blocks along dim {dim} (full sizes {full}, {[n / size for n in full]} a rank); "
            f"use a tensor-parallel size that leaves every rank whole blocks of {block}"
        )


def keep_fp8(
    model: nn.Module,
    has: Callable[[str], bool],
    shape: Callable[[str], tuple[int, ...]],
    packed: Mapping[str, tuple[str, ...]],
    fp8: Fp8Format,
) -> list[str]:
    """Replace the model's plain linears whose checkpoint weights are all quantised by
    ``Fp8BlockLinear`` s (module docstring); returns their names. ``has(name)``: the
    checkpoint holds tensor ``name`` (under the model's names); ``shape(name)``: its
    shape; ``packed``: ``loader.packed_params``. Before the weights load: on the meta
    device before ``to_empty`` (``loader.load_model``: the 16-bit twins are never
    allocated), or on the model's device; the caller rebinds the model
    (``DecoderLM.rebind``)."""
    kept = []
    tp = getattr(model, "tp", None)
    for name, module in list(model.named_modules()):
        if isinstance(module, RoutedExperts):
            weights = [f"{name}.{e}.{n}.weight" for e in range(len(module)) for n in module.names]
            fresh = module.fp8_block is None  # (a second pass finds nothing new)
            if fresh and all(has(w) and has(w + SCALE_SUFFIX) for w in weights):
                module.keep_fp8(fp8.block)  # (a tp size that cuts a block: refused there)
                kept.append(name)
            continue
        if type(module) not in PLAIN_LINEARS:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if attr in getattr(owner, "dense_linears", ()):
            continue
        pads = attr in getattr(owner, "strided_outputs", ())
        parts = packed.get(f"{name}.weight", (f"{name}.weight",))
        if not all(has(p) and has(p + SCALE_SUFFIX) for p in parts):
            continue
        full = [shape(p)[0] for p in parts]
        if _cuts_blocks(full, fp8.block[0]):  # dequantised at load (a rank's cut: refused)
            continue
        parallel = {ColumnParallelLinear: "column", RowParallelLinear: "row"}.get(type(module))
        bias = None if module.bias is None else module.bias.data
        ops = getattr(module, "ops", None) or model.ops  # a tensor-parallel linear has none
        new = Fp8BlockLinear(
            module.in_features, module.out_features, bias, fp8.block, ops,
            device=module.weight.device, parallel=parallel, tp=tp,
            reduce=getattr(module, "reduce", True), adds_bias=getattr(module, "adds_bias", True),
            pads=pads,
        )  # fmt: skip
        if parallel is not None:
            _check_tp(name, new, tp, full if parallel == "column" else [shape(parts[0])[1]])
        setattr(owner, attr, new)
        kept.append(name)
    return kept
