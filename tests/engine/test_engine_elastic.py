"""The engine over an elastic pool (issue 44): ``LLM.resize_kv_cache`` between
steps, growing, shrinking (page moves below the new top) and refused shrinks,
with greedy tokens identical to transformers' ``generate`` and to a fixed-size
run on the same weights (CPU, fp32, torch reference kernels). Released chunks of
the emulated backing are poisoned with NaN bytes, so a page read after its chunk
went would change the tokens.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    assert_pages_returned,
    hf_greedy,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_model,
)

import unikv.pool
from unikv.backing import EmulatedBacking
from unikv.engine import LLM, SamplingParams
from unikv.hf_config import specs_from_hf_config
from unikv.pool import pool_bytes_for

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENS = [5, 19, 33, 41]
NEW_TOKENS = 24
PS = 4
CHUNK = 4096


class Resizer:
    """``on_step``: every step a resize, cycling through grow to the most, shrink
    to just above what the bands hold (live pages move below the new top), and a
    shrink to half of what they hold (refused: nothing may change)."""

    def __init__(self, most: int) -> None:
        self.most, self.steps, self.moved, self.shrinks, self.refused = most, 0, 0, 0, 0
        self.released = 0

    def __call__(self, llm, batch, logits) -> None:
        books = llm.alloc.parts.books.values()
        prefix = llm.alloc.parts.prefix  # cached pages no request holds may be evicted
        held = sum(
            (b.num_live + b.num_pending - len(prefix.evictable_physical(b.name))) * b.page_bytes
            for b in books
        )
        sink = llm.pool.sink_bytes
        kind = self.steps % 3
        self.steps += 1
        if kind == 0:
            assert llm.resize_kv_cache(self.most) == 0
        elif kind == 1:
            slack = sum(3 * b.page_bytes for b in books)
            try:
                self.moved += llm.resize_kv_cache(min(self.most, sink + held + slack))
                self.shrinks += 1
            except ValueError as e:  # below one worst-case request: the pool's floor
                assert "worst-case request" in str(e), str(e)
        elif held:
            pages = {b.name: (b.lo, b.hi, b.num_live) for b in books}
            try:
                llm.resize_kv_cache(sink + held // 2)
            except ValueError as e:
                assert "running requests need" in str(e) or "worst-case" in str(e), str(e)
                self.refused += "running requests need" in str(e)
            else:
                raise AssertionError(f"a shrink to half of {held} held bytes passed")
            assert {b.name: (b.lo, b.hi, b.num_live) for b in books} == pages
        llm.alloc.check_integrity()
        pool = llm.pool
        assert pool.backing.committed == [(0, pool._end)], "one committed run from the base"
        assert pool.total_bytes + pool.tail_pad_bytes <= pool._end < pool.total_bytes + CHUNK * 2
        self.released += pool.max_bytes - pool._end > 0


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_tokens_equal_across_grow_and_shrink(arch, tmp_path, monkeypatch):
    # 4 KiB chunks instead of 2 MiB: the tiny pool crosses chunk edges, so shrinks
    # release (and poison) memory right above the pages the requests keep
    monkeypatch.setattr(unikv.pool, "make_backing", lambda device: EmulatedBacking(CHUNK))
    hf = save_tiny_model(arch, str(tmp_path))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    greedy = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    configs = specs_from_hf_config(str(tmp_path), page_size=PS, dtype=torch.float32)
    most = pool_bytes_for(configs, {c.name: 120 for c in configs})
    kw = {"device": "cpu", "page_size": PS, "max_num_seqs": 8, "max_num_batched_tokens": 16}
    kw["max_model_len"] = 72
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)

    fixed = LLM(str(tmp_path), kv_cache_bytes=most, **kw)
    want = [o.output_ids for o in fixed.generate(prompts, params)]
    assert want == greedy

    small = pool_bytes_for(configs, {c.name: 40 for c in configs})
    llm = LLM(str(tmp_path), kv_cache_bytes=small, kv_cache_max_bytes=most, **kw)
    resizer = Resizer(most)
    got = [o.output_ids for o in llm.generate(prompts, params, on_step=resizer)]
    assert got == greedy
    print(arch, vars(resizer))
    assert resizer.shrinks >= 3 and resizer.moved > 0 and resizer.released > 3, vars(resizer)
    if arch == "llama":  # full attention holds every page: a shrink to half is refused
        assert resizer.refused >= 1, vars(resizer)
    assert_pages_returned(llm)
    with pytest.raises(ValueError, match="max_bytes"):
        llm.resize_kv_cache(most + 1)


def test_elastic_options_refused_where_not_supported(tmp_path):
    save_tiny_model("llama", str(tmp_path))
    kw = {"device": "cpu", "max_model_len": 64, "max_num_seqs": 2}
    with pytest.raises(ValueError, match="does not yet combine"):
        LLM(str(tmp_path), kv_cache_max_bytes=1 << 24, swap_host_bytes=1 << 20, **kw)
    with pytest.raises(ValueError, match="CUDA only"):
        LLM(str(tmp_path), kv_cache_margin_bytes=1 << 20, **kw)
    with pytest.raises(ValueError, match="elastic pool"):
        LLM(str(tmp_path), kv_cache_bytes=1 << 22, **kw).resize_kv_cache(1 << 21)
    llm = LLM(str(tmp_path), kv_cache_max_bytes=1 << 22, **kw)  # the default budget, capped
    assert llm.pool.total_bytes <= 1 << 22 and llm.pool.max_bytes == 1 << 22


def test_resize_while_serving(tmp_path, monkeypatch):
    """``resize_kv_cache`` from another thread while the serving loop runs: each
    resize runs between two steps in the loop's thread; tokens equal transformers'."""
    import threading

    monkeypatch.setattr(unikv.pool, "make_backing", lambda device: EmulatedBacking(CHUNK))
    hf = save_tiny_model("llama", str(tmp_path))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    greedy = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    configs = specs_from_hf_config(str(tmp_path), page_size=PS, dtype=torch.float32)
    most = pool_bytes_for(configs, {c.name: 120 for c in configs})
    least = pool_bytes_for(configs, {c.name: 24 for c in configs})
    llm = LLM(str(tmp_path), device="cpu", page_size=PS, max_num_seqs=8, max_model_len=72,
              max_num_batched_tokens=16, kv_cache_bytes=least, kv_cache_max_bytes=most)  # fmt: skip
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    out: dict = {}
    llm.engine.start()
    try:
        worker = threading.Thread(target=lambda: out.setdefault("o", llm.generate(prompts, params)))
        worker.start()
        done = {"grow": 0, "shrink": 0, "refused": 0}
        while worker.is_alive() or not done["shrink"]:
            for size, kind in ((most, "grow"), (least, "shrink")):
                try:
                    llm.resize_kv_cache(size)
                    done[kind] += 1
                except ValueError as e:
                    assert "running requests need" in str(e), str(e)
                    done["refused"] += 1
            llm.engine.call(llm.alloc.check_integrity).result()
        worker.join()
    finally:
        llm.engine.shutdown()
    assert [o.output_ids for o in out["o"]] == greedy
    assert done["grow"] >= 2 and done["shrink"] >= 1, done
