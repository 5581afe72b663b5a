"""Prefill/decode disaggregation: one instance prefills, another decodes.

Two ``LLM`` instances of the same checkpoint and options, on two ranks of a
torch.distributed group (NCCL between GPUs, gloo on CPU). The prefill rank
runs its scheduler with decodes held back: as soon as a request has sampled
its first token it leaves the prefill scheduler and is handed off:

    P -> D   hello: page size, max context, model facts      (once; both check)
    per prefill step that completed requests:
    P -> D   header: each request's tokens (prompt + first sampled token),
             num_cached, sampling params and seed, and per sub-pool the page
             columns it still holds (SWA: only the pages inside the window;
             hybrid models: the recurrent-state slot as one more "page")
    D        opens a request slot, a state slot (hybrid models) and allocates
             num_cached tokens in its own pool (alloc_extend, then
             free_out_of_window: the same rule leaves the same SWA columns
             bound), so the virtual and physical ids are its own; a request
             that does not fit is queued for recompute
    D -> P   accept mask (or D's error: both raise)
    P -> D   send_pages / recv_pages: every accepted request's pages, one
             envelope per page (all layers), per sub-pool in request order;
             handshake on spec fingerprints, per-page checksums
    P        frees the handed-off requests' pages
    D        runs one decode step (overlapping P's next prefill step)
    P -> D   {"done": true}; D decodes the rest and returns the outputs

Greedy or seeded sampling gives the tokens of a single instance: the decode
side continues from the same cache bytes, tokens and seeds. This file holds
the wire helpers and ``PrefillWorker``; ``disagg_decode.py`` the
``DecodeWorker``. The handoff path syncs the host (it is I/O, not the
per-step forward path of either instance).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
import torch.distributed as dist

from unikv.engine.llm import LLM
from unikv.engine.request import Request, Status
from unikv.engine.sampling import SamplingParams
from unikv.ids import PhysicalPageIds
from unikv.io.transfer import exchange_json, recv_json, send_json, send_pages


def _device(llm: LLM, group) -> torch.device:
    """NCCL sends device tensors; every other backend sends host tensors."""
    return llm.device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _hello(llm: LLM) -> dict:
    c = llm.config
    return {
        "architecture": c.architecture,
        "vocab_size": c.vocab_size,
        "num_layers": c.num_layers,
        "max_model_len": llm.max_model_len,
        "page_sizes": {n: s.page_size for n, s in llm.pool.subpools.items()},
    }


def _agree(llm: LLM, peer: int, group, device, *, first: bool) -> None:
    """Exchange ``_hello`` facts; both sides raise alike unless they match."""
    ours = _hello(llm)
    theirs = exchange_json(ours, peer, group, device, first=first)
    if ours != theirs:
        diff = {k: (ours[k], theirs.get(k)) for k in ours if ours[k] != theirs.get(k)}
        raise ValueError(
            f"prefill and decode instances differ (this side, rank {peer}): {diff}; build both "
            "LLMs from the same checkpoint with the same page_size and max_model_len"
        )


def _meta(r: Request, index: int, pages: dict) -> dict:
    params = dataclasses.asdict(r.params)
    params["stop_token_ids"] = list(params["stop_token_ids"])
    return {
        "index": index,
        "prompt_ids": r.prompt_ids,
        "output_ids": r.output_ids,
        "num_cached": r.num_cached,
        "params": params,
        "seed": r.seed,
        "stop_ids": sorted(r.stop_ids),
        "finish_reason": r.finish_reason,
        "num_preemptions": r.num_preemptions,
        "pages": {name: cols.tolist() for name, (cols, _) in pages.items()},
    }


@dataclasses.dataclass
class HandoffStats:
    """What a prefill rank handed off."""

    num_requests: int = 0
    num_handoffs: int = 0
    pages: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes: int = 0
    transfer_seconds: float = 0.0


class PrefillWorker:
    """The prefill instance: ``run(prompts, params)`` prefills every prompt on
    ``llm`` and hands each request to the decode rank ``dst`` (a
    :class:`DecodeWorker` on the same ``group``)."""

    def __init__(self, llm: LLM, dst: int, *, group=None) -> None:
        if llm.prefix_caching and llm.scheduler.has_window:
            raise ValueError(
                "a prefill instance of a sliding-window model needs "
                "prefix caching off: its requests keep their cached prompt pages in the window "
                "sub-pools, where the decode instance's window rule expects only the window; "
                "build the prefill LLM with enable_prefix_caching=False (the default for it)"
            )
        self.llm, self.dst, self.group = llm, dst, group
        self.device = _device(llm, group)

    def run(self, prompts, sampling_params: SamplingParams | list | None = None) -> HandoffStats:
        """Prompts and params as ``LLM.generate`` takes them (validated before
        any message). Returns once the decode rank has every request."""
        llm, sched = self.llm, self.llm.scheduler
        requests = llm.make_requests(prompts, sampling_params)
        index = {r.request_id: i for i, r in enumerate(requests)}
        _agree(llm, self.dst, self.group, self.device, first=True)
        stats = HandoffStats(pages={name: 0 for name in llm.pool.subpools})
        for r in requests:
            sched.add(r)
        while sched.has_work():
            batch = sched.schedule()
            tokens, _ = llm.runner.step(batch)
            finished = sched.complete(batch, tokens)
            ready = [r for r in batch.requests if r.status is Status.RUNNING and r.output_ids]
            for r in ready:  # prefilled: no decode step here
                sched.running.remove(r)
            if ready or finished:
                self._hand_off(ready + finished, index, stats)
        send_json({"done": True}, self.dst, self.group, self.device)
        return stats

    def _hand_off(self, reqs: list[Request], index: dict, stats: HandoffStats) -> None:
        alloc = self.llm.alloc
        held = {r.request_id: alloc.request_pages(r.slot) for r in reqs if r.slot is not None}
        metas = [_meta(r, index[r.request_id], held.get(r.request_id, {})) for r in reqs]
        send_json({"requests": metas}, self.dst, self.group, self.device)
        reply = recv_json(self.dst, self.group, self.device)
        if "error" in reply:
            raise ValueError(f"decode rank {self.dst} refused the requests: {reply['error']}")
        sent = [r for r, ok in zip(reqs, reply["accept"]) if ok]
        try:
            if sent:
                self._send(sent, held, stats)
        finally:  # handed off (or failed on both sides): the pages are not ours any more
            holders = [r for r in reqs if r.slot is not None]
            if holders:  # one free for all (one table write)
                alloc.free_request(np.array([r.slot for r in holders], np.int64))
            for r in holders:
                r.slot, r.status = None, Status.FINISHED
        stats.num_requests += len(reqs)
        stats.num_handoffs += 1

    def _send(self, sent: list[Request], held: dict, stats: HandoffStats) -> None:
        """One send_pages of every accepted request's pages (and state slots), per
        sub-pool in order."""
        pages = {
            name: np.concatenate([held[r.request_id][name][1] for r in sent])
            for name in self.llm.pool.subpools
        }
        start = time.perf_counter()
        send_pages(self.llm.pool, _page_ids(pages), self.dst, group=self.group)
        stats.transfer_seconds += time.perf_counter() - start
        for name, data in pages.items():
            stats.pages[name] += len(data)
            stats.bytes += len(data) * self.llm.pool[name].page_bytes


def _page_ids(pages: dict[str, np.ndarray]) -> dict[str, PhysicalPageIds]:
    return {n: PhysicalPageIds(torch.from_numpy(p.astype(np.int64)), n) for n, p in pages.items()}
