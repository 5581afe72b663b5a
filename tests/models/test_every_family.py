"""Every architecture the family table (``unikv/models/family.py``) runs, from the
table: one tiny random-init checkpoint per architecture, greedy tokens equal
transformers'.

The table drives the parametrisation. An architecture added to a family with a model
fails ``test_every_architecture_has_a_tiny_checkpoint`` until it has a saver here, so
no family runs untested. The families' own test files go deeper (preemption, chunks, page sizes,
byte oracles); this is the floor every entry of the table meets.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import (
    hf_greedy,
    save_tiny_deepseek,
    save_tiny_falcon_h1,
    save_tiny_gemma,
    save_tiny_hybrid,
    save_tiny_model,
    save_tiny_nemotron_h,
)
from family_fixtures import (
    save_tiny_gemma3_mm,
    save_tiny_lfm2,
    save_tiny_qwen3_5_mm,
    save_tiny_qwen3_5_moe,
)
from mamba_hybrid_fixtures import bamba_config, granite_config, save_hf, zamba2_config
from test_engine_kimi_linear import save_tiny_kimi
from test_engine_mimo import save_tiny_mimo
from test_engine_mixtral import save_tiny_mixtral
from test_engine_qwen3_moe import save_tiny_qwen3_moe

from unikv.models import family

NEW_TOKENS = 8
PROMPT_LENS = (5, 19)  # one page-crossing batch of two


SAVERS = {  # architecture -> a saver returning transformers' fp32 eval model
    "LlamaForCausalLM": lambda p: save_tiny_model("llama", p),
    "MistralForCausalLM": lambda p: save_tiny_model("mistral", p),
    "Qwen2ForCausalLM": lambda p: save_tiny_model("qwen2", p),
    "Qwen3ForCausalLM": lambda p: save_tiny_model("qwen3", p),
    "GptOssForCausalLM": lambda p: save_tiny_model("gpt_oss", p),
    "Qwen3_5ForCausalLM": lambda p: save_tiny_hybrid("qwen3_5", p),
    "Qwen3_5ForConditionalGeneration": save_tiny_qwen3_5_mm,
    "Qwen3_5MoeForCausalLM": save_tiny_qwen3_5_moe,
    "Qwen3_5MoeForConditionalGeneration": lambda p: save_tiny_qwen3_5_mm(p, moe=True),
    "Qwen3NextForCausalLM": lambda p: save_tiny_hybrid("qwen3_next", p),
    "NemotronHForCausalLM": lambda p: save_tiny_nemotron_h(p, "M*-E"),
    "FalconH1ForCausalLM": save_tiny_falcon_h1,
    "DeepseekV2ForCausalLM": lambda p: save_tiny_deepseek(2, p),
    "DeepseekV3ForCausalLM": lambda p: save_tiny_deepseek(3, p),
    "KimiLinearForCausalLM": save_tiny_kimi,
    "Gemma2ForCausalLM": lambda p: save_tiny_gemma("gemma2", p),
    "Gemma3ForCausalLM": lambda p: save_tiny_gemma("gemma3", p),
    "Gemma3ForConditionalGeneration": save_tiny_gemma3_mm,
    "MiMoV2FlashForCausalLM": save_tiny_mimo,
    "MixtralForCausalLM": save_tiny_mixtral,
    "Qwen3MoeForCausalLM": save_tiny_qwen3_moe,
    "Lfm2ForCausalLM": save_tiny_lfm2,
    "BambaForCausalLM": lambda p: save_hf(bamba_config(), p),
    "GraniteMoeHybridForCausalLM": lambda p: save_hf(granite_config(), p),
    "Zamba2ForCausalLM": lambda p: save_hf(zamba2_config(), p),
}


def test_every_architecture_has_a_tiny_checkpoint():
    runs = set(family.architectures())
    missing = sorted(runs - set(SAVERS))
    assert not missing, f"architectures the family table runs with no tiny checkpoint: {missing}"
    assert not set(SAVERS) - runs, "a saver for an architecture the table no longer runs"


def _cases():
    for f in family.FAMILIES:
        for a in f.architectures:
            yield pytest.param(a, id=f"{f.name}-{a}")


@pytest.mark.parametrize("arch", list(_cases()))
def test_greedy_tokens_equal_transformers(arch, tmp_path):
    from unikv.engine import LLM, SamplingParams

    assert arch in SAVERS, "no tiny checkpoint (test_every_architecture_has_a_tiny_checkpoint)"
    hf = SAVERS[arch](str(tmp_path))
    assert type(hf).__name__ == arch
    vocab = hf.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    llm = LLM(str(tmp_path), device="cpu", dtype=torch.float32, page_size=4, max_model_len=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert [o.output_ids for o in outs] == want
