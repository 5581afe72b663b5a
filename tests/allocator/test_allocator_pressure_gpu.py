"""Issue 16's compaction bug on the GPU (run with ``pytest -m gpu``).

On an H200, with CUDA graphs and one step in flight, a pool sized for a single
worst-case request (GQA 6/3, head_dim 40, 3 layers, page 16, max_model_len 160,
chunk 32; 10 prompts of 1-100 tokens, 40 new tokens each) crashed in the
allocator's compaction with "the packing that waiting made feasible vanished":
a forward's done-event fired out of the order the allocator expected. Under
pressure the allocator must wait for the right fence or say no (and the engine
preempts). The run must complete, give the tokens of an uncontended run (a big
pool: no preemption, no compaction) and leave every invariant intact.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_fixtures import assert_pages_returned, save_tiny_model

from unikv.pool import SubPoolConfig, pool_bytes_for
from unikv.specs import MHASpec

pytestmark = pytest.mark.gpu

PAGE, MAX_LEN, CHUNK, NEW = 16, 160, 32, 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pressure"))
    save_tiny_model(
        "llama",
        path,
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=40,
        num_hidden_layers=3,
    )
    return path


def _llm(path: str, kv_cache_bytes: int | None):
    from unikv.engine import LLM

    return LLM(
        path,
        device="cuda",
        dtype=torch.float32,  # fp32: batch shapes cannot flip a near-tie
        page_size=PAGE,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=10,
        kv_cache_bytes=kv_cache_bytes,
        cuda_graphs=True,
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_pool_for_one_worst_case_request_completes_with_the_uncontended_tokens(checkpoint):
    from unikv.engine import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(1, 101, 10)]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.0)
    spec = MHASpec(3, 3, 40, dtype=torch.float32)  # 3 layers, 3 KV heads, head_dim 40
    one_request = pool_bytes_for([SubPoolConfig("full", spec, PAGE)], {"full": MAX_LEN // PAGE})
    big = 64 * one_request  # every request at once, many times over

    tight = _llm(checkpoint, one_request)
    got = [list(o.outputs[0].token_ids) for o in tight.generate(prompts, params)]
    assert tight.stats.preemptions > 0, "the setup is meant to run under pressure"
    assert_pages_returned(tight)

    roomy = _llm(checkpoint, big)
    want = [list(o.outputs[0].token_ids) for o in roomy.generate(prompts, params)]
    assert roomy.stats.preemptions == 0
    roomy.alloc.check_integrity()
    assert got == want
    assert all(len(tokens) == NEW for tokens in got)
