"""What a step's sampler does besides sampling: penalties, the min-tokens mask and
log-probabilities, batched over the requests that ask for them.

Everything is built from host lists the scheduler already holds and copied to
the device without waiting (pinned staging on CUDA). A request's newest output
token may still be a placeholder ``-(1 + lane)`` (its value is on the device, in
lane ``lane`` of the previous step's sampled tokens); it is resolved there, as
the runner resolves input ids. The plain greedy path (``Request.plain_greedy``
for every row) never comes here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unikv.engine.request import BatchKind
from unikv.engine.sampling import sample
from unikv.engine.structured import mask_structured


def _to_device(values: list, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)


def _resolve(tokens: torch.Tensor, prev_tokens: torch.Tensor | None) -> torch.Tensor:
    """Placeholders ``-(1 + lane)`` in (N,) int64 ``tokens`` read from ``prev_tokens``."""
    if prev_tokens is None:
        return tokens
    lanes = (-tokens - 1).clamp_(min=0)
    return torch.where(tokens < 0, prev_tokens[lanes], tokens)


def _token_rows(lists: list[list[int]], device, pin, prev_tokens=None):
    """(row, token) device index pairs of every token of ``lists[row]``."""
    rows = [i for i, ids in enumerate(lists) for _ in ids]
    flat = [t for ids in lists for t in ids]
    rows_t = _to_device(rows, torch.int64, device, pin)
    return rows_t, _resolve(_to_device(flat, torch.int64, device, pin), prev_tokens)


def apply_penalties(logits: torch.Tensor, reqs, prev_tokens, pin: bool) -> None:
    """vLLM's penalties, in place on ``logits`` (B, V) fp32, for rows whose params
    have any: repetition (prompt and output tokens: positive logits divided,
    negative multiplied), then frequency (per output occurrence) and presence
    (once per output token seen) subtracted."""
    rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[-1]
    sub = [reqs[i] for i in rows]
    counts = torch.zeros((len(rows), vocab), dtype=torch.float32, device=dev)
    r_idx, toks = _token_rows([r.output_ids for r in sub], dev, pin, prev_tokens)
    counts.index_put_((r_idx, toks), torch.ones_like(toks, dtype=torch.float32), accumulate=True)
    seen = torch.zeros((len(rows), vocab), dtype=torch.bool, device=dev)
    r_idx, toks = _token_rows([r.prompt_ids for r in sub], dev, pin)
    seen[r_idx, toks] = True
    seen |= counts > 0
    params = _to_device(
        [
            (r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty)
            for r in sub
        ],
        torch.float32,
        dev,
        pin,
    )
    rows_t = _to_device(rows, torch.int64, dev, pin)
    x = logits.index_select(0, rows_t)
    rep = params[:, 0:1]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - params[:, 1:2] * counts - params[:, 2:3] * (counts > 0).float()
    logits.index_copy_(0, rows_t, x)


def mask_early_stops(logits: torch.Tensor, reqs, pin: bool) -> None:
    """Rows with fewer than ``min_tokens`` outputs cannot sample a stop id (EOS
    included): their logits are set to -inf, in place on (B, V) ``logits``."""
    lists = [sorted(r.stop_ids) if len(r.output_ids) < r.params.min_tokens else [] for r in reqs]
    if not any(lists):
        return
    r_idx, toks = _token_rows(lists, logits.device, pin)
    logits[r_idx, toks] = float("-inf")


def _pinned(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Pinned host copies of ``tensors``, enqueued without waiting."""
    out = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.append(host.copy_(t, non_blocking=True))
    return out


def _logprob_parts(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """(chosen (R,), rank (R,), top_values (R, k), top_ids (R, k)) of raw logits (R, V)
    against the tokens ``targets`` (R,) int64: log-softmax, the targets' logprobs and
    ranks (1 = the most likely), the k most likely."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets[:, None])
    rank = (lp > chosen).sum(dim=-1) + 1
    top_values, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], targets[:, None][:, :0])
    return chosen[:, 0], rank, top_values, top_ids


@dataclass
class StepLogprobs:
    """Log-probabilities of one step, for the rows in ``rows`` (host ints, batch
    lanes): chosen (R,) fp32 of the sampled token, rank (R,) int64 (1 = the most
    likely), top_values / top_ids (R, k) of the k most likely tokens."""

    rows: list[int]
    chosen: torch.Tensor
    rank: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def to_host(self) -> StepLogprobs:
        """Pinned host copies, enqueued without waiting (read after the step's event)."""

        return StepLogprobs(
            self.rows, *_pinned(self.chosen, self.rank, self.top_values, self.top_ids)
        )

    def lists(self) -> dict[int, tuple[float, int, list[tuple[int, float]]]]:
        """lane -> (chosen logprob, rank, [(token id, logprob)] of the top k)."""
        chosen, rank = self.chosen.tolist(), self.rank.tolist()
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        return {
            lane: (chosen[j], rank[j], list(zip(ids[j], values[j])))
            for j, lane in enumerate(self.rows)
        }


def step_logprobs(logits: torch.Tensor, tokens: torch.Tensor, reqs, pin: bool):
    """StepLogprobs of the rows whose params ask for logprobs (else None), from the
    raw model logits (B, V) fp32 and the sampled tokens (B,) int64."""
    rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if not rows:
        return None
    k = max(reqs[i].params.logprobs for i in rows)
    rows_t = _to_device(rows, torch.int64, logits.device, pin)
    parts = _logprob_parts(logits.index_select(0, rows_t), tokens.index_select(0, rows_t), k)
    return StepLogprobs(rows, *parts)


def sample_requests(reqs, logits: torch.Tensor, prev_tokens, *, pin: bool, prev_host=None):
    """(B,) int64 next tokens of ``reqs`` (batch order) from logits (B, V) fp32,
    and their StepLogprobs (None if no row asks). ``logits`` is not modified.
    prev_host: None, or a callable giving the previous step's tokens on the host
    (called, a wait, only when a structured-output request is in the batch)."""
    dev = logits.device
    processed = logits
    structured = any(r.params.structured is not None for r in reqs)
    if structured or any(
        r.params.has_penalties or len(r.output_ids) < r.params.min_tokens for r in reqs
    ):
        processed = logits.clone()
        apply_penalties(processed, reqs, prev_tokens, pin)
        mask_early_stops(processed, reqs, pin)
        if structured:
            mask_structured(processed, reqs, prev_host() if prev_host is not None else None)
    floats = _to_device(
        [(r.params.temperature, r.params.top_p, r.params.min_p) for r in reqs],
        torch.float32,
        dev,
        pin,
    )
    ints = _to_device(
        [(r.params.top_k, r.seed, len(r.output_ids)) for r in reqs], torch.int64, dev, pin
    )
    min_p = floats[:, 2] if any(r.params.min_p > 0 for r in reqs) else None
    tokens = sample(
        processed, floats[:, 0], ints[:, 0], floats[:, 1], ints[:, 1], ints[:, 2], min_p
    )
    return tokens, step_logprobs(logits, tokens, reqs, pin)


@dataclass
class PromptRows:
    """The prompt rows of one step whose logits its requests asked for
    (``SamplingParams.prompt_logprobs``): ``rows`` (E,) int64 device token rows of
    the step (appended to the forward's logits rows), ``targets`` (E,) the prompt
    tokens they predict, ``spans`` (lane, first prompt position, count) host ints,
    ``k`` the top tokens to return."""

    rows: torch.Tensor
    targets: torch.Tensor
    spans: list[tuple[int, int, int]]
    k: int


def prompt_rows(batch, device, pin: bool) -> PromptRows | None:
    """PromptRows of ``batch`` (None when no request asks, or none of its prompt
    positions is in this step). A request's lane ``j`` feeds tokens ``[s, s + n)``
    (``s``: its computed tokens); the logits of its token ``s + t`` predict prompt
    position ``s + t + 1``, wanted while that is a prompt position."""
    if batch.kind is BatchKind.DECODE:  # every lane feeds its last token: no prompt row
        return None  # (and the decode hot path keeps no loop over its requests here)
    reqs, num_new = batch.requests, batch.num_new
    asks = [j for j, r in enumerate(reqs) if r.params.prompt_logprobs is not None]
    if not asks:
        return None
    one_token = batch.is_decode  # one token per lane: lane j is token row j
    offsets = [0]
    for n in num_new:
        offsets.append(offsets[-1] + n)
    rows, targets, spans, k = [], [], [], 0
    for j in asks:
        r = reqs[j]
        first, last = r.num_cached + 1, min(r.num_cached + num_new[j], len(r.prompt_ids) - 1)
        if last < first:
            continue
        base = j if one_token else offsets[j]
        rows.extend(range(base, base + last - first + 1))
        targets.extend(r.prompt_ids[first : last + 1])
        spans.append((j, first, last - first + 1))
        k = max(k, r.params.prompt_logprobs)
    if not rows:
        return None
    rows_t = _to_device(rows, torch.int64, device, pin)
    return PromptRows(rows_t, _to_device(targets, torch.int64, device, pin), spans, k)


@dataclass
class PromptLogprobs:
    """Log-probabilities of a step's prompt rows (``PromptRows``): chosen (E,),
    rank (E,), top_values / top_ids (E, k), and the rows' spans."""

    spans: list[tuple[int, int, int]]
    chosen: torch.Tensor
    rank: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def to_host(self) -> PromptLogprobs:
        """Pinned host copies, enqueued without waiting (read after the step's event)."""

        return PromptLogprobs(
            self.spans, *_pinned(self.chosen, self.rank, self.top_values, self.top_ids)
        )

    def lists(self) -> dict[int, tuple[int, list]]:
        """lane -> (first prompt position, [(logprob, rank, [(id, logprob)] of the
        top k)] of its positions in order)."""
        chosen, rank = self.chosen.tolist(), self.rank.tolist()
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        out, e = {}, 0
        for lane, first, count in self.spans:
            out[lane] = (
                first,
                [(chosen[i], rank[i], list(zip(ids[i], values[i]))) for i in range(e, e + count)],
            )
            e += count
        return out


def prompt_logprobs(logits: torch.Tensor, pr: PromptRows) -> PromptLogprobs:
    """PromptLogprobs of the prompt rows' raw logits (E, V)."""
    return PromptLogprobs(pr.spans, *_logprob_parts(logits, pr.targets, pr.k))
