"""Hypothesis stateful runs of the allocator over 2- and 3-sub-pool chains at page
sizes 1 and 16, with ``check_integrity()`` and a marker check after every step.

Marker pool: every row (K and V, every layer) of a filled slot holds the virtual
token id living there, written into the real pool bytes through the (page,
slot) views; a Mamba slot holds request slot + 1. After any operation
(compaction, frontier moves, another sub-pool's writes) each token must still
read its own id: data followed every move and no band overlapped another.
Total: 4 chains x MAX_EXAMPLES x up to STEPS steps; each chain asserts that at
least MIN_OPS_PER_CHAIN operations ran (4 x 5,000 = 20,000 >= 10,000 required).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from allocator_fixtures import WINDOW, FakeEvent, build, snapshot
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from unikv.ids import PhysicalPageIds, VirtualPageIds, VirtualTokenIds

MAX_EXAMPLES, STEPS = 100, 75  # per chain: up to 7,500 steps
OPS = {"count": 0}
MIN_OPS_PER_CHAIN = 5_000  # x 4 chains: at least 20,000 operations in total


def _write_rows(views, pages, slots, values):
    for layer in views:
        for view in layer if isinstance(layer, tuple) else (layer,):
            view[pages, slots] = values.view(-1, *([1] * (view.dim() - 2))).to(view.dtype)


def _read_rows(views, pages, slots):
    out = []
    for layer in views:
        for view in layer if isinstance(layer, tuple) else (layer,):
            out.append(view[pages, slots].reshape(len(pages), -1))
    return torch.cat(out, 1)


class AllocatorMachine(RuleBasedStateMachine):
    CHAIN, PS = "full+swa", 1

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.alloc = build(
            self.CHAIN, self.PS, requests=4, on_shortfall=self._on_shortfall
        )
        self.batch: list[int] = []
        self.shortfalls = 0
        self.ps = self.PS
        self.ctx = self.alloc.parts.requests.max_context
        self.tokens: dict[int, list[int]] = {}  # request -> virtual ids by position
        self.gone: dict[int, int] = {}  # request -> SWA pages out of the window
        self.released: dict[str, dict[int, int]] = {
            n: {} for n in self.alloc.parts.roles.token_names
        }  # vpage -> slot
        self.mamba: set[int] = set()
        self.pinned: dict[tuple[str, int], int] = {}  # (sub, page) -> virtual page
        self.event: FakeEvent | None = None
        self.moves = 0
        move = self.pool.move_pages

        def counting_move(name, src, dst, **kw):  # check, disjoint: passed through
            self.moves += len(src)
            move(name, src, dst, **kw)

        self.pool.move_pages = counting_move

    # -- helpers ----------------------------------------------------------------

    def _on_shortfall(self, shortfall):
        """The scheduler's part: evict the biggest request outside the batch."""
        self.shortfalls += 1
        assert shortfall.free_bytes >= 0 and set(shortfall.usage) == set(self.alloc.parts.books)
        victims = [s for s in self.tokens if s not in self.batch]
        if not victims:
            return False
        size = {s: sum(self.alloc.parts.tokens.request_footprint(s).values()) for s in victims}
        self._evict(max(victims, key=lambda s: (size[s], s)))
        return True

    def _evict(self, slot):
        self.alloc.free_request(slot)
        for name, released in self.released.items():
            self.released[name] = {v: s for v, s in released.items() if s != slot}
        del self.tokens[slot]
        self.mamba.discard(slot)

    def _pick(self, data, most=3):
        open_ = sorted(self.tokens)
        return data.draw(st.lists(st.sampled_from(open_), min_size=1, max_size=most, unique=True))

    def _markers(self, name, rows, positions):
        """Write/return markers of tokens (rows, positions) in sub-pool ``name``."""
        ids = torch.tensor([self.tokens[r][p] for r, p in zip(rows, positions)], dtype=torch.int32)
        phys = self.alloc.translate(VirtualTokenIds(ids), name, physical=True).data.long()
        return ids, phys // self.ps, phys % self.ps

    def _write(self, rows, positions):
        for name in self.alloc.parts.roles.token_names:
            keep = [i for i, (r, p) in enumerate(zip(rows, positions)) if self._visible(name, r, p)]
            if keep:
                ids, pages, slots = self._markers(
                    name, [rows[i] for i in keep], [positions[i] for i in keep]
                )
                _write_rows(self.pool[name].paged_views, pages, slots, ids.float())

    def _visible(self, name, r, p):
        page = p // self.ps
        if name in self.alloc.parts.roles.windows and page < self.gone.get(r, 0):
            return False
        return self.tokens[r][page * self.ps] // self.ps not in self.released[name]

    def _allocate(self, slots, ext, decode, fused=False):
        prefix = np.array([len(self.tokens[s]) for s in slots])
        demand = self.alloc.parts.tokens.demand_for(np.array(slots), ext)
        now, after = self.alloc.can_admit(demand)
        before, shortfalls = self.moves, self.shortfalls
        self.batch = list(slots)
        step = None
        if fused:
            step = self.alloc.decode_step(np.array(slots), prefix)
            ids = None if step is None else step.virtual_ids
        elif decode:
            ids = self.alloc.alloc_decode(np.array(slots), prefix)
        else:
            ids = self.alloc.alloc_extend(np.array(slots), prefix, ext)
        self.batch = []
        if after:  # can_admit promised room: no eviction was needed
            assert ids is not None and self.shortfalls == shortfalls, "can_admit said yes"
        else:
            assert self.shortfalls > shortfalls, "a demand beyond capacity must ask the callback"
        if now:
            assert self.moves == before, "a demand that fits now must not move pages"
        if ids is None:
            return
        ids = ids.data.tolist()
        assert len(ids) == int(np.sum(ext))
        rows, positions, at = [], [], 0
        for s, n in zip(slots, ext):
            for k in range(n):
                pos = len(self.tokens[s])
                tv = ids[at]
                assert tv % self.ps == pos % self.ps, "a token sits at its position's slot"
                if pos % self.ps:
                    assert tv // self.ps == self.tokens[s][pos - 1] // self.ps, (
                        "the tail page is reused"
                    )
                self.tokens[s].append(tv)
                rows.append(s)
                positions.append(pos)
                at += 1
        if step is None:
            self._write(rows, positions)
            return
        self._note_window(slots, prefix + 1)  # decode_step freed out-of-window pages too
        self._check_step(step, slots, prefix + 1)
        for name in self.alloc.parts.roles.token_names:  # markers at the returned kernel ids
            lanes = [
                i for i, (r, p) in enumerate(zip(rows, positions)) if self._visible(name, r, p)
            ]
            kernel = step.write_ids[name].data[lanes].long()
            values = torch.tensor([self.tokens[rows[i]][positions[i]] for i in lanes]).float()
            for layer in self.pool[name].views:
                for view in layer if isinstance(layer, tuple) else (layer,):
                    view[kernel] = values.view(-1, *([1] * (view.dim() - 1))).to(view.dtype)

    def _check_step(self, step, slots, lens):
        """decode_step's tables equal the unfused block_table / translate verbs."""
        slots_dev = torch.tensor(slots, dtype=torch.int32)
        lens_dev = torch.tensor(lens, dtype=torch.int32)
        assert torch.equal(step.req_slots, slots_dev) and torch.equal(step.seq_lens, lens_dev)
        for name in self.alloc.parts.roles.token_names:
            table = torch.full_like(step.block_tables[name].data, -7)
            window = self.alloc.parts.roles.windows.get(name, 0)
            self.alloc.block_table(slots_dev, lens_dev, name, table, window=window)
            assert torch.equal(step.block_tables[name].data, table), f"{name}: block table"
            locs = self.alloc.translate(step.virtual_ids, name).data
            assert torch.equal(step.write_ids[name].data, locs), f"{name}: write ids"
            if window:  # the model's out-of-window pages hold no physical page any more
                for s in slots:
                    gone = [self.tokens[s][j * self.ps] // self.ps for j in range(self.gone[s])]
                    v2p = self.alloc.parts.books[name].v2p_host[np.array(gone, np.int64)]
                    assert (v2p < 0).all(), f"{name}: request {s} kept out-of-window pages"

    # -- rules --------------------------------------------------------------------

    @precondition(lambda self: len(self.tokens) < 4)
    @rule()
    def open_request(self):
        OPS["count"] += 1
        slot = self.alloc.new_request()
        assert slot not in self.tokens
        self.tokens[slot] = []
        self.gone[slot] = 0

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def extend(self, data):
        OPS["count"] += 1
        slots = self._pick(data)
        most = 3 * self.ps if self.ps > 1 else 6
        ext = np.array(
            [data.draw(st.integers(0, min(most, self.ctx - len(self.tokens[s])))) for s in slots]
        )
        self._allocate(slots, ext, decode=False)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def decode(self, data):
        OPS["count"] += 1
        slots = [s for s in self._pick(data, 4) if len(self.tokens[s]) < self.ctx]
        if slots:
            fused = data.draw(st.booleans())  # decode_step, or alloc_decode alone
            self._allocate(slots, np.ones(len(slots), np.int64), decode=True, fused=fused)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free_out_of_window(self, data):
        OPS["count"] += 1
        slots = self._pick(data)
        seq = np.array([data.draw(st.integers(0, len(self.tokens[s]))) for s in slots])
        self.alloc.free_out_of_window(np.array(slots), seq)
        self._note_window(slots, seq)

    def _note_window(self, slots, seq):
        """Model of free_out_of_window(slots, seq): pages that left each window."""
        if self.alloc.parts.roles.windows:
            window = WINDOW[self.ps]
            for s, n in zip(slots, seq):
                held = -(-len(self.tokens[s]) // self.ps)
                # page j leaves when its last position (j+1)*ps-1 is < n - window
                out = sum(1 for j in range(held) if (j + 1) * self.ps - 1 < n - window)
                self.gone[s] = max(self.gone[s], out)
            swa = self.released["swa"]
            for vpage, slot in list(swa.items()):
                if self.tokens[slot].index(vpage * self.ps) // self.ps < self.gone[slot]:
                    del swa[vpage]  # left the window while released: never bound again

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free_request(self, data):
        OPS["count"] += 1
        slot = data.draw(st.sampled_from(sorted(self.tokens)))
        self._evict(slot)
        before = snapshot(self.alloc)
        with pytest.raises(ValueError, match="not open"):
            self.alloc.free_request(slot)  # double free: clear error, state unchanged
        assert snapshot(self.alloc) == before

    def _pages(self, slot):
        return {tv // self.ps for tv in self.tokens[slot]}

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data):
        OPS["count"] += 1
        slot = data.draw(st.sampled_from(sorted(self.tokens)))
        held = len(self.tokens[slot])
        low = 0  # the next query must find its window bound: keep none, or >= gone*ps + W - 1
        if self.alloc.parts.roles.windows and self.gone[slot]:
            low = self.gone[slot] * self.ps + WINDOW[self.ps] - 1
        cuts = st.just(0) | st.integers(low, held) if low <= held else st.just(0)
        keep = data.draw(cuts)
        self.alloc.truncate(np.array([slot]), np.array([keep]))
        del self.tokens[slot][keep:]
        self.gone[slot] = min(self.gone[slot], -(-keep // self.ps))  # no kept page beyond
        kept = self._pages(slot)
        for name, released in self.released.items():
            self.released[name] = {v: s for v, s in released.items() if s != slot or v in kept}

    def _owner(self, vpage):
        return int(self.alloc.parts.vspace.owner[vpage])

    @precondition(lambda self: self.alloc.parts.roles.mamba_name and set(self.tokens) - self.mamba)
    @rule(data=st.data())
    def alloc_mamba(self, data):
        OPS["count"] += 1
        slot = data.draw(st.sampled_from(sorted(set(self.tokens) - self.mamba)))
        _, after = self.alloc.can_admit({self.alloc.parts.roles.mamba_name: 1})
        shortfalls, self.batch = self.shortfalls, [slot]
        pages = self.alloc.alloc_mamba(np.array([slot]))
        self.batch = []
        assert (
            (pages is not None and self.shortfalls == shortfalls)
            if after
            else self.shortfalls > shortfalls
        )
        if pages is not None:
            self.mamba.add(slot)
            views = self.pool[self.alloc.parts.roles.mamba_name].views
            for view in views.values():
                view[:, pages.data.long()] = float(slot + 1)

    @precondition(lambda self: self.mamba)
    @rule(data=st.data())
    def free_mamba(self, data):
        OPS["count"] += 1
        slot = data.draw(st.sampled_from(sorted(self.mamba)))
        self.alloc.parts.mamba.free(np.array([slot]))
        self.mamba.discard(slot)

    @rule()
    def compact(self):
        OPS["count"] += 1
        self.alloc.compact()
        self.event = None

    @precondition(lambda self: self.event is None)
    @rule()
    def start_forward(self):
        OPS["count"] += 1
        self.event = FakeEvent()
        self.alloc.mark_in_flight(self.event)

    @precondition(lambda self: self.event is not None)
    @rule()
    def finish_forward(self):
        OPS["count"] += 1
        self.event.fired = True
        self.event = None

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def pin_or_unpin(self, data):
        OPS["count"] += 1
        if self.pinned and data.draw(st.booleans()):
            (name, page), _ = self.pinned.popitem()
            self.alloc.io.unpin(name, PhysicalPageIds(torch.tensor([page]), name))
            return
        name = data.draw(st.sampled_from(self.alloc.parts.roles.token_names))
        sub = self.alloc.parts.books[name]
        live = np.flatnonzero(sub.p2v_host[sub.first_page :] >= 0) + sub.first_page
        if len(live):
            page = int(data.draw(st.sampled_from(live.tolist())))
            if (name, page) not in self.pinned:
                self.alloc.io.pin(name, PhysicalPageIds(torch.tensor([page]), name))
                self.pinned[(name, page)] = int(sub.p2v_host[page])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release_or_bind(self, data):
        OPS["count"] += 1
        name = data.draw(st.sampled_from(self.alloc.parts.roles.token_names))
        sub = self.alloc.parts.books[name]
        if self.released[name] and data.draw(st.booleans()):
            vpage = data.draw(st.sampled_from(sorted(self.released[name])))
            self.batch = [self.released[name][vpage]]
            pages = self.alloc.io.bind_physical(name, VirtualPageIds(torch.tensor([vpage])))
            self.batch = []
            if pages is None:
                return
            slot = self.released[name].pop(vpage)
            positions = [p for p, tv in enumerate(self.tokens[slot]) if tv // self.ps == vpage]
            self._write([slot] * len(positions), positions)  # the "reload"
            return
        full = [
            (s, p)
            for s in self.tokens
            for p in range(0, len(self.tokens[s]) - self.ps + 1, self.ps)
        ]
        full = [(s, p) for s, p in full if self._visible(name, s, p)]
        if not full:
            return
        slot, pos = data.draw(st.sampled_from(full))
        vpage = self.tokens[slot][pos] // self.ps
        if sub.pins[sub.v2p_host[vpage]]:
            return
        self.alloc.io.release_physical(name, VirtualPageIds(torch.tensor([vpage])), fence=None)
        self.released[name][vpage] = slot
        before = snapshot(self.alloc)
        with pytest.raises(ValueError, match="hold no physical page"):
            self.alloc.io.release_physical(name, VirtualPageIds(torch.tensor([vpage])))
        with pytest.raises(TypeError):
            self.alloc.io.release_physical(name, PhysicalPageIds(torch.tensor([vpage]), name))
        assert snapshot(self.alloc) == before

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def integrity(self):
        self.alloc.check_integrity()

    @invariant()
    def markers_followed_the_data(self):
        for name in self.alloc.parts.roles.token_names:
            rows = [
                (r, p)
                for r in self.tokens
                for p in range(len(self.tokens[r]))
                if self._visible(name, r, p)
            ]
            if rows:
                ids, pages, slots = self._markers(name, *zip(*rows))
                got = _read_rows(self.pool[name].paged_views, pages, slots)
                assert torch.equal(got, ids.float()[:, None].expand_as(got)), (
                    f"{name}: markers moved"
                )
        if self.mamba:
            slots = torch.tensor(sorted(self.mamba))
            phys = self.alloc.mamba_slots(slots).data.long()
            for view in self.pool[self.alloc.parts.roles.mamba_name].views.values():
                got = view[:, phys].reshape(view.shape[0], len(slots), -1)
                assert torch.equal(got, (slots + 1).float()[None, :, None].expand_as(got))

    @invariant()
    def pinned_pages_never_move(self):
        for (name, page), vpage in self.pinned.items():
            sub = self.alloc.parts.books[name]
            assert sub.p2v_host[page] in (vpage, -1), "a pinned page was moved or reused"


SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    # shrinking a failure can take minutes on CI; UNIKV_SHRINK=1 turns it on locally
    phases=tuple(Phase)
    if os.environ.get("UNIKV_SHRINK") == "1"
    else (Phase.explicit, Phase.generate),
)


def _machine(chain: str, ps: int):
    return type(f"Machine_{chain}_{ps}", (AllocatorMachine,), {"CHAIN": chain, "PS": ps})


@pytest.mark.parametrize("chain", ["full+swa", "full+swa+mamba"])
@pytest.mark.parametrize("ps", [1, 16])
def test_stateful(chain, ps):
    start = OPS["count"]
    run_state_machine_as_test(_machine(chain, ps), settings=SETTINGS)
    ran = OPS["count"] - start
    print(f"{chain} ps={ps}: {ran} operations")
    assert ran >= MIN_OPS_PER_CHAIN, f"only {ran} operations ran"  # 4 chains: >= 10,000 in total
