"""gpt-oss's mixture-of-experts block: a top-k router and the fused MoE
(``kernels/moe/fused.py``) with gpt-oss's clamped SwiGLU (``alpha`` 1.702, ``limit`` 7),
its expert weights dense or MXFP4 kept packed.

The rest of gpt-oss (alternating sliding/full layers, attention sinks, yarn
rope, biased projections, fp32 norms) is the shared decoder in ``llama.py``.

The MoE kernel is the model's backend's (``kernels/backend.py``, taken at
construction): the Triton MoE, or on the torch backend its torch reference: dense
(every expert on every token, zero weight when not routed; no host sync) for T <=
``DENSE_MAX_TOKENS``, sparse (each expert on its tokens, as transformers) above;
both add the experts in index order, as transformers' loop does.
"""

from __future__ import annotations

import torch
from torch import nn

from unikv.kernels.backend import KernelBackend, model_ops, step_rows
from unikv.models.config import ModelConfig
from unikv.models.moe import DENSE_MAX_TOKENS  # noqa: F401  (the bound: a re-export)
from unikv.models.parallel import tp_size


class Router(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden) -> (scores (T, k) softmax over the top-k logits,
        expert indices (T, k) int64)."""
        logits = nn.functional.linear(x, self.weight, self.bias)  # (T, E)
        top_values, top_indices = torch.topk(logits, self.top_k, dim=-1)
        scores = torch.softmax(top_values, dim=1, dtype=top_values.dtype)
        return scores, top_indices


class Experts(nn.Module):
    """gpt-oss's experts, run by the backend's fused MoE (``ops``, None:
    ``model_ops()``; fixed at construction), with gate and up interleaved (gate 2j,
    up 2j+1).

    Dense (transformers' shapes): ``gate_up_proj`` (E, hidden, 2I), ``down_proj``
    (E, I, hidden), stored transposed, so the kernel's (E, N, K) views of them (no
    copy) are contiguous along K.
    MXFP4 kept packed (``config.extra["mxfp4_experts"]``, a checkpoint quantised
    with ``quant_method`` "mxfp4"): the checkpoint's ``gate_up_proj_blocks`` (E, 2I,
    hidden / 32, 16) and ``_scales`` (E, 2I, hidden / 32), ``down_proj_blocks`` (E,
    hidden, I / 32, 16) and ``_scales``, uint8 (``models/mxfp4.py``), dequantised
    inside the kernel's tiles. Where the backend runs such experts re-packed (its
    ``moe_repacked``: the Hopper kernel on an H200 in bf16), ``finish_loading`` re-packs
    them in place, and that kernel then runs every step. Biases ``gate_up_proj_bias``
    (E, 2I), ``down_proj_bias`` (E, hidden) in the model dtype either way.

    With ``tp`` every expert holds intermediate rows [r*I/tp, (r+1)*I/tp): a
    contiguous slice of 2I/tp gate_up columns keeps each (gate, up) pair whole.
    Outputs are partial sums (the MoE all-reduces once); only rank 0 adds the
    down bias, so it is counted once."""

    alpha = 1.702
    limit = 7.0

    def __init__(self, config: ModelConfig, tp=None, ops: KernelBackend | None = None) -> None:
        super().__init__()
        e, h = config.num_experts, config.hidden_size
        i = config.intermediate_size // tp_size(tp)
        self.num_experts = e
        self.mxfp4 = bool(config.extra.get("mxfp4_experts", False))
        if self.mxfp4:
            check_mxfp4_dims(h, i, tp_size(tp))
            self.gate_up_proj_blocks = _uint8_param(e, 2 * i, h // 32, 16)
            self.gate_up_proj_scales = _uint8_param(e, 2 * i, h // 32)
            self.down_proj_blocks = _uint8_param(e, h, i // 32, 16)
            self.down_proj_scales = _uint8_param(e, h, i // 32)
            shards = {"gate_up_proj_blocks": 1, "gate_up_proj_scales": 1}
            shards.update({"down_proj_blocks": 2, "down_proj_scales": 2})
        else:
            # transformers' shapes, stored K-contiguous: the kernel's (E, N, K) views
            # (``operands``) load whole K runs; N-contiguous storage made every weight
            # tile a stride-2 gather (interleaved gate/up), 3x the FLOP time at prefill
            self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h).transpose(1, 2))
            self.down_proj = nn.Parameter(torch.zeros(e, h, i).transpose(1, 2))
            shards = {"gate_up_proj": 2, "down_proj": 1}
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h))
        self.add_down_bias = tp is None or tp.rank == 0
        if tp is not None:
            self.tp_shards = {**shards, "gate_up_proj_bias": 1}
        self.ops = model_ops(ops)
        self.kernel = self.ops.moe  # the backend's MoE on the checkpoint's layout
        self.fragments = None  # the MXFP4 bytes re-packed for the backend (``finish_loading``)

    def finish_loading(self) -> None:
        """After the checkpoint is in (``loader.load_model``): where the backend runs
        MXFP4 experts of this dtype and shape re-packed (``ops.moe_repacked``: the Hopper
        kernel on an H200 with bf16 activations), re-pack them in place into that
        kernel's order (same bytes, one pass, one layer's copy at a time); the
        parameters then hold that order and only that kernel reads them."""
        if not self.mxfp4 or self.fragments is not None:
            return
        h, i2 = self.down_proj_bias.shape[1], self.gate_up_proj_bias.shape[1]
        variant = self.ops.moe_repacked(self.down_proj_bias.dtype, h, i2 // 2)
        if variant is None:
            return
        params = (self.gate_up_proj_blocks, self.gate_up_proj_scales, self.down_proj_blocks,
                  self.down_proj_scales)  # fmt: skip
        self.fragments = variant.pack(*params, "interleaved")
        self.kernel = variant.run  # ``operands`` hands it the fragments

    def _apply(self, fn, recurse=True):  # to / to_empty / cuda
        if self.fragments is not None:
            raise RuntimeError(
                "gpt-oss's MXFP4 experts were re-packed for the Hopper kernel and cannot be "
                "moved or cast; load the model on its final device and dtype (or set "
                "UNIKV_MOE_HOPPER=0 to keep the checkpoint's layout)"
            )
        return super()._apply(fn, recurse)

    def operands(self) -> dict:
        """The MoE kernel's weight arguments (views, no copy): the re-packed fragments
        for the re-packed variant, else the checkpoint's layout for the backend's ``moe``."""
        if self.fragments is not None:  # fixed at load
            w = {"frags": self.fragments}
        elif self.mxfp4:  # a host bool fixed at construction
            w = {"w1": self.gate_up_proj_blocks, "w2": self.down_proj_blocks}
            w.update(w1_scales=self.gate_up_proj_scales, w2_scales=self.down_proj_scales)
        else:
            w = {"w1": self.gate_up_proj.transpose(1, 2), "w2": self.down_proj.transpose(1, 2)}
        w["b2"] = self.down_proj_bias if self.add_down_bias else None
        return w

    def planned(self) -> dict:
        """The step's ``RowsPlan`` for the backend's ``moe`` (its dense table or sparse
        loop, its bucket); the re-packed variant takes none (fixed at load)."""
        return {} if self.fragments is not None else {"rows": step_rows()}

    def forward(self, x: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor):
        """x: (T, hidden); scores/indices: (T, k) -> (T, hidden) in x.dtype."""
        return self.kernel(
            x,
            scores,
            indices,
            **self.operands(),
            b1=self.gate_up_proj_bias,
            activation="gpt_oss",
            gate_up="interleaved",
            **self.planned(),
            alpha=self.alpha,
            limit=self.limit,
        )


def _uint8_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=torch.uint8), requires_grad=False)


def check_mxfp4_dims(hidden: int, intermediate: int, tp: int) -> None:
    """ValueError unless hidden and the per-rank intermediate size split into MXFP4
    groups of 32."""
    if hidden % 32 or intermediate % 32:
        raise ValueError(
            f"MXFP4 experts need hidden_size ({hidden}) and intermediate_size / tp "
            f"({intermediate}, tp={tp}) multiples of 32; use a tp that keeps whole groups"
        )


def config_extras(hf_config) -> dict:
    """gpt-oss's own fields: whether the checkpoint's experts are MXFP4 (kept packed)."""
    quant = getattr(hf_config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else quant.quant_method
    return {"mxfp4_experts": method == "mxfp4"}


class MoE(nn.Module):
    """gpt-oss MLP block: ``mlp.router`` (replicated under ``tp``) and
    ``mlp.experts`` (sharded on the intermediate dim, one all-reduce)."""

    def __init__(self, config: ModelConfig, tp=None, ops: KernelBackend | None = None) -> None:
        super().__init__()
        self.router = Router(config)
        self.experts = Experts(config, tp, ops)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        scores, indices = self.router(x)
        out = self.experts(x, scores, indices)
        return out if self.tp is None else self.tp.all_reduce(out)
