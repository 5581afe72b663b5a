"""A verify step's tensors: from the batch (host) to the emitted tokens (device).

The batch's requests fed ``1 + n_b`` rows each (``batch.num_new``; the drafts in
``batch.drafts``, or on the device in ``batch.draft_tokens``); the forward scored every row. This gathers each request's rows
into (B, K+1, V), K the longest draft (shorter ones repeat their last row, masked
by ``n_b``), and accepts with ``verify.greedy_accept`` when every request is
greedy (known on the host), else ``verify.rejection_accept``. Host arrays go to the
device in one copy.
"""

from __future__ import annotations

import numpy as np
import torch

from unikv.engine.speculative.verify import greedy_accept, rejection_accept


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
    starts = np.zeros(bsz, np.int64)
    np.cumsum(np.asarray(batch.num_new[:-1], np.int64), out=starts[1:])
    # one int64 host block: rows (B, K+1) | drafts (B, K) | counts | seeds | steps | top_k
    block = np.zeros((bsz, 2 * width + 5), np.int64)
    block[:, : width + 1] = starts[:, None] + np.minimum(np.arange(width + 1), counts[:, None])
    on_device = batch.draft_tokens is not None  # the host arrays are placeholders -(1 + i)
    if counts.sum():  # the ragged drafts (or their indices) into the padded block
        owner = np.repeat(np.arange(bsz), counts)
        column = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
        flat = np.concatenate(drafts)
        block[owner, width + 1 + column] = -1 - flat if on_device else flat
    block[:, 2 * width + 1] = counts
    greedy = force or all(r.params.temperature == 0 for r in reqs)
    if not greedy:
        block[:, 2 * width + 2] = [r.seed for r in reqs]
        block[:, 2 * width + 3] = [len(r.output_ids) for r in reqs]
        block[:, 2 * width + 4] = [r.params.top_k for r in reqs]
    host = torch.from_numpy(block)
    dev = (host.pin_memory() if pin else host).to(logits.device, non_blocking=True)
    rows, draft_ids = dev[:, : width + 1], dev[:, width + 1 : 2 * width + 1]
    if on_device:  # indices into the device drafts (0 past a request's own: masked)
        draft_ids = batch.draft_tokens[draft_ids.reshape(-1)].view(bsz, width)
    num = dev[:, 2 * width + 1]
    scored = logits[rows.reshape(-1)].reshape(bsz, width + 1, -1)
    if greedy:
        return greedy_accept(scored, draft_ids, num, force)
    floats = torch.tensor(
        [(r.params.temperature, r.params.top_p, r.params.min_p) for r in reqs],
        dtype=torch.float32,
        pin_memory=pin,
    ).to(logits.device, non_blocking=True)
    min_p = floats[:, 2] if any(r.params.min_p > 0 for r in reqs) else None
    steps = dev[:, 2 * width + 3] if shift is None else dev[:, 2 * width + 3] + shift
    return rejection_accept(
        scored, draft_ids, num, temperature=floats[:, 0], top_k=dev[:, 2 * width + 4],
        top_p=floats[:, 1], min_p=min_p, seeds=dev[:, 2 * width + 2], steps=steps,
    )  # fmt: skip
