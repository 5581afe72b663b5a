"""The model runner: plans a scheduled batch (one translation per sub-pool),
runs the model over the pool and samples.

Built once: the kernel backend (Triton on CUDA, torch references on CPU), one
``LayerCache`` per model layer (its sub-pool's dense K/V views and window),
and, on CUDA, the decode CUDA graphs. Per step: host lengths -> one packed
host-to-device copy -> translate write ids and build block tables once per
sub-pool -> forward -> sample -> one device-to-host copy of the tokens.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from unikv.engine.logits import sample_requests
from unikv.engine.plan import (
    DecodeAttention,
    ExtendAttention,
    LayerCache,
    LayerState,
    MLALayerCache,
    StepPlan,
    SubPoolStep,
)
from unikv.engine.scheduler import Batch
from unikv.models.llama import CausalLM


def layer_caches(
    pool, num_layers: int, soft_cap: float = 0.0
) -> tuple[list[LayerCache | None], list[LayerState | None]]:
    """Per model layer, from the sub-pools' ``layers`` lists: its attention cache
    (a LayerCache, with the model's attention ``soft_cap``, 0 = off) and its
    recurrent state (a LayerState), None where it has none (a layer may have
    both, e.g. Falcon-H1, or neither, an MLP-only layer)."""
    caches: list[LayerCache | None] = [None] * num_layers
    states: list[LayerState | None] = [None] * num_layers
    for sub in pool.subpools.values():
        for index, layer in enumerate(sub.layers):
            if sub.spec.kind == "mamba":  # views: {part: (num_layers, S, *shape)}
                states[layer] = LayerState(sub.views["conv0"][index], sub.views["temporal"][index])
                continue
            if sub.spec.kind == "mla":  # views: [latent (N, rank + rope)] per layer
                caches[layer] = MLALayerCache(sub.name, sub.views[index], sub.page_size)
                continue
            k, v = sub.views[index]
            window = sub.spec.sliding_window or 0
            caches[layer] = LayerCache(sub.name, k, v, window, sub.page_size, soft_cap)
    return caches, states


def check_soft_cap(backend, soft_cap: float) -> float:
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

    __slots__ = ("_event", "_host", "_logprobs", "batch", "logits", "tokens_dev")

    def __init__(self, batch, logits, tokens_dev, host, event, logprobs=None) -> None:
        self.batch, self.logits, self.tokens_dev = batch, logits, tokens_dev
        self._host, self._event, self._logprobs = host, event, logprobs

    def tokens(self) -> list[int]:
        """The sampled tokens on the host; waits for this step only."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()

    def logprobs(self) -> dict | None:
        """lane -> (logprob, rank, top [(id, logprob)]) of the rows that asked for
        logprobs (``StepLogprobs.lists``), or None; waits for this step only."""
        if self._logprobs is None:
            return None
        if self._event is not None:
            self._event.synchronize()
        return self._logprobs.lists()


class ModelRunner:
    """Runs planned steps of ``model`` over ``pool`` (managed by ``alloc``)."""

    def __init__(
        self,
        model: CausalLM,
        pool,
        alloc,
        backend,
        *,
        cuda_graphs: bool = False,
        max_graph_batch: int = 0,
    ):
        self.model, self.pool, self.alloc, self.backend = model, pool, alloc, backend
        self.device = pool.device
        self._pin = self.device.type == "cuda"  # host staging is pinned: copies never block
        self.sm_scale = model.config.sm_scale  # the family's own where it has one (Gemma)
        soft_cap = check_soft_cap(backend, model.config.extra.get("attn_soft_cap", 0.0))
        self.layers, self.states = layer_caches(pool, model.config.num_layers, soft_cap)
        # the token sub-pools (block tables, write ids); the Mamba one has state slots
        self.subpools = [s for s in pool.subpools.values() if s.spec.kind != "mamba"]
        self.has_state = len(self.subpools) < len(pool.subpools)
        # Two pinned staging slots per direction, used alternately: with one step in
        # flight while the next is planned, a slot is rewritten only after the step
        # that last used it was resolved (its copies done).
        self._staging = [torch.empty(0, dtype=torch.int64)] * 2
        self._tokens_host = [torch.empty(0, dtype=torch.int64)] * 2
        self._launches = 0
        self.graphs = None
        if cuda_graphs:
            from unikv.engine.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, max_graph_batch)

    # -- planning ------------------------------------------------------------------

    def host_arrays(self, batch: Batch) -> dict[str, np.ndarray]:
        """Per-step int64 host arrays: tokens, positions, lengths, slots."""
        reqs = batch.requests
        num_new = np.asarray(batch.num_new, dtype=np.int64)
        starts = np.fromiter((r.num_cached for r in reqs), np.int64, len(reqs))
        q_indptr = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(num_new, out=q_indptr[1:])
        if batch.is_decode:  # each request feeds its last token
            tokens = [r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in reqs]
        else:
            tokens = [t for r, s, n in zip(reqs, starts, num_new) for t in r.token_slice(s, s + n)]
        offsets = np.repeat(q_indptr[:-1] - starts, num_new)  # row - position, per token
        return {
            "input_ids": np.asarray(tokens, dtype=np.int64),
            "positions": np.arange(q_indptr[-1], dtype=np.int64) - offsets,
            "logits_indices": q_indptr[1:] - 1,
            "seq_lens": starts + num_new,
            "q_indptr": q_indptr,
            "slots": np.fromiter((r.slot for r in reqs), np.int64, len(reqs)),
        }

    def to_device(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """One host-to-device copy of all arrays, then views into it."""
        packed = torch.from_numpy(np.concatenate(list(arrays.values())))
        if self.device.type == "cuda":
            slot = self._launches % 2
            if self._staging[slot].numel() < packed.numel():
                size = 2 * packed.numel()
                self._staging[slot] = torch.empty(size, dtype=torch.int64).pin_memory()
            staged = self._staging[slot][: packed.numel()]
            staged.copy_(packed)
            packed = staged.to(self.device, non_blocking=True)
        out, start = {}, 0
        for name, a in arrays.items():
            out[name] = packed[start : start + a.size]
            start += a.size
        return out

    def device_arrays(
        self, batch: Batch, prev_tokens: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """The step's arrays on the device. A token not yet known on the host is a
        placeholder ``-(1 + lane)``: it is read from lane ``lane`` of the previous
        step's sampled tokens ``prev_tokens`` (B_prev,) int64, on the device."""
        dev = self.to_device(self.host_arrays(batch))
        if prev_tokens is not None:
            ids = dev["input_ids"]
            lanes = (-ids - 1).clamp_(min=0)
            dev["input_ids"] = torch.where(ids < 0, prev_tokens[lanes], ids)
        return dev

    def plan(self, batch: Batch, prev_tokens: torch.Tensor | None = None) -> StepPlan:
        """Translate the batch once per sub-pool into a StepPlan."""
        dev = self.device_arrays(batch, prev_tokens)
        seq_lens, slots = dev["seq_lens"].to(torch.int32), dev["slots"].to(torch.int32)
        max_q_len = int(np.max(np.asarray(batch.num_new)))
        done = batch.step_tables  # decode_step already built them (decode-only batch)
        if done is not None:
            steps = {
                n: SubPoolStep(done.write_ids[n], done.block_tables[n].data)
                for n in done.block_tables
            }
            return self._plan(batch, dev, seq_lens, max_q_len, steps)
        max_pages_tokens = max(r.num_cached + n for r, n in zip(batch.requests, batch.num_new))
        virtual_ids = batch.virtual_ids
        steps = {}
        for sub in self.subpools:
            window = sub.spec.sliding_window or 0
            if window:
                window += max_q_len - 1  # the first new token still sees W keys back
            max_pages = -(-max_pages_tokens // sub.page_size)
            table = torch.empty(
                (len(batch.requests), max_pages), dtype=torch.int32, device=self.device
            )
            self.alloc.block_table(slots, seq_lens, sub.name, table, window=window)
            steps[sub.name] = SubPoolStep(self.alloc.translate(virtual_ids, sub.name), table)
        return self._plan(batch, dev, seq_lens, max_q_len, steps)

    def state_slots(self, slots: torch.Tensor) -> torch.Tensor | None:
        """(B,) int64 physical state slots of (B,) device request slots (hybrid
        models; translated once per step, outside any graph), else None."""
        return self.alloc.mamba_slots(slots).data if self.has_state else None

    def _plan(self, batch: Batch, dev: dict, seq_lens, max_q_len: int, steps: dict) -> StepPlan:
        return StepPlan(
            is_decode=batch.is_decode,
            input_ids=dev["input_ids"],
            positions=dev["positions"],
            logits_indices=dev["logits_indices"],
            seq_lens=seq_lens,
            q_indptr=dev["q_indptr"].to(torch.int32),
            max_q_len=max_q_len,
            subpools=steps,
            state_slots=self.state_slots(dev["slots"]),
        )

    # -- running -------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """fp32 logits (B, vocab) of each request's last token in the step."""
        kind = DecodeAttention if plan.is_decode else ExtendAttention
        attn = kind(self.layers, plan, self.backend, self.sm_scale, self.states)
        return self.model(plan.input_ids, plan.positions, attn, plan.logits_indices)

    @torch.inference_mode()
    def step(self, batch: Batch) -> tuple[list[int], torch.Tensor]:
        """Run one step and wait for it; returns (one sampled token per request,
        fp32 logits (B, V))."""
        launched = self.launch(batch)
        return launched.tokens(), launched.logits

    @torch.inference_mode()
    def launch(self, batch: Batch, prev: Launched | None = None) -> Launched:
        """Enqueue one step without waiting for it. Placeholder tokens in the batch
        (see ``device_arrays``) are read from ``prev``'s sampled tokens."""
        prev_tokens = prev.tokens_dev if prev is not None else None
        if self.graphs is not None and batch.is_decode and self.graphs.fits(batch):
            logits = self.graphs.run(batch, prev_tokens)
        else:
            logits = self.forward(self.plan(batch, prev_tokens))
        tokens_dev, logprobs = self.sample(batch, logits, prev_tokens)
        host, event = tokens_dev, None
        if self.device.type == "cuda":
            logprobs = logprobs.to_host() if logprobs is not None else None
            slot = self._launches % 2
            if self._tokens_host[slot].numel() < tokens_dev.numel():
                self._tokens_host[slot] = torch.empty(
                    2 * tokens_dev.numel(), dtype=torch.int64
                ).pin_memory()
            host = self._tokens_host[slot][: tokens_dev.numel()]
            host.copy_(tokens_dev, non_blocking=True)
            event = self._event()
        self.alloc.mark_in_flight(event)
        self._launches += 1
        return Launched(batch, logits, tokens_dev, host, event, logprobs)

    def _event(self):
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def sample(self, batch: Batch, logits: torch.Tensor, prev_tokens=None):
        """(B,) int64 next tokens and the step's logprobs (a StepLogprobs or None).
        All-plain-greedy batches (known on the host) are one argmax; others go
        through ``logits.sample_requests`` (penalties, min_tokens, min_p, logprobs;
        placeholders in the outputs read from ``prev_tokens`` on the device)."""
        reqs = batch.requests
        if all(r.plain_greedy for r in reqs):
            return logits.argmax(dim=-1), None
        return sample_requests(reqs, logits, prev_tokens, pin=self._pin)
