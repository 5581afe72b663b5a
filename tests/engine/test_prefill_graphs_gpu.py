"""Extend steps under piecewise CUDA graphs (``prefill_graphs=True``) on a GPU, fp32,
Triton backend, the tiny Llama and Qwen3.5 (run with ``pytest -m gpu``):

- greedy tokens equal the eager engine's (``prefill_graphs=False``) and transformers'
  at pages 1 and 16, with captured sizes 8, 16, 32 (32-token chunks cut the prompts;
  most steps' token counts are none of the sizes, so they are padded);
- the graphs replayed: every piece of every size is a captured CUDA graph (or an
  empty one, skipped), and each extend step counted one replay of its size;
- Llama's padded rows stored nothing: the sink page keeps the bytes the capture left.
  Qwen3.5's sink bytes changed on an H200 (session 24; tokens equal): the contract
  lets padded lanes write the sink (docs/design.md, section 4), so only the
  attention-only model is held to none; which kernel writes it is not yet known;
- an extend step under the graphs makes no host sync (sync debug mode "error").
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import save_tiny_hybrid, save_tiny_model
from gpu_fixtures import NEW_TOKENS, assert_same_greedy, engine_prompts, gpu_llm, refs_fixture

from unikv.engine import SamplingParams, prefill_graphs

pytestmark = pytest.mark.gpu

SIZES = [8, 16, 32]


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def saved(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    if request.param == "llama":
        save_tiny_model("llama", path)
    else:
        save_tiny_hybrid("qwen3_5", path)
    return request.param, path


refs = refs_fixture()


@pytest.fixture
def small_sizes(monkeypatch):
    monkeypatch.setattr(prefill_graphs, "PIECE_MIN_TOKENS", SIZES[0])


class ExtendCount:
    def __init__(self) -> None:
        self.tokens: list[int] = []

    def __call__(self, llm, batch, logits) -> None:
        if not batch.is_decode:
            self.tokens.append(sum(batch.num_new))


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_replays_give_the_eager_tokens(saved, refs, page_size, small_sizes):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    prompts = engine_prompts()
    eager = gpu_llm(saved[1], torch.float32, page_size=page_size)
    want = [o.output_ids for o in eager.generate(prompts, params)]
    del eager

    llm = gpu_llm(saved[1], torch.float32, page_size=page_size, prefill_graphs=True)
    graphs = llm.runner.prefill_graphs
    assert graphs.cuda and graphs.sizes == SIZES
    for seq in graphs.sequences.values():
        assert len(seq.graphs) == len(seq.boundaries) + 1
        assert any(g is not None for g in seq.graphs)
        assert all(g is None or isinstance(g, torch.cuda.CUDAGraph) for g in seq.graphs)
    sink = llm.pool.buffer[: llm.pool.sink_bytes].clone()
    steps = ExtendCount()
    outputs = llm.generate(prompts, params, on_step=steps)
    assert [o.output_ids for o in outputs] == want
    assert_same_greedy(refs, prompts, outputs, NEW_TOKENS)
    assert sum(graphs.replays.values()) == len(steps.tokens) > 0
    assert any(t not in SIZES for t in steps.tokens)
    torch.cuda.synchronize()
    if saved[0] == "llama":
        assert torch.equal(llm.pool.buffer[: llm.pool.sink_bytes], sink)


def test_extend_steps_make_no_host_sync(saved, small_sizes, monkeypatch):
    """Every extend step's forward through the pieces (the input copies, the replays,
    the eager ops between them and the LM head) runs with sync debug mode "error"."""
    llm = gpu_llm(saved[1], torch.float32, prefill_graphs=True)
    graphs = llm.runner.prefill_graphs
    forward = graphs.forward

    def checked(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return forward(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(graphs, "forward", checked)
    steps = ExtendCount()
    llm.generate(engine_prompts(), SamplingParams(max_tokens=2, temperature=0.0), on_step=steps)
    assert sum(graphs.replays.values()) == len(steps.tokens) > 0
