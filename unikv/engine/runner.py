"""The model runner: runs the step planner's plans through the model and samples.

Built once: one ``LayerCache`` per model layer (its sub-pool's dense K/V views
and window), the ``StepPlanner`` (the step buffers) and, when asked, the decode
CUDA graphs over its buffers; the device decides, at construction only, whether
host copies are pinned and sampled tokens read back asynchronously. Per step:
plan (one packed host-to-device copy, one translation per sub-pool) -> forward
(or a graph replay, the greedy argmax inside for small all-greedy batches) ->
sample -> one device-to-host copy of the tokens, on a side stream on CUDA (so the
next step's uploads and launches need not queue behind it).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

from unikv.engine.attention import (
    DecodeAttention,
    ExtendAttention,
    LayerCache,
    LayerState,
    MLALayerCache,
)
from unikv.engine.logits import prompt_logprobs, prompt_rows, sample_requests
from unikv.engine.plan import DRAFT_PREFIX, StepPlan, StepPlanner
from unikv.engine.scheduler import Batch, BatchKind
from unikv.engine.speculative.step import all_greedy, verify_step
from unikv.kernels.backend import KernelBackend
from unikv.models.llama import CausalLM

if TYPE_CHECKING:
    from unikv.allocator import PoolAllocator
    from unikv.engine.speculative.stash import HiddenStash
    from unikv.pool import UnifiedPool

# Settled A/Bs, no longer switches (docs/history.md, sixteenth session and "one request,
# decode graphs"): the sampled tokens' copy to the host runs on a side stream (CUDA);
# greedy graphs take the argmax inside the model's LM head where it fuses one; one-row
# graphs of a model that resolves placeholder tokens itself read them from the planner's
# feedback buffer (no token gather before a steady request's step).


def layer_caches(
    pool: UnifiedPool, num_layers: int, soft_cap: float = 0.0, draft: bool = False
) -> tuple[list[LayerCache | None], list[LayerState | None]]:
    """Per model layer, from the sub-pools' ``layers`` lists: its attention cache
    (a LayerCache, with the model's attention ``soft_cap``, 0 = off) and its
    recurrent state (a LayerState), None where it has none (a layer may have
    both, e.g. Falcon-H1, or neither, an MLP-only layer). ``draft``: the layers of
    a speculative draft model's sub-pools (``draft_*``) instead of the target's."""
    caches: list[LayerCache | None] = [None] * num_layers
    states: list[LayerState | None] = [None] * num_layers
    for sub in pool.subpools.values():
        if sub.name.startswith(DRAFT_PREFIX) != draft:
            continue
        for index, layer in enumerate(sub.layers):
            if sub.spec.kind == "mamba":  # views: {part: (num_layers, S, *shape)}
                temporal = sub.views.get("temporal")  # None: a conv-only slot (LFM2)
                states[layer] = LayerState(
                    sub.views["conv0"][index], None if temporal is None else temporal[index]
                )
                continue
            if sub.spec.kind == "mla":  # views: [latent (N, rank + rope)] per layer
                caches[layer] = MLALayerCache(sub.name, sub.views[index], sub.page_size)
                continue
            k, v = sub.views[index]
            window = sub.spec.sliding_window or 0
            caches[layer] = LayerCache.of(
                sub.name, k, v, sub.spec.dtype, window, sub.page_size, soft_cap
            )
    return caches, states


def check_soft_cap(backend: KernelBackend, soft_cap: float) -> float:
    """The attention logit soft-cap (0 = off) once the backend's attention ops are
    known to apply it; ValueError at start-up naming the op that cannot."""
    for op in ("decode_attention", "extend_attention") if soft_cap > 0 else ():
        if "soft_cap" not in inspect.signature(getattr(backend, op)).parameters:
            raise ValueError(
                f"the model soft-caps its attention logits (cap {soft_cap}) but the "
                f"{backend.name!r} backend's {op} cannot apply soft-capping; run it with "
                "backend='torch' or backend='triton'"
            )
    return float(soft_cap)


class Launched:
    """A step enqueued on the device: its batch, logits (B, V) fp32, sampled tokens
    on the device (B,) int64 and their host copy, valid once ``event`` fired, and
    the host copy of its log-probabilities (a StepLogprobs, or None)."""

    __slots__ = (
        "_host", "_logprobs", "_prompt", "accepted", "batch", "emitted", "event", "fed", "logits",
        "row_ids", "tokens_dev", "verify",
    )  # fmt: skip

    def __init__(
        self, batch, logits, tokens_dev, host, event, logprobs=None, fed=False, prompt=None
    ) -> None:
        self.batch, self.logits, self.tokens_dev = batch, logits, tokens_dev
        self._host, self.event, self._logprobs = host, event, logprobs
        self.fed = fed  # the tokens are in the planner's feedback buffer
        self._prompt = prompt  # the prompt rows' PromptLogprobs (host copies), or None
        self.emitted: list[list[int]] | None = None  # a verify step's tokens per request
        # a verify step's readback (host copy, its event, the draft), until read_emitted
        self.verify: tuple | None = None
        self.accepted: torch.Tensor | None = None  # a verify step's (B,) accepted drafts
        self.row_ids: torch.Tensor | None = None  # a verify step's rows' virtual ids (device)

    def _ready(self, host):
        """``host`` (this step's host copies) once the step is done; waits for it only."""
        if self.event is not None:
            self.event.synchronize()
        return host

    def read_emitted(self) -> list[list[int]]:
        """A verify step's emitted tokens per request (its accepted drafts, then the
        target's token), on the host; waits for this step only (the first call)."""
        if self.emitted is None:
            packed, copied, draft = self.verify
            if copied is not None:
                copied.synchronize()
            host = packed.tolist()
            if draft is not None:
                draft.settled(self.batch, [row[-1] for row in host])
            self.emitted = [row[: row[-1] + 1] for row in host]
        return self.emitted

    def prompt_logprobs(self) -> dict | None:
        """lane -> (first position, entries) of the prompt rows its requests asked
        for (``PromptLogprobs.lists``), or None; waits for this step only."""
        return None if self._prompt is None else self._ready(self._prompt).lists()

    def tokens(self) -> list[int]:
        """The sampled tokens on the host; waits for this step only."""
        return self._ready(self._host).tolist()

    def logprobs(self) -> dict | None:
        """lane -> (logprob, rank, top [(id, logprob)]) of the rows that asked for
        logprobs (``StepLogprobs.lists``), or None; waits for this step only."""
        return None if self._logprobs is None else self._ready(self._logprobs).lists()


class ModelRunner:
    """Runs planned steps of ``model`` over ``pool`` (managed by ``alloc``) with the
    ops of ``backend``. max_num_seqs / max_num_batched_tokens size the planner's
    buffers; cuda_graphs: capture decode steps of up to ``max_graph_batch``."""

    def __init__(
        self,
        model: CausalLM,
        pool: UnifiedPool,
        alloc: PoolAllocator,
        backend: KernelBackend,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        cuda_graphs: bool = False,
        max_graph_batch: int = 0,
        q_per_kv_of: dict[str, int] | None = None,
        prefill_graphs: bool = False,
        prefill_graph_tokens: int | None = None,
        hidden_stash: HiddenStash | None = None,
    ):
        self.model, self.pool, self.alloc, self.backend = model, pool, alloc, backend
        # a lazy draft head's stash (``speculative/stash.py``): every decode step writes
        # its exported hidden states there, inside its graph (set before the capture)
        self.hidden_stash = hidden_stash
        self.device = pool.device
        self._pin = self.device.type == "cuda"  # decided once: pinned, asynchronous copies
        self.sm_scale = model.config.sm_scale  # the family's own where it has one (Gemma)
        soft_cap = check_soft_cap(backend, model.config.extra.get("attn_soft_cap", 0.0))
        self.layers, self.states = layer_caches(pool, model.config.num_layers, soft_cap)
        self.planner = StepPlanner(
            alloc,
            backend,
            max_seqs=max_num_seqs,
            max_tokens=max_num_batched_tokens,
            q_per_kv=model.config.num_heads // model.config.num_kv_heads,
            q_per_kv_of=q_per_kv_of,
            pin=self._pin,
            feed_graphs=(cuda_graphs and getattr(model, "resolves_feedback", False)),
        )
        # Two pinned host slots for the sampled tokens, used alternately: with one
        # step in flight, a slot is rewritten only after its step was resolved. Sized
        # for the largest step here, once: pinning on the step path (a slot grown as
        # batches grew) is a driver call in the middle of a step's launches.
        slot = max_num_seqs if self._pin else 0
        self._tokens_host = [torch.empty(slot, dtype=torch.int64, pin_memory=self._pin)
                             for _ in range(2)]  # fmt: skip
        self._readback = self._pinned_readback if self._pin else self._direct_readback
        self._copy_stream = torch.cuda.Stream(self.device) if self._pin else None
        self._launches = 0
        # the step's readback event waits by sleeping (cudaEventBlockingSync), not by
        # spinning a core: the engine process sets it (nothing else runs in its
        # thread while it waits); LLM.generate keeps CUDA's default (a spin)
        self.blocking_readback = False
        # the model's forward returns (logits, greedy tokens) when asked (decided once)
        self._fused_greedy = "greedy" in inspect.signature(model.forward).parameters
        self.force_accept = False  # speculative decoding's benchmark mode (LLM sets it)
        self.draft = None  # a speculative draft model (``speculative.draft.DraftModel``)
        self.verify_graphs = None  # speculative verify steps' graphs (``capture_verify``)
        self.graphs = None
        if cuda_graphs:
            from unikv.engine.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(
                self.forward, self.planner, max_graph_batch, forward_greedy=self.forward_greedy
            )
        # extend steps through piecewise graphs (plain calls of the same pieces on CPU)
        self.prefill_graphs = None
        if prefill_graphs:
            from unikv.engine.prefill_graphs import PrefillGraphs, prefill_token_sizes

            make_step = lambda plan: ExtendAttention(
                self.layers, plan, self.backend, self.sm_scale, self.states
            )
            top = min(prefill_graph_tokens or self.planner.max_tokens, self.planner.max_tokens)
            sizes = prefill_token_sizes(top)
            self.prefill_graphs = PrefillGraphs(model, self.planner, make_step, sizes)

    # -- running -------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self, plan: StepPlan, greedy: bool = False, extra_rows=None, every_row=False, pieces=False
    ):
        """fp32 logits (B, vocab) of each request's last token in the step; greedy:
        (logits, the model's (B,) int64 greedy tokens) from a model that fuses them.
        extra_rows: (E,) int64 more token rows whose logits follow (B + E rows);
        every_row: the logits of every token row (T, vocab) (a verify step).
        pieces: an extend step may run in the prefill graphs (never inside a capture)."""
        kind = DecodeAttention if plan.is_decode else ExtendAttention
        attn = kind(self.layers, plan, self.backend, self.sm_scale, self.states)
        # a decode step's rows are its requests' last tokens: no gather before the head
        rows = None if plan.is_decode or every_row else plan.logits_indices
        if extra_rows is not None:
            rows = torch.cat([plan.logits_indices, extra_rows])  # an eager plan: B rows
            attn.logit_rows_plan = self.backend.plan_rows(rows.shape[0])  # the head's B + E
        extra = {"greedy": True} if greedy else {}
        if pieces and self.prefill_graphs is not None and not plan.is_decode:
            out = self.prefill_graphs.forward(plan, attn, rows, **extra)
            if out is not None:  # (None: more rows than the largest size)
                return out
        out = self.model(plan.input_ids, plan.positions, attn, rows, **extra)
        if plan.is_decode and self.hidden_stash is not None:
            self.hidden_stash.write(plan)  # (in the decode graph: no launch of its own)
        return out

    @torch.inference_mode()
    def forward_greedy(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's (fp32 logits (B, vocab), (B,) int64 greedy tokens): the
        argmax inside the model's LM head where it fuses one (``greedy=True``), else
        the backend's argmax after ``forward``."""
        if self._fused_greedy:
            return self.forward(plan, greedy=True)
        logits = self.forward(plan)
        return logits, self.backend.argmax(logits)

    @torch.inference_mode()
    def step(self, batch: Batch) -> tuple[list[int], torch.Tensor]:
        """Run one step and wait for it; returns (one sampled token per request,
        fp32 logits (B, V))."""
        launched = self.launch(batch)
        return launched.tokens(), launched.logits

    @torch.inference_mode()
    def launch(self, batch: Batch, prev: Launched | None = None) -> Launched:
        """Enqueue one step without waiting for it. Placeholder tokens in the batch
        (``Pending``) are read from ``prev``'s sampled tokens on the device."""
        if batch.drafts is not None:
            return self._launch_verify(batch, prev)
        prev_tokens = prev.tokens_dev if prev is not None else None
        greedy = self._greedy(batch)
        # prompt logprobs (only where a request asks; never in a plain-greedy batch)
        wanted = None if greedy else prompt_rows(batch, self.device, self._pin)
        graphed = self.graphs is not None and wanted is None
        rows = self.graphs.rows_for(batch) if graphed else None
        prev_fed = prev is not None and prev.fed
        draft = self.draft  # past the rule a plain decode step leaves the draft lazy
        lazy = draft is not None and batch.kind is BatchKind.DECODE and batch.lazy  # (the plan's)
        assert (
            lazy or batch.tables is None or batch.tables is not self.planner.tables.target_only
        ), "runner invariant: a step whose draft runs had its draft's tables built"
        if draft is not None and not lazy and draft.prepare(batch) and batch.step is not None:
            batch.step.rebuild()  # a lazy draft's catch-up planned over decode_step's tables
        plan = self.planner.plan(batch, prev_tokens, rows=rows, prev_fed=prev_fed)
        tokens_dev, fed, prompt = None, False, None
        if wanted is not None:
            logits = self.forward(plan, extra_rows=wanted.rows, pieces=True)
            num = len(batch.requests)
            prompt = prompt_logprobs(logits[num:], wanted)
            prompt = prompt.to_host() if self._pin else prompt
            logits = logits[:num]
        elif rows is None:
            logits = self.forward(plan, pieces=True)
        else:
            in_graph = greedy and self.graphs.has_greedy(rows)  # the argmax inside
            if in_graph and self._copy_stream is not None and prev is not None:
                # the graph rewrites its token buffer: prev's copy of it comes first
                torch.cuda.current_stream(self.device).wait_event(prev.event)
            logits, tokens_dev = self.graphs.replay(rows, in_graph)
            logits = logits[: len(batch.requests)]
            # the model's argmax wrote them into the plan's feedback buffer
            fed = in_graph and self._fused_greedy and plan.feedback is not None
        owned = tokens_dev is None  # not the greedy graph's own buffer
        if owned:
            tokens_dev, logprobs = self.sample(batch, logits, prev_tokens, greedy, prev)
        else:
            tokens_dev, logprobs = tokens_dev[: len(batch.requests)], None
        if lazy:  # no draft forward (``catch_up`` writes its rows later)
            draft.defer(plan, batch, tokens_dev)
        elif draft is not None:  # the draft's K/V of the same rows (its invariant)
            draft.forward_plan(plan, batch, tokens_dev)
        host, event, logprobs = self._readback(tokens_dev, logprobs, owned)
        self.alloc.mark_in_flight(event)
        self._launches += 1
        return Launched(batch, logits, tokens_dev, host, event, logprobs, fed, prompt)

    def _launch_verify(self, batch: Batch, prev: Launched | None = None) -> Launched:
        """A verify step (speculative decoding), enqueued: every row scored, the drafts
        accepted or rejected (``speculative.step.verify_step``) and the emitted tokens'
        readback started; ``Launched.read_emitted`` waits for them (the next step's
        drafts need them). Placeholders: a draft model's device drafts, or (a verify
        step planned ahead, ``Scheduler.verify_ahead``) the last emitted token of
        ``prev``'s requests, its ``tokens_dev``, and its drafts and rows derived on
        the device from ``prev``'s acceptance (``speculative/derive.py``)."""
        graphs = self.verify_graphs
        rows = graphs.rows_for(batch) if graphs is not None else None
        derive, slack = batch.derive, 0
        if derive is not None:  # planned ahead of ``prev``: whatever it accepts
            derive.upload(self.device, self._pin)
            batch.draft_tokens = derive.sources(prev.accepted, prev.tokens_dev)
            slack = derive.slack
        drafts = batch.draft_tokens
        if drafts is None and prev is not None:
            drafts = prev.tokens_dev
        if rows is None:
            plan = self.planner.plan(batch, drafts, slack=slack)
        else:
            plan = self.planner.plan(batch, drafts, rows=rows, pad_q=graphs.q, slack=slack)
        row_ids = batch.virtual_ids.data
        if derive is not None:  # the rows' true virtual ids: some of prev's, some its own
            row_ids = derive.fix(
                plan, prev.accepted, torch.cat([prev.row_ids, row_ids]), self.alloc
            )
        num, out = len(batch.requests), None
        if rows is None:
            logits = self.forward(plan, every_row=True)
        else:
            logits, out = graphs.run(plan, rows)
            logits = logits[: sum(batch.num_new)]
        if out is not None and (self.force_accept or all_greedy(batch.requests)):
            # the graph accepted on the device: no host array, no upload for it
            packed, last, tokens, accepted = out.lanes(num)
        else:
            shift = derive.delta if derive is not None else None  # sampled: output steps
            tokens, accepted = verify_step(batch, logits, self._pin, self.force_accept, shift)
            packed = torch.cat([tokens, accepted[:, None]], dim=1)
            last = tokens.gather(1, accepted[:, None])[:, 0]  # each request's next pending token
        copied = None
        if self._pin:  # the emitted tokens' copy, enqueued before the draft's forward
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            copied = torch.cuda.Event(blocking=self.blocking_readback)
            copied.record()
            packed = host
        done = copied  # its pages stay fenced until the step (and a draft's forward) is done
        if self.draft is not None:  # the rows kept after the rollback are the true tokens'
            self.draft.forward_verify(plan, batch, tokens, accepted, rows)  # under the host's work
            if copied is not None:
                done = torch.cuda.Event()
                done.record()
        self.alloc.mark_in_flight(done)
        self._launches += 1
        launched = Launched(batch, logits, last, None, None)
        launched.verify, launched.accepted = (packed, copied, self.draft), accepted
        launched.row_ids = row_ids
        return launched

    def capture_verify(self, q: int, max_rows: int, capture: bool = True) -> None:
        """Verify steps of ``q`` rows per request, up to ``max_rows`` requests, under
        CUDA graphs (``speculative.graphs.VerifyGraphs``; ``capture=False``: the same
        padded plans run eagerly)."""
        from unikv.engine.speculative.graphs import VerifyGraphs

        forward = lambda plan: self.forward(plan, every_row=True)
        self.verify_graphs = VerifyGraphs(
            forward, self.planner, max_rows, q, capture, force=self.force_accept
        )

    def _direct_readback(self, tokens_dev: torch.Tensor, logprobs, owned=True):
        """(host tokens, no event, logprobs): the device is the host (a copy of a
        buffer the next step rewrites: not ``owned``, e.g. the feedback buffer)."""
        return (tokens_dev if owned else tokens_dev.clone()), None, logprobs

    def _pinned_readback(self, tokens_dev: torch.Tensor, logprobs, owned=True):
        """(pinned host copy of the tokens, its CUDA event, logprobs on the host),
        all enqueued without waiting. owned: ``tokens_dev`` came from the caching
        allocator (not a graph's buffer), so a side-stream copy records its use."""
        logprobs = logprobs.to_host() if logprobs is not None else None
        host = self._tokens_host[self._launches % 2]
        assert tokens_dev.numel() <= host.numel(), "a step has at most max_num_seqs requests"
        host = host[: tokens_dev.numel()]
        event = torch.cuda.Event(blocking=self.blocking_readback)
        side = self._copy_stream
        if side is None:
            host.copy_(tokens_dev, non_blocking=True)
            event.record()
            return host, event, logprobs
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # the event covers the step: side waited for it
            host.copy_(tokens_dev, non_blocking=True)
            event.record()
        if owned:
            tokens_dev.record_stream(side)  # not reused by the allocator before the copy
        return host, event, logprobs

    @staticmethod
    def _greedy(batch: Batch) -> bool:
        """Whether every sample of the batch is a bare argmax (host knowledge only)."""
        greedy = batch.all_greedy  # the scheduler's, when it knows (DECODE batches)
        return greedy if greedy is not None else all(r.plain_greedy for r in batch.requests)

    def sample(self, batch: Batch, logits: torch.Tensor, prev_tokens=None, greedy=None, prev=None):
        """(B,) int64 next tokens and the step's logprobs (a StepLogprobs or None).
        All-plain-greedy batches (known on the host) are the backend's argmax; others go
        through ``logits.sample_requests`` (penalties, min_tokens, min_p, logprobs;
        placeholders in the outputs read from ``prev_tokens`` on the device)."""
        if greedy if greedy is not None else self._greedy(batch):
            return self.backend.argmax(logits), None
        prev_host = prev.tokens if prev is not None else None  # structured outputs' sync
        return sample_requests(
            batch.requests, logits.float(), prev_tokens, pin=self._pin, prev_host=prev_host
        )
