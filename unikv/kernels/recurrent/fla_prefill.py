"""Prefill of Gated DeltaNet and Mamba-2 over slot states through fla-core's chunked kernels.

fla-core (``pip install 'unikv[gpu]'``) is GPU-only and imported lazily. Its varlen
layout is ``[1, T, H, ...]`` with ``cu_seqlens`` (N+1,) int64 and states ``[N, H, K, V]``
(or ``[N, H, V, K]`` with ``state_v_first``). The slot states are gathered
(``state[slots]``, fp32), run through fla and scattered back (``state[slots] = final``;
with ``ckpt_slots``, a chunk ending at a prefix-cache checkpoint, into those slots too in
the same write: ``recurrent_ref.write_final``); a lane with no new tokens gets its
initial state back. Mamba-2's SSD is simple GLA:
q = C, k = B (expanded to H heads), v = x * dt, g = dt * A, scale 1, state (P, N) =
``[V, K]`` (``state_v_first=True``), plus the D skip outside the kernel.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from unikv.kernels.recurrent.ref import gdn_gates, write_final

INSTALL_HINT = "pip install 'unikv[gpu]' (fla-core==0.6.0)"
FLA_CHUNK = 64  # fla-core's Gated DeltaNet chunk (its default; passed explicitly)


def chunk_indices(q_indptr: np.ndarray, chunk: int = FLA_CHUNK) -> np.ndarray:
    """(NT, 2) int64 (lane, chunk within the lane) of every ``chunk``-token chunk of
    every lane of ``q_indptr`` (B+1,) host ints, lanes in order: fla-core's varlen
    chunk list (``prepare_chunk_indices``), which it derives from a device
    ``cu_seqlens`` with a host sync unless given. The step planner makes it from the
    host copy of q_indptr and uploads it (``StepPlan.state_chunks``)."""
    counts = -(-np.diff(np.asarray(q_indptr, np.int64)) // chunk)  # ceil: 0 for no tokens
    lanes = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([lanes, np.arange(lanes.shape[0], dtype=np.int64) - starts], axis=1)


def _fla():
    """(chunk_gated_delta_rule, chunk_simple_gla) from fla-core, or a clear ImportError."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as err:
        raise ImportError(
            f"the chunked prefill of Gated DeltaNet / Mamba-2 needs fla-core: {INSTALL_HINT}"
        ) from err
    return chunk_gated_delta_rule, chunk_simple_gla


@functools.cache
def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


@functools.cache
def use_fla(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """fla-core on CUDA when installed, for 16-bit activations; otherwise (once,
    with a warning on CUDA) the fused-recurrent Triton kernels of ``recurrent.py``
    take the prefill too. fp32 always takes them: fla's chunked form runs its dots
    in tf32 (relative error ~1e-3), while fp32 is the engine's exactness mode
    (greedy tokens identical to transformers)."""
    if device.type != "cuda" or dtype == torch.float32:
        return False
    if not fla_available():
        warnings.warn(
            "fla-core is not installed: recurrent prefill falls back to the fused-recurrent "
            f"Triton kernels (sequential over time, slower on long prompts); {INSTALL_HINT}",
            stacklevel=3,
        )
        return False
    return True


def _scatter(state, slots, q_indptr, initial, final, ckpt_slots=None) -> None:
    """state[slots] = final (and state[ckpt_slots], given), except lanes with no new
    tokens keep their initial state."""
    lens = q_indptr[1:] - q_indptr[:-1]
    keep = (lens > 0).view(-1, *([1] * (final.dim() - 1)))
    write_final(state, slots, ckpt_slots, torch.where(keep, final, initial).to(state.dtype))


def gated_delta_rule(
    q, k, v, g, beta, state, slots, q_indptr, *, scale, use_qk_l2norm, gating=None,
    ckpt_slots=None, chunks=None,
):  # fmt: skip
    """q, k: (T, Hk, Dk), Hk dividing H; v: (T, H, Dv); g, beta: (T, H) (the raw a, b
    with ``gating`` = (A_log, dt_bias)); state: (S, H, Dk, Dv) view; slots: (B,);
    q_indptr: (B+1,); ckpt_slots: None or (B,) second destinations of the final state;
    chunks: None or ``chunk_indices(q_indptr)`` on the device (fla-core then derives
    nothing from q_indptr: no host sync). Returns (T, H, Dv) in v.dtype; state updated."""
    if gating is not None:
        g, beta = gdn_gates(g, beta, *gating)
    groups = v.shape[1] // q.shape[1]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    chunk_gated_delta_rule, _ = _fla()
    initial = state[slots].float()  # (B, H, Dk, Dv) gather
    out, final = chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None].float(),
        beta[None],
        scale=float(scale),
        initial_state=initial,
        output_final_state=True,
        cu_seqlens=q_indptr.long(),
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm),
        **({} if chunks is None else {"chunk_indices": chunks, "chunk_size": FLA_CHUNK}),
    )
    _scatter(state, slots, q_indptr, initial, final, ckpt_slots)
    return out[0].to(v.dtype)


def mamba2_ssd(
    x, dt, A, B, C, D, dt_bias, state, slots, q_indptr, *, dt_softplus, dt_limit, ckpt_slots=None
):
    """x: (T, H, P); dt: (T, H); A, D, dt_bias: (H,); B, C: (T, G, N); state:
    (S, H, P, N) view; slots: (B,); q_indptr: (B+1,). Returns (T, H, P) in x.dtype."""
    _, chunk_simple_gla = _fla()
    heads = x.shape[1]
    rep = heads // B.shape[1]
    step = dt.float() + dt_bias.float()
    step = F.softplus(step) if dt_softplus else step
    step = step.clamp(dt_limit[0], dt_limit[1])  # (T, H) fp32
    values = (x.float() * step[..., None]).to(x.dtype)  # (T, H, P)
    initial = state[slots].float()  # (B, H, P, N) = fla's [N, H, V, K]
    out, final = chunk_simple_gla(
        C.repeat_interleave(rep, dim=1)[None],  # q: (1, T, H, N)
        B.repeat_interleave(rep, dim=1)[None],  # k
        values[None],
        g=(step * A.float())[None],
        scale=1.0,
        initial_state=initial,
        output_final_state=True,
        state_v_first=True,
        cu_seqlens=q_indptr.long(),
    )
    _scatter(state, slots, q_indptr, initial, final, ckpt_slots)
    return (out[0].float() + D.float()[:, None] * x.float()).to(x.dtype)
