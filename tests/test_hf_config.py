"""HF configs -> specs, checked against transformers itself: each tiny model is
built from its config class (no downloads), run on 5 tokens, and the cache it
fills says per layer which kind of state it keeps and with what shape."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionLayer

from unikv.hf_config import ARCHITECTURES, model_specs_from_hf_config, specs_from_hf_config
from unikv.specs import MambaSpec, MHASpec, MLASpec

T = transformers
SMALL = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4, "vocab_size": 100}
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}

CASES = {
    "llama": (
        T.LlamaForCausalLM,
        lambda: T.LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **SMALL),
    ),
    "mistral-swa": (
        T.MistralForCausalLM,
        lambda: T.MistralConfig(
            num_hidden_layers=2, num_key_value_heads=2, sliding_window=3, head_dim=8, **SMALL
        ),
    ),
    "mixtral": (
        T.MixtralForCausalLM,
        lambda: T.MixtralConfig(num_hidden_layers=2, num_key_value_heads=1, **MOE, **SMALL),
    ),
    "qwen2-swa-from-layer-1": (
        T.Qwen2ForCausalLM,
        lambda: T.Qwen2Config(
            num_hidden_layers=3,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=1,
            **SMALL,
        ),
    ),
    "qwen3": (
        T.Qwen3ForCausalLM,
        lambda: T.Qwen3Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=32, **SMALL),
    ),
    "qwen3-moe": (
        T.Qwen3MoeForCausalLM,
        lambda: T.Qwen3MoeConfig(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            **SMALL,
        ),
    ),
    "gpt-oss": (
        T.GptOssForCausalLM,
        lambda: T.GptOssConfig(
            num_hidden_layers=4, num_key_value_heads=2, head_dim=8, sliding_window=3, **MOE, **SMALL
        ),
    ),
    "gemma2": (
        T.Gemma2ForCausalLM,
        lambda: T.Gemma2Config(
            num_hidden_layers=3, num_key_value_heads=2, head_dim=32, sliding_window=3, **SMALL
        ),
    ),
    "gemma3": (
        T.Gemma3ForCausalLM,
        lambda: T.Gemma3TextConfig(
            num_hidden_layers=7, num_key_value_heads=1, head_dim=24, sliding_window=3, **SMALL
        ),
    ),
    "deepseek-v2": (
        T.DeepseekV2ForCausalLM,
        lambda: T.DeepseekV2Config(
            num_hidden_layers=2,
            num_key_value_heads=4,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=12,
            q_lora_rank=None,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            **SMALL,
        ),
    ),
    "deepseek-v3": (
        T.DeepseekV3ForCausalLM,
        lambda: T.DeepseekV3Config(
            num_hidden_layers=2,
            num_key_value_heads=4,
            kv_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=12,
            q_lora_rank=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            **SMALL,
        ),
    ),
    "bamba": (
        T.BambaForCausalLM,
        lambda: T.BambaConfig(
            num_hidden_layers=4,
            num_key_value_heads=2,
            attn_layer_indices=[1, 3],
            mamba_n_heads=8,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=3,
            mamba_chunk_size=4,
            **SMALL,
        ),
    ),
}


def cache_facts(model_cls, config) -> list[dict]:
    """Per model layer, what transformers' own cache holds after 5 tokens."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_cls(config).eval()
        with torch.no_grad():
            cache = model(torch.tensor([[1, 2, 3, 4, 5]]), use_cache=True).past_key_values
    facts = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionLayer):
            facts.append(
                {
                    "kind": "mamba",
                    "conv": tuple(layer.conv_states[0].shape[1:]),
                    "ssm": tuple(layer.recurrent_states[0].shape[1:]),
                }
            )
            continue
        fact = {
            "kind": "full",
            "heads": layer.keys.shape[1],
            "k_dim": layer.keys.shape[-1],
            "v_dim": layer.values.shape[-1],
        }
        if isinstance(layer, DynamicSlidingWindowLayer):
            fact.update(kind="swa", window=layer.sliding_window)
        facts.append(fact)
    return facts


@pytest.mark.parametrize("case", list(CASES))
def test_specs_match_what_transformers_caches(case: str) -> None:
    model_cls, make_config = CASES[case]
    config = make_config()
    facts = cache_facts(model_cls, config)
    model = model_specs_from_hf_config(config, page_size=4)
    assert model.num_hidden_layers == len(facts)
    served = sorted(i for sub in model.subpools for i in sub.layers)
    assert served == list(range(len(facts))), "every layer in exactly one sub-pool"
    for sub in model.subpools:
        spec = sub.spec
        assert spec.num_layers == len(sub.layers)
        for i in sub.layers:
            fact = facts[i]
            assert model.layer_kinds[i] == sub.name
            if isinstance(spec, MHASpec):
                assert (fact["kind"], fact["heads"], fact["k_dim"], fact["v_dim"]) == (
                    spec.kind,
                    spec.num_kv_heads,
                    spec.head_dim,
                    spec.v_head_dim,
                ), (i, fact, spec)
                assert fact.get("window") == spec.sliding_window
            elif isinstance(
                spec, MLASpec
            ):  # transformers caches the latent as K, the rope part as V
                assert (fact["k_dim"], fact["v_dim"]) == (spec.kv_lora_rank, spec.rope_dim)
            else:
                assert fact["kind"] == "mamba"
                assert (fact["conv"], fact["ssm"]) == (spec.conv[0].shape, spec.temporal.shape)
        assert sub.page_size == (1 if isinstance(spec, MambaSpec) else 4)


def test_mla_row_is_the_width_of_the_compressed_kv_projection() -> None:
    model_cls, make_config = CASES["deepseek-v3"]
    config = make_config()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attn = model_cls(config).model.layers[0].self_attn
    (spec_sub,) = specs_from_hf_config(config)
    assert attn.kv_a_proj_with_mqa.out_features == spec_sub.spec.row_elems
    assert attn.kv_a_layernorm.weight.shape[0] == spec_sub.spec.kv_lora_rank


@pytest.mark.parametrize("case", list(CASES))
def test_a_config_dict_without_derived_fields_gives_the_same_specs(case: str, tmp_path) -> None:
    """Read as plain JSON, without transformers' __post_init__: fields such as
    layer_types are re-derived by unikv's own rules and must agree."""
    config = CASES[case][1]()
    raw = json.loads(config.to_json_string(use_diff=False))
    raw.pop("layer_types", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    want = specs_from_hf_config(config)
    assert specs_from_hf_config(raw) == want
    assert specs_from_hf_config(tmp_path) == want
    assert specs_from_hf_config(str(tmp_path / "config.json")) == want


def test_multimodal_gemma3_reads_its_text_config() -> None:
    text = CASES["gemma3"][1]()
    outer = T.Gemma3Config(text_config=text.to_dict())
    assert specs_from_hf_config(outer) == specs_from_hf_config(text)


def test_unknown_architecture_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown architecture 'mamba2'") as info:
        specs_from_hf_config(T.Mamba2Config())
    for name in ARCHITECTURES:
        assert repr(name) in str(info.value)
    with pytest.raises(ValueError, match="no config.json"):
        specs_from_hf_config("/nonexistent/model")


def test_dtype_and_page_size_options() -> None:
    config = CASES["bamba"][1]()
    subs = {s.name: s for s in specs_from_hf_config(config, page_size=16, dtype="fp8")}
    assert subs["full"].page_size == 16 and subs["mamba"].page_size == 1
    assert subs["full"].spec.dtype == torch.float8_e4m3fn
    assert subs["full"].spec.storage_dtype == torch.uint8
    assert subs["mamba"].spec.conv[0].dtype == torch.bfloat16  # no fp8 conv state
    assert subs["mamba"].spec.temporal.dtype == torch.float32
    subs = {s.name: s for s in specs_from_hf_config(config, dtype=torch.float16, ssm_dtype="bf16")}
    assert subs["mamba"].spec.conv[0].dtype == torch.float16
    assert subs["mamba"].spec.temporal.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of .* got 'int4'"):
        specs_from_hf_config(config, dtype="int4")
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        specs_from_hf_config(config, page_size=0)


def test_model_facts() -> None:
    config = CASES["gpt-oss"][1]()
    model = model_specs_from_hf_config(config)
    assert model.model_type == "gpt_oss"
    assert model.max_position_embeddings == config.max_position_embeddings
    assert model.layer_kinds == tuple(
        "swa" if t == "sliding_attention" else "full" for t in config.layer_types
    )
