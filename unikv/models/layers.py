"""Building blocks shared by unikv's models: the elementwise ops, RMSNorm, the
attention block, the gated MLP.

Attention is split in two: the model owns the projections, norms and rope; the
paged part (store K/V, read the cache) is an ``AttentionFn`` the engine passes
to ``forward`` for each step, already planned (write locations and block
tables translated once for the whole step). A model never sees the pool.

The elementwise work (RMSNorm with the residual add, rope, SwiGLU) goes
through the elementwise ops of one ``KernelBackend`` chosen once per model and taken
by each module at construction (an ``ops`` argument, else ``backend.model_ops()``:
the loader builds the model inside ``backend.building(ops)``): Triton kernels on
CUDA, their torch references elsewhere; a module built outside any runs the
references. Attention and the
gated MLP run one GEMM for q|k|v and one for gate|up; their weights are
concatenated at load (``packed``: fused module -> the checkpoint's modules).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from unikv.kernels.backend import KernelBackend, RowsPlan, model_ops, step_rows
from unikv.models.config import ModelConfig
from unikv.models.parallel import linear_layers, tp_size
from unikv.models.rope import Rotary


class AttentionFn(Protocol):
    """The engine's per-step attention: stores this step's K/V rows of model
    layer ``layer`` and attends over the cache.

    q: (T, Hq, D), k: (T, H, D), v: (T, H, D) in the model dtype, T = tokens of
    the step in batch order; sinks: None or (Hq,) learned sink logits.
    Returns (T, Hq, D).

    An implementation with ``fuses_rope = True`` (the engine's) also takes
    ``rope=(rotary, positions)``: q and k come unrotated and it applies the
    ``Rotary``'s tables itself, inside the K/V store (``kernels/attention/rope_store.py``).
    Without it, ``Attention`` rotates first (a model test's dense attention)."""

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class StateFn(Protocol):
    """The engine's per-step recurrent-state ops (Gated DeltaNet, Mamba-2 layers).

    The step object passed to ``forward`` as ``attn`` implements these beside
    ``AttentionFn``. Each reads the state of model layer ``layer`` for every
    request of the step from the request's state slot and writes it back
    updated; T = tokens of the step in batch order. See ``unikv/kernels/
    recurrent_ref.py`` for the exact semantics (the torch references)."""

    def causal_conv1d(
        self,
        layer: int,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        activation: str | None,
    ) -> torch.Tensor:
        """x: (T, C), weight: (C, K), bias: (C,) or None -> (T, C) in x.dtype."""
        ...

    def gated_delta_rule(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        scale: float,
        use_qk_l2norm: bool,
        gating: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q, k: (T, Hk, Dk) (Hk dividing H), v: (T, H, Dv), g, beta: (T, H) (the raw
        a, b with ``gating`` = (A_log, dt_bias), gated by the op) -> (T, H, Dv)."""
        ...

    def mamba2_ssd(
        self,
        layer: int,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor,
        dt_bias: torch.Tensor,
        *,
        dt_softplus: bool,
        dt_limit: tuple[float, float],
    ) -> torch.Tensor:
        """x: (T, H, P), dt: (T, H), A, D, dt_bias: (H,), B, C: (T, G, N) -> (T, H, P)."""
        ...


class Linear(nn.Linear):
    """``nn.Linear`` through the kernel backend's ``linear`` (``ops``, None:
    ``model_ops()``): the Triton backend runs a one-request decode step's product as a
    GEMV (``kernels/linear/gemv.py``), cuBLAS otherwise, as the step's ``RowsPlan``
    says (``step_rows``); the torch backend is ``F.linear``. Same parameters and
    state-dict names as ``nn.Linear``."""

    def __init__(self, *args, ops: KernelBackend | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ops = model_ops(ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias, rows=step_rows())


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32.

    ``weight_in_fp32``: gpt-oss multiplies by the weight before casting back
    (``(w * x).to(dtype)``); Llama casts first (``w * x.to(dtype)``). ``offset``: the
    weight is ``offset + w`` (1.0: the zero-centred norms of Gemma and Qwen3.5, which
    also multiply in fp32: ``ZeroCenteredRMSNorm``). ``ops``: the backend (None:
    ``model_ops()``)."""

    def __init__(
        self, dim: int, eps: float, weight_in_fp32: bool = False, ops: KernelBackend | None = None,
        offset: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32
        self.ops = model_ops(ops)
        self.kw = {"weight_in_fp32": weight_in_fp32, "offset": offset}  # the ops' keywords

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., dim) -> normed, same shape and dtype."""
        return self.ops.rms_norm(x, self.weight, self.eps, **self.kw)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: (T, dim) -> (norm(x + residual), x + residual); ``residual``
        may be overwritten: use only the returned tensors."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps, **self.kw)

    def sandwich(
        self, x: torch.Tensor, residual: torch.Tensor, post: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: (T, dim) -> (norm(residual + post(x)), residual + post(x)): the
        previous block's post-norm ``post`` (of this norm's kind, ``fuses_post``), the
        residual add and this norm in one op (``sandwich_rms_norm``). ``residual`` may
        be overwritten: use only the returned tensors."""
        return self.ops.sandwich_rms_norm(
            x, residual, post.weight, self.weight, self.eps, **self.kw
        )

    def fuses_post(self, post: object) -> bool:
        """Whether ``sandwich`` can take ``post`` as the previous block's post-norm: an
        RMSNorm of this one's type, width, eps, weight rule and backend."""
        return (
            type(post) is type(self)
            and isinstance(post, RMSNorm)
            and post.weight.shape == self.weight.shape
            and (post.eps, post.kw, post.ops) == (self.eps, self.kw, self.ops)
        )

    def linear(
        self, x: torch.Tensor, residual: torch.Tensor | None, lin: nn.Linear,
        rows: RowsPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(lin(norm(x + residual)), x + residual), or (lin(norm(x)), x) without a
        residual: the norm fused into the GEMV where the backend runs one
        (``add_rms_norm_linear``) and ``rows`` (the plan of x's rows: the step's, or
        the LM head's; None: by x's shape) says so. ``residual`` may be overwritten."""
        return self.ops.add_rms_norm_linear(
            x, residual, self.weight, self.eps, lin.weight, lin.bias, **self.kw, rows=rows
        )

    def fp8_linear(
        self, x: torch.Tensor, residual: torch.Tensor | None, lin: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``linear`` for an FP8 linear (``fp8_linear.Fp8BlockLinear``): where its GEMM
        quantises x at the step's rows (``lin.input_quant``: the step's plan, host
        values), the norm writes the FP8 codes and scales instead of the normed rows
        (``add_rms_norm_quant``, one pass) and the GEMM takes them
        (``lin.forward_quantized``); else the norm, then ``lin``. Residual None: the
        norm of x, x returned as the residual. ``residual`` may be overwritten."""
        quant = lin.input_quant(x.shape[0], x.dtype, step_rows())
        if quant is None:
            h, residual = (self(x), x) if residual is None else self.add(x, residual)
            return lin(h), residual
        xq, xs, residual = self.ops.add_rms_norm_quant(
            x, residual, self.weight, self.eps, group=quant.group, m_major=quant.m_major,
            **self.kw,
        )  # fmt: skip
        return lin.forward_quantized(xq, xs, x.dtype), residual

    def linear_argmax(
        self, x: torch.Tensor, residual: torch.Tensor | None, lin: nn.Linear,
        out: torch.Tensor | None = None, rows: RowsPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(lin(norm(x + residual)), each row's greedy token, into ``out`` when given):
        ``linear`` with the argmax inside the GEMV's epilogue where the backend runs
        one (``add_rms_norm_linear_argmax``; ``rows`` as in ``linear``). ``residual``
        may be overwritten."""
        logits, _, tokens = self.ops.add_rms_norm_linear_argmax(
            x, residual, self.weight, self.eps, lin.weight, lin.bias, out=out, **self.kw,
            rows=rows,
        )  # fmt: skip
        return logits, tokens

    def embed_linear(
        self, ids: torch.Tensor, table: torch.Tensor, lin: nn.Linear,
        feedback: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(lin(norm(table[ids])), table[ids]): a model's embedding, its first pre-norm
        and the GEMM after it, the gather inside the GEMV where the backend runs one
        (``embed_rms_norm_linear``, by the step's ``RowsPlan``); placeholder ids
        -(1 + lane) read ``feedback``."""
        return self.ops.embed_rms_norm_linear(
            ids, table, self.weight, self.eps, lin.weight, lin.bias, feedback=feedback,
            **self.kw, rows=step_rows(),
        )  # fmt: skip


def overrides_forward(module: nn.Module, base: type) -> bool:
    """True for a subclass of ``base`` with its own ``forward`` (it may call the
    unfused projections by name, so it keeps them)."""
    return type(module).forward is not base.forward


class Attention(nn.Module):
    """q/k/v projections, optional q/k norm (Qwen3), rope, paged attention, o_proj.

    q, k and v come from one GEMM, ``qkv_proj`` (rows: q heads, k heads, v heads),
    loaded from transformers' ``q_proj``, ``k_proj``, ``v_proj`` (``packed``);
    other weight names are transformers' (``o_proj``, ``q_norm``, ``k_norm``,
    ``sinks``). A subclass overriding ``forward`` keeps the three projections.

    With ``tp`` (``models.parallel``), this rank holds heads ``1/tp`` of them:
    q/k/v column-parallel by heads (each concatenated per shard), o_proj
    row-parallel (all-reduce)."""

    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary, tp=None) -> None:
        super().__init__()
        hidden, d, n = config.hidden_size, config.head_dim, tp_size(tp)
        column, row = linear_layers(tp)
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads // n, config.num_kv_heads // n
        self.head_dim = d
        q, kv = self.num_heads * d, self.num_kv_heads * d
        self.split = (q, kv, kv)
        self.packed = {}
        if overrides_forward(self, Attention):
            self.q_proj = column(hidden, q, bias=config.qkv_bias)
            self.k_proj = column(hidden, kv, bias=config.qkv_bias)
            self.v_proj = column(hidden, kv, bias=config.qkv_bias)
        else:
            self.qkv_proj = column(hidden, q + 2 * kv, bias=config.qkv_bias)
            self.packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
        self.o_proj = row(q, hidden, bias=config.o_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None
        if tp is not None:
            self.tp_shards = {"sinks": 0}  # sinks follow the q heads
        self.rotary = [rotary]  # shared, kept out of this module's parameters
        self.key_scale: float | None = None  # keys scaled after k_proj (set by a family)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """x: (T, hidden); positions: (T,) int64 -> (T, hidden). q/k/v reach
        ``attn`` as strided views of the one GEMM's output."""
        return self.attend(self.qkv_proj(x), positions, attn)

    def input_linear(self) -> nn.Module | None:
        """The GEMM a decoder may fuse this block's pre-norm into (``decoder.Block``):
        the q|k|v projection where it is a plain ``Linear`` (not under tp) or an FP8
        linear whose x the norm may quantise (``fuses_norm``), not in a subclass
        keeping the three projections; else None."""
        qkv = getattr(self, "qkv_proj", None)
        if overrides_forward(self, Attention):
            return None
        return qkv if type(qkv) is Linear or getattr(qkv, "fuses_norm", False) else None

    def from_input(self, qkv: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """``forward`` after ``input_linear``'s GEMM."""
        return self.attend(qkv, positions, attn)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """``forward`` after the qkv GEMM: qkv (T, (Hq + 2 Hkv) D) -> (T, hidden)
        (a caller that fused the pre-norm into that GEMM enters here)."""
        t = qkv.shape[0]
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.key_scale is not None:  # a constant of the model (Falcon-H1's keys)
            k = k * self.key_scale
        if self.q_norm is not None:  # both norms in one launch (one eps and rounding)
            norm = self.q_norm
            q, k = norm.ops.qk_rms_norm(q, k, norm.weight, self.k_norm.weight, norm.eps, **norm.kw)
        if getattr(attn, "fuses_rope", False):  # the engine's: rope inside the K/V store
            out = attn(self.layer, q, k, v, self.sinks, rope=(self.rotary[0], positions))
        else:
            q, k = self.rotary[0](positions, q, k)
            out = attn(self.layer, q, k, v, self.sinks)  # (T, Hq, D)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (Llama family), gate and up as one
    GEMM (``gate_up_proj``, loaded from ``gate_proj`` and ``up_proj``) and one
    fused ``silu_mul``. A subclass overriding ``forward`` keeps the two
    projections. With ``tp``: gate/up column-parallel on the intermediate dim
    (concatenated per shard), down row-parallel; ``reduce=False``: its output is this
    rank's partial sum, all-reduced by the caller (a MoE's shared experts)."""

    def __init__(
        self, config: ModelConfig, tp=None, ops: KernelBackend | None = None, reduce: bool = True
    ) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size // tp_size(tp), config.mlp_bias
        column, row = linear_layers(tp, reduce)
        self.packed = {}
        if overrides_forward(self, GatedMLP):
            self.gate_proj = column(h, i, bias=bias)
            self.up_proj = column(h, i, bias=bias)
        else:
            self.gate_up_proj = column(h, 2 * i, bias=bias)
            self.packed = {"gate_up_proj": ("gate_proj", "up_proj")}
        self.down_proj = row(i, h, bias=bias)
        self.ops = model_ops(ops)
        self.rebind()

    def rebind(self) -> None:
        """SwiGLU inside the down GEMV where ``down_proj`` is a plain ``Linear`` (again
        after the loader replaced it, ``DecoderLM.rebind``)."""
        self.fused_down = type(self.down_proj) is Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        return self.down(self.gate_up_proj(x))

    def input_linear(self) -> nn.Module | None:
        """The gate|up GEMM a decoder may fuse the pre-norm into (``decoder.Block``),
        where it is a plain ``Linear`` or an FP8 linear whose x the norm may quantise
        (``fuses_norm``), of the stock forward; else None."""
        gate_up = getattr(self, "gate_up_proj", None)
        fuses = type(gate_up) is Linear or getattr(gate_up, "fuses_norm", False)
        return gate_up if fuses and not overrides_forward(self, GatedMLP) else None

    def from_input(self, gate_up: torch.Tensor, positions=None, attn=None) -> torch.Tensor:
        """``forward`` after ``input_linear``'s GEMM."""
        return self.down(gate_up)

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``forward`` after the gate/up GEMM: (T, 2I) -> (T, hidden)."""
        if self.fused_down:
            return self.ops.silu_mul_linear(
                gate_up, self.down_proj.weight, self.down_proj.bias, rows=step_rows()
            )
        return self.down_proj(self.ops.silu_mul(gate_up))
