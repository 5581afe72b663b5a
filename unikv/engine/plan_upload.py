"""The step's packed host upload: a batch's int arrays in one host-to-device copy.

``StepUpload`` (owned by ``plan.StepPlanner``) writes a step's arrays into one of
two host staging buffers (pinned on CUDA) and copies them to one device byte
buffer in one copy; typed views for (R rows, T tokens):

    input_ids (T,) i64 | positions (T,) i64 | logits_indices (R,) i64 |
    lanes (R,) i64 | seq_lens (R,) i32 | slots (R,) i32 | q_indptr (R+1,) i32 |
    row_ids (T,) i32 | (to 8 bytes) | write_ids (S, T) i64

``row_ids``: a verify step's rows' virtual ids where the host knows them
(``speculative/headroom.HostRows``: the rows' second upload folded into this one);
``write_ids``: their kernel ids in each of the S token sub-pools, computed on the
host from the allocator's page mirror (``AllocatorView.row_kernel_ids``); both
unused (stale bytes) otherwise.

``lanes``: in a one-token step whose every input is a placeholder (steady
decoding), lane i's placeholder's lane, so input_ids[:B] = prev_tokens[lanes] is
one gather (else ``Pending.fill``, or nothing when the host sees no placeholder).

A padded lane (rows R > B requests) feeds token 0 at position 0 with seq_len 1
and state slot 0 (a verify graph's: ``pad_q`` tokens at positions 0 .. pad_q - 1).
For a given (R, T) the device views lie at the same addresses every step
(CUDA-graph inputs). The two staging slots alternate, so one may
still be copying while the next step is staged. A steady verify step's arrays are
not built from its requests: the last verify step's, kept, are advanced in place
(``plan_steady.SteadyVerify``) and staged in one memory copy.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np
import torch

from unikv.engine.plan_steady import SteadyVerify
from unikv.engine.request import Pending
from unikv.engine.scheduler import Batch

I64, I32 = 8, 4  # bytes per element of the two sections of the packed buffer
_NUM_CACHED, _SLOT = attrgetter("num_cached"), attrgetter("slot")
ALL, SOME, NONE = "all", "some", "none"  # which input tokens are placeholders


def _token_at(r, index: int) -> int:
    """all_ids[index] of request ``r`` without building all_ids."""
    n = len(r.prompt_ids)
    return r.prompt_ids[index] if index < n else r.output_ids[index - n]


def _views(buffer, rows: int, num_tokens: int, subpools: int = 0) -> tuple[dict, int]:
    """Typed views of a byte buffer (numpy or torch) for ``rows`` requests and
    ``num_tokens`` tokens (the layout in the module docstring; ``write_ids`` only
    for ``subpools`` > 0), and its bytes."""
    fields, views, start = [], {}, 0
    fields += [("input_ids", I64, num_tokens), ("positions", I64, num_tokens)]
    fields += [("logits_indices", I64, rows), ("lanes", I64, rows)]
    fields += [("seq_lens", I32, rows), ("slots", I32, rows)]
    fields += [("q_indptr", I32, rows + 1), ("row_ids", I32, num_tokens)]
    for name, size, count in fields:
        raw = buffer[start : start + size * count]
        if isinstance(raw, np.ndarray):
            views[name] = raw.view(np.int64 if size == I64 else np.int32)
        else:
            views[name] = raw.view(torch.int64 if size == I64 else torch.int32)
        start += size * count
    if subpools:  # (after row_ids: the steady arrays' layout is this one's prefix)
        start = -(-start // I64) * I64
        raw = buffer[start : start + I64 * subpools * num_tokens]
        wide = np.int64 if isinstance(raw, np.ndarray) else torch.int64
        views["write_ids"] = raw.view(wide).reshape(subpools, num_tokens)
        start += I64 * subpools * num_tokens
    return views, start


class StepUpload:
    """The device byte buffer of the step arrays and its two host staging slots.

    Args:
        device: the pool's device; max_seqs: rows per step at most; max_tokens:
            tokens per step at most (>= max_seqs); pin: pinned staging (CUDA);
            subpools: token sub-pools whose write ids a step may stage (``write_ids``).
    """

    def __init__(
        self, device: torch.device, *, max_seqs: int, max_tokens: int, pin: bool, subpools: int = 0
    ) -> None:
        self.max_seqs, self.max_tokens, self.subpools = max_seqs, max_tokens, subpools
        nbytes = I64 * (2 * max_tokens + 2 * max_seqs) + I32 * (3 * max_seqs + 1 + max_tokens)
        nbytes += (I64 + I64 * subpools * max_tokens) if subpools else 0  # (aligned)
        self._buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        staging = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(2)]
        self._staging = [t.pin_memory() for t in staging] if pin else staging
        self._host = [t.numpy() for t in self._staging]
        self._num_plans = 0
        # CUDA: each staging slot's copy, recorded; a slot is rewritten only after it
        # ran (the engine's loop settles a step before its slot comes round again,
        # so this waits only where steps are planned back to back: a draft's chain)
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._pin = pin  # decided once: pinned staging, copies recorded
        self._layouts: dict[tuple[int, int, int], tuple[dict, dict, int, tuple]] = {}
        self._arange = np.arange(max_tokens + 1, dtype=np.int64)
        self.steady = SteadyVerify(nbytes, _views)  # the last verify step's arrays, kept

    def upload(
        self,
        batch: Batch,
        rows: int,
        pad_q: int = 1,
        row_ids: np.ndarray | None = None,
        write_ids: np.ndarray | None = None,
    ) -> tuple[dict, dict, str]:
        """The step's int arrays, padded to ``rows`` lanes, written into a host
        staging buffer and copied to the device in one copy; (typed device views,
        typed host views, which tokens are placeholders: ALL, SOME or NONE).
        A steady verify step's arrays are the last one's advanced in place
        (``plan_steady.SteadyVerify``); any other step's are built (``build``).
        ``pad_q``: tokens per padded lane (a verify graph's lanes all feed k + 1).
        ``row_ids``: the rows' virtual ids (host ints), staged too (``row_ids``);
        ``write_ids``: (S, n) their kernel ids per token sub-pool, staged too."""
        advanced = self.steady.advance(batch, rows, pad_q)
        if advanced is None:
            return self.build(batch, rows, pad_q, row_ids, write_ids)
        kept, nbytes = advanced
        slot, host, dev, _ = self._stage(rows, kept["input_ids"].shape[0])
        host_bytes = self._host[slot]
        host_bytes[:nbytes] = self.steady.buffer[:nbytes]
        self._stage_ids(host, row_ids, write_ids)
        real = self.steady.real
        pending = NONE if not real or host["input_ids"][:real].min() >= 0 else SOME
        self._copy(slot, rows, kept["input_ids"].shape[0], write_ids is not None)
        return dev, host, pending

    def build(
        self,
        batch: Batch,
        rows: int,
        pad_q: int = 1,
        row_ids: np.ndarray | None = None,
        write_ids: np.ndarray | None = None,
    ) -> tuple[dict, dict, str]:
        """``upload``'s arrays built from the batch's requests (kept for the next step
        when ``batch`` is a verify step). One-token steps (decodes) take a path
        without per-token arrays: positions are the starts, q_indptr an arange, and
        ``lanes`` the placeholders' lanes."""
        reqs, num_new = batch.requests, batch.num_new
        num = len(reqs)
        starts = list(map(_NUM_CACHED, reqs))
        one_token = len(num_new) == num_new.count(1) and pad_q == 1
        if one_token:
            # a one-token lane feeds its token at num_cached: a decode's last token, or
            # a prefill chunk of one (a chunk cut at a state checkpoint, a budget's last)
            tokens = [_token_at(r, s) for r, s in zip(reqs, starts)]
            num_tokens = rows
        else:
            tokens = [t for r, s, n in zip(reqs, starts, num_new) for t in r.token_slice(s, s + n)]
            num_tokens = len(tokens) + (rows - num) * pad_q
        assert num_tokens <= self.max_tokens, (
            f"step planner invariant: {num_tokens} tokens in a step, buffers hold {self.max_tokens}"
        )
        slot, host, dev, nbytes = self._stage(rows, num_tokens)
        seq_lens, input_ids = host["seq_lens"], host["input_ids"]
        seq_lens[:num] = starts
        seq_lens[num:] = 0
        input_ids[:num_tokens] = 0
        input_ids[: len(tokens)] = tokens
        host["slots"][:num] = list(map(_SLOT, reqs))
        host["slots"][num:] = 0
        q_indptr, positions = host["q_indptr"], host["positions"]
        pending = NONE if not tokens or input_ids[: len(tokens)].min() >= 0 else SOME
        if one_token:
            positions[:] = seq_lens  # the starts, 0 on padded lanes
            q_indptr[:] = self._arange[: rows + 1]
            host["logits_indices"][:] = self._arange[:rows]
            if pending is SOME and input_ids[:num].max() < 0:  # -(1 + lane) -> lane
                np.subtract(-1, input_ids[:num], out=host["lanes"][:num])
                pending = ALL
        else:
            counts = np.full(rows, pad_q, np.int64)
            counts[:num] = num_new
            q_indptr[0] = 0
            np.cumsum(counts, out=q_indptr[1:])
            positions[:] = self._arange[:num_tokens] - np.repeat(q_indptr[:-1] - seq_lens, counts)
            host["logits_indices"][:] = q_indptr[1:] - 1
        seq_lens += 1 if one_token else counts  # padded lanes: 1, a token at position 0
        self._stage_ids(host, row_ids, write_ids)
        if batch.drafts is not None and batch.derive is None and not one_token:  # verify: kept
            self.steady.keep(batch, rows, pad_q, self._host[slot], nbytes)
        self._copy(slot, rows, num_tokens, write_ids is not None)
        return dev, host, pending

    @staticmethod
    def _stage_ids(host: dict, row_ids: np.ndarray | None, write_ids: np.ndarray | None) -> None:
        """The rows' virtual ids and their write ids (S, n), where given, into the
        staging views."""
        if row_ids is not None:
            host["row_ids"][: len(row_ids)] = row_ids
        if write_ids is not None:
            host["write_ids"][:, : write_ids.shape[1]] = write_ids

    def _stage(self, rows: int, num_tokens: int) -> tuple[int, dict, dict, int]:
        """(the staging slot of this step, its host views, the device views, bytes):
        the slot's last copy has run (the other may still be copying: a step in
        flight)."""
        slot = self._num_plans % 2  # the other slot may still be copying (step in flight)
        self._num_plans += 1
        if self._copied[slot] is not None:  # this slot's last copy has run
            self._copied[slot].synchronize()
        host, dev, nbytes, _ = self._layout(slot, rows, num_tokens)
        return slot, host, dev, nbytes

    def _copy(self, slot: int, rows: int, num_tokens: int, wide: bool) -> None:
        """Staging slot ``slot``'s bytes of a (rows, num_tokens) step to the device
        (one copy, recorded; ``wide``: the write ids too, else up to ``row_ids``)."""
        device, staging = self._layout(slot, rows, num_tokens)[3][wide]
        device.copy_(staging, non_blocking=True)
        if self._pin:
            self._copied[slot] = torch.cuda.Event()
            self._copied[slot].record()

    @staticmethod
    def fill(dev: dict, pending: str, prev_tokens: torch.Tensor, num: int) -> None:
        """Write the placeholders of ``dev["input_ids"]`` from ``prev_tokens``
        (B_prev,) int64, the previous step's samples on the device: one gather
        through ``lanes`` (ALL), ``Pending.fill`` (SOME), nothing (NONE)."""
        if pending is ALL:  # steady decoding: one gather
            torch.index_select(prev_tokens, 0, dev["lanes"][:num], out=dev["input_ids"][:num])
        elif pending is SOME:
            Pending.fill(dev["input_ids"], prev_tokens)

    def _layout(self, slot: int, rows: int, num_tokens: int) -> tuple[dict, dict, int, tuple]:
        """(host views of staging slot ``slot``, device views, bytes, the (device,
        staging) byte slices of the copy without and with the write ids) for ``rows`` requests and ``num_tokens``
        tokens, built once per shape (views are cheap to keep, slow to make on every
        step)."""
        key = (slot, rows, num_tokens)
        found = self._layouts.get(key)
        if found is None:
            host, nbytes = _views(self._host[slot], rows, num_tokens, self.subpools)
            short = _views(self._host[slot], rows, num_tokens)[1]  # (no write ids)
            with torch.inference_mode(False):  # kept views: usable in and out of it
                dev = _views(self._buffer, rows, num_tokens, self.subpools)[0]
                pairs = tuple((self._buffer[:n], self._staging[slot][:n]) for n in (short, nbytes))
            found = host, dev, nbytes, pairs
            if len(self._layouts) < 4 * self.max_seqs:  # decode shapes and some extends
                self._layouts[key] = found
        return found
