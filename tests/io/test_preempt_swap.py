"""Preemption by swap (``io/swap.py``, issue 17) end to end on CPU (fp32, torch
reference kernels): on a pool too small for every request's decodes, preempted
requests are swapped to host slots (``preemption="swap"``) and resume from the
reloaded pages. Greedy tokens equal transformers' ``generate`` and a run that
recomputes instead, for full attention (llama, pages 4 and 16), full + sliding
window (gpt-oss, window 6: only the live window pages move) and a recurrent
hybrid (Qwen3.5: the state slot moves too), with and without prefix caching.
The swap path ran (counters > 0), and every reloaded page's bytes, read from
the pool buffer after the swap-in, equal that page's bytes read from the buffer
right before the swap-out (recorded independently of the host tier). A host
tier without room recomputes. Bad ``preemption`` / ``swap_host_bytes`` values
are refused with a ValueError.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import VOCAB, hf_greedy, one_thread  # noqa: F401
from prefix_fixtures import save_tiny_models, tight_llm, tight_prompts

from unikv.engine import LLM, SamplingParams
from unikv.io.swap import SwapSpace

NEW_TOKENS = 10
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_tiny_models(tmp_path_factory)


class ByteWitness:
    """Records a request's page envelopes (``pool.page_envelope``) right before
    each swap-out, and compares them with the envelopes of the pages it holds at
    the same columns right after its swap-in."""

    def __init__(self, llm, monkeypatch) -> None:
        self.llm, self.saved, self.compared, self.bytes = llm, {}, 0, 0
        swap_out, swap_in = SwapSpace.swap_out, SwapSpace.swap_in
        witness = self

        def out_and_record(space, request_id, slot, num_cached):
            before = witness.envelopes(slot)
            record = swap_out(space, request_id, slot, num_cached)
            if record is not None:
                witness.saved[request_id] = before
            return record

        def in_and_compare(space, request_id, slot):
            swap_in(space, request_id, slot)
            want, got = witness.saved.pop(request_id), witness.envelopes(slot)
            for name, pages in want.items():
                for col, data in pages.items():
                    assert torch.equal(got[name][col], data), f"{name} col {col}: bytes differ"
                    witness.bytes += data.numel()
            witness.compared += 1

        monkeypatch.setattr(SwapSpace, "swap_out", out_and_record)
        monkeypatch.setattr(SwapSpace, "swap_in", in_and_compare)

    def envelopes(self, slot: int) -> dict[str, dict[int, torch.Tensor]]:
        pool, out = self.llm.pool, {}
        for name, (cols, pages) in self.llm.alloc.request_pages(slot).items():
            out[name] = {
                int(c): pool.page_envelope(name, int(p)).clone() for c, p in zip(cols, pages)
            }
        return out


_WANT: dict[str, list[list[int]]] = {}


def hf_tokens(models, arch: str) -> list[list[int]]:
    """transformers' greedy tokens for ``tight_prompts()`` (once per model)."""
    if arch not in _WANT:
        _WANT[arch] = [hf_greedy(models[arch][1], p, NEW_TOKENS) for p in tight_prompts()]
    return _WANT[arch]


CASES = [  # arch, page size, token pages in the pool (sized to preempt), prefix caching
    ("llama", 4, 20, False),
    ("llama", 16, 5, False),
    ("gpt_oss", 4, 14, False),
    ("gpt_oss", 16, 4, False),
    ("qwen3_5", 4, 16, False),
    ("qwen3_5", 16, 5, False),
    ("llama", 4, 20, True),
    ("qwen3_5", 4, 16, True),
]


@pytest.mark.parametrize("arch,ps,pages,caching", CASES)
def test_swapped_requests_resume_with_the_same_tokens(
    models, monkeypatch, arch, ps, pages, caching
):
    path, want = models[arch][0], hf_tokens(models, arch)
    prompts, params = tight_prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    again = tight_llm(path, ps, pages, "recompute", caching, debug=False).generate(prompts, params)
    assert [o.output_ids for o in again] == want
    llm = tight_llm(path, ps, pages, "swap", caching)
    witness = ByteWitness(llm, monkeypatch)
    assert [o.output_ids for o in llm.generate(prompts, params)] == want
    swap = llm.scheduler.swap
    counters = swap.counters()
    assert llm.scheduler.num_preemptions > 0 and counters["swap_swapped_out"] > 0, counters
    assert counters["swap_swapped_in"] == counters["swap_swapped_out"] == witness.compared
    assert counters["swap_swapped_in_bytes"] == counters["swap_swapped_out_bytes"] == witness.bytes
    assert not swap.held and not witness.saved
    # llm.stats holds the run's swaps: the witness counted each swap-in's bytes itself
    assert (llm.stats.swapped_in, llm.stats.swapped_in_bytes) == (witness.compared, witness.bytes)
    swap.check_integrity()
    llm.alloc.check_integrity()


def test_windowed_swap_moves_only_the_live_window(models, monkeypatch):
    """gpt-oss (window 6, pages of 4): a swapped request's sliding-window pages
    are at most the window's; its full-attention pages are all it holds."""
    path, _ = models["gpt_oss"]
    llm = tight_llm(path, 4, 14, "swap")
    witness = ByteWitness(llm, monkeypatch)
    sizes = []
    swap_out = SwapSpace.swap_out  # the witness's, which records the envelopes

    def out_and_count(space, request_id, slot, num_cached):
        record = swap_out(space, request_id, slot, num_cached)
        if record is not None:
            sizes.append((num_cached, {n: len(c) for n, (c, _) in record.slots.items()}))
        return record

    monkeypatch.setattr(SwapSpace, "swap_out", out_and_count)
    llm.generate(tight_prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert sizes and witness.compared == len(sizes)
    windowed = [c.name for c in llm.pool.subpools.values() if c.spec.sliding_window]
    full = [c.name for c in llm.pool.subpools.values() if not c.spec.sliding_window]
    for num_cached, pages in sizes:
        assert all(pages[n] <= 3 for n in windowed), pages  # 6 tokens span <= 3 pages of 4
        assert all(pages[n] == -(-num_cached // 4) for n in full), (num_cached, pages)


def test_a_host_tier_without_room_recomputes(models):
    from unikv.hf_config import specs_from_hf_config

    path = models["llama"][0]

    configs = specs_from_hf_config(path, page_size=4, dtype=torch.float32)
    one_page = sum(c.spec.page_bytes(4) for c in configs)
    prompts, params = tight_prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    llm = tight_llm(path, 4, 20, "swap", swap_host_bytes=2 * one_page)
    assert [o.output_ids for o in llm.generate(prompts, params)] == hf_tokens(models, "llama")
    counters = llm.scheduler.swap.counters()
    assert llm.scheduler.num_preemptions > 0 and counters["swap_no_room"] > 0, counters
    assert counters["swap_swapped_out"] == 0
    llm.scheduler.swap.check_integrity()


def test_bad_swap_options_are_refused(models):
    path, _ = models["llama"]
    kw = {"device": "cpu", "max_model_len": 48}
    with pytest.raises(ValueError, match="preemption must be one of"):
        LLM(path, preemption="always", **kw)
    with pytest.raises(ValueError, match="swap_host_bytes is 0"):
        LLM(path, preemption="swap", **kw)
    with pytest.raises(ValueError, match="swap_host_bytes must be an int >= 0"):
        LLM(path, swap_host_bytes=-1, **kw)
    with pytest.raises(ValueError, match="swap_host_bytes must be an int >= 0"):
        LLM(path, swap_host_bytes=2.5, **kw)
    with pytest.raises(ValueError, match="swap_host_bytes=10 holds no whole page envelope"):
        LLM(path, swap_host_bytes=10, **kw)
    assert LLM(path, **kw).scheduler.swap is None
    assert LLM(path, swap_host_bytes=1 << 20, preemption="recompute", **kw).scheduler.swap is None
    assert LLM(path, swap_host_bytes=1 << 20, **kw).scheduler.swap.policy.mode == "auto"
