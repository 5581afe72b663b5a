"""Hypothesis stateful runs of the prefix cache over a tight full-attention +
Mamba pool (page sizes 1 and 4; issue 17): requests sharing prefixes open with
a hit (``match -> new_request(prefix=hit)``), restore their state slot in a
later rule (``alloc_mamba``: the checkpoint stays pinned meanwhile), prefill in
chunks that end at page boundaries, checkpoint there (``prefix.checkpoint``),
decode, free; compaction, forward fences, and a pool small enough that cached
pages and checkpoints are evicted. After every rule, ``check_integrity()`` and:

- a restored slot holds exactly the bytes checkpointed for its prefix (a shadow
  dict keyed by the prefix tokens, filled when the checkpoint was taken); a
  miss starts from zeros;
- a checkpoint's bytes never change while it exists; no checkpoint slot is a
  live request's slot; a pinned checkpoint (restore pending) is never evicted;
- every live request's slot holds the last state it wrote;
- a decode that completes a page checkpoints there only where the cost rule
  (``engine/checkpoint_rule.py``; a copy worth 0.5 tokens of prefill at page 1, 1.5
  at page 4) says so, from the tokens since the request's previous checkpoint and
  its chance to end there; each checkpoint records the length of the prefix it was taken after
  (``position``), and a corrupted one is caught (``test_a_misplaced_...``);
- the pool fractions the cost rule weighs (``PrefixCaching.pool_fractions``: the
  checkpoints' and the running requests' bytes, from the books' counters) equal the
  shadow's: its checkpoints, and each live request's uncached pages and state slot read
  from the request table (``test_a_slot_counted_twice_...``: an off count is caught).

Each "prefill" chunk writes values used once (a counter) through the pool's
Mamba views, so a slot read through the wrong id cannot look right.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import FakeEvent, full_config, mamba_config, same_start
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_prefix_cache_stateful import BASES, FenceRules, derandomized

from unikv.allocator import PoolAllocator
from unikv.engine.checkpoint_rule import CheckpointRule
from unikv.engine.prefix_policy import PrefixCaching
from unikv.pool import UnifiedPool, pool_bytes_for

CONTEXT = 24
PROMPTS = st.builds(
    lambda base, cut, tail: (base[:cut] + tail)[:20],
    st.sampled_from(BASES),
    st.integers(4, 12),
    st.lists(st.integers(0, 3), max_size=3),
)


class HybridMachine(FenceRules, RuleBasedStateMachine):
    PS = 4

    def __init__(self) -> None:
        super().__init__()
        configs = [full_config(self.PS), mamba_config()]
        pages = {"full": 20 // self.PS + 4, "mamba": 4}
        self.pool = UnifiedPool(configs, pool_bytes_for(configs, pages))
        self.alloc = PoolAllocator(self.pool, max_requests=4, max_context=CONTEXT, debug=True)
        self.prefix = self.alloc.parts.prefix
        self.states = self.prefix.states
        self.book = self.alloc.parts.books["mamba"]
        self.prompt: dict[int, list[int]] = {}  # request -> its prompt (then decoded tokens)
        self.held: dict[int, int] = {}  # request -> tokens allocated (prefilled)
        self.key: dict[int, tuple[int, ...]] = {}  # request -> the prefix its hit covers
        self.state: dict[int, torch.Tensor | None] = {}  # request -> its slot's bytes (None: none)
        self.shadow: dict[tuple[int, ...], torch.Tensor] = {}  # prefix tokens -> checkpoint bytes
        self.counter = 1
        self.event: FakeEvent | None = None
        self.hits = self.misses = 0
        self.since: dict[int, int] = {}  # request -> tokens of its latest checkpoint or hit
        self.decisions = [0, 0]  # decode boundaries declined, taken by the rule
        self.policy = PrefixCaching(self.alloc, has_state=True, has_window=False)

    # -- helpers ------------------------------------------------------------------

    def _phys(self, slot: int) -> int:
        return int(self.alloc.mamba_slots(torch.tensor([slot])).data[0])

    def _bytes(self, phys: int) -> torch.Tensor:
        return self.pool.page_envelope("mamba", phys).clone()

    def _write_state(self, slot: int) -> None:
        """The "prefill" of a chunk: values used once into every state part (views)."""
        phys = self._phys(slot)
        for view in self.pool["mamba"].views.values():
            part = view[:, phys]
            part.copy_(torch.arange(part.numel(), dtype=part.dtype).view_as(part) + self.counter)
            self.counter += part.numel()
        self.state[slot] = self._bytes(phys)

    def _node(self, key: tuple[int, ...]) -> int | None:
        """The node of ``key``'s checkpoint, or None: a hit covers all of it only then."""
        hit = self.alloc.prefix.match(np.array(key, np.int64))
        return int(hit.nodes[-1]) if key and hit.num_tokens == len(key) else None

    def _ckpt_phys(self, node: int) -> int:
        return int(self.book.v2p_host[self.states.by_node[node]])

    # -- rules --------------------------------------------------------------------

    @initialize()
    def served_chains(self):
        """Every example starts with each base's first 12 tokens served and finished:
        cached pages and a checkpoint at each page boundary, so its admissions hit,
        restore and evict whatever the generated sequence (the coverage checks below
        do not hang on the seed). It draws nothing, so every example's start is the
        same: served once per machine class, with its debug-mode checks, and forked
        into each later one (``same_start``)."""
        same_start(self, self._serve_chains)

    def _serve_chains(self) -> None:
        for base in BASES:
            slot = self._admit(base[:12])
            if self._restore(slot):
                for stop in range(self.PS, 13, self.PS):
                    if stop > self.held[slot] and not self._prefill(slot, stop, save=True):
                        break
            self._free(slot)

    @precondition(lambda self: len(self.prompt) < 4)
    @rule(prompt=PROMPTS)
    def admit(self, prompt):
        self._admit(prompt)

    @precondition(lambda self: len(self.prompt) < 4)
    @rule(prompt=PROMPTS)
    def serve(self, prompt):
        """Admit, restore and prefill to the end, checkpointing at the engine's points."""
        slot = self._admit(prompt)
        if not self._restore(slot):
            return
        for stop in ((len(prompt) - 1) // self.PS * self.PS, len(prompt)):
            if stop > self.held[slot] and not self._prefill(slot, stop, save=True):
                return

    @precondition(lambda self: any(s is None for s in self.state.values()))
    @rule(data=st.data())
    def restore(self, data):
        self._restore(
            data.draw(st.sampled_from(sorted(s for s, v in self.state.items() if v is None)))
        )

    def _admit(self, prompt: list[int]) -> int:
        hit = self.alloc.prefix.match(np.array(prompt[:-1]))
        slot = self.alloc.new_request(prefix=hit)
        key = tuple(prompt[: hit.num_tokens])
        assert not key or key in self.shadow, f"a hit of {key} with no checkpoint taken"
        self.prompt[slot], self.held[slot], self.key[slot] = list(prompt), hit.num_tokens, key
        self.since[slot] = hit.num_tokens
        self.state[slot] = None
        return slot

    def _restore(self, slot: int) -> bool:
        if self.alloc.alloc_mamba(np.array([slot])) is None:
            return False  # no room: it waits, its checkpoint stays pinned
        got, key = self._bytes(self._phys(slot)), self.key[slot]
        if key:
            assert torch.equal(got, self.shadow[key]), f"restore of {key}: not its checkpoint"
            self.hits += 1
        else:
            assert not got.any(), "a miss starts from a zeroed state slot"
            self.misses += 1
        self.state[slot] = got
        return True

    @precondition(
        lambda self: any(
            v is not None and self.held[s] < len(self.prompt[s]) for s, v in self.state.items()
        )
    )
    @rule(data=st.data(), pages=st.integers(1, 3), save=st.booleans())
    def prefill(self, data, pages, save):
        ready = [s for s, v in self.state.items() if v is not None]
        slot = data.draw(
            st.sampled_from(sorted(s for s in ready if self.held[s] < len(self.prompt[s])))
        )
        stop = min((self.held[slot] // self.PS + pages) * self.PS, len(self.prompt[slot]))
        self._prefill(slot, stop, save)

    def _prefill(self, slot: int, stop: int, save: bool) -> bool:
        """Allocate and "prefill" request ``slot`` to ``stop`` tokens; False: no room."""
        held = self.held[slot]
        args = np.array([slot]), np.array([held]), np.array([stop - held])
        if self.alloc.alloc_extend(*args) is None:
            return False
        self.held[slot] = stop
        self._write_state(slot)  # the state after exactly prompt[:stop]
        if save and stop % self.PS == 0:
            self._checkpoint(slot, tuple(self.prompt[slot][:stop]))
        return True

    def _checkpoint(self, slot: int, key: tuple[int, ...]) -> None:
        self.alloc.prefix.insert(slot, np.array(key))
        existed = self._node(key) is not None
        if self.alloc.prefix.checkpoint(slot, np.array(key)):
            assert self._node(key) is not None, f"checkpoint of {key} taken but not matched"
            self.since[slot] = len(key)
            if not existed:
                self.shadow[key] = self.state[slot].clone()

    @precondition(
        lambda self: any(
            v is not None and self.held[s] == len(self.prompt[s]) < CONTEXT
            for s, v in self.state.items()
        )
    )
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        done = [s for s, v in self.state.items() if v is not None]
        slot = data.draw(
            st.sampled_from(
                sorted(s for s in done if self.held[s] == len(self.prompt[s]) < CONTEXT)
            )
        )
        held = self.held[slot]
        if self.alloc.alloc_decode(np.array([slot]), np.array([held])) is None:
            return
        self.prompt[slot].append(token)
        self.held[slot] = held + 1
        self._write_state(slot)
        if self.held[slot] % self.PS == 0:  # a page completed: the cost rule decides
            reuse = CheckpointRule.reuse_at(self.held[slot], CONTEXT, self.PS)
            copy = {1: 0.5, 4: 1.5}[self.PS]  # tokens of prefill: both decisions occur
            rule = CheckpointRule(copy_s=copy, prefill_tokens_per_s=1.0)
            take = rule.take(reuse, self.held[slot] - self.since[slot], False, 0.0)
            self.decisions[take] += 1
            if take:
                self._checkpoint(slot, tuple(self.prompt[slot]))

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def demote(self, data):
        """A checkpoint superseded (the engine's policy: a request's prompt-end one once
        its output-end one is taken): the first to go from now on."""
        key = data.draw(st.sampled_from(sorted(self.shadow)))
        self.alloc.prefix.demote_checkpoint(np.array(key, np.int64))

    @precondition(lambda self: self.prompt)
    @rule(data=st.data())
    def free(self, data):
        self._free(data.draw(st.sampled_from(sorted(self.prompt))))

    def _free(self, slot: int) -> None:
        self.alloc.free_request(slot)
        for table in (self.prompt, self.held, self.key, self.state, self.since):
            del table[slot]

    # -- invariants -----------------------------------------------------------------

    @invariant()
    def integrity(self):
        self.alloc.check_integrity()

    @invariant()
    def checkpoints_hold_what_was_copied(self):
        nodes = {}
        for key in list(self.shadow):
            node = self._node(key)
            if node is None:  # evicted (with its pages or alone): the shadow forgets it
                del self.shadow[key]
            else:
                nodes[key] = node
        assert len(self.shadow) == len(self.states.by_node), "a checkpoint no rule took"
        ckpts = {self._ckpt_phys(n) for n in nodes.values()}
        assert len(ckpts) == len(nodes), "two checkpoints share a slot"
        for key, node in nodes.items():
            assert torch.equal(self._bytes(self._ckpt_phys(node)), self.shadow[key]), (
                f"checkpoint of {key} written"
            )
            assert self.states.position[node] == len(key), f"checkpoint of {key}: its position"
        live = {self._phys(s) for s, v in self.state.items() if v is not None}
        assert not live & ckpts, "a checkpoint slot is a live request's slot"
        for slot, key in self.key.items():
            if self.state[slot] is None and key:
                assert key in nodes, f"pinned checkpoint of {key} evicted before its restore"
        self.pool_fractions_match_the_shadow(len(nodes))

    def pool_fractions_match_the_shadow(self, ckpts: int):
        """(Called by ``checkpoints_hold_what_was_copied`` with the shadow's live
        checkpoints, counted there.)"""
        got = self.policy.pool_fractions()
        parts, total = self.alloc.parts, self.pool.total_bytes
        slot_bytes, page_bytes = self.pool["mamba"].page_bytes, self.pool["full"].page_bytes
        batch = 0
        for slot in self.held:
            pages = parts.requests.held_pages(slot)
            batch += int((~parts.prefix.is_cached(pages)).sum()) * page_bytes
            batch += slot_bytes if self.state[slot] is not None else 0  # a restored slot
        want = (ckpts * slot_bytes / total, batch / total)
        assert got == pytest.approx(want), f"pool fractions {got} vs the shadow's {want}"

    @invariant()
    def requests_hold_their_own_state(self):
        for slot, state in self.state.items():
            if state is not None:
                assert torch.equal(self._bytes(self._phys(slot)), state), (
                    f"request {slot}'s state slot changed under it"
                )


@pytest.mark.parametrize("ps", [1, 4])
def test_prefix_hybrid_state_machine(ps):
    machine = type(f"HybridMachine{ps}", (HybridMachine,), {"PS": ps})
    runs = {"hits": 0, "misses": 0, "restored": 0, "evicted": 0, "evicted_pages": 0}
    runs |= {"declined": 0, "taken": 0}

    class Counted(machine):
        def teardown(self):
            runs["hits"] += self.hits
            runs["misses"] += self.misses
            runs["restored"] += self.states.restored
            runs["evicted"] += self.states.evicted
            runs["evicted_pages"] += self.alloc.prefix.counters()["evicted_pages"]
            runs["declined"] += self.decisions[0]
            runs["taken"] += self.decisions[1]

    # (a decode boundary the rule takes needs several decodes of one request before it
    # is freed; 50 steps reach some on the derandomized runs since the eviction orders
    # of issue 41 changed their course: 40 reached none, at page 1 and, since junction
    # chains go last, at page 4)
    steps = 50
    Counted.TestCase.settings = derandomized(max_examples=100, steps=steps, shrink=False)
    Counted.TestCase().runTest()
    assert runs["hits"] > 20 and runs["restored"] == runs["hits"], runs
    assert runs["evicted"] > 10 and runs["evicted_pages"] > 10 and runs["misses"] > 20, runs
    assert runs["declined"] > 5 and runs["taken"] > 0, runs  # the rule both ways


def test_a_misplaced_checkpoint_is_caught():
    """A checkpoint recorded one page off its node (a state restored from the wrong
    position) fails the integrity check and stops the hit that would restore it."""
    machine = HybridMachine()
    machine.served_chains()
    states = machine.states
    key = next(k for k in machine.shadow if len(k) == 8)
    node = machine._node(key)
    states.position[node] += HybridMachine.PS
    with pytest.raises(AssertionError, match="taken at its node's position"):
        machine.alloc.check_integrity()
    hit = machine.prefix.match(np.array(key + (0,), np.int64))
    assert hit.num_tokens == 8
    with pytest.raises(AssertionError, match="a hit restores a checkpoint taken at its own"):
        machine.alloc.new_request(prefix=hit)


def test_a_slot_counted_twice_is_caught():
    """A Mamba book that counts one live slot too many (a checkpoint slot freed but
    still counted): the batch fraction the cost rule weighs is off, and named."""
    machine = HybridMachine()
    machine.served_chains()
    machine.checkpoints_hold_what_was_copied()
    machine.book.num_live += 1
    with pytest.raises(AssertionError, match="pool fractions"):
        machine.checkpoints_hold_what_was_copied()
