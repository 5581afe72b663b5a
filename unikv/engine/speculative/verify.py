"""Acceptance of a verify step's drafts, batched over requests (torch, no host sync).

Request b fed its pending token and ``n_b`` drafts ``d_1 .. d_n`` (rows ``j = 0 .. n``
of the step); row j's logits are the target's distribution ``p_j`` of the token
after ``d_j`` (row 0: after the pending token). Draft ``d_{j+1}`` is accepted with
probability ``min(1, p_j(d) / q_j(d))`` (``q_j``: the draft's distribution; one-hot
for n-gram drafts, where this is ``p_j(d)``); the first rejected position samples
from ``max(p_j - q_j, 0)`` renormalised, and a request whose every draft was
accepted samples its bonus token from ``p_n``. The emitted tokens are then
distributed exactly as the target's own samples (Leviathan et al., 2023; Chen et
al., 2023). Greedy rows (temperature 0) take ``p_j`` one-hot at the argmax: a
draft is accepted iff it equals the target's argmax, and the first mismatch (or
the bonus) emits the argmax, so greedy outputs equal decoding without drafts.

Randomness is counter-based like ``sampling.sample``: the acceptance uniform of
output step s of a request with seed ``seed`` is a hash of (seed, s) with a salt of
its own, and the token sampled at step s uses ``gumbel_noise(seed, s)``.
"""

from __future__ import annotations

import torch

from unikv.engine.sampling import MASK32, _allowed, gumbel_noise, hash32

_ACCEPT_SALT = 0x5BD1E995  # keeps the acceptance uniforms apart from the Gumbel noise


def accept_uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Uniform(0, 1) fp64 noise, a pure function of (seed, step); same shape as steps
    (seeds broadcast against it)."""
    s = hash32(hash32(seeds & MASK32) ^ ((seeds >> 32) & MASK32) ^ _ACCEPT_SALT)
    bits = hash32(s ^ hash32((steps & MASK32) + _ACCEPT_SALT))
    return (bits.double() + 0.5) / 2.0**32


def greedy_accept(
    logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, force: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: logits (B, K+1, V), drafts (B, K) int64, num_drafts (B,)
    int64. Returns (tokens (B, K+1) int64: the accepted drafts then the target's
    argmax at the first mismatch or the bonus, num_accepted (B,) int64). ``force``
    (benchmarks only): every draft is accepted, whatever the target says.

    An accepted draft equals the target's argmax at its row, so the emitted tokens
    are the argmax rows up to the first rejection (few device ops: a verify step's
    host cost is its launches)."""
    target = logits.argmax(dim=-1)  # (B, K+1)
    width = drafts.shape[1]
    pos = torch.arange(width + 1, device=drafts.device)
    if force:  # the drafts, then the target's token after the last (never the model's)
        num_accepted = num_drafts
        target = torch.cat([torch.where(pos[:width] < num_drafts[:, None], drafts,
                                        target[:, :width]), target[:, width:]], dim=1)  # fmt: skip
    else:
        ok = (target[:, :width] == drafts) & (pos[:width] < num_drafts[:, None])
        num_accepted = ok.cumprod(dim=1).sum(dim=1)
    return target.masked_fill(pos > num_accepted[:, None], -1), num_accepted


def _emit(final_rows, drafts, num_drafts, accepted):
    """(tokens, num_accepted) from per-position acceptance (B, K) and the token each
    position would emit if it were the first rejection (B, K+1)."""
    width = drafts.shape[1]
    pos = torch.arange(width, device=drafts.device)
    ok = accepted & (pos[None, :] < num_drafts[:, None])
    num_accepted = ok.long().cumprod(dim=1).sum(dim=1)
    last = final_rows.gather(1, num_accepted[:, None])  # (B, 1)
    tokens = torch.cat([drafts, drafts[:, :1]], dim=1)
    tokens = torch.where(torch.arange(width + 1, device=drafts.device) < num_accepted[:, None],
                         tokens, torch.full_like(tokens, -1))  # fmt: skip
    tokens.scatter_(1, num_accepted[:, None], last)
    return tokens, num_accepted


def rejection_accept(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling (module docstring). logits (B, K+1, V); drafts (B, K)
    int64; num_drafts (B,) int64; temperature/top_p/min_p (B,) fp32 (0 = greedy);
    top_k (B,) int64; seeds (B,) int64; steps (B,) int64: outputs generated before
    the step (row j emits output step ``steps + j``); draft_probs: None (one-hot
    drafts, n-gram) or (B, K, V) the draft's distributions. Returns (tokens (B,
    K+1) int64, -1 past the emitted ones; num_accepted (B,) int64)."""
    bsz, rows, vocab = logits.shape
    flat = logits.reshape(bsz * rows, vocab).float()
    rep = rows  # per-request parameters, one per row
    t = temperature.repeat_interleave(rep)
    safe_t = torch.where(t > 0, t, torch.ones_like(t))
    scaled = flat / safe_t[:, None]
    mp = None if min_p is None else min_p.repeat_interleave(rep)
    allowed = _allowed(scaled, top_k.repeat_interleave(rep), top_p.repeat_interleave(rep), mp)
    probs = torch.softmax(scaled.masked_fill(~allowed, float("-inf")), dim=-1)
    onehot = torch.nn.functional.one_hot(flat.argmax(dim=-1), vocab).to(probs.dtype)
    probs = torch.where((t > 0)[:, None], probs, onehot).reshape(bsz, rows, vocab)
    p_draft = probs[:, :-1].gather(2, drafts[:, :, None]).squeeze(2)  # (B, K)
    pos = torch.arange(rows, device=logits.device)
    u = accept_uniform(seeds[:, None], steps[:, None] + pos[None, :-1])
    if draft_probs is None:
        accepted = u < p_draft
        q = torch.nn.functional.one_hot(drafts, vocab).to(probs.dtype)
    else:
        q = draft_probs.to(probs.dtype)
        accepted = u * q.gather(2, drafts[:, :, None]).squeeze(2) < p_draft
    # the token each position emits if it is the first rejection (or the bonus, at n)
    residual = (probs[:, :-1] - q).clamp_(min=0)
    at_n = pos[None, :-1] >= num_drafts[:, None]  # no draft there: the bonus's p
    residual = torch.where(at_n[:, :, None], probs[:, :-1], residual)
    dist = torch.cat([residual, probs[:, -1:]], dim=1)  # (B, K+1, V)
    noise = gumbel_noise(
        seeds.repeat_interleave(rows), (steps[:, None] + pos[None, :]).reshape(-1), vocab
    ).reshape(bsz, rows, vocab)
    final = (dist.log() + noise).argmax(dim=-1)
    return _emit(final, drafts, num_drafts, accepted)
