"""The prefix cache's host tier (``io/prefix_host.py``, issue 17) end to end
on CPU (fp32, torch reference kernels): on a pool too small to keep every cached
prompt, evicted pages (and state checkpoints) spill to the host and later hits
reload them. Greedy tokens equal the run without the cache and transformers'
``generate``, for full attention (llama, pages 4 and 16), full + sliding window
(gpt-oss, window 6, no multiple of the page) and a recurrent hybrid (Qwen3.5:
checkpoint spill). The host path ran (host-hit counters > 0), and every reloaded
page's bytes, read from the pool buffer after the reload, equal that page's
bytes read from the buffer before it spilled (recorded independently of the host
tier). Bad ``prefix_host_bytes`` are refused with a ValueError.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import VOCAB, hf_greedy, one_thread  # noqa: F401
from prefix_fixtures import (
    distinct_prompts,
    host_tier_bytes,
    pool_budget,
    prefix_llm,
    save_tiny_models,
)

from unikv.engine import SamplingParams
from unikv.io.prefix_host import PrefixHost
from unikv.pool import pool_bytes_for

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_tiny_models(tmp_path_factory)


class ByteWitness:
    """Records each spilled node's page envelopes from the pool buffer right
    before the spill, and compares them with the envelopes of the fresh pages
    right after each reload (both read with ``pool.page_envelope``)."""

    def __init__(self, llm, monkeypatch) -> None:
        self.llm, self.saved, self.compared = llm, {}, 0
        spill, copy_in = PrefixHost.spill, PrefixHost._copy_in
        witness = self

        def spill_and_record(host, prefix, nodes):
            before = {n.node_id: witness.envelopes(n.page) for n in nodes}
            spilled, copies = spill(host, prefix, nodes)
            witness.saved.update({i: before[i] for i in spilled})
            return spilled, copies

        def reload_and_compare(host, prefix, nodes, columns):
            copy_in(host, prefix, nodes, columns)
            for node in nodes:
                got = witness.envelopes(node.page)
                want = witness.saved.pop(node.node_id)
                assert got.keys() == want.keys()
                for name in want:
                    assert torch.equal(got[name], want[name]), f"{name}: reloaded bytes differ"
                witness.compared += 1

        monkeypatch.setattr(PrefixHost, "spill", spill_and_record)
        monkeypatch.setattr(PrefixHost, "_copy_in", reload_and_compare)

    def envelopes(self, vpage: int) -> dict[str, torch.Tensor]:
        books, pool = self.llm.alloc.parts.books, self.llm.pool
        out = {}
        for name in self.llm.alloc.parts.roles.token_names:
            ppage = int(books[name].v2p_host[vpage])
            if ppage > 0:
                out[name] = pool.page_envelope(name, ppage).clone()
        return out


def spill_run(models, monkeypatch, arch: str, ps: int, pages: int, host_pages: int, count=4):
    """The prompts without the cache, then twice with a tight pool and a host tier
    (reload forced): every run equals transformers; returns the cached LLM."""
    from unikv.hf_config import specs_from_hf_config

    path, hf = models[arch]
    prompts = distinct_prompts(ps, seed=7, count=count)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    plain = prefix_llm(path, ps, False).generate(prompts, params)
    assert [o.output_ids for o in plain] == want
    configs = specs_from_hf_config(path, page_size=ps, dtype=torch.float32)
    budget = pool_budget(configs, pages)
    host_bytes = host_tier_bytes(configs, ps, host_pages, 4 * host_pages)
    max_len = 8 * ps if ps == 4 else 5 * ps
    llm = prefix_llm(
        path, ps, True, kv_cache_bytes=budget, prefix_host_bytes=host_bytes,
        max_model_len=max_len,
    )  # fmt: skip
    llm.alloc.prefix.host.policy.mode = "always"  # CPU: reload whenever there is a hit
    witness = ByteWitness(llm, monkeypatch)
    for _ in range(2):
        assert [o.output_ids for o in llm.generate(prompts, params)] == want
    stats = llm.alloc.prefix.counters()
    assert stats["host_spilled_pages"] > 0 and stats["host_hit_tokens"] > 0, str(stats)
    assert stats["host_reloaded_pages"] > 0 and witness.compared == stats["host_reloaded_pages"]
    llm.alloc.check_integrity()
    return llm, stats


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("ps", [4, 16])
def test_full_attention_hits_from_host_give_the_same_tokens(models, monkeypatch, ps):
    spill_run(models, monkeypatch, "llama", ps, pages=10 if ps == 4 else 6, host_pages=16)


@pytest.mark.usefixtures("one_thread")
def test_sliding_window_hits_from_host_give_the_same_tokens(models, monkeypatch):
    """gpt-oss in a tight pool with a host tier, a chat's second turn (each prompt, its
    answer and a new message): the first turns' chains spill with their chain ends'
    window suffixes (issue 41: a prompt's end inside a chain keeps its suffix only
    while nodes are left to evict, so a plain repeat of the prompts no longer reloads
    from the host here), and the second turns reload them with transformers' tokens."""
    from unikv.hf_config import specs_from_hf_config

    path, hf = models["gpt_oss"]
    ps = 4
    prompts = distinct_prompts(ps, seed=7, count=4)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    configs = specs_from_hf_config(path, page_size=ps, dtype=torch.float32)
    llm = prefix_llm(
        path, ps, True, kv_cache_bytes=pool_budget(configs, 10),
        prefix_host_bytes=host_tier_bytes(configs, ps, 16, 64), max_model_len=8 * ps,
    )  # fmt: skip
    llm.alloc.prefix.host.policy.mode = "always"  # CPU: reload whenever there is a hit
    witness = ByteWitness(llm, monkeypatch)
    first = llm.generate(prompts, params)
    assert [o.output_ids for o in first] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    turns = [p + o.output_ids + [7, 8, 9] for p, o in zip(prompts, first)]
    want = [hf_greedy(hf, t, NEW_TOKENS) for t in turns]
    assert [o.output_ids for o in llm.generate(turns, params)] == want
    stats = llm.alloc.prefix.counters()
    assert stats["host_spilled_pages"] > 0 and stats["host_hit_tokens"] > 0, str(stats)
    assert stats["host_reloaded_pages"] > 0 and witness.compared == stats["host_reloaded_pages"]
    llm.alloc.check_integrity()


@pytest.mark.usefixtures("one_thread")
def test_hybrid_checkpoints_spill_and_restore_from_host(models, monkeypatch):
    _, stats = spill_run(models, monkeypatch, "qwen3_5", 4, pages=8, host_pages=16, count=8)
    assert stats["host_spilled_checkpoints"] > 0 and stats["host_reloaded_checkpoints"] > 0


@pytest.mark.usefixtures("one_thread")
def test_a_small_host_tier_drops_its_oldest_and_never_reload_recomputes(models):
    """A host tier of 2 pages drops for real; mode "never" serves device-only hits."""
    from unikv.hf_config import specs_from_hf_config

    path, hf = models["llama"]
    ps, prompts = 4, distinct_prompts(4, seed=8)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    configs = specs_from_hf_config(path, page_size=ps, dtype=torch.float32)
    token = sum(c.spec.page_bytes(ps) for c in configs)
    for mode, host_pages in (("always", 2), ("never", 16)):
        llm = prefix_llm(
            path, ps, True, kv_cache_bytes=pool_bytes_for(configs, {"full": 10}),
            prefix_host_bytes=host_pages * token, max_model_len=32,
        )  # fmt: skip
        llm.alloc.prefix.host.policy.mode = mode
        for _ in range(2):
            assert [o.output_ids for o in llm.generate(prompts, params)] == want
        stats = llm.alloc.prefix.counters()
        assert stats["host_spilled_pages"] > 0, stats
        if mode == "always":
            assert stats["host_evicted_pages"] > 0 and stats["host_pages"] <= 2, stats
        else:
            assert stats["host_hit_tokens"] == 0 and stats["host_reload_declined"] > 0, stats
        llm.alloc.check_integrity()


def test_bad_prefix_host_bytes_are_refused(models):
    path, _ = models["llama"]
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        prefix_llm(path, 4, False, prefix_host_bytes=1 << 20)
    with pytest.raises(ValueError, match="int >= 0"):
        prefix_llm(path, 4, True, prefix_host_bytes=-1)
    with pytest.raises(ValueError, match="holds no whole page envelope"):
        prefix_llm(path, 4, True, prefix_host_bytes=10)
    with pytest.raises(ValueError, match="int >= 0"):
        prefix_llm(path, 4, True, prefix_host_bytes=1.5)
    assert prefix_llm(path, 4, True, prefix_host_bytes=0).alloc.prefix.host is None


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("arch,pages,count", [("llama", 10, 4), ("qwen3_5", 8, 8)])
def test_reset_prefix_cache_drops_device_and_host_copies(models, monkeypatch, arch, pages, count):
    """After runs with spills and reloads, ``reset_prefix_cache`` leaves no cached
    page, checkpoint or host copy: every sub-pool's pages are free again (read off
    the page books), the next run hits nothing and still gives transformers' tokens;
    with caching off it refuses (False)."""
    llm, _ = spill_run(models, monkeypatch, arch, 4, pages=pages, host_pages=16, count=count)
    prefix = llm.alloc.parts.prefix
    assert llm.alloc.prefix.counters()["pages"] > 0 and prefix.host.nodes
    assert llm.reset_prefix_cache() is True
    counters = llm.alloc.prefix.counters()
    assert counters["pages"] == counters["evictable"] == counters["host_pages"] == 0, counters
    assert counters.get("checkpoints", 0) == counters["host_checkpoints"] == 0, counters
    assert not prefix.by_id and not prefix.host.nodes and not prefix.host.ckpts
    assert all(book.num_live == 0 for book in llm.alloc.parts.books.values()), "pages left"
    llm.alloc.check_integrity()
    prompts = distinct_prompts(4, seed=7, count=count)
    outs = llm.generate(prompts[:2], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    want = [hf_greedy(models[arch][1], p, NEW_TOKENS) for p in prompts[:2]]
    assert [o.output_ids for o in outs] == want
    assert prefix_llm(models[arch][0], 4, False).reset_prefix_cache() is False


def test_a_spill_fences_its_pages_with_its_copy_instead_of_waiting():
    """On CUDA a spill's copy runs on a side stream: its pages must not be reused
    before the copy is done, and eviction must not wait for it (a host sync). With
    the host tier's copies given done-events under test control (CPU), evicted pages
    are held, not free, no event is synchronized, the pages become holes once the
    copy's event fires, and the hit reloads the bytes that were cached (the pool
    buffer read before the spill and after the reload)."""
    import numpy as np
    from allocator_fixtures import FakeEvent, full_config

    from unikv.allocator import PoolAllocator
    from unikv.io.prefix_host import ReloadPolicy
    from unikv.io.prefix_host_setup import enable_prefix_host
    from unikv.pool import UnifiedPool

    ps, n = 4, 3
    configs = [full_config(ps)]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": n + 3}))
    alloc = PoolAllocator(pool, max_requests=2, max_context=(n + 1) * ps)
    host = enable_prefix_host(alloc, (n + 1) * pool["full"].page_bytes, ReloadPolicy("always"))
    events, synced = [], []

    class CopyEvent(FakeEvent):
        def synchronize(self) -> None:
            synced.append(self)
            super().synchronize()

    tier = host.tiers["full"]
    sync_launch = tier._launch

    def launch_with_event(stream, copy, pages, slots, writers):
        sync_launch(stream, copy, pages, slots, writers)  # the bytes move now (CPU) ...
        if copy != tier._copy_out:
            return None  # reloads: synchronous, as on CPU
        events.append(CopyEvent())  # ... but the spill only knows from its event
        return events[-1]

    tier._launch = launch_with_event
    prefix, tokens, book = alloc.parts.prefix, np.arange(n * ps + 1), alloc.parts.books["full"]
    slot = alloc.new_request()
    alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([len(tokens)]))
    pages = book.physical(alloc.parts.requests.pages[slot, :n])
    g = torch.Generator().manual_seed(0)
    for p in pages.tolist():
        pool.page_envelope("full", p).copy_(torch.randint(0, 256, (pool["full"].page_bytes,),
                                                          dtype=torch.uint8, generator=g))  # fmt: skip
    want = [pool.page_envelope("full", p).clone() for p in pages.tolist()]
    alloc.prefix.insert(slot, tokens)
    alloc.free_request(slot)
    free_before = book.num_free
    alloc.parts.writer.write(prefix.evict(n))
    assert len(events) == 1 and not synced, "a spill must not wait for its copy"
    assert host.counters()["host_pages"] == n
    alloc.parts.room.drain()
    assert book.num_free == free_before and book.num_pending == n, "reused before copied"
    alloc.check_integrity()
    events[0].fired = True
    alloc.parts.room.drain()
    assert book.num_free == free_before + n and book.num_pending == 0
    hit = alloc.prefix.reload(alloc.prefix.match(tokens))
    assert hit.num_tokens == n * ps and not synced
    got = alloc.parts.books["full"].physical(np.asarray(hit.pages, np.int32))
    assert [torch.equal(pool.page_envelope("full", int(p)), w) for p, w in zip(got, want)] == [
        True
    ] * n
    alloc.check_integrity()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("arch", ["llama", "gpt_oss", "qwen3_5"])
def test_reset_between_steps_keeps_running_requests_exact(models, arch):
    """``reset_prefix_cache`` every third step of a run with hits, spills and
    reloads (a server's POST /reset_prefix_cache lands between two steps): the
    pages running requests hold stay, the tokens are transformers', and the
    allocator's invariants hold after every verb (debug) and at the end."""
    from unikv.hf_config import specs_from_hf_config

    path, hf = models[arch]
    ps, prompts = 4, distinct_prompts(4, seed=9)
    prompts = prompts + [p[: len(p) - 3] + [1, 2, 3] for p in prompts[:2]]  # partial hits
    configs = specs_from_hf_config(path, page_size=ps, dtype=torch.float32)
    llm = prefix_llm(
        path, ps, True, kv_cache_bytes=pool_budget(configs, 12),
        prefix_host_bytes=host_tier_bytes(configs, ps, 16, 64), max_model_len=32,
    )  # fmt: skip
    llm.alloc.prefix.host.policy.mode = "always"
    steps, resets = [0], []

    def reset_now_and_then(llm, batch, logits):
        steps[0] += 1
        if steps[0] % 3 == 0:
            resets.append(llm.reset_prefix_cache())

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    for _ in range(2):
        outs = llm.generate(prompts, params, on_step=reset_now_and_then)
        assert [o.output_ids for o in outs] == want
    assert resets and all(resets)
    llm.alloc.check_integrity()
    assert llm.reset_prefix_cache()  # idle now: nothing is left anywhere
    assert all(book.num_live == 0 for book in llm.alloc.parts.books.values()), "pages left"
