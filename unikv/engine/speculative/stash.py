"""A lazy draft head's stash (``mtp.HiddenDraft`` past the batch-size rule): each
row's target hidden state (the target's export, ``DecoderLM.export_hidden``) and
its next token, for the rows a plain decode step leaves the head out of, kept per
request slot on the device, ``window`` positions deep (a ring: position p at
``p % window``).

The decode step writes its rows' hidden states itself: ``write`` runs in
``ModelRunner.forward`` after the model, on a decode plan, so under CUDA graphs it
is captured in the decode graphs (no launch of its own, no host work). A padded
lane (position 0: no request decodes at position 0) writes the scratch slot's row.
Each lane's flat ring index stays in ``at`` for the step's token write after its
sample (``tokens``: one ``index_copy_``, the tokens being sampled after the graph).
"""

from __future__ import annotations

import numpy as np
import torch

from unikv.engine.speculative.draft import to_device

LAZY_WINDOW = 16  # positions per request slot the stash keeps, at least (``lazy_window``)
LAZY_WINDOW_MAX = 64  # ... at most, where the stash fits ``LAZY_STASH_BYTES``
LAZY_STASH_BYTES = 64 << 20


def lazy_window(slots: int, row_bytes: int) -> int:
    """The stash's depth for ``slots`` request slots of ``row_bytes`` each a position:
    the deepest up to ``LAZY_WINDOW_MAX`` that fits ``LAZY_STASH_BYTES``, never under
    ``LAZY_WINDOW``. Past the rule the head runs nothing: when a request drafts again
    its last ``window`` rows are written exactly, older ones are holes (``holes.py``):
    a deeper stash leaves fewer."""
    fit = LAZY_STASH_BYTES // max(slots * row_bytes, 1)
    return max(LAZY_WINDOW, min(LAZY_WINDOW_MAX, fit))


class HiddenStash:
    """The ring over ``hidden_out`` (the target's (rows, width) export buffer) for
    ``slots`` request slots, the last the scratch slot (padded lanes)."""

    def __init__(self, hidden_out: torch.Tensor, slots: int, window: int | None = None) -> None:
        self.hidden_out, self.slots = hidden_out, slots
        self.at = torch.zeros(hidden_out.shape[0], dtype=torch.int64, device=hidden_out.device)
        self.resize(window)

    def resize(self, window: int | None = None) -> None:
        """(Re)allocate the ring ``window`` positions deep (None: ``lazy_window``'s);
        before any decode graph is captured (the graphs hold its addresses)."""
        out = self.hidden_out
        if window is None:
            window = lazy_window(self.slots, out.shape[1] * out.element_size() + 8)
        self.window = window
        scratch = (self.slots - 1) * window  # (a 0-d tensor: ``where``'s out= form)
        self.scratch = torch.tensor(scratch, dtype=torch.int64, device=out.device)
        self.h = torch.zeros(self.slots * window, out.shape[1], dtype=out.dtype, device=out.device)
        self.t = torch.zeros(self.slots * window, dtype=torch.int64, device=out.device)

    def write(self, plan) -> None:
        """A decode plan's rows (every lane, padded ones to the scratch row): their
        exported hidden states into the ring, their ring indices into ``at``."""
        pos, num = plan.positions, plan.positions.shape[0]
        at = self.at[:num]
        torch.where(pos > 0, plan.slots * self.window + pos % self.window, self.scratch, out=at)
        self.h.index_copy_(0, at, self.hidden_out[:num])

    def tokens(self, num: int, tokens: torch.Tensor) -> None:
        """The step's ``num`` requests' next tokens (its samples) at their rows."""
        self.t.index_copy_(0, self.at[:num], tokens[:num])

    def rows(self, slots: np.ndarray, counts: np.ndarray, positions: torch.Tensor) -> torch.Tensor:
        """The flat ring indices of a catch-up's rows: ``counts[i]`` rows of slot
        ``slots[i]`` in order, at ``positions`` (its plan's, on the device)."""
        base = to_device(np.repeat(slots * self.window, counts), positions.device)
        return base + positions[: base.shape[0]] % self.window
