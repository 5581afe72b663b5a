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

A checkpoint inside a lane (``ckpt_at``, issue 41: the state after that row into
``ckpt_slots``) cannot be read out of fla's chunked kernels, which keep a sequence's
state only at its end, and its sequences run independently (sequence 2 cannot start
from sequence 1's final state in the same call). So such a step is two calls
(``CkptSplit``): the first over every lane with each cut lane split at its checkpoint row
into two varlen sequences (the head's final state is the checkpoint; the tail's rows
are computed from the wrong state and discarded: under one page a lane), the second over
only the cut lanes' tails, gathered, from their heads' final states; its outputs
are scattered back and its final states are the lanes'. The planner makes the split's
index arrays on the host (``ckpt_split``) and uploads them (``StepPlan.ckpt_split``);
without them the op derives them from the device (a host sync: tests only).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import NamedTuple

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


class CkptSplit(NamedTuple):
    """A step's lanes split at their checkpoint rows (module docstring), int64 on the
    device. c cut lanes (a checkpoint row before their last), S = B + c sequences:

    indptr (S+1,): the first call's cu_seqlens (lane b's head, then its tail if cut);
    chunks (NT, 2): fla-core's chunk list of ``indptr``;
    heads (B,): the sequence of each lane's head (its whole rows when not cut);
    lanes (c,): the cut lanes; rows (Tt,): their tails' rows, in order;
    tail_indptr (c+1,), tail_chunks: the second call's cu_seqlens over ``rows`` and
    its chunk list;
    sources (S,): the lane whose initial state each sequence of the first call starts
    from (a tail: its lane's, discarded), the same for every layer of the step: made
    on the host, not by index writes per layer."""

    indptr: torch.Tensor
    chunks: torch.Tensor
    heads: torch.Tensor
    lanes: torch.Tensor
    rows: torch.Tensor
    tail_indptr: torch.Tensor
    tail_chunks: torch.Tensor
    sources: torch.Tensor


def ckpt_split(q_indptr: np.ndarray, ckpt_at: np.ndarray) -> list[np.ndarray] | None:
    """``CkptSplit``'s arrays (host int64, in its field order) for lanes ``q_indptr``
    (B+1,) with checkpoint rows ``ckpt_at`` (B,) (-1: the last row), or None when no
    lane is cut before its last row (one call: the final state is the checkpoint)."""
    indptr = np.asarray(q_indptr, np.int64)
    lens, at = np.diff(indptr), np.asarray(ckpt_at, np.int64)
    cut = (at >= 0) & (at < lens - 1)
    if not cut.any():
        return None
    lanes = np.flatnonzero(cut)
    points = indptr[lanes] + at[lanes] + 1  # each cut lane's first tail row
    split = np.sort(np.concatenate([indptr, points]))
    heads = np.arange(len(lens), dtype=np.int64) + np.cumsum(cut) - cut
    tail_lens = indptr[lanes + 1] - points
    rows = np.repeat(points - np.cumsum(tail_lens) + tail_lens, tail_lens) + np.arange(
        tail_lens.sum(), dtype=np.int64
    )
    tail_indptr = np.concatenate([[0], np.cumsum(tail_lens)]).astype(np.int64)
    sources = np.repeat(np.arange(len(lens), dtype=np.int64), 1 + cut)  # a cut lane: twice
    return [split, chunk_indices(split), heads, lanes.astype(np.int64), rows, tail_indptr,
            chunk_indices(tail_indptr), sources]  # fmt: skip


def _device_split(q_indptr, ckpt_at) -> CkptSplit | None:
    """``ckpt_split`` from device tensors (a host sync: a caller without the plan's)."""
    arrays = ckpt_split(q_indptr.cpu().numpy(), ckpt_at.cpu().numpy())
    if arrays is None:
        return None
    dev = q_indptr.device
    return CkptSplit(*(torch.from_numpy(a).to(dev) for a in arrays))


def _two_calls(run, rows: list, initial: torch.Tensor, split: CkptSplit):
    """(out, final, at): ``run(rows, initial, cu_seqlens, chunks) -> (out, final)`` (one
    fla call over varlen sequences) over the lanes split at their checkpoint rows:
    ``at`` the state after each lane's checkpoint row, ``final`` after its last."""
    out, final = run(rows, initial[split.sources], split.indptr, split.chunks)
    at = final[split.heads]
    tails = [t[:, split.rows] for t in rows]
    out_t, final_t = run(tails, at[split.lanes], split.tail_indptr, split.tail_chunks)
    out[:, split.rows] = out_t
    last = at.index_copy(0, split.lanes, final_t.to(at.dtype))
    return out, last, at


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


def _scatter(state, slots, q_indptr, initial, final, ckpt_slots=None, at=None) -> None:
    """state[slots] = final (and state[ckpt_slots] = ``at``, default final, given),
    except lanes with no new tokens keep their initial state."""
    lens = q_indptr[1:] - q_indptr[:-1]
    keep = (lens > 0).view(-1, *([1] * (final.dim() - 1)))
    final = torch.where(keep, final, initial).to(state.dtype)
    at = None if at is None else torch.where(keep, at, initial).to(state.dtype)
    write_final(state, slots, ckpt_slots, final, at)


def _varlen(run, rows, initial, q_indptr, chunks, ckpt_at, ckpt_split):
    """(out, final, at) of ``run`` over the step's lanes: one call, or with checkpoints
    inside lanes (``ckpt_at``) two (``_two_calls``); ``at`` None when the final state
    is the checkpoint's."""
    split = ckpt_split
    if ckpt_at is not None and split is None:
        split = _device_split(q_indptr, ckpt_at)
    if split is None:
        out, final = run(rows, initial, q_indptr.long(), chunks)
        return out, final, None
    return _two_calls(run, rows, initial, split)


def gated_delta_rule(
    q, k, v, g, beta, state, slots, q_indptr, *, scale, use_qk_l2norm, gating=None,
    ckpt_slots=None, chunks=None, ckpt_at=None, ckpt_split=None,
):  # fmt: skip
    """q, k: (T, Hk, Dk), Hk dividing H; v: (T, H, Dv); g, beta: (T, H) (the raw a, b
    with ``gating`` = (A_log, dt_bias)); state: (S, H, Dk, Dv) view; slots: (B,);
    q_indptr: (B+1,); ckpt_slots: None or (B,) second destinations of the final state
    (``ckpt_at`` (B,): of the state after that row instead; ``ckpt_split``: the plan's
    ``CkptSplit`` of them); chunks: None or ``chunk_indices(q_indptr)`` on the device
    (fla-core then derives nothing from q_indptr: no host sync). Returns (T, H, Dv) in
    v.dtype; state updated."""
    if gating is not None:
        g, beta = gdn_gates(g, beta, *gating)
    groups = v.shape[1] // q.shape[1]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    chunk_gated_delta_rule, _ = _fla()

    def run(rows, initial, cu_seqlens, chunk_list):
        q, k, v, g, beta = rows
        return chunk_gated_delta_rule(
            q, k, v, g, beta, scale=float(scale), initial_state=initial,
            output_final_state=True, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=bool(use_qk_l2norm),
            **({} if chunk_list is None else {"chunk_indices": chunk_list,
                                             "chunk_size": FLA_CHUNK}),
        )  # fmt: skip

    initial = state[slots].float()  # (B, H, Dk, Dv) gather
    rows = [q[None], k[None], v[None], g[None].float(), beta[None]]
    out, final, at = _varlen(run, rows, initial, q_indptr, chunks, ckpt_at, ckpt_split)
    _scatter(state, slots, q_indptr, initial, final, ckpt_slots, at)
    return out[0].to(v.dtype)


def mamba2_ssd(
    x, dt, A, B, C, D, dt_bias, state, slots, q_indptr, *, dt_softplus, dt_limit,
    ckpt_slots=None, ckpt_at=None, ckpt_split=None,
):  # fmt: skip
    """x: (T, H, P); dt: (T, H); A, D, dt_bias: (H,); B, C: (T, G, N); state:
    (S, H, P, N) view; slots: (B,); q_indptr: (B+1,); ``ckpt_*``: as
    ``gated_delta_rule``. Returns (T, H, P) in x.dtype."""
    _, chunk_simple_gla = _fla()
    heads = x.shape[1]
    rep = heads // B.shape[1]
    step = dt.float() + dt_bias.float()
    step = F.softplus(step) if dt_softplus else step
    step = step.clamp(dt_limit[0], dt_limit[1])  # (T, H) fp32
    values = (x.float() * step[..., None]).to(x.dtype)  # (T, H, P)

    def run(rows, initial, cu_seqlens, _chunks):  # (it memoises its own chunk list)
        q, k, v, g = rows
        return chunk_simple_gla(
            q, k, v, g=g, scale=1.0, initial_state=initial, output_final_state=True,
            state_v_first=True, cu_seqlens=cu_seqlens,
        )  # fmt: skip

    initial = state[slots].float()  # (B, H, P, N) = fla's [N, H, V, K]
    rows = [C.repeat_interleave(rep, dim=1)[None], B.repeat_interleave(rep, dim=1)[None],
            values[None], (step * A.float())[None]]  # fmt: skip
    out, final, at = _varlen(run, rows, initial, q_indptr, None, ckpt_at, ckpt_split)
    _scatter(state, slots, q_indptr, initial, final, ckpt_slots, at)
    return (out[0].float() + D.float()[:, None] * x.float()).to(x.dtype)
