"""Host-side argument checks of the recurrent-state launchers (``recurrent.py``):
shapes, dtypes and strides, with errors that say what was expected. They read no
device memory, so they cost no sync on the per-step path."""

from __future__ import annotations

import torch

from unikv.kernels.runtime.checks import check_ids, check_same_device

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _want(name: str, t: torch.Tensor | None, shape: tuple, *, unit_last: bool = True) -> None:
    if t is None or tuple(t.shape) != tuple(shape):
        got = None if t is None else tuple(t.shape)
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {got}")
    if t.dtype not in FLOATS:
        raise ValueError(f"{name} must be float32/bfloat16/float16, got {t.dtype}")
    if unit_last and t.numel() and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} needs unit stride on its last dim, got strides {t.stride()}")


def _check_batch(name: str, num_tokens: int, state, slots, q_indptr, max_q_len, *tensors):
    check_ids("slots", slots)
    check_ids("q_indptr", q_indptr)
    if q_indptr.shape[0] != slots.shape[0] + 1:
        raise ValueError(
            f"{name}: q_indptr must have B+1 = {slots.shape[0] + 1} entries, got {q_indptr.shape[0]}"
        )
    if not isinstance(max_q_len, int) or max_q_len < 0:
        raise ValueError(f"{name}: max_q_len must be a host int >= 0, got {max_q_len!r}")
    if max_q_len == 1 and num_tokens != slots.shape[0]:
        raise ValueError(
            f"{name}: a decode step (max_q_len == 1) has one token per lane: got {num_tokens} "
            f"tokens for {slots.shape[0]} slots; pad the batch or pass the real max_q_len"
        )
    check_same_device(state, slots, q_indptr, *tensors)


def check_draft_slots(draft_slots, slots) -> None:
    """``draft_slots``: None, or (B, k) int32/int64 physical slots, k >= 1, on the
    slots' device (a speculative verify step's per-draft-position states)."""
    if draft_slots is None:
        return
    check_ids("draft_slots", draft_slots, dim=2)
    if draft_slots.shape[0] != slots.shape[0] or not draft_slots.shape[1]:
        raise ValueError(
            f"draft_slots must be (B, k) = ({slots.shape[0]}, k >= 1) physical slots, one row "
            f"per lane, got {tuple(draft_slots.shape)}"
        )
    if draft_slots.stride(1) != 1:
        raise ValueError(f"draft_slots needs unit stride on k, got strides {draft_slots.stride()}")
    check_same_device(slots, draft_slots)


def check_ckpt_slots(ckpt_slots, slots, ckpt_at=None) -> None:
    """``ckpt_slots``: None, or (B,) int32/int64 physical slots on the slots' device
    (a prefill chunk reaching prefix-cache checkpoints: each lane's second destination
    of its state, 0 the sink); ``ckpt_at``: None, or with them (B,) int32/int64 the
    row of each lane after which that state is taken (-1: its last)."""
    if ckpt_slots is None:
        if ckpt_at is not None:
            raise ValueError("ckpt_at needs ckpt_slots (the slots its rows' states go to)")
        return
    if ckpt_at is not None:
        check_ids("ckpt_at", ckpt_at, dim=1)
        if ckpt_at.shape != ckpt_slots.shape:
            raise ValueError(
                f"ckpt_at must be (B,) = ({slots.shape[0]},) rows, one per lane, "
                f"got {tuple(ckpt_at.shape)}"
            )
        check_same_device(slots, ckpt_at)
    check_ids("ckpt_slots", ckpt_slots, dim=1)
    if ckpt_slots.shape[0] != slots.shape[0]:
        raise ValueError(
            f"ckpt_slots must be (B,) = ({slots.shape[0]},) physical slots, one per lane, "
            f"got {tuple(ckpt_slots.shape)}"
        )
    check_same_device(slots, ckpt_slots)


def check_conv_args(x, conv_state, slots, q_indptr, weight, bias, max_q_len, activation) -> None:
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    if conv_state.dim() != 3:
        raise ValueError(f"conv_state must be an (S, C, K) view, got {tuple(conv_state.shape)}")
    _, channels, width = conv_state.shape
    _want("conv_state", conv_state, conv_state.shape, unit_last=False)
    _want("x", x, (x.shape[0] if x.dim() == 2 else -1, channels))
    _want("weight", weight, (channels, width), unit_last=False)
    if bias is not None:
        _want("bias", bias, (channels,))
    _check_batch(
        "causal_conv1d", x.shape[0], conv_state, slots, q_indptr, max_q_len, x, weight, bias
    )


def check_gdn_args(q, k, v, g, beta, state, slots, q_indptr, max_q_len, gating=None) -> None:
    if state.dim() != 4:
        raise ValueError(f"state must be an (S, H, Dk, Dv) view, got {tuple(state.shape)}")
    _, heads, dim_k, dim_v = state.shape
    num_tokens = q.shape[0] if q.dim() == 3 else -1
    qk_heads = q.shape[1] if q.dim() == 3 else -1
    if qk_heads <= 0 or heads % qk_heads:
        raise ValueError(
            f"q must be (T, Hk, Dk) with Hk dividing the state's H = {heads}, got {tuple(q.shape)}"
        )
    _want("state", state, state.shape, unit_last=False)
    for name, t, shape in (
        ("q", q, (num_tokens, qk_heads, dim_k)),
        ("k", k, (num_tokens, qk_heads, dim_k)),
        ("v", v, (num_tokens, heads, dim_v)),
    ):
        _want(name, t, shape)
    per_channel = g is not None and g.dim() == 3  # KDA: a decay per key channel
    _want("g", g, (num_tokens, heads, dim_k) if per_channel else (num_tokens, heads),
          unit_last=False)  # fmt: skip
    _want("beta", beta, (num_tokens, heads), unit_last=False)
    _check_batch(
        "gated_delta_rule", num_tokens, state, slots, q_indptr, max_q_len, q, k, v, g, beta
    )
    if gating is not None:
        if per_channel:
            raise ValueError(
                "gating (A_log, dt_bias) gates a per-head decay; a per-channel g (T, H, Dk), "
                "Kimi Delta Attention's, is passed already computed, without gating"
            )
        if len(gating) != 2:
            raise ValueError(f"gating must be (A_log, dt_bias), got {len(gating)} tensors")
        for name, t in zip(("A_log", "dt_bias"), gating):
            _want(name, t, (heads,), unit_last=False)


def check_ssd_args(x, dt, A, B, C, D, dt_bias, state, slots, q_indptr, max_q_len, dt_limit) -> None:
    if state.dim() != 4:
        raise ValueError(f"state must be an (S, H, P, N) view, got {tuple(state.shape)}")
    _, heads, dim_p, dim_n = state.shape
    num_tokens = x.shape[0] if x.dim() == 3 else -1
    groups = B.shape[1] if B.dim() == 3 else -1
    if groups <= 0 or heads % groups:
        raise ValueError(f"B must be (T, G, N) with G dividing H = {heads}, got {tuple(B.shape)}")
    _want("state", state, state.shape, unit_last=False)
    _want("x", x, (num_tokens, heads, dim_p))
    _want("dt", dt, (num_tokens, heads), unit_last=False)
    _want("B", B, (num_tokens, groups, dim_n))
    _want("C", C, (num_tokens, groups, dim_n))
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        _want(name, t, (heads,))
    if len(dt_limit) != 2:
        raise ValueError(f"dt_limit must be a (low, high) pair of floats, got {dt_limit!r}")
    _check_batch("mamba2_ssd", num_tokens, state, slots, q_indptr, max_q_len, x, dt, A, B, C, D)
