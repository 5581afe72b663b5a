"""Extend steps through the prefill graphs' pieces on CPU (``engine/prefill_graphs.py``:
no CUDA graphs there, the same cut, padding and fixed buffers as plain calls),
fp32, torch reference kernels, Llama and the hybrids Qwen3.5 (Gated DeltaNet layers:
their conv and scan are eager ops between pieces too) and NemotronH (Mamba-2, MoE):

- greedy tokens equal transformers' ``generate`` and every sampled logit row equals
  the eager engine's (``prefill_graphs=False``) at pages 1 and 16, with captured
  sizes 8, 16, 32 and steps whose token counts are none of them (padded);
- chunked prefill cutting prompts (7-token steps, every one padded to 8);
- padded rows store nothing: the sink page (where a padded plan's lanes would write)
  keeps the bytes it had after start-up, and the rest of the pool equals the eager
  engine's after the same run (K/V pages and recurrent state slots);
- every extend step ran through the pieces (replays counted per size);
- prompt logprobs (the head over more rows than requests) equal transformers';
- an MLA model (ops the pieces do not cut at) is refused at start-up.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import (
    GreedyReference,
    StepLogits,
    check_engine_outputs,
    engine_llm,
    hf_logits,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_deepseek,
    save_tiny_hybrid,
    save_tiny_model,
    save_tiny_nemotron_h,
)

from unikv.engine import SamplingParams, prefill_graphs

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENS = [5, 17, 33, 60]
NEW_TOKENS = 6
SIZES = [8, 16, 32]  # PIECE_MIN_TOKENS 8 under max_num_batched_tokens 32


@pytest.fixture(scope="module", params=["llama", "qwen3_5", "nemotron_h"])
def ref(request, tmp_path_factory) -> GreedyReference:
    path = str(tmp_path_factory.mktemp(request.param))
    if request.param == "llama":
        hf = save_tiny_model("llama", path)
    elif request.param == "qwen3_5":
        hf = save_tiny_hybrid("qwen3_5", path)
    else:  # Mamba-2, attention, Mamba-2, MLP, MoE
        hf = save_tiny_nemotron_h(path, "M*M-E")
    return GreedyReference(hf, path, PROMPT_LENS, NEW_TOKENS)


@pytest.fixture
def small_sizes(monkeypatch):
    monkeypatch.setattr(prefill_graphs, "PIECE_MIN_TOKENS", SIZES[0])


class ExtendSteps(StepLogits):
    """StepLogits, and the token count of every extend step."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[int] = []

    def __call__(self, llm, batch, logits) -> None:
        super().__call__(llm, batch, logits)
        if not batch.is_decode:
            self.tokens.append(sum(batch.num_new))


def _run(llm, ref):
    steps = ExtendSteps()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    return llm.generate(ref.prompts, params, on_step=steps), steps


def _non_sink(llm) -> torch.Tensor:
    pool = llm.pool
    return pool.buffer[pool.sink_bytes :].view(torch.float32)


@pytest.mark.parametrize("page_size", [1, 16])
def test_tokens_match_transformers_and_eager(ref, page_size, small_sizes):
    llm = engine_llm(ref, page_size=page_size, prefill_graphs=True)
    graphs = llm.runner.prefill_graphs
    assert graphs.sizes == SIZES and llm.runner.graphs is None
    sink = llm.pool.buffer[: llm.pool.sink_bytes].clone()  # after the recording wrote it
    outputs, steps = _run(llm, ref)
    check_engine_outputs(ref, llm, outputs)
    # every extend step ran in the pieces, some of them padded
    assert sum(graphs.replays.values()) == len(steps.tokens)
    assert any(t not in SIZES for t in steps.tokens), steps.tokens
    for size, count in graphs.replays.items():
        assert count == sum(graphs.size_for(t) == size for t in steps.tokens)
    # padded rows stored nothing: the sink kept the recording's bytes
    assert torch.equal(llm.pool.buffer[: llm.pool.sink_bytes], sink)

    eager = engine_llm(ref, page_size=page_size)
    assert eager.runner.prefill_graphs is None
    eager_outputs, eager_steps = _run(eager, ref)
    check_engine_outputs(ref, eager, eager_outputs)
    assert eager_steps.tokens == steps.tokens
    assert steps.rows.keys() == eager_steps.rows.keys()
    for key, row in steps.rows.items():
        torch.testing.assert_close(row, eager_steps.rows[key], atol=1e-5, rtol=0)
    # the same K/V and state bytes as the eager engine's run, none elsewhere
    assert eager.pool.buffer.shape == llm.pool.buffer.shape
    torch.testing.assert_close(_non_sink(llm), _non_sink(eager), atol=1e-5, rtol=0)


def test_chunked_prefill_pads_every_step(ref, small_sizes):
    """7-token steps cut every prompt but the first; each pads to the one size, 8."""
    llm = engine_llm(ref, max_num_batched_tokens=7, prefill_graphs=True)
    graphs = llm.runner.prefill_graphs
    assert graphs.sizes == [8]  # the planner's max_tokens: max(7, max_num_seqs 8)
    rows = StepLogits()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    outputs = llm.generate(ref.prompts, params, on_step=rows)
    check_engine_outputs(ref, llm, outputs)
    assert rows.cut > 0 and graphs.replays[8] >= sum(PROMPT_LENS) // 7


def test_one_prompt_at_a_time_pads_to_each_size(ref, small_sizes):
    """A lone 5-token prompt runs at size 8, a lone 17-token one at 32 (17 > 16);
    their decode steps run eagerly."""
    llm = engine_llm(ref, prefill_graphs=True)
    graphs = llm.runner.prefill_graphs
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    for prompt, want in zip(ref.prompts[:2], ref.greedy[:2], strict=True):
        (out,) = llm.generate([prompt], params)
        assert out.output_ids == want
    assert graphs.replays == {8: 1, 16: 0, 32: 1}


def test_steps_above_the_token_cap_run_eagerly(ref, small_sizes):
    """prefill_graph_tokens 16: sizes 8 and 16 only; a lone 17-token prompt (more rows
    than the largest size) runs eagerly, with the same tokens."""
    llm = engine_llm(ref, prefill_graphs=True, prefill_graph_tokens=16)
    graphs = llm.runner.prefill_graphs
    assert graphs.sizes == [8, 16]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    for prompt, want in zip(ref.prompts[:2], ref.greedy[:2], strict=True):
        (out,) = llm.generate([prompt], params)
        assert out.output_ids == want
    assert graphs.replays == {8: 1, 16: 0}


@pytest.mark.parametrize("bad", [0, -3, 2.5, "512"])
def test_bad_prefill_graph_tokens_is_refused(bad):
    from unikv.engine.config import EngineConfig

    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        EngineConfig(model="m", device="cpu", prefill_graph_tokens=bad)


def test_prompt_logprobs_through_the_pieces(ref, small_sizes):
    """Prompt logprobs (more logits rows than requests: the head's own rows plan)
    through the pieces equal transformers' teacher-forced log-softmax."""
    llm = engine_llm(ref, prefill_graphs=True)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate(ref.prompts[:2], params)
    assert sum(llm.runner.prefill_graphs.replays.values()) > 0
    for prompt, out in zip(ref.prompts[:2], outputs, strict=True):
        want = torch.log_softmax(hf_logits(ref.hf, prompt).double(), dim=-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            got = out.prompt_logprobs[i][prompt[i]].logprob
            assert abs(got - want[i - 1, prompt[i]].item()) < 1e-4, (i, got)


def test_mla_model_is_refused(tmp_path):
    """MLA layers call step ops the pieces do not cut at: refused at start-up, naming
    the option to turn off."""
    from unikv.engine import LLM

    save_tiny_deepseek(2, str(tmp_path))
    with pytest.raises(ValueError, match="MLA.*prefill_graphs=False"):
        LLM(str(tmp_path), device="cpu", max_num_seqs=2, max_model_len=64, prefill_graphs=True)
