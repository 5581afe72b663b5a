"""Hypothesis stateful runs of the scheduler and the allocator together (issue 37):
a tiny pool, the smallest that starts or a page or two more, prefix caching on,
with or without the host tier behind it (reload forced), swap or recompute
preemption, sliding windows and recurrent state. No model: a stand-in forward
writes, for every new token, a value that names its whole prefix into its K row
through the step's write ids, and advances the request's state slot the same
way. Before each launch the machine checks:

- each sub-pool's block table of the step equals a table built from the
  allocator's state at launch time (``PoolAllocator.block_table``, one launch of
  its own): a batch whose tables predate a page move is caught here (R5);
- every key the step's queries read, followed through the step's table, holds
  the value of its own prefix (a row read through a stale or wrong page, a swap
  or reload that restored other bytes, cannot look right);
- the state slot of each request holds its prefix's value (zeros for a fresh
  one): checkpoints and swap restore exactly what was saved;

and after every step ``check_integrity()`` (debug mode) and the swap space's own
invariants. The sampled token is a function of the prefix, so every schedule
gives each request the same tokens: the machine checks that too.
"""

from __future__ import annotations

from collections import Counter

import torch
from allocator_fixtures import full_config, mamba_config
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from unikv.allocator import PoolAllocator
from unikv.engine.plan import StepPlanner
from unikv.engine.request import Request, Status
from unikv.engine.sampling import SamplingParams
from unikv.engine.scheduler import Scheduler
from unikv.kernels.backend import get_backend
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

VOCAB, MOD = 50, 1_000_003  # prefix values stay below 2**24: exact in fp32
MAX_LEN, CHUNK, SEQS = 24, 6, 4
COVERAGE: Counter = Counter()  # what the runs went through (read by the coverage test)
BASES = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [3, 1, 4, 1, 5, 9, 7, 7, 7, 7], [11] * 12]


def _swa(ps: int, window: int) -> SubPoolConfig:
    return SubPoolConfig(
        "swa", MHASpec(1, 1, 2, dtype=torch.float32, sliding_window=window), page_size=ps
    )


CHAINS = {  # name -> (page size) -> configs
    "full": lambda ps: [full_config(ps)],
    "full+swa": lambda ps: [full_config(ps), _swa(ps, 6)],
    "swa": lambda ps: [_swa(ps, 5)],
    "full+mamba": lambda ps: [full_config(ps), mamba_config()],
    "full+swa+mamba": lambda ps: [full_config(ps), _swa(ps, 7), mamba_config()],
}


def prefix_values(tokens: list[int]) -> list[int]:
    """values[t]: a hash of tokens[0..t] (the stand-in forward's key row at t)."""
    out, h = [], 0
    for tok in tokens:
        h = (h * 31 + tok + 1) % MOD
        out.append(h)
    return out


def smallest_pages(configs: list[SubPoolConfig], ps: int) -> dict[str, int]:
    """Pages per sub-pool of the smallest pool that places one request of MAX_LEN
    tokens (the scheduler's start-up condition), every sub-pool sized for the whole
    request (more than a window needs since issue 41: a request holds only its
    window, cache on)."""
    need = {c.name: 2 if c.spec.kind == "mamba" else -(-MAX_LEN // ps) + 1 for c in configs}
    return need


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        chain=st.sampled_from(sorted(CHAINS)),
        ps=st.sampled_from([1, 2, 4]),
        slack=st.integers(0, 2),
        host=st.sampled_from([True, True, False]),
        swap=st.sampled_from(["recompute", "swap"]),
    )
    def build(self, chain, ps, slack, host, swap):
        configs = CHAINS[chain](ps)
        pages = {n: k + (slack if k > 2 else 0) for n, k in smallest_pages(configs, ps).items()}
        pool = UnifiedPool(
            configs,
            pool_bytes_for(configs, pages),
            max_request_tokens=MAX_LEN,
            chunk_tokens=CHUNK,
        )
        self.pool, self.ps = pool, ps
        backend = get_backend(pool.device, "torch")
        self.alloc = PoolAllocator(
            pool, max_requests=SEQS, max_context=MAX_LEN, debug=True, backend=backend
        )
        self.planner = StepPlanner(self.alloc, backend, max_seqs=SEQS, max_tokens=CHUNK, q_per_kv=1)
        swap_space = None
        if swap == "swap":
            from unikv.io.swap import SwapPolicy, build_swap_space

            swap_space = build_swap_space(self.alloc, 64 * pool.total_bytes, SwapPolicy("swap"))
        self.sched = Scheduler(
            self.alloc,
            pool.subpools.values(),
            max_num_seqs=SEQS,
            max_num_batched_tokens=CHUNK,
            tables=self.planner.tables,
            prefix_caching=True,
            swap=swap_space,
        )
        if host:
            from unikv.io.prefix_host import ReloadPolicy
            from unikv.io.prefix_host_setup import enable_prefix_host

            token = sum(s.page_bytes for s in pool.subpools.values() if s.spec.kind != "mamba")
            state = [s.page_bytes for s in pool.subpools.values() if s.spec.kind == "mamba"]
            enable_prefix_host(self.alloc, 6 * token + 4 * sum(state), ReloadPolicy(mode="always"))
        self.windows = {n: s.spec.sliding_window or 0 for n, s in pool.subpools.items()}
        self.tokens = {n: s for n, s in pool.subpools.items() if s.spec.kind != "mamba"}
        self.mamba = next((s for s in pool.subpools.values() if s.spec.kind == "mamba"), None)
        self.requests: list[Request] = []
        self.expected: dict[int, list[int]] = {}  # request id -> its full token list
        self.next_id = 0
        self.steps = self.decode_only = 0

    # -- rules -----------------------------------------------------------------------

    @precondition(lambda self: len(self.sched.waiting) + len(self.sched.running) < 8)
    @rule(
        base=st.sampled_from(range(len(BASES))),
        cut=st.integers(3, 14),
        tail=st.lists(st.integers(0, VOCAB - 1), max_size=4),
        new=st.integers(1, 8),
    )
    def add(self, base, cut, tail, new):
        prompt = (BASES[base][:cut] + tail)[: MAX_LEN - 1]
        params = SamplingParams(max_tokens=new, temperature=0)
        r = Request(self.next_id, prompt, params, 0, frozenset(), MAX_LEN)
        self.next_id += 1
        self.requests.append(r)
        self.expected[r.request_id] = self._continue(prompt, r.max_new_tokens)
        self.sched.add(r)

    @precondition(lambda self: self.sched.has_work())
    @rule()
    def step(self):
        sched, alloc = self.sched, self.alloc
        batch = sched.schedule()
        plan = self.planner.plan(batch)
        num = len(batch.requests)
        self.decode_only += batch.step is not None and batch.tables is not None
        starts = [r.num_cached for r in batch.requests]
        self._check_tables(batch, plan)
        row = 0
        for i, (r, n) in enumerate(zip(batch.requests, batch.num_new)):
            values = prefix_values(r.token_slice(0, starts[i] + n))
            for name, sub in self.tokens.items():
                ids = plan.subpools[name].write_ids.data[row : row + n].long()
                sub.views[0][0][ids] = torch.tensor(values[starts[i] :], dtype=torch.float32)[
                    :, None, None
                ]
            self._check_keys(r, i, plan, values, starts[i] + n)
            if self.mamba is not None:
                ckpt = int(plan.ckpt_slots[i]) if plan.ckpt_slots is not None else 0
                at = int(plan.ckpt_at[i]) if plan.ckpt_at is not None else -1
                self._check_state(r, int(plan.state_slots[i]), values, starts[i], n, ckpt, at)
            row += n
        assert row == plan.input_ids.shape[0] == sum(batch.num_new)
        alloc.mark_in_flight()
        tokens = []
        for i, r in enumerate(batch.requests):
            values = prefix_values(r.token_slice(0, starts[i] + batch.num_new[i]))
            tokens.append(values[-1] % VOCAB)
        sched.complete(batch, tokens)
        self.steps += 1
        assert num == len(tokens)

    @precondition(lambda self: self.sched.running or self.sched.waiting)
    @rule(data=st.data())
    def abort(self, data):
        live = [r for r in self.requests if r.status is not Status.FINISHED]
        r = data.draw(st.sampled_from(live))
        self.sched.finish(r, "abort")
        self.expected[r.request_id] = None  # its outputs stop anywhere

    @precondition(lambda self: not self.sched.running)
    @rule()
    def idle_compact(self):
        self.alloc.compact()

    # -- checks --------------------------------------------------------------------------

    @invariant()
    def integrity(self):
        if not hasattr(self, "alloc"):
            return
        self.alloc.check_integrity()
        if self.sched.swap is not None:
            self.sched.swap.check_integrity()
        for r in self.requests:
            want = self.expected[r.request_id]
            if want is not None:  # the same tokens whatever the schedule
                assert r.output_ids == want[: len(r.output_ids)], "tokens"

    def _continue(self, prompt: list[int], count: int) -> list[int]:
        """The stand-in model's greedy continuation of ``prompt``."""
        tokens = list(prompt)
        for _ in range(count):
            tokens.append(prefix_values(tokens)[-1] % VOCAB)
        return tokens[len(prompt) :]

    def _check_tables(self, batch, plan) -> None:
        """The step's tables equal tables built from the allocator now."""
        num = len(batch.requests)
        slots = torch.tensor([r.slot for r in batch.requests], dtype=torch.int32)
        lens = torch.tensor(
            [r.num_cached + n for r, n in zip(batch.requests, batch.num_new)], dtype=torch.int32
        )
        max_q = max(batch.num_new)
        for name in self.tokens:
            table = plan.subpools[name].block_table[:num]
            fresh = torch.full_like(table, -7)
            window = self.windows[name] + (max_q - 1 if self.windows[name] else 0)
            self.alloc.block_table(slots, lens, name, fresh, window=window)
            assert torch.equal(table, fresh), f"{name}: the step's block table is the allocator's"

    def _check_keys(self, r: Request, i: int, plan, values: list[int], end: int) -> None:
        """Every key the request's queries read this step holds its prefix's value."""
        ps = self.ps
        for name, sub in self.tokens.items():
            window = self.windows[name]  # the first query (position num_cached) reads from
            lo = max(0, r.num_cached + 1 - window) if window else 0
            positions = torch.arange(lo, end)
            entries = plan.subpools[name].block_table[i, positions // ps].long()
            assert (entries > 0).all(), f"{name}: a key the step reads is on the sink"
            kid = entries * ps + positions % ps
            got = sub.views[0][0][kid][:, 0, 0]
            want = torch.tensor(values[lo:end], dtype=torch.float32)
            assert torch.equal(got, want), f"{name}: keys read through the table are the prefix's"

    def _check_state(
        self, r: Request, slot: int, values, start: int, n: int, ckpt=0, at=-1
    ) -> None:
        """The state slot holds the prefix's value before the step; then it advances,
        and the plan's checkpoint slot ``ckpt``, when it names one, takes the value after
        row ``at`` (-1: the last; issue 41: the chunk that reaches a checkpoint writes
        it, at its end or inside it, as the recurrent ops do)."""
        state = self.mamba.views["temporal"][0, slot]
        want = float(values[start - 1]) if start else 0.0
        assert slot > 0, "a running request holds a state slot"
        assert float(state[0]) == want, "the state slot holds its prefix's state"
        state[0] = float(values[start + n - 1])
        if ckpt:
            COVERAGE["chunk_written_checkpoints"] += 1
            COVERAGE["inside_chunk_checkpoints"] += at >= 0
            row = n - 1 if at < 0 else at
            self.mamba.views["temporal"][0, ckpt][0] = float(values[start + row])

    def teardown(self):
        if not hasattr(self, "alloc"):
            return
        COVERAGE["runs"] += 1
        COVERAGE["steps"] += self.steps
        if self.steps > 3:
            # drain: every request runs to its end with the same tokens
            for _ in range(400):
                if not self.sched.has_work():
                    break
                self.step()
            assert not self.sched.has_work(), "the scheduler drains"
            self.integrity()
        prefix = self.alloc.prefix.counters()
        COVERAGE["preemptions"] += self.sched.num_preemptions
        COVERAGE["hit_tokens"] += prefix.get("hit_tokens", 0)
        COVERAGE["host_reloaded_pages"] += prefix.get("host_reloaded_pages", 0)
        COVERAGE["checkpoints"] += prefix.get("checkpoints", 0)
        COVERAGE["decode_only_steps"] += self.decode_only
        if self.sched.swap is not None:
            COVERAGE["swapped_in"] += self.sched.swap.stats.swapped_in


SchedulerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: minutes on a failure
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_scheduler_and_allocator = SchedulerMachine.TestCase
