"""Zamba2 (Mamba-2 layers; hybrid layers fed by shared attention blocks, one
block's weights serving several layers, each with its own K/V cache and LoRA
adapters) in unikv against transformers on the same weights (fp32 CPU, torch ops).

Two tiny models:
- "adapters": 6 layers, hybrid on 1, 3 and 4 over 2 shared blocks (layer 4 reuses
  block 0, the weights stored under layer 1, with its own adapters), q/k/v and MLP
  adapters, rope;
- "plain": the same pattern over 1 block, no q/k/v adapters, no rope, GQA (4/2).

Each: the model alone gives transformers' logits (1e-4), and the engine
transformers' greedy tokens for a batch of mixed lengths. On "adapters": pages 1, 4
and 16, 7-token chunks cutting prompts mid-way, preemption, and the byte oracle
(state slot of every layer and K/V rows of the three hybrid layers after prefill
equal transformers' cache: three caches under one block's weights).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from engine_fixtures import DenseMamba2Step, hf_logits, one_thread  # noqa: F401  (a fixture)
from mamba_hybrid_fixtures import (
    check_chunks,
    check_greedy,
    check_preemption,
    check_prefill_bytes,
    reference,
    save_hf,
    zamba2_config,
)

from unikv.models import load_model, load_model_config

pytestmark = pytest.mark.usefixtures("one_thread")

HYBRID = [1, 3, 4]
VARIANTS = {
    "adapters": {},
    "plain": {
        "num_mem_blocks": 1,
        "use_shared_attention_adapter": False,
        "use_mem_rope": False,
        "num_key_value_heads": 2,
    },
}


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    made = {}

    def get(variant: str):
        if variant not in made:
            path = str(tmp_path_factory.mktemp(f"zamba2_{variant}"))
            made[variant] = reference(zamba2_config(**VARIANTS[variant]), path)
        return made[variant]

    return get


@pytest.fixture(scope="module")
def ref(refs):
    return refs("adapters")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_greedy_match_transformers(refs, variant):
    ref = refs(variant)
    model = load_model(ref.path)
    tokens = ref.prompts[3][:37]  # > chunk_size 16
    step = DenseMamba2Step((24 / 2) ** -0.5)  # head_dim 2 * 48 / 4, scaled as head_dim / 2
    ours = model(torch.tensor(tokens), torch.arange(len(tokens)), step)
    want = hf_logits(ref.hf, tokens)
    assert want.std() > 0.3 and (ours - want).abs().max() < 1e-4
    assert step.min_dt < ref.hf.config.time_step_min  # the clamp binds and is applied
    check_greedy(ref)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_at_page_sizes(ref, page_size):
    llm = check_greedy(ref, page_size=page_size)
    assert {n: list(llm.pool[n].layers) for n in llm.pool.subpools} == {
        "full": HYBRID,
        "mamba": list(range(6)),
    }


def test_chunked_prefill_cuts_prompts_mid_way(ref):
    check_chunks(ref)


def test_tight_pool_preempts_with_same_tokens(ref):
    check_preemption(ref)


def test_state_and_kv_bytes_after_prefill_match_transformers_cache(ref):
    check_prefill_bytes(ref, HYBRID)


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively")
def test_triton_kernels_under_the_interpreter(ref):
    """The engine on the Triton ops (TRITON_INTERPRET=1 on CPU, set by conftest):
    the shared block's rope inside the K/V store of three layers' caches."""
    from unikv.engine import LLM, SamplingParams

    llm = LLM(ref.path, device="cpu", backend="triton", page_size=4, max_model_len=64,
              max_num_batched_tokens=16)  # fmt: skip
    # one 17-token prompt (a 16-token chunk, then 1) and 5 tokens: the interpreter is slow
    outputs = llm.generate(ref.prompts[1:2], SamplingParams(max_tokens=5, temperature=0.0))
    assert outputs[0].output_ids == ref.greedy[1][:5]


def test_tied_copies_in_a_checkpoint_are_ignored(ref, tmp_path):
    """A checkpoint that also stores the tied copy of a shared block (layer 4's, of
    block 0) loads, the copy unused: the same logits."""
    import shutil

    from safetensors.torch import load_file, save_file

    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{ref.path}/{name}", tmp_path / name)
    tensors = load_file(tmp_path / "model.safetensors")
    prefix = "model.layers.1.shared_transformer."
    for name in [n for n in tensors if n.startswith(prefix)]:
        tensors[name.replace("layers.1.", "layers.4.")] = tensors[name].clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    tokens = torch.tensor(ref.prompts[1])
    logits = [
        load_model(path)(tokens, torch.arange(len(tokens)), DenseMamba2Step(12**-0.5))
        for path in (ref.path, str(tmp_path))
    ]
    assert torch.equal(*logits)


def test_shared_block_weights_load_once_and_adapters_per_layer(ref):
    """Layers 1 and 4 run one block's weights (the same tensors) but their own
    adapters, which equal the checkpoint's at their hybrid index (0 and 2)."""
    from safetensors.torch import load_file

    model = load_model(ref.path)
    layers = model.model.layers
    assert layers[1].shared[0] is layers[4].shared[0] is not layers[3].shared[0]
    assert not hasattr(layers[4], "shared_transformer")
    saved = load_file(f"{ref.path}/model.safetensors")
    block = layers[1].shared_transformer
    for j in (0, 2):
        name = f"model.layers.1.shared_transformer.self_attn.linear_q_adapter_list.{j}.0.weight"
        assert torch.equal(block.self_attn.linear_q_adapter_list[j][0].weight, saved[name])
    assert isinstance(block.self_attn.linear_q_adapter_list[1], torch.nn.Identity)


def test_bad_configs_raise(tmp_path):
    from unikv.models.zamba2 import Zamba2ForCausalLM

    save_hf(
        zamba2_config(num_hidden_layers=2, layers_block_type=["mamba", "hybrid"]), str(tmp_path)
    )
    config, _ = load_model_config(str(tmp_path))
    with pytest.raises(ValueError, match="tensor parallelism"):
        Zamba2ForCausalLM(config, 64, tp=SimpleNamespace(size=4, rank=0))  # 6 Mamba heads
    bad = type(config)(**{**config.__dict__, "num_kv_heads": 2})
    with pytest.raises(ValueError, match="num_key_value_heads == num_attention_heads"):
        Zamba2ForCausalLM(bad, 64)
    bad = type(config)(**{**config.__dict__, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="hidden_act must be one of"):
        Zamba2ForCausalLM(bad, 64)
