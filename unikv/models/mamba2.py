"""The Mamba-2 mixer on unikv's step object (NemotronH, Falcon-H1).

    x (T, hidden) -> in_proj -> [z (I) | xBC (I + 2 G N) | dt (H)]
    xBC -> attn.causal_conv1d (depthwise, kernel K, silu; per-request conv state)
        -> [x (H, P) | B (G, N) | C (G, N)]
    y = attn.mamba2_ssd(x, dt, A = -exp(A_log), B, C, D, dt_bias)   (per-request SSM state)
    y -> gated RMSNorm with z over G groups -> out_proj -> (T, hidden)

I = H * P (heads times head dim), G groups, N the state size. The recurrent state
(the conv window of xBC and the SSM state S (H, P, N) fp32) lives in the engine's
Mamba sub-pool; the model only calls the step object's ops (``layers.StateFn``).
Parameter names follow transformers (``in_proj``, ``conv1d.weight`` (C, 1, K),
``conv1d.bias``, ``dt_bias``, ``A_log``, ``D``, ``norm.weight``, ``out_proj``).

Under tensor parallelism (``models/parallel.py``) a rank runs ``dims.shard(tp)``: its
heads, and B/C of its groups (or of the one group its heads use, shared with other
ranks, whose gated-norm mean square is then summed over them); ``in_proj`` stays one
plain GEMM (the pre-norm fuses into it), ``out_proj`` is row-parallel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from unikv.models.layers import Linear, model_ops
from unikv.models.parallel import RowParallelLinear, Segments, shard_rows, tp_size

ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class Mamba2Dims:
    """Hyper-parameters of one Mamba-2 mixer (plain Python values).

    ``dt_limit``: the clamp of the softplus'd step size. ``norm``: whether the
    gated RMSNorm runs (Falcon-H1 may drop it: then y * silu(z)); ``norm_before_gate``:
    normalise y first, then gate with silu(z) (else gate, then normalise);
    ``norm_weight_in_fp32``: the norm's weight multiplies in fp32 before the
    cast back (Falcon-H1), else after it (NemotronH)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    out_bias: bool
    activation: str
    eps: float
    dt_limit: tuple[float, float]
    norm: bool = True
    norm_before_gate: bool = False
    norm_weight_in_fp32: bool = False
    # the HF fields of the head and group counts (the errors name them)
    fields: tuple[str, str] = field(default=("mamba_num_heads", "n_groups"), compare=False)

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """The SSM state of one request: (heads, head dim, state size)."""
        return (self.num_heads, self.head_dim, self.state_size)

    def shard(self, size: int) -> Mamba2Dims:
        """One of ``size`` tensor-parallel ranks' dims: heads / size; groups / size
        where ``size`` divides them, else (``size`` a multiple of them) the one group
        that all the rank's heads use. ValueError naming the fields otherwise."""
        if size == 1:
            return self
        heads, groups = self.fields
        if self.num_heads % size or (self.n_groups % size and size % self.n_groups):
            raise ValueError(
                f"tensor parallelism of {size} needs {heads} ({self.num_heads}) divisible by "
                f"{size} and {groups} ({self.n_groups}) divisible by {size} or dividing it; "
                "use a tensor-parallel size that splits the Mamba heads and groups"
            )
        local_groups = self.n_groups // size if self.n_groups % size == 0 else 1
        return dataclasses.replace(self, num_heads=self.num_heads // size, n_groups=local_groups)

    def segments(self) -> tuple[Segments, Segments]:
        """How ``in_proj`` ([z | x | B | C | dt], dim 0) and the conv ([x | B | C]) split
        over ranks: z, x and dt by heads, B and C by groups."""
        inner, gn = self.intermediate_size, self.n_groups * self.state_size
        h, g = self.num_heads, self.n_groups
        xbc = ((inner, h), (gn, g), (gn, g))
        return Segments(0, ((inner, h), *xbc, (h, h))), Segments(0, xbc)

    def check(self) -> None:
        """Raise ValueError on dims the mixer cannot run."""
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"Mamba-2 conv activation must be one of {ACTIVATIONS}, got {self.activation!r}"
            )
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"mamba heads ({self.num_heads}) must be a multiple of n_groups "
                f"({self.n_groups}); fix the config"
            )


class GatedRMSNorm(nn.Module):
    """RMSNorm over groups of the last dim, gated by silu(z), in fp32.

    x, z: (T, I) -> (T, I) in x.dtype; I splits into ``n_groups`` groups, each
    normalised on its own (transformers' Zamba2RMSNormGated: gate, normalise, cast,
    weight; FalconH1RMSNormGated: optionally normalise first, weight in fp32, cast)."""

    def __init__(
        self, dim: int, n_groups: int, eps: float, norm_before_gate: bool, weight_in_fp32: bool,
        shared: tuple | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.n_groups, self.eps, self.norm_before_gate = n_groups, eps, norm_before_gate
        self.weight_in_fp32 = weight_in_fp32
        self.ops = model_ops(None)
        # under tp with fewer groups than ranks: (tp, full groups, this rank's group,
        # group width) - the rank holds a slice of one group, whose mean square is
        # summed over the ranks sharing it (``shared_group``)
        self.shared = shared

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z: (T, I) -> (T, I): one backend op (``gated_rms_norm``), or with a group
        shared by ranks the torch form with one all-reduce of the sums of squares."""
        if self.shared is not None:  # a host value fixed at construction
            return self.across_ranks(x, z)
        return self.ops.gated_rms_norm(
            x, z, self.weight, self.eps, group_size=x.shape[1] // self.n_groups,
            norm_before_gate=self.norm_before_gate,
            weight_mode="fp32" if self.weight_in_fp32 else "dtype_after_gate",
        )  # fmt: skip

    def across_ranks(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``forward`` where this rank holds a slice of one group (the op's reference
        math, the mean square over the whole group)."""
        tp, groups, mine, width = self.shared
        dtype, t = x.dtype, x.shape[0]
        h, gate = x.float(), nn.functional.silu(z.float())
        if not self.norm_before_gate:
            h = h * gate
        sums = h.new_zeros(t, groups)
        sums[:, mine] = h.pow(2).sum(-1)
        square = tp.all_reduce(sums)[:, mine, None] / width  # (T, 1)
        h = h * torch.rsqrt(square + self.eps)
        if self.weight_in_fp32:
            h = self.weight * h
        if self.norm_before_gate:
            h = h * gate
        return h.to(dtype) if self.weight_in_fp32 else self.weight * h.to(dtype)


def shared_group(full: Mamba2Dims, tp) -> tuple | None:
    """``GatedRMSNorm``'s ``shared`` for ``full`` dims split over ``tp``: None where each
    rank holds whole groups (or no tp)."""
    size = tp_size(tp)
    if size == 1 or full.n_groups % size == 0:
        return None
    return (
        tp,
        full.n_groups,
        tp.rank * full.n_groups // size,
        full.intermediate_size // full.n_groups,
    )


class Conv1dWeights(nn.Module):
    """The depthwise conv's parameters under transformers' names: ``weight``
    (C, 1, K), ``bias`` (C,) or None. The conv itself runs in the step object."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None


class Mamba2Mixer(nn.Module):
    """Mamba-2 mixer of model layer ``layer``; see the module docstring."""

    def __init__(self, dims: Mamba2Dims, layer: int, tp=None) -> None:
        super().__init__()
        dims.check()
        full, dims = dims, dims.shard(tp_size(tp))  # this rank's heads and groups
        self.dims, self.layer = dims, layer
        h, inner = dims.num_heads, dims.intermediate_size
        self.in_proj = Linear(dims.hidden_size, inner + dims.conv_dim + h, bias=dims.proj_bias)
        self.conv1d = Conv1dWeights(dims.conv_dim, dims.conv_kernel, dims.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(h))
        self.A_log = nn.Parameter(torch.zeros(h))
        self.D = nn.Parameter(torch.ones(h))
        if dims.norm:
            self.norm = GatedRMSNorm(
                inner, dims.n_groups, dims.eps, dims.norm_before_gate, dims.norm_weight_in_fp32,
                shared_group(full, tp),
            )  # fmt: skip
        if tp is None:
            self.out_proj = Linear(inner, dims.hidden_size, bias=dims.out_bias)
            return
        # tensor parallelism: z, x, dt and the conv's x channels by heads, B and C by
        # groups (or the rank's one group), out_proj row-parallel (one all-reduce)
        proj, conv = full.segments()
        shard_rows(self.in_proj, proj)
        shard_rows(self.conv1d, conv)
        self.tp_shards = {"dt_bias": 0, "A_log": 0, "D": 0}
        if dims.norm:
            self.norm.tp_shards = {"weight": 0}
        self.out_proj = RowParallelLinear(inner, dims.hidden_size, bias=dims.out_bias, tp=tp)

    def finish_loading(self) -> None:
        """After the weights load (``loader.load_model``): A = -exp(A_log) (H,) fp32 kept,
        so a step does not launch the two elementwise ops that derive it. A module whose
        weights come another way derives A each step (``decay_rates``)."""
        self.register_buffer("neg_a", -torch.exp(self.A_log.float()), persistent=False)

    def decay_rates(self) -> torch.Tensor:
        """A = -exp(A_log) (H,) fp32: the one kept at load, else derived now."""
        kept = getattr(self, "neg_a", None)
        return kept if kept is not None else -torch.exp(self.A_log.float())

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, I + C + H): [z | xBC | dt] (Falcon-H1 scales it)."""
        return self.in_proj(x)

    def input_linear(self) -> nn.Linear | None:
        """``in_proj``, the GEMM a decoder may fuse the pre-norm into, where ``project``
        is the plain projection (not Falcon-H1's scaled one), else None."""
        return self.in_proj if type(self).project is Mamba2Mixer.project else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None, attn) -> torch.Tensor:
        """x: (T, hidden) model dtype; positions: unused (a token mixer's signature);
        attn: the step object (``layers.StateFn``) -> (T, hidden)."""
        return self.from_input(self.project(x), positions, attn)

    def from_input(self, proj: torch.Tensor, positions: torch.Tensor | None, attn) -> torch.Tensor:
        """``forward`` after the input projection: proj (T, I + C + H) -> (T, hidden)."""
        d, t = self.dims, proj.shape[0]
        inner, gn = d.intermediate_size, d.n_groups * d.state_size
        z, xbc, dt = proj.split([inner, d.conv_dim, d.num_heads], dim=-1)
        weight = self.conv1d.weight.squeeze(1)  # (C, K)
        xbc = attn.causal_conv1d(self.layer, xbc, weight, self.conv1d.bias, d.activation)
        xs, b, c = xbc.split([inner, gn, gn], dim=-1)
        y = attn.mamba2_ssd(
            self.layer,
            xs.reshape(t, d.num_heads, d.head_dim),
            dt,
            self.decay_rates(),
            b.reshape(t, d.n_groups, d.state_size),
            c.reshape(t, d.n_groups, d.state_size),
            self.D,
            self.dt_bias,
            dt_softplus=True,
            dt_limit=d.dt_limit,
        )  # (T, H, P)
        y = y.reshape(t, inner)
        if d.norm:
            y = self.norm(y, z)
        else:
            y = y * nn.functional.silu(z)
        return self.out_proj(y.to(proj.dtype))
