"""A verify step planned ahead, made valid whatever the step before it accepts: its
inputs are derived on the device from that step's acceptance.

Step N (in flight) fed request b its pending token and ``n_b`` drafts at positions
``L_b .. L_b + n_b``; it accepts ``a_b`` of them (0 .. n_b, on the device only) and
emits ``a_b + 1`` tokens, the last its bonus. Step N + 1 is planned on the host for
the worst case, full acceptance: ``1 + m_b`` rows at positions ``L_b + n_b + 1 ..``,
pages held up to ``L_b + n_b + m_b + 2`` (``alloc_extend``). Its true rows sit
``n_b - a_b`` positions lower, inside pages the request holds already (step N's
rows or N + 1's). ``Derivation.fix`` moves them there on the device:

    delta_b          = a_b - n_b                      (<= 0)
    positions[t]    += delta_{owner(t)}               seq_lens[b] += delta_b
    write_ids[t]     = translate(ids[vtab[b, a_b + 1 + j]])   (row t = (b, j))

where ``ids`` is the virtual ids of step N's true rows then N + 1's planned ones and ``vtab[b, i]``
the index there of request b's position ``L_b + i``. Its block table was built for
the full-acceptance length with ``n_max`` more tokens of window slack, so it covers
the lower rows. Its input tokens (``sources``): row 0 of request b is N's bonus for
b (N's ``tokens_dev``); its drafts are row ``a_b`` of the host's candidates
``(n_b + 1, m_b)``: the n-gram continuation of the history as it is if N accepts
``a`` drafts (``ahead.py``), selected on the device. The planned batch's tokens
are placeholders ``-(1 + i)`` into ``cat(bonus (B,), chosen drafts (sum m_b,))``.

A recurrent target's rows of N wrote the state after row j into draft slot j and
the one after the last row into the live slot; ``select_states`` makes draft slot
``a_b`` the live slot of N + 1 where N kept fewer rows than it fed (the exchange the
host's ``MambaSlots.select`` makes when N's counts arrive), so N + 1's kernels
read the right state and write their own per-draft states into the other k slots.

The host arrays go to the device in one copy; nothing here reads the device.
"""

from __future__ import annotations

import numpy as np
import torch

from unikv.ids import VirtualTokenIds


class Derivation:
    """Host arrays of a verify step planned ahead (requests in step N's order).

    Args:
        counts: (B,) step N's drafts per request (``n_b``).
        candidates: per request (n_b + 1, m_b) int64: row a, its drafts in step
            N + 1 if N accepts a of its drafts.
    """

    def __init__(self, counts: np.ndarray, candidates: list[np.ndarray]) -> None:
        bsz = len(candidates)
        rooms = np.fromiter((c.shape[1] for c in candidates), np.int64, bsz)
        assert (rooms > 0).all() and all(
            c.shape[0] == n + 1 for c, n in zip(candidates, counts.tolist())
        ), "derivation invariant: every request has m_b > 0 drafts and n_b + 1 candidates"
        self.counts, self.rooms, self.candidates = counts, rooms, candidates
        self.slack = int(counts.max())  # window tokens the lower rows may reach back
        k1, width = int(counts.max()) + 1, int(rooms.max())
        fed, ahead = counts + 1, rooms + 1  # rows of step N and of step N + 1 per request
        first_n = np.cumsum(fed) - fed
        first_a = int(fed.sum()) + np.cumsum(ahead) - ahead
        span = int((fed + ahead).max())
        cols = np.arange(span)
        vtab = np.where(
            cols[None, :] < fed[:, None],
            first_n[:, None] + cols[None, :],
            first_a[:, None] + cols[None, :] - fed[:, None],
        )  # (B, span): columns past a request's own are never read
        owner = np.repeat(np.arange(bsz), ahead)
        col = np.arange(owner.size) - np.repeat(np.cumsum(ahead) - ahead, ahead)
        cand = np.zeros((bsz, k1, width), np.int64)
        for b, c in enumerate(candidates):
            cand[b, : c.shape[0], : c.shape[1]] = c
        pick = np.repeat(np.arange(bsz) * width, rooms) + (
            np.arange(int(rooms.sum())) - np.repeat(np.cumsum(rooms) - rooms, rooms)
        )
        parts = {"counts": counts, "owner": owner, "col": col, "vtab": vtab, "cand": cand}
        parts["pick"] = pick
        self._shapes = {name: a.shape for name, a in parts.items()}
        self._block = np.concatenate([a.reshape(-1) for a in parts.values()]).astype(np.int64)
        self._dev: dict | None = None
        self.delta: torch.Tensor | None = None  # (B,) a_b - n_b on the device, once fixed

    def placeholders(self, b: int) -> tuple[int, np.ndarray]:
        """Request b's planned tokens: (its pending token's placeholder, its drafts')."""
        bsz, start = len(self.rooms), int(self.rooms[:b].sum())
        drafts = -(1 + bsz + start + np.arange(int(self.rooms[b]), dtype=np.int64))
        return -(1 + b), drafts

    def chosen(self, accepted: np.ndarray) -> list[np.ndarray]:
        """The drafts step N + 1 verified, once N's acceptance is on the host."""
        return [c[a] for c, a in zip(self.candidates, accepted.tolist())]

    def upload(self, device: torch.device, pin: bool) -> dict:
        """The host arrays on the device (one copy, enqueued), as named views."""
        host = torch.from_numpy(self._block)
        flat = (host.pin_memory() if pin else host).to(device, non_blocking=True)
        views, at = {}, 0
        for name, shape in self._shapes.items():
            size = int(np.prod(shape))
            views[name] = flat[at : at + size].view(shape)
            at += size
        self._dev = views
        return views

    def sources(self, accepted: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        """(B + sum m_b,) int64 on the device: the tokens the placeholders stand for
        (each request's bonus of step N, then its chosen drafts, request-major)."""
        dev = self._dev
        bsz = len(self.rooms)
        chosen = dev["cand"][torch.arange(bsz, device=accepted.device), accepted]  # (B, M)
        return torch.cat([bonus[:bsz], chosen.reshape(-1)[dev["pick"]]])

    def fix(self, plan, accepted: torch.Tensor, ids: torch.Tensor, alloc) -> torch.Tensor:
        """Move the plan's rows to where step N's acceptance puts them (module
        docstring), in place (a verify graph reads the same buffers). ``ids``: the
        virtual ids of step N's true rows then step N + 1's planned ones (device,
        request-major). Returns the virtual ids of N + 1's true rows (the next step
        planned ahead reads them as its ``ids``)."""
        dev = self._dev
        owner, bsz = dev["owner"], len(self.rooms)
        delta = self.delta = accepted - dev["counts"]
        rows = owner.shape[0]
        plan.positions[:rows].add_(delta[owner])
        plan.seq_lens[:bsz].add_(delta.to(plan.seq_lens.dtype))
        column = accepted[owner] + 1 + dev["col"]
        vids = VirtualTokenIds(ids[dev["vtab"][owner, column]])
        for name, step in plan.subpools.items():
            alloc.translate(vids, name, out=step.write_ids.data[:rows])
        if getattr(plan, "draft_slots", None) is not None:  # a recurrent target
            select_states(plan.state_slots[:bsz], plan.draft_slots[:bsz], accepted, delta < 0)
        return vids.data


def select_states(
    live: torch.Tensor, drafts: torch.Tensor, accepted: torch.Tensor, moved: torch.Tensor
) -> None:
    """The state slots of a step planned ahead of step N, in place: N's rows wrote the
    state after row j of request b into ``drafts[b, j]`` (j < its drafts) and the one
    after its last row into ``live[b]``; a request that kept ``a`` rows of drafts
    (``moved``: fewer than it had) continues from ``drafts[b, a]``, which becomes its
    live slot and its old live slot draft slot a: ``MambaSlots.select``'s exchange,
    made here on the device and by ``complete_verify`` on the host when N's counts
    arrive, so the next steps see the same bindings."""
    col = accepted.clamp(max=drafts.shape[1] - 1)[:, None]
    chosen = drafts.gather(1, col)[:, 0]
    old = live.clone()
    live.copy_(torch.where(moved, chosen, old))
    drafts.scatter_(1, col, torch.where(moved, old, chosen)[:, None])
