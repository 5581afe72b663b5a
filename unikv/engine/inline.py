"""``LLM.generate`` on the engine loop in the caller's thread, with its counters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Stats:
    """Counters of the last ``generate`` call."""

    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    steps: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    seconds: float = 0.0
    peak_pages: dict[str, int] = field(default_factory=dict)
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache
    prefix_query_tokens: int = 0  # prompt tokens looked up in it
    prefix_evicted_pages: int = 0
    prefix_host_hit_tokens: int = 0  # hit tokens reloaded from the host tier
    prefix_host_spilled_pages: int = 0
    prefix_host_reloaded_pages: int = 0
    prefix_host_evicted_pages: int = 0
    swapped_out: int = 0  # preempted requests swapped to the host tier (not recomputed)
    swapped_in: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    spec_verify_steps: int = 0  # speculative decoding: steps that verified drafts
    spec_draft_tokens: int = 0  # drafts scored
    spec_accepted_tokens: int = 0  # drafts accepted
    spec_emitted_tokens: int = 0  # tokens the verify steps emitted (accepted + bonus)
    spec_verify_requests: int = 0  # (request, verify step) pairs
    spec_draft_seconds: float = 0.0  # host time proposing drafts
    spec_ahead_steps: int = 0  # verify steps planned ahead of the one in flight (pipeline)
    spec_ahead_dropped: int = 0  # of those, thrown away (a request finished or ended)
    spec_head_hole_rows: int = 0  # a lazy head's rows past the rule left as holes (zeroed)
    spec_head_hole_hits: int = 0  # admissions whose prefix hit holds such rows

    @property
    def spec_acceptance_rate(self) -> float:
        """Drafts accepted / drafts scored (0 when none was scored)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a request emits per verify step (accepted drafts + the bonus)."""
        n = self.spec_verify_requests
        return self.spec_emitted_tokens / n if n else 0.0

    @property
    def spec_draft_time_share(self) -> float:
        """Host time proposing drafts / the call's wall time."""
        return self.spec_draft_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


PREFIX_COUNTERS = (
    "hit_tokens",
    "query_tokens",
    "evicted_pages",
    "host_hit_tokens",
    "host_spilled_pages",
    "host_reloaded_pages",
    "host_evicted_pages",
)


def run_inline(loop, groups, use_tqdm: bool, on_step=None) -> Stats:
    """Run ``groups`` (RequestGroups) on the engine loop ``loop`` in this thread until
    no work is left; returns the run's Stats. ``on_step(loop.owner, batch, logits)``
    after every step."""
    core = loop.core
    requests = [r for g in groups for r in g.requests]
    stats = Stats(
        num_requests=len(requests), prompt_tokens=sum(len(r.prompt_ids) for r in requests)
    )
    stats.peak_pages = {name: 0 for name in core.pool.subpools}
    sched = core.scheduler
    preempted_before = sched.num_preemptions
    prefix_before = core.alloc.prefix.counters()
    swap_before = sched.swap.counters() if sched.swap is not None else {}
    spec_before = sched.spec.counters.as_dict() if sched.spec is not None else {}
    bar = None
    if use_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=sum(r.max_new_tokens for r in requests), unit="tok", desc="generate")
    for g in groups:
        loop.submit(g, bounded=False)
    loop.on_step, loop.on_schedule = on_step, lambda batch: _track_pages(core, stats)
    start = time.perf_counter()
    try:
        while (step := loop.step()) is not None:
            batch, _, finished = step
            made = sched.num_appended
            stats.steps += 1
            stats.decode_steps += batch.is_decode
            stats.output_tokens += made
            if bar is not None:
                bar.update(made + sum(r.max_new_tokens - len(r.output_ids) for r in finished))
    finally:
        loop.on_step = loop.on_schedule = None
    stats.seconds = time.perf_counter() - start
    stats.preemptions = sched.num_preemptions - preempted_before
    prefix = core.alloc.prefix.counters()
    for key, value in (sched.swap.counters() if sched.swap is not None else {}).items():
        name = key.removeprefix("swap_")
        if hasattr(stats, name):
            setattr(stats, name, value - swap_before.get(key, 0))
    for key, value in (sched.spec.counters.as_dict() if sched.spec is not None else {}).items():
        if hasattr(stats, f"spec_{key}"):
            setattr(stats, f"spec_{key}", value - spec_before[key])
    for key in PREFIX_COUNTERS:  # the host tier's are there when one is attached
        if key in prefix:
            setattr(stats, f"prefix_{key}", prefix[key] - prefix_before.get(key, 0))
    if bar is not None:
        bar.close()
    return stats


def _track_pages(core, stats: Stats) -> None:
    for name in core.pool.subpools:
        stats.peak_pages[name] = max(stats.peak_pages[name], core.alloc.view.live_pages(name))
