"""The decode side of prefill/decode disaggregation (protocol: ``disagg.py``).

A handed-off request gets fresh ids here: a request slot, virtual pages from
this instance's allocator and physical pages of this pool (``alloc_extend``
of its cached tokens, then ``free_out_of_window``). Only then are the page
destinations read, in one pass after every request of the handoff was
admitted, because an allocation may compact and move earlier pages.
"""

from __future__ import annotations

import numpy as np

from unikv.engine.disagg import (
    _agree,
    _device,
    _page_ids,
)
from unikv.engine.llm import LLM, RequestOutput
from unikv.engine.request import Request, Status
from unikv.engine.sampling import SamplingParams
from unikv.io.transfer import recv_json, recv_pages, send_json


class DecodeWorker:
    """The decode instance: ``run()`` receives requests from the prefill rank
    ``src`` (a ``PrefillWorker`` on the same ``group``) into ``llm``'s own pool
    and decodes them to the end. A request that does not fit when it arrives
    is queued and prefilled again here (recompute), as after a preemption."""

    def __init__(self, llm: LLM, src: int, *, group=None) -> None:
        self.llm, self.src, self.group = llm, src, group
        self.device = _device(llm, group)
        self.num_recomputed = 0

    def run(self) -> list[RequestOutput]:
        """Outputs of every request the prefill rank handed off, in its prompt order."""
        sched = self.llm.scheduler
        _agree(self.llm, self.src, self.group, self.device, first=False)
        received: dict[int, Request] = {}
        while True:
            message = recv_json(self.src, self.group, self.device)
            if message.get("done"):
                break
            self._receive(message["requests"], received)
            if sched.has_work():  # overlaps the prefill rank's next step
                self._step()
        while sched.has_work():
            self._step()
        return [self.llm.output_of(received[i]) for i in sorted(received)]

    def _step(self) -> None:
        batch = self.llm.scheduler.schedule()
        tokens, _ = self.llm.runner.step(batch)
        self.llm.scheduler.complete(batch, tokens)

    def _request(self, meta: dict) -> Request:
        """A Request in the prefill rank's state: its tokens, seed and stop ids."""
        llm = self.llm
        params = dict(meta["params"], stop_token_ids=tuple(meta["params"]["stop_token_ids"]))
        r = Request(
            llm.requests.take_id(),
            list(meta["prompt_ids"]),
            SamplingParams(**params),
            meta["seed"],
            frozenset(meta["stop_ids"]),
            llm.max_model_len,
        )
        r.output_ids = list(meta["output_ids"])
        r.finish_reason, r.num_preemptions = meta["finish_reason"], meta["num_preemptions"]
        return r

    def _receive(self, metas: list[dict], received: dict[int, Request]) -> None:
        """One handoff: admit, reply with the accept mask, receive the pages."""
        try:
            reqs = [self._request(m) for m in metas]
        except (KeyError, TypeError, ValueError) as e:
            send_json({"error": f"{type(e).__name__}: {e}"}, self.src, self.group, self.device)
            raise
        slots = [self._admit(r, m["num_cached"]) for r, m in zip(reqs, metas)]
        accept = [slot is not None for slot in slots]
        send_json({"accept": accept}, self.src, self.group, self.device)
        if any(accept):
            dst = self._destinations(slots, metas)
            try:
                recv_pages(self.llm.pool, _page_ids(dst), self.src, group=self.group)
            except Exception:
                for r, ok in zip(reqs, accept):
                    if ok:
                        self._drop(r)
                raise
        for r, m in zip(reqs, metas):
            received[m["index"]] = r

    def _admit(self, r: Request, num_cached: int) -> int | None:
        """Open a slot holding ``num_cached`` tokens for ``r`` and run it (its slot),
        or queue it for recompute, or record it finished (None)."""
        sched, alloc = self.llm.scheduler, self.llm.alloc
        if r.finish_reason is not None:
            r.status = Status.FINISHED
            return None
        ids = None
        if len(sched.running) < sched.max_num_seqs:  # running requests hold every slot
            slot = alloc.new_request()
            state = not sched.has_state or alloc.alloc_mamba(np.array([slot])) is not None
            if state:
                ids = alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([num_cached]))
            if ids is None:
                alloc.free_request(slot)
        if ids is None:  # no room now: prefill it again here later
            self.num_recomputed += 1
            sched.add(r)
            return None
        if sched.has_window:
            alloc.free_out_of_window(np.array([slot]), np.array([num_cached]))
        r.slot, r.num_cached, r.status = slot, num_cached, Status.RUNNING
        sched.running.append(r)
        return slot

    def _destinations(self, slots: list, metas: list[dict]) -> dict[str, np.ndarray]:
        """Physical destination pages (and state slots) per sub-pool, accepted
        requests in order."""
        dst = {name: [] for name in self.llm.pool.subpools}
        for slot, meta in zip(slots, metas):
            if slot is None:
                continue
            for name, (cols, physical) in self.llm.alloc.request_pages(slot).items():
                assert cols.tolist() == meta["pages"][name], (
                    f"disagg invariant: both instances hold the same columns of {name!r} (one "
                    f"window rule), got {cols.tolist()} here, {meta['pages'][name]} there"
                )
                dst[name].append(physical)
        return {name: np.concatenate(pages) for name, pages in dst.items()}

    def _drop(self, r: Request) -> None:
        self.llm.scheduler.running.remove(r)
        self.llm.alloc.free_request(r.slot)
        r.slot, r.status = None, Status.WAITING
