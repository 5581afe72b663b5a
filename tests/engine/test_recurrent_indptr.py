"""A chunked recurrent step of a hybrid on CUDA with fla-core hands its Gated DeltaNet
layers the step's q_indptr in int64 and fla-core's chunk list of it
(``StepPlan.state_indptr`` / ``state_chunks``, one asynchronous upload): fla-core then
derives no chunk list from the device (a host sync), and Mamba-2's ``chunk_simple_gla``,
which memoises its own by the identity of ``cu_seqlens``, derives it once a step (one
tensor for every layer of a step), never a stale one (a new tensor each step: the
plan's q_indptr is the same object every step with new contents). Decode steps keep
the plan's view (CUDA-graph inputs at fixed addresses) and no list.

Oracles: the step's own batch (host ints): its requests' new-token counts, summed, and
a walk over each lane's 64-token chunks; the same tokens with the lists off.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_fixtures import HYBRID_LAYERS, VOCAB, one_thread, save_tiny_hybrid  # noqa: F401

from unikv.engine import LLM, SamplingParams
from unikv.engine.online import EngineLoop
from unikv.kernels.recurrent.fla_prefill import chunk_indices

pytestmark = pytest.mark.usefixtures("one_thread")


def traced(llm, monkeypatch, prompts) -> tuple[list, list]:
    """Generate ``prompts`` (3 tokens each, greedy) with the Gated DeltaNet op and the
    loop's steps spied on: (per op call (its step's index, its args, its kwargs), per
    step (decode or not, its requests' new-token counts)); and the outputs."""
    calls: list = []
    steps: list = []
    real = llm.runner.backend.gated_delta_rule

    def spy(*args, **kwargs):
        calls.append((len(steps), args, kwargs))
        return real(*args, **kwargs)

    llm.runner.backend = dataclasses.replace(llm.runner.backend, gated_delta_rule=spy)
    step = EngineLoop.step

    def counted(loop):
        out = step(loop)
        if out is not None:
            steps.append((out[0].is_decode, list(out[0].num_new)))
        return out

    with monkeypatch.context() as m:
        m.setattr(EngineLoop, "step", counted)
        outs = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))
    llm.runner.backend = dataclasses.replace(llm.runner.backend, gated_delta_rule=real)
    return calls, steps, outs


def test_chunk_indices_match_a_naive_walk():
    """``fla_prefill.chunk_indices`` against a walk over each lane's chunks (lanes with
    no tokens, one token, exact and partial chunks)."""
    lens = [0, 1, 64, 65, 130, 0, 3, 128]
    indptr = [0, *torch.tensor(lens).cumsum(0).tolist()]
    want = [(b, i) for b, n in enumerate(lens) for i in range(-(-n // 64))]
    got = chunk_indices(indptr)
    assert got.dtype == "int64" and got.tolist() == [list(w) for w in want]
    assert chunk_indices([0, 5, 9], chunk=4).tolist() == [[0, 0], [0, 1], [1, 0]]


def test_chunked_steps_carry_a_fresh_int64_indptr_and_its_chunk_list(tmp_path, monkeypatch):
    """With ``StepPlanner.state_chunks`` on (set here on the CPU), every Gated DeltaNet
    call of a chunked step gets one int64 q_indptr, new that step, equal to the step's
    cumulative new-token counts, and one chunk list equal to a walk over them."""
    save_tiny_hybrid("qwen3_5", str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", dtype=torch.float32, page_size=4,
              max_num_seqs=4, max_num_batched_tokens=96, max_model_len=256)  # fmt: skip
    llm.runner.planner.state_chunks = True
    prompts = [[(5 * i + j) % VOCAB for j in range(n)] for i, n in enumerate((70, 3, 140))]
    traced_calls, steps, outs = traced(llm, monkeypatch, prompts)
    calls = [(i, args[7], kwargs.get("chunks")) for i, args, kwargs in traced_calls]

    layers = sum(t == "linear_attention" for t in HYBRID_LAYERS)  # the model's GDN layers
    assert layers > 1  # (else one tensor a step holds trivially)
    chunked = 0
    kept = []  # every step's tensor stays alive: ids cannot be reused
    for index, (decode, new) in enumerate(steps):
        got = [(q, c) for i, q, c in calls if i == index]
        assert len(got) == layers, (index, len(got))
        if decode or max(new) == 1:
            assert all(q.dtype == torch.int32 and c is None for q, c in got), index
            continue
        chunked += 1
        q, c = got[0]
        assert all(g[0] is q and g[1] is c for g in got), f"step {index}: one of each a step"
        want = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()])
        assert q.dtype == torch.int64 and torch.equal(q[: len(want)].cpu(), want), (index, q)
        walk = [[b, i] for b, n in enumerate(new) for i in range(-(-n // 64))]
        assert c.tolist() == walk, (index, new)
        assert all(q is not k for k in kept), f"step {index} reuses an earlier tensor"
        kept.append(q)
    assert chunked >= 3  # 213 prompt tokens over 96-token chunks
    llm.runner.planner.state_chunks = False  # the same tokens without them
    again = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))
    assert [o.output_ids for o in again] == [o.output_ids for o in outs]
