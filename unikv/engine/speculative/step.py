"""A verify step's tensors: from the batch (host) to the emitted tokens (device).

The batch's requests fed ``1 + n_b`` rows each (``batch.num_new``; the drafts in
``batch.drafts``, or on the device in ``batch.draft_tokens``); the forward scored every row. This gathers each request's rows
into (B, K+1, V), K the longest draft (shorter ones repeat their last row, masked
by ``n_b``; a view of the logits when every request has K drafts), and accepts with ``verify.greedy_accept`` when every request is
greedy (known on the host), else ``verify.rejection_accept``. Host arrays go to the
device in one copy.
"""

from __future__ import annotations

import numpy as np
import torch

from unikv.engine.speculative.verify import greedy_accept, rejection_accept


def all_greedy(requests) -> bool:
    """Whether every request of a verify step accepts greedily (host knowledge)."""
    return all(r.params.temperature == 0 for r in requests)


def verify_step(batch, logits: torch.Tensor, pin: bool = False, force: bool = False, shift=None):
    """(tokens (B, K+1) int64 with -1 past each request's emitted ones, num_accepted
    (B,) int64), both on ``logits``' device; logits: (T, V), every row of the step.
    ``force`` (the benchmark mode ``force_accept``): every draft accepted, greedily.
    ``shift``: None, or (B,) int64 on the device added to each request's output count
    (a step planned ahead, counted on the host at the step before's full acceptance:
    ``Derivation.delta``)."""
    reqs, drafts = batch.requests, batch.drafts
    bsz = len(reqs)
    counts = np.fromiter((len(d) for d in drafts), np.int64, bsz)
    width = int(counts.max())
    uniform = bool((counts == width).all())  # rows request-major, width + 1 each: a view
    on_device = batch.draft_tokens is not None  # the host arrays are placeholders -(1 + i)
    greedy = force or all_greedy(reqs)
    # one int64 host block: [rows (B, K+1)] | drafts (B, K) | counts [| seeds | steps | top_k]
    at = 0 if uniform else width + 1
    block = np.zeros((bsz, at + width + (1 if greedy else 4)), np.int64)
    if not uniform:
        starts = np.zeros(bsz, np.int64)
        np.cumsum(np.asarray(batch.num_new[:-1], np.int64), out=starts[1:])
        block[:, :at] = starts[:, None] + np.minimum(np.arange(width + 1), counts[:, None])
    if uniform and width:
        flat = np.stack(drafts)
        block[:, at : at + width] = -1 - flat if on_device else flat
    elif counts.sum():  # the ragged drafts (or their indices) into the padded block
        owner = np.repeat(np.arange(bsz), counts)
        column = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
        flat = np.concatenate(drafts)
        block[owner, at + column] = -1 - flat if on_device else flat
    block[:, at + width] = counts
    if not greedy:
        block[:, at + width + 1] = [r.seed for r in reqs]
        block[:, at + width + 2] = [len(r.output_ids) for r in reqs]
        block[:, at + width + 3] = [r.params.top_k for r in reqs]
    host = torch.from_numpy(block)
    dev = (host.pin_memory() if pin else host).to(logits.device, non_blocking=True)
    draft_ids = dev[:, at : at + width]
    if on_device:  # indices into the device drafts (0 past a request's own: masked)
        draft_ids = batch.draft_tokens[draft_ids.reshape(-1)].view(bsz, width)
    num = dev[:, at + width]
    if uniform:
        scored = logits[: bsz * (width + 1)].view(bsz, width + 1, -1)
    else:
        scored = logits[dev[:, :at].reshape(-1)].reshape(bsz, width + 1, -1)
    if greedy:
        return greedy_accept(scored, draft_ids, num, force)
    floats = torch.tensor(
        [(r.params.temperature, r.params.top_p, r.params.min_p) for r in reqs],
        dtype=torch.float32,
        pin_memory=pin,
    ).to(logits.device, non_blocking=True)
    min_p = floats[:, 2] if any(r.params.min_p > 0 for r in reqs) else None
    seeds, steps, top_k = dev[:, at + width + 1 :].unbind(dim=1)
    steps = steps if shift is None else steps + shift
    return rejection_accept(
        scored, draft_ids, num, temperature=floats[:, 0], top_k=top_k,
        top_p=floats[:, 1], min_p=min_p, seeds=seeds, steps=steps,
    )  # fmt: skip
