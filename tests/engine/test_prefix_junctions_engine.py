"""Junction checkpoints end to end (issue 41): a branching few-shot workload on a tiny
Qwen3.5 hybrid (Gated DeltaNet + full attention, CPU fp32) in a tight pool.

Prompts share an instruction, branch into three shot sets, then diverge into their
own questions, served one at a time: a prompt that leaves a cached run takes a
junction checkpoint there (``StateCheckpoints.shared``), later prompts of the same
shot set hit it, and the tight pool evicts. Greedy tokens with the cache equal those
without it and transformers' ``generate`` on the same weights (an independent
implementation), so every hit restored the state at exactly its token.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import VOCAB, hf_greedy, one_thread, save_tiny_hybrid  # noqa: F401
from prefix_fixtures import pool_budget, prefix_llm

from unikv.engine import SamplingParams
from unikv.hf_config import specs_from_hf_config

PS = 4
NEW_TOKENS = 6


def _branching(seed: int) -> list[list[int]]:
    """A 9-token instruction, 3 shot sets of 7 tokens, 8 questions of 2-5 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()
    head, shots = ids(9), [ids(7) for _ in range(3)]
    order = [0, 0, 1, 0, 2, 1, 2, 0]
    return [head + shots[s] + ids(2 + i % 4) for i, s in enumerate(order)]


@pytest.mark.usefixtures("one_thread")
def test_branching_prompts_hit_junctions_with_the_tokens_of_no_cache(tmp_path):
    path = str(tmp_path)
    hf = save_tiny_hybrid("qwen3_5", path)
    prompts = _branching(seed=7)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    plain = prefix_llm(path, PS, False, max_model_len=48)
    assert [plain.generate([p], params)[0].output_ids for p in prompts] == want
    configs = specs_from_hf_config(path, page_size=PS, dtype=torch.float32)
    llm = prefix_llm(path, PS, True, max_model_len=48, kv_cache_bytes=pool_budget(configs, 16, 5))
    states, shared = llm.alloc.parts.prefix.states, set()
    outs = []
    for p in prompts:  # one at a time: each later prompt finds the earlier ones cached
        outs.append(llm.generate([p], params)[0])
        shared |= states.shared
        llm.alloc.check_integrity()
    assert [o.output_ids for o in outs] == want
    stats = llm.alloc.prefix.counters()
    assert shared, "a prompt left a cached run: a junction checkpoint was taken"
    assert stats["evicted_pages"] > 0, "the pool was tight enough to evict"
    assert sum(o.num_cached_tokens >= 16 for o in outs) >= 2, "later prompts hit the shots"
