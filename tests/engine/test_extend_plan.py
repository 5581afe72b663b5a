"""The fresh prompts' attention variant is the step's plan (``ExtendPlan``), made once per
step by ``StepPlanner`` from host ints, as ``DecodePlan`` is.

Oracles: the backend's own extend op (every key a plan's ``launch`` holds is a keyword
parameter of it, so a layer can pass the plan through), the variants' published
thresholds (``fresh_hopper.MIN_Q_LEN``, ``sdpa.MIN_TOKENS``), and, for the planner, the
steps the scheduler must form from the prompt lengths and the token budget: a recording
``plan_extend`` sees exactly the fresh prompts of each step, every layer's fresh-prompt
attention is handed that step's plan, and the tokens still equal transformers' greedy
ones.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from engine_fixtures import VOCAB, hf_greedy, one_thread, save_tiny_model  # noqa: F401

from unikv.engine import LLM, SamplingParams
from unikv.kernels import backend as kb

pytestmark = pytest.mark.usefixtures("one_thread")


def _triton_backends() -> dict[str, kb.KernelBackend]:
    pytest.importorskip("triton")
    return {
        "plain": kb._triton(kb.Flags()),
        "sdpa": kb._triton(kb.Flags(cuda=True, extend_sdpa=True, extend_hopper=False)),
        "hopper": kb._triton(kb.Flags(cuda=True, sm90=True)),
        "hopper-sdpa": kb._triton(kb.Flags(cuda=True, sm90=True, extend_sdpa=True)),
    }


def test_each_backend_plans_the_variants_it_has():
    from unikv.kernels.attention import fresh_hopper, sdpa

    ops = _triton_backends()
    torch_ops = kb.get_backend("cpu", "torch")
    assert torch_ops.plan_extend(1, max_q_len=1 << 20, head_dim=128).launch == {}
    assert ops["plain"].plan_extend(1, max_q_len=1 << 20, head_dim=128).launch == {}
    one = ops["sdpa"].plan_extend(1, max_q_len=sdpa.MIN_TOKENS, head_dim=64).launch
    two = ops["sdpa"].plan_extend(2, max_q_len=1 << 20, head_dim=64).launch
    assert one == {"sdpa": True} and two == {"sdpa": False}
    long = fresh_hopper.MIN_Q_LEN[128]
    both = ops["hopper-sdpa"].plan_extend(1, max_q_len=long, head_dim=128).launch
    assert both == {"hopper": True, "sdpa": True}
    short = ops["hopper"].plan_extend(4, max_q_len=long - 1, head_dim=128).launch
    assert short == {"hopper": False}


def test_a_plans_keys_are_keywords_of_its_backends_extend_op():
    """Every backend, the ones ``fit_backend`` makes for head dims the Triton attention
    cannot tile included (the references' extend op takes no plan keys, so the plan
    must fall back with it)."""
    from unikv.kernels.runtime import widths
    from unikv.placement import SubPoolConfig
    from unikv.specs import MHASpec

    backends = {**_triton_backends(), "torch": kb.get_backend("cpu", "torch")}
    narrow = [SubPoolConfig("full", MHASpec(2, 2, 6, dtype=torch.float32), page_size=4)]
    for name in ("hopper-sdpa", "sdpa"):
        backends[f"{name}, head_dim 6"] = widths.fit_backend(backends[name], narrow)
    for name, ops in backends.items():
        params = inspect.signature(ops.extend_attention).parameters
        launch = ops.plan_extend(1, max_q_len=1 << 20, head_dim=128).launch
        for key in launch:
            assert key in params and params[key].kind is inspect.Parameter.KEYWORD_ONLY, (
                f"{name}: plan key {key!r} is no keyword of its extend_attention"
            )


def test_the_planner_plans_each_steps_fresh_prompts_once(tmp_path):
    """Prompts of 20 and 5 tokens, 16 tokens a step: step 1 is the first 16 of the
    first prompt (fresh: one prompt, 16 long); step 2 holds its last 4 (cached prefix)
    and the whole second prompt (a split step whose fresh part is one prompt of 5);
    then decode steps (no fresh prompt, no plan)."""
    hf = save_tiny_model("llama", str(tmp_path))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (20, 5)]
    llm = LLM(str(tmp_path), device="cpu", page_size=4, max_model_len=64,
              max_num_batched_tokens=16)  # fmt: skip
    runner, calls, seen = llm.runner, [], []
    reference = runner.backend.extend_attention

    def recording(num_requests, *, max_q_len, head_dim):
        calls.append((num_requests, max_q_len, head_dim))
        return kb.ExtendPlan({"probe": len(calls) - 1})  # which plan a layer was handed

    def extend_attention(*args, probe=None, **kw):
        seen.append((probe, kw.get("fresh_kv") is not None))
        return reference(*args, **kw)

    ops = dataclasses.replace(
        runner.backend, plan_extend=recording, extend_attention=extend_attention
    )
    runner.backend = runner.planner.backend = ops
    outputs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0))
    dim = hf.config.hidden_size // hf.config.num_attention_heads
    assert calls == [(1, 16, dim), (1, 5, dim)]
    # every layer's fresh part got its step's plan; a cached part got none
    layers = hf.config.num_hidden_layers
    assert seen == [(0, True)] * layers + [(None, False), (1, True)] * layers
    assert [o.output_ids for o in outputs] == [hf_greedy(hf, p, 3) for p in prompts]
