"""A chunked recurrent step hands its Gated DeltaNet layers one int64 ``q_indptr``
(``DecodeAttention._chunked_indptr``): fla-core memoises its chunk indices, a host
sync, by the identity of ``cu_seqlens``, so one tensor for every layer of a step means
one derivation a step instead of one a layer; a fresh tensor each step, because the
plan's view is the same object every step with new contents (a memo keyed on it would
hand a later step an earlier step's chunks). Decode steps keep the plan's view
(CUDA-graph inputs at fixed addresses).

Oracle: the step's own batch (host ints): its requests' new-token counts, summed.
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


def test_chunked_steps_share_one_fresh_int64_indptr(tmp_path, monkeypatch):
    save_tiny_hybrid("qwen3_5", str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", dtype=torch.float32, page_size=4,
              max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)  # fmt: skip
    prompts = [[(7 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((21, 9, 14))]
    traced_calls, steps, _ = traced(llm, monkeypatch, prompts)
    calls = [(i, args[7]) for i, args, _ in traced_calls]  # the q_indptr each call got

    layers = sum(t == "linear_attention" for t in HYBRID_LAYERS)  # the model's GDN layers
    assert layers > 1  # (else one tensor a step holds trivially)
    chunked = seen = 0
    kept = []  # every step's tensor stays alive: ids cannot be reused
    for index, (decode, new) in enumerate(steps):
        got = [q for i, q in calls if i == index]
        assert len(got) == layers, (index, len(got))
        want = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()])
        if decode or max(new) == 1:
            assert all(q.dtype == torch.int32 for q in got), index  # the plan's view
            continue
        chunked += 1
        assert all(q is got[0] for q in got), f"step {index}: one tensor for every layer"
        assert got[0].dtype == torch.int64
        assert torch.equal(got[0][: len(want)].cpu(), want), (index, got[0], want)
        assert all(got[0] is not q for q in kept), f"step {index} reuses an earlier tensor"
        kept.append(got[0])
        seen += 1
    assert chunked >= 3 and seen == chunked  # 44 prompt tokens over 16-token chunks


def test_chunk_indices_match_a_naive_walk():
    """``fla_prefill.chunk_indices`` against a walk over each lane's chunks (lanes with
    no tokens, one token, exact and partial chunks)."""
    lens = [0, 1, 64, 65, 130, 0, 3, 128]
    indptr = [0, *torch.tensor(lens).cumsum(0).tolist()]
    want = [(b, i) for b, n in enumerate(lens) for i in range(-(-n // 64))]
    got = chunk_indices(indptr)
    assert got.dtype == "int64" and got.tolist() == [list(w) for w in want]
    assert chunk_indices([0, 5, 9], chunk=4).tolist() == [[0, 0], [0, 1], [1, 0]]


def test_chunked_steps_carry_their_chunk_list(tmp_path, monkeypatch):
    """With ``StepPlanner.state_chunks`` on (a hybrid on CUDA with fla-core; set here on
    the CPU), every Gated DeltaNet call of a chunked step gets the step's chunk list,
    equal to a walk over the step's new-token counts; decode steps get none."""
    save_tiny_hybrid("qwen3_5", str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", dtype=torch.float32, page_size=4,
              max_num_seqs=4, max_num_batched_tokens=160, max_model_len=256)  # fmt: skip
    llm.runner.planner.state_chunks = True
    prompts = [[(5 * i + j) % VOCAB for j in range(n)] for i, n in enumerate((70, 3, 140))]
    traced_calls, steps, outs = traced(llm, monkeypatch, prompts)
    calls = [(i, kwargs.get("chunks")) for i, _, kwargs in traced_calls]
    chunked = 0
    for index, (decode, new) in enumerate(steps):
        got = [c for i, c in calls if i == index]
        if decode or max(new) == 1:
            assert all(c is None for c in got), index
            continue
        chunked += 1
        want = [[b, i] for b, n in enumerate(new) for i in range(-(-n // 64))]
        assert all(c is got[0] for c in got) and got[0].tolist() == want, (index, new)
    assert chunked >= 1
    llm.runner.planner.state_chunks = False  # the same tokens without the lists
    again = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))
    assert [o.output_ids for o in again] == [o.output_ids for o in outs]
