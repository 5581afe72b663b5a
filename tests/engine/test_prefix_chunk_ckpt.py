"""Checkpoints written by the prefill chunk itself (issue 41, cheaper checkpoints).

A hybrid request's prompt checkpoints (the junction with its hit's cached run, its last
whole page) fall at the end of a prefill chunk or inside it (the scheduler no longer
cuts the prompt's last chunk at its last whole page), so the chunk writes the state
after that row into the checkpoint slot as well (``StepPlan.ckpt_slots``, ``ckpt_at``),
and no slot copy follows. End to end on CPU
(fp32, torch reference kernels; with ``-m gpu`` also on CUDA, the Triton kernels), tiny Qwen3.5 (Gated DeltaNet) and NemotronH
(Mamba-2), pages 4 and 16:

- greedy tokens with the cache (twice: the second run hits) equal those without it;
- a spy on ``StateCheckpoints.save``: no prompt checkpoint queues a copy, and some are
  new checkpoints (taken, not found), so the spy fails when every take copies;
- the bytes of each such checkpoint at its chunk's end equal the request's slot right
  after its chunk (a second description: what the removed copy would have copied); one
  inside its chunk (some must be) equals the state a run without the cache holds after
  a prompt of exactly its tokens (taken as that request is freed; close, not equal: its
  projections ran at other batch shapes).

Allocator level: a reservation the take does not adopt (the node had a checkpoint
already) and one whose request is freed are released, and the integrity check names
a reserved slot the cache lost track of.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import full_config, mamba_config
from engine_fixtures import (
    VOCAB,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_hybrid,
    save_tiny_nemotron_h,
)
from prefix_fixtures import prefix_llm

from unikv.allocator import PoolAllocator
from unikv.engine import SamplingParams
from unikv.pool import UnifiedPool, pool_bytes_for

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def model(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    if request.param == "qwen3_5":
        save_tiny_hybrid("qwen3_5", path)
    else:
        save_tiny_nemotron_h(path, "M*M-")
    return path


def _prompts(ps: int) -> list[list[int]]:
    """Three prompts over one 2.5-page system prompt, and one unrelated."""
    g = torch.Generator().manual_seed(ps)
    system = torch.randint(0, VOCAB, (2 * ps + ps // 2,), generator=g).tolist()
    out = [system + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, ps + 1, 5)]
    return out + [torch.randint(0, VOCAB, (2 * ps + 3,), generator=g).tolist()]


class SaveSpy:
    """Wraps ``states.save``: per prompt checkpoint (not a decode one, not from a draft
    slot) whether it queued a copy and whether it was new; a new one's bytes against
    the request's live slot, compared at once (its chunk's step just ended)."""

    def __init__(self, llm) -> None:
        states = llm.alloc.parts.prefix.states
        self.queued, self.new, self.mismatched = 0, 0, []
        self.inside: list[tuple[list[int], torch.Tensor]] = []  # (its tokens, its bytes)
        save = states.save
        slot_bytes = state_bytes(llm)
        running = lambda slot: next(r for r in llm.scheduler.running if r.slot == slot)

        def spied(slot, node_id, alive, tokens, reserve, turn_end=False, source=None, *a, **k):
            queued, had = len(states.queued), node_id in states.by_node
            live = slot_bytes(int(states.book.physical(np.array([slot + 1], np.int32))[0]))
            taken = save(slot, node_id, alive, tokens, reserve, turn_end, source, *a, **k)
            if turn_end or source is not None or not taken:
                return taken
            self.queued += len(states.queued) > queued
            if not had and node_id in states.by_node:
                self.new += 1
                vid = np.array([states.by_node[node_id]], np.int32)
                got = slot_bytes(int(states.book.physical(vid)[0]))
                r = running(slot)
                if tokens < r.num_cached:  # inside its chunk: checked against a plain run
                    self.inside.append((list(r.token_slice(0, tokens)), got))
                elif not torch.equal(got, live):
                    self.mismatched.append((slot, tokens))
            return taken

        states.save = spied


def state_bytes(llm):
    """Mamba page -> a copy of its bytes in ``llm``'s pool (as fp32 words)."""
    sub = next(s for s in llm.pool.subpools.values() if s.spec.kind == "mamba")
    size = sub.page_bytes  # (Mamba page p lies at byte p * size of the pool buffer)
    return lambda page: llm.pool.buffer[page * size : (page + 1) * size].clone().view(torch.float32)


def plain_states(llm, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The state slot's bytes of ``llm`` (no cache) after prefilling each prompt whole
    (max_tokens 1: no decode step follows), taken as its request is freed."""
    got, slot_bytes, free = [], state_bytes(llm), llm.alloc.free_request

    def spied(slots, *a, **k):
        for slot in np.atleast_1d(np.asarray(slots, np.int64)).tolist():
            req = torch.tensor([slot], dtype=torch.int32, device=llm.pool.buffer.device)
            phys = llm.alloc.mamba_slots(req).data
            got.append(slot_bytes(int(phys[0])))
        return free(slots, *a, **k)

    llm.alloc.free_request = spied
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for p in prompts:
        llm.generate([p], params)
    llm.alloc.free_request = free
    assert len(got) == len(prompts), "one request freed per prompt"
    return got


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])]  # cuda: Triton kernels


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ps", [4, 16])
def test_prompt_checkpoints_are_written_by_their_chunk_not_copied(model, ps, device):
    prompts = _prompts(ps)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    kw = {"max_num_batched_tokens": 64, "max_model_len": 64, "device": device}
    want = [o.output_ids for o in prefix_llm(model, ps, False, **kw).generate(prompts, params)]
    llm = prefix_llm(model, ps, True, **kw)
    spy = SaveSpy(llm)
    for _ in range(2):
        assert [o.output_ids for o in llm.generate(prompts, params)] == want
    assert llm.alloc.prefix.counters()["hit_tokens"] > 0
    assert spy.new >= 2, "prompt checkpoints were taken"
    assert spy.queued == 0, f"{spy.queued} prompt checkpoints were copied after their chunk"
    assert not spy.mismatched, f"checkpoint bytes differ from the request's slot: {spy.mismatched}"
    assert spy.inside, "some prompt checkpoints were taken inside their chunk"
    plain = plain_states(prefix_llm(model, ps, False, **kw), [ids for ids, _ in spy.inside])
    for (ids, got), want in zip(spy.inside, plain):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"after {len(ids)}")
    states = llm.alloc.parts.prefix.states
    assert not states.direct, "no reservation outlives its step"
    llm.alloc.check_integrity()


# -- allocator level -------------------------------------------------------------------


def _alloc() -> PoolAllocator:
    configs = [full_config(4), mamba_config()]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": 16, "mamba": 6}))
    return PoolAllocator(pool, max_requests=2, max_context=32, debug=True)


def _request(alloc: PoolAllocator, tokens: int) -> int:
    slot = alloc.new_request()
    assert alloc.alloc_mamba(np.array([slot])) is not None
    assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([tokens]))
    return slot


def test_checkpoint_rows_come_up_as_int64_in_one_upload():
    """``checkpoint_rows`` (each prefill step with a reservation): the padded slots and
    the rows inside the chunk are views of the one tensor the allocator's uploader
    returns, int64 already (no widening copy after it), holding the reserved physical
    slot and the sink; a reservation at the chunk's end uploads the slots alone."""
    alloc = _alloc()
    a = _request(alloc, 9)
    assert alloc.prefix.reserve_checkpoint(a, 8)
    writer, uploads = alloc.parts.writer, []
    real = writer.upload

    def spy(array, wide=False):
        uploads.append((wide, real(array, wide=wide)))
        return uploads[-1][1]

    writer.upload = spy
    slots, rows, _ = alloc.prefix.checkpoint_rows(np.array([a]), np.array([9]), np.array([0, 9]), 3)
    states = alloc.parts.prefix.states
    want = int(states.book.physical(np.array([states.direct[a][0]], np.int32))[0])
    assert slots.dtype == rows.dtype == torch.int64
    assert slots.tolist() == [want, 0, 0] and rows.tolist() == [7, -1, -1]
    assert len(uploads) == 1 and uploads[0][0]
    up = uploads[0][1]
    assert slots.data_ptr() == up.data_ptr() and rows.data_ptr() == up[3:].data_ptr(), "a copy"
    slots, rows, _ = alloc.prefix.checkpoint_rows(np.array([a]), np.array([8]), np.array([0, 8]), 2)
    assert len(uploads) == 2 and rows is None and slots.data_ptr() == uploads[1][1].data_ptr()
    assert slots.tolist() == [want, 0]


def test_checkpoint_rows_name_the_row_inside_each_chunk():
    """``checkpoint_rows``: a reservation at 8 tokens matches a step from 5 to 11 tokens
    at row 2 (the chunk's third row: tokens 6, 7, 8), one from 4 to 8 at -1 (its end,
    and then no rows tensor: the ops' plain path), none outside ``(start, end]``; the
    other and padded lanes name the sink at -1 (written out by hand)."""
    alloc = _alloc()
    a, b = _request(alloc, 11), _request(alloc, 3)
    assert alloc.prefix.reserve_checkpoint(a, 8)
    states = alloc.parts.prefix.states
    want = int(states.book.physical(np.array([states.direct[a][0]], np.int32))[0])
    slots, rows, host = alloc.prefix.checkpoint_rows(
        np.array([b, a]), np.array([3, 11]), np.array([0, 3, 9]), 3
    )
    assert slots.dtype == rows.dtype == torch.int64
    assert slots.tolist() == [0, want, 0] and rows.tolist() == [-1, 2, -1] == host.tolist()
    slots, rows, _ = alloc.prefix.checkpoint_rows(np.array([a]), np.array([8]), np.array([0, 4]), 2)
    assert slots.tolist() == [want, 0] and rows is None
    assert alloc.prefix.checkpoint_rows(np.array([a]), np.array([7]), np.array([0, 4]), 1) is None
    assert alloc.prefix.checkpoint_rows(np.array([a]), np.array([12]), np.array([0, 4]), 1) is None


def test_an_unadopted_or_orphaned_reservation_is_released():
    alloc = _alloc()
    states = alloc.parts.prefix.states
    book = states.book
    tokens = np.arange(9)
    a = _request(alloc, 9)
    assert alloc.prefix.reserve_checkpoint(a, 8)
    slots, _, _ = alloc.prefix.checkpoint_rows(np.array([a]), np.array([8]), np.array([0, 8]), 2)
    vid = states.direct[a][0]
    assert slots.tolist() == [int(book.physical(np.array([vid], np.int32))[0]), 0]
    assert alloc.prefix.checkpoint_rows(np.array([a]), np.array([4]), np.array([0, 4]), 1) is None
    alloc.prefix.insert(a, tokens[:8])
    assert alloc.prefix.checkpoint(a, tokens[:8]) and not states.direct  # adopted
    assert states.by_node and not states.queued
    b = _request(alloc, 9)  # the same tokens: the node has its checkpoint already
    assert alloc.prefix.reserve_checkpoint(b, 8)
    held = states.direct[b][0]
    alloc.prefix.insert(b, tokens[:8])
    assert alloc.prefix.checkpoint(b, tokens[:8])
    assert not states.direct and held in states.free_vids, "released, not adopted"
    assert alloc.prefix.reserve_checkpoint(b, 4)
    alloc.free_request(b)  # freed before its step's take
    assert not states.direct
    alloc.check_integrity()
    bound = int((book.v2p_host[states.base :] >= 0).sum())
    assert bound == len(states.by_node) == 1, "only the adopted checkpoint's id stays bound"


def test_a_reserved_slot_the_cache_lost_is_named():
    alloc = _alloc()
    states = alloc.parts.prefix.states
    a = _request(alloc, 9)
    assert alloc.prefix.reserve_checkpoint(a, 8)
    states.direct.clear()  # corruption: the slot stays bound, its record is gone
    with pytest.raises(AssertionError, match="bound exactly while the cache holds them"):
        alloc.check_integrity()
