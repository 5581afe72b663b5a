"""Pure-torch references of the recurrent-state ops: the CPU path and the oracle
of their Triton twins (``unikv/kernels/recurrent/triton_ops.py``).

Every op reads each request's state from its slot of a per-layer pool view,
runs the step's new tokens of that request through the recurrence and writes
the final state back in place (docs/design.md section 8):

    x (T, ...)         new tokens of the step, requests in batch order; request b
                       owns rows q_indptr[b]:q_indptr[b+1]
    state (S, ...)     strided per-layer view of the Mamba sub-pool, indexed by
                       PHYSICAL slot; slots (B,) int64 (0 = the sink, padded lanes)

    ckpt_slots (B,)     None, or (a prefill chunk that ends at a prefix-cache
                       checkpoint, issue 41) per lane a second physical slot that
                       receives the final state too, in the same write (0, the sink,
                       for lanes without one): the checkpoint needs no copy after.
    ckpt_at (B,)        None, or with ``ckpt_slots`` per lane the row (within the lane)
                       after which its state goes to ``ckpt_slots[b]`` instead of its
                       final state (a checkpoint inside the chunk: the page-aligned
                       prompt end, issue 41); -1: after its last row (the final state).
                       The conv writes the window ending at that row.
    draft_slots (B, k)  None, or (a speculative verify step) per lane the physical
                       slots that receive the state after each of its first k
                       tokens: column j the state after token j, for j < the
                       lane's token count - 1 (the state after its last token goes
                       to ``slots`` as always). Accepting j drafts then selects
                       the slot of position j by index (``allocator/mamba.py``).

The requests are handled together: tokens are scattered into a padded
(B, max_q_len) grid, time is a loop of ``max_q_len`` steps (a host int) and
lanes past their own length keep their state. Math runs in fp32. No host
synchronisation, so the references also run (slowly) on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu")


def _lanes(q_indptr: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request index (T,), position inside the request's new tokens (T,)) of every row."""
    rows = torch.arange(num_tokens, device=q_indptr.device)
    ends = q_indptr[1:].long()
    lane = torch.searchsorted(ends, rows, right=True)
    return lane, rows - q_indptr.long()[lane]


def _grid(x: torch.Tensor, lane, pos, num_lanes: int, max_q_len: int) -> torch.Tensor:
    """(B, max_q_len, *x.shape[1:]) fp32 zeros with row t of x at (lane[t], pos[t])."""
    grid = x.new_zeros((num_lanes, max_q_len, *x.shape[1:]), dtype=torch.float32)
    grid[lane, pos] = x.float()
    return grid


def draft_targets(
    draft_slots: torch.Tensor | None, q_indptr: torch.Tensor, max_q_len: int
) -> torch.Tensor | None:
    """(B, max_q_len) int64: the physical slot that receives lane b's state after its
    token i (``draft_slots[b, i]`` where i < k and i < the lane's tokens - 1), else 0,
    the sink (a harmless write); None without ``draft_slots`` ((B, k), k >= 1)."""
    if draft_slots is None:
        return None
    lens = (q_indptr[1:] - q_indptr[:-1]).long()
    width = draft_slots.shape[1]
    cols = torch.arange(max_q_len, device=draft_slots.device)
    picked = draft_slots.long()[:, cols.clamp(max=width - 1)]
    live = (cols[None, :] < lens[:, None] - 1) & (cols[None, :] < width)
    return torch.where(live, picked, torch.zeros_like(picked))


def ckpt_rows(ckpt_at: torch.Tensor, q_indptr: torch.Tensor) -> torch.Tensor:
    """(B,) int64: the row of each lane after which its checkpoint state is taken
    (``ckpt_at``, -1 read as the lane's last row; -1 for a lane with no tokens)."""
    lens = (q_indptr[1:] - q_indptr[:-1]).long()
    at = ckpt_at.to(lens.device).long()
    return torch.where(at < 0, lens - 1, at)


def write_final(
    state: torch.Tensor,
    slots: torch.Tensor,
    ckpt_slots: torch.Tensor | None,
    value,
    ckpt_value=None,
) -> None:
    """``state[slots] = value`` and, with ``ckpt_slots`` (B,), ``state[ckpt_slots] =
    ckpt_value`` (default ``value``) in the same indexed write (lanes without a
    checkpoint name the sink, 0)."""
    if ckpt_slots is None:
        state[slots] = value
        return
    both = torch.cat([slots.long(), ckpt_slots.to(slots.device).long()])
    state[both] = torch.cat([value, value if ckpt_value is None else ckpt_value])


def _cut(ckpt_slots, ckpt_at, q_indptr) -> torch.Tensor | None:
    """``ckpt_rows`` when the step takes checkpoints inside its chunks, else None (the
    final state is the checkpoint's)."""
    if ckpt_slots is None or ckpt_at is None:
        return None
    return ckpt_rows(ckpt_at, q_indptr)


def _check_activation(activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    q_indptr: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    max_q_len: int,
    activation: str | None,
    draft_slots: torch.Tensor | None = None,
    ckpt_slots: torch.Tensor | None = None,
    ckpt_at: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv over each request's new tokens, continuing its state.

    x: (T, C); conv_state: (S, C, K) view, the last K inputs of each slot, oldest
    first; slots: (B,) int64; q_indptr: (B+1,) int32; weight: (C, K); bias: (C,)
    or None; activation: None or "silu". Per request, with seq = [state | x_b]
    along time: out[j] = act(sum_k weight[:, k] * seq[j + 1 + k] + bias), and the
    state becomes the last K entries of seq (``draft_slots``: the module docstring;
    the window after token j goes there; ``ckpt_slots``/``ckpt_at``: the window ending
    at the checkpoint row). Returns (T, C) in x.dtype.
    """
    _check_activation(activation)
    num_lanes, width = slots.numel(), conv_state.shape[-1]
    lane, pos = _lanes(q_indptr, x.shape[0])
    seq = x.new_zeros((num_lanes, width + max_q_len, x.shape[1]), dtype=torch.float32)
    seq[:, :width] = conv_state[slots].float().transpose(1, 2)  # (B, K, C): time-major
    seq[lane, pos + width] = x.float()
    taps = torch.arange(width, device=x.device)
    windows = seq[lane[:, None], pos[:, None] + 1 + taps]  # (T, K, C)
    out = (windows * weight.float().t()).sum(1)
    if bias is not None:
        out = out + bias.float()
    if activation == "silu":
        out = F.silu(out)
    targets = draft_targets(draft_slots, q_indptr, max_q_len)
    if targets is not None:  # the window after each row, into its draft slot (or the sink)
        conv_state[targets[lane, pos]] = windows.transpose(1, 2).to(conv_state.dtype)
    lens = (q_indptr[1:] - q_indptr[:-1]).long()
    every = torch.arange(num_lanes, device=x.device)[:, None]
    last = seq[every, lens[:, None] + taps].transpose(1, 2).to(conv_state.dtype)
    ckpt = None
    if ckpt_slots is not None and ckpt_at is not None:  # the window ending at that row
        rows = ckpt_rows(ckpt_at, q_indptr)
        ckpt = seq[every, rows[:, None] + 1 + taps].transpose(1, 2).to(conv_state.dtype)
    write_final(conv_state, slots, ckpt_slots, last, ckpt)
    return out.to(x.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's gates from the input projection's raw a, b (T, H):
    g = -exp(A_log) * softplus(a + dt_bias) in fp32 (the log decay), beta =
    sigmoid(b) in b's dtype (transformers' Qwen3.5 / Qwen3-Next order of casts)."""
    return -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias), b.sigmoid()


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    q_indptr: torch.Tensor,
    *,
    max_q_len: int,
    scale: float,
    use_qk_l2norm: bool,
    gating: tuple[torch.Tensor, torch.Tensor] | None = None,
    draft_slots: torch.Tensor | None = None,
    ckpt_slots: torch.Tensor | None = None,
    chunks: torch.Tensor | None = None,
    ckpt_at: torch.Tensor | None = None,
    ckpt_split: object = None,
) -> torch.Tensor:
    """Gated delta rule (Gated DeltaNet) over each request's new tokens.

    q, k: (T, Hk, Dk) with Hk dividing H (value head h reads q/k head h // (H / Hk));
    v: (T, H, Dv); g: (T, H) log decay, or (T, H, Dk) a decay per key channel (Kimi
    Delta Attention, given as computed: no ``gating``); beta: (T, H); state: (S, H, Dk,
    Dv) view. ``gating`` = (A_log, dt_bias), each (H,): g and beta are the raw a and b,
    and the gates are ``gdn_gates(g, beta, A_log, dt_bias)``. Per token, in fp32: q, k
    l2-normalised if ``use_qk_l2norm``; q *= scale; S *= exp(g) (row i of S by
    exp(g[i]) per channel); delta = (v - k S) * beta; S += k^T delta; o = q S.
    ``draft_slots``, ``ckpt_slots``, ``ckpt_at``: the module docstring. ``chunks``,
    ``ckpt_split``: fla-core's chunk list of q_indptr and split of the lanes at their
    checkpoint rows on CUDA (``fla_prefill``), unread here. Returns (T, H, Dv)
    in v.dtype.
    """
    if gating is not None:
        g, beta = gdn_gates(g, beta, *gating)
    groups = v.shape[1] // q.shape[1]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    num_lanes = slots.numel()
    lane, pos = _lanes(q_indptr, q.shape[0])
    qs, ks = q.float(), k.float()
    if use_qk_l2norm:
        qs, ks = _l2norm(qs), _l2norm(ks)
    qs = qs * scale
    grids = [_grid(t, lane, pos, num_lanes, max_q_len) for t in (qs, ks, v, g, beta)]
    qg, kg, vg, gg, bg = grids
    live = _grid(torch.ones_like(beta[:, 0]), lane, pos, num_lanes, max_q_len) > 0  # (B, L)
    s = state[slots].float()  # (B, H, Dk, Dv)
    out = torch.zeros_like(vg)
    per_channel = g.dim() == 3  # a host bool from the shape (fixed per model)
    targets = draft_targets(draft_slots, q_indptr, max_q_len)
    cut = _cut(ckpt_slots, ckpt_at, q_indptr)
    ck = s
    for i in range(max_q_len):
        decay = gg[:, i].exp()  # (B, H) or (B, H, Dk)
        decayed = s * (decay[..., None] if per_channel else decay[..., None, None])
        kv = (decayed * kg[:, i, :, :, None]).sum(-2)  # (B, H, Dv)
        delta = (vg[:, i] - kv) * bg[:, i, :, None]
        new = decayed + kg[:, i, :, :, None] * delta[:, :, None, :]
        s = torch.where(live[:, i, None, None, None], new, s)
        out[:, i] = (s * qg[:, i, :, :, None]).sum(-2)
        if targets is not None:  # the state after token i, into its draft slot (or the sink)
            state[targets[:, i]] = s.to(state.dtype)
        if cut is not None:  # the state after the checkpoint row, kept for its slot
            ck = torch.where((cut == i)[:, None, None, None], s, ck)
    ckpt = None if cut is None else ck.to(state.dtype)
    write_final(state, slots, ckpt_slots, s.to(state.dtype), ckpt)
    return out[lane, pos].to(v.dtype)


def mamba2_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    q_indptr: torch.Tensor,
    *,
    max_q_len: int,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    draft_slots: torch.Tensor | None = None,
    ckpt_slots: torch.Tensor | None = None,
    ckpt_at: torch.Tensor | None = None,
    ckpt_split: object = None,
) -> torch.Tensor:
    """Mamba-2 selective state space scan over each request's new tokens.

    x: (T, H, P); dt: (T, H) raw step sizes; A: (H,) (negative); B, C: (T, G, N),
    head h reads group h // (H // G); D, dt_bias: (H,); state: (S, H, P, N) view.
    Per token, in fp32: dt = clamp(softplus(dt + dt_bias), *dt_limit);
    S = S * exp(dt A) + (dt x) B^T; y = S C + D x. ``draft_slots``, ``ckpt_slots``,
    ``ckpt_at``: the module docstring (``ckpt_split``: fla-core's, unread here). Returns (T, H, P) in x.dtype.
    """
    num_lanes, heads = slots.numel(), x.shape[1]
    lane, pos = _lanes(q_indptr, x.shape[0])
    groups = B.shape[1]
    if heads % groups:
        raise ValueError(f"mamba2_ssd: heads ({heads}) must be a multiple of groups ({groups})")
    step = dt.float() + dt_bias.float()
    step = F.softplus(step) if dt_softplus else step
    step = step.clamp(dt_limit[0], dt_limit[1])
    bh = B.float().repeat_interleave(heads // groups, dim=1)  # (T, H, N)
    ch = C.float().repeat_interleave(heads // groups, dim=1)
    xs, step_g = (
        _grid(x, lane, pos, num_lanes, max_q_len),
        _grid(step, lane, pos, num_lanes, max_q_len),
    )
    bg, cg = _grid(bh, lane, pos, num_lanes, max_q_len), _grid(ch, lane, pos, num_lanes, max_q_len)
    live = _grid(torch.ones_like(step[:, 0]), lane, pos, num_lanes, max_q_len) > 0
    a = A.float()
    targets = draft_targets(draft_slots, q_indptr, max_q_len)
    cut = _cut(ckpt_slots, ckpt_at, q_indptr)
    s = state[slots].float()  # (B, H, P, N)
    ck = s
    out = torch.zeros_like(xs)
    for i in range(max_q_len):
        decay = (step_g[:, i] * a).exp()[..., None, None]  # (B, H, 1, 1)
        inject = (step_g[:, i, :, None] * xs[:, i])[..., None] * bg[:, i, :, None, :]
        s = torch.where(live[:, i, None, None, None], s * decay + inject, s)
        out[:, i] = (s * cg[:, i, :, None, :]).sum(-1)
        if targets is not None:  # the state after token i, into its draft slot (or the sink)
            state[targets[:, i]] = s.to(state.dtype)
        if cut is not None:  # the state after the checkpoint row, kept for its slot
            ck = torch.where((cut == i)[:, None, None, None], s, ck)
    ckpt = None if cut is None else ck.to(state.dtype)
    write_final(state, slots, ckpt_slots, s.to(state.dtype), ckpt)
    y = out[lane, pos] + D.float()[:, None] * x.float()
    return y.to(x.dtype)
