"""The batch-size rule costs nothing (issue 42: "at B = 64 speculation is never slower
than without"): a decode step past ``disable_by_batch_size`` is the plain engine's
step, op for op.

Oracle: the same engine without ``speculative_config``, over the same requests.
Each loop step is counted twice: the aten ops it dispatches (a
``TorchDispatchMode``: every device op the step launches, its plan's uploads and
table writes included) and the Python calls it makes into
``unikv/engine/speculative/`` (``sys.setprofile``: the speculator's per-step
bookkeeping). For n-gram speculation past the rule the ops per step equal the
plain engine's step for step, and the step calls nothing of the speculator (the
rule is a host int the scheduler reads: ``Scheduler.spec_limit``).
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from engine_fixtures import VOCAB, one_thread, save_tiny_model  # noqa: F401  (a fixture)
from torch.utils._python_dispatch import TorchDispatchMode

from unikv.engine import LLM, SamplingParams
from unikv.engine.online import EngineLoop

pytestmark = pytest.mark.usefixtures("one_thread")
SPECULATIVE = "/unikv/engine/speculative/"


class _Ops(TorchDispatchMode):
    """Counts the aten ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def step_costs(llm: LLM, prompts, params, monkeypatch) -> list[tuple[str, int, int, Counter]]:
    """Per loop step: (batch kind, requests, aten ops dispatched, the functions of the
    speculative package entered from outside it, counted: empty when the step made no
    call into it)."""
    costs, step = [], EngineLoop.step

    def inside(frame) -> bool:
        return frame is not None and SPECULATIVE in frame.f_code.co_filename.replace("\\", "/")

    def counted(loop):
        ops, entered = _Ops(), Counter()

        def profile(frame, event, arg):
            if event == "call" and inside(frame) and not inside(frame.f_back):
                entered[frame.f_code.co_qualname] += 1

        sys.setprofile(profile)
        try:
            with ops:
                out = step(loop)
        finally:
            sys.setprofile(None)
        if out is not None:
            costs.append((out[0].kind.name, len(out[0].requests), ops.count, entered))
        return out

    with monkeypatch.context() as m:
        m.setattr(EngineLoop, "step", counted)
        llm.generate(prompts, params)
    return costs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rule_step_is_the_plain_step_op_for_op(tmp_path, monkeypatch, device):
    """Four requests decoding, limit 2: every decode step but the last (where the
    requests finish and leave the speculator's sets) dispatches as many ops as the
    plain engine's step and calls nothing in ``speculative/`` (on CUDA: the ops
    launched outside the decode graphs, which both replay)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path = str(tmp_path / "llama")
    save_tiny_model("llama", path)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (4,), generator=g).tolist() * 3 for _ in range(4)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = {"device": device, "dtype": torch.float32, "page_size": 4, "max_num_seqs": 4,
          "max_num_batched_tokens": 64, "max_model_len": 64, "kv_cache_bytes": 16 << 20}  # fmt: skip
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2, "disable_by_batch_size": 2}  # fmt: skip
    plain = step_costs(LLM(path, **kw), prompts, params, monkeypatch)
    llm = LLM(path, speculative_config=spec, **kw)
    rule = step_costs(llm, prompts, params, monkeypatch)
    assert [c[:3] for c in rule[:-1]] == [c[:3] for c in plain[:-1]]
    decodes = [c for c in rule[:-1] if c[0] == "DECODE"]
    assert len(decodes) >= 7 and all(c[1] == 4 for c in decodes)
    assert all(not calls for _, _, _, calls in decodes)  # no speculative bookkeeping
    assert llm.scheduler.spec.counters.skipped_by_batch_size >= len(decodes)
