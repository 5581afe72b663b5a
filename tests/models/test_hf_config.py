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
from unikv.specs import MambaSpec, MLASpec

T = transformers
SMALL = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4, "vocab_size": 100}
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
HYBRID_QWEN = dict(
    num_key_value_heads=2,
    head_dim=24,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=12,
    linear_value_head_dim=20,
    linear_conv_kernel_dim=3,
    **SMALL,
)

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
    "mimo_v2_flash": (  # asymmetric K/V (36 / 20), sliding layers with twice the KV heads
        T.MiMoV2FlashForCausalLM,
        lambda: T.MiMoV2FlashConfig(
            num_hidden_layers=7,  # transformers' default pattern: full on layers 0 and 5
            num_key_value_heads=1,
            head_dim=36,
            v_head_dim=20,
            sliding_window=3,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
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
    # LFM2: short convolutions (a conv window alone, no recurrent state) beside attention
    "lfm2": (
        T.Lfm2ForCausalLM,
        lambda: T.Lfm2Config(
            num_hidden_layers=5,
            num_key_value_heads=2,
            full_attn_idxs=[1, 4],
            conv_L_cache=3,
            **SMALL,
        ),
    ),
    "granitemoehybrid": (  # hub-style layer names; no rope; experts beside a shared MLP
        T.GraniteMoeHybridForCausalLM,
        lambda: T.GraniteMoeHybridConfig(
            num_hidden_layers=4,
            num_key_value_heads=2,
            layer_types=["mamba", "attention", "mamba", "attention"],
            mamba_n_heads=8,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=3,
            shared_intermediate_size=24,
            **MOE,
            **SMALL,
        ),
    ),
    "zamba2": (  # hybrid layers keep K/V (head 2 hidden / heads) and a Mamba-2 state
        T.Zamba2ForCausalLM,
        lambda: T.Zamba2Config(
            num_hidden_layers=4,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
            n_mamba_heads=8,
            mamba_d_state=16,
            mamba_ngroups=2,
            mamba_d_conv=3,
            num_mem_blocks=2,
            use_shared_attention_adapter=True,
            adapter_rank=8,
            **SMALL,
        ),
    ),
    # hybrids: Gated DeltaNet (Qwen3.5 / Qwen3-Next), Mamba-2 (NemotronH, Falcon-H1), Mamba-1
    # (Jamba). Odd sizes everywhere, so that a swapped field shows up as a wrong shape.
    "qwen3_5": (
        T.Qwen3_5ForCausalLM,
        lambda: T.Qwen3_5TextConfig(num_hidden_layers=5, **HYBRID_QWEN),  # full every 4th
    ),
    "qwen3_next": (
        T.Qwen3NextForCausalLM,
        lambda: T.Qwen3NextConfig(
            layer_types=[
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
            num_hidden_layers=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            **HYBRID_QWEN,
        ),
    ),
    "qwen3_5_moe": (
        T.Qwen3_5MoeForCausalLM,
        lambda: T.Qwen3_5MoeTextConfig(
            num_hidden_layers=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            **HYBRID_QWEN,
        ),
    ),
    "nemotron_h": (
        T.NemotronHForCausalLM,
        lambda: T.NemotronHConfig(
            hybrid_override_pattern="M-*EM",
            num_key_value_heads=2,
            head_dim=24,
            mamba_num_heads=4,
            mamba_head_dim=12,
            ssm_state_size=8,
            n_groups=2,
            conv_kernel=3,
            chunk_size=4,
            n_routed_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16,
            use_mamba_kernels=False,
            **SMALL,
        ),
    ),
    "falcon_h1": (
        T.FalconH1ForCausalLM,
        lambda: T.FalconH1Config(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=24,
            mamba_d_ssm=96,
            mamba_n_heads=6,
            mamba_d_state=8,
            mamba_n_groups=2,
            mamba_d_conv=3,
            mamba_chunk_size=4,
            **SMALL,
        ),
    ),
    "falcon_h1-d_ssm-null": (  # d_ssm null: the Mamba width is mamba_expand * hidden_size
        T.FalconH1ForCausalLM,
        lambda: T.FalconH1Config(
            num_hidden_layers=1,
            num_key_value_heads=1,
            mamba_d_ssm=None,
            mamba_expand=3,
            mamba_n_heads=4,
            mamba_d_state=8,
            mamba_chunk_size=4,
            **SMALL,
        ),
    ),
    "jamba": (
        T.JambaForCausalLM,
        lambda: T.JambaConfig(
            num_hidden_layers=5,
            num_key_value_heads=2,
            attn_layer_period=3,
            attn_layer_offset=1,
            mamba_d_state=8,
            mamba_d_conv=3,
            mamba_expand=3,
            num_experts=2,
            use_mamba_kernels=False,
            **SMALL,
        ),
    ),
}


# an irregular pattern, not derivable from an interval (Granite's is its layer_types field)
EXPLICIT_LAYER_TYPES = {"qwen3_next", "granitemoehybrid"}


def cache_facts(model_cls, config) -> list[dict]:
    """Per model layer, what transformers' own cache holds after 5 tokens of a bf16
    model: {"attention": {...}} and/or {"state": {...}} (Falcon-H1 layers hold both;
    NemotronH's MLP and MoE layers neither)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_cls(config).to(torch.bfloat16).eval()
        with torch.no_grad():
            cache = model(torch.tensor([[1, 2, 3, 4, 5]]), use_cache=True).past_key_values
    facts = []
    for layer in cache.layers:
        fact = {}
        if isinstance(layer, LinearAttentionLayer) and layer.conv_states[0] is not None:
            conv, ssm = layer.conv_states[0], layer.recurrent_states[0]
            fact["state"] = {
                "conv": (tuple(conv.shape[1:]), conv.dtype),
                # None: a conv window alone (LFM2 never fills its recurrent state)
                "ssm": (tuple(ssm.shape[1:]), ssm.dtype) if torch.is_tensor(ssm) else None,
            }
        if getattr(layer, "keys", None) is not None and torch.is_tensor(layer.keys):
            fact["attention"] = {
                "kind": "swa" if isinstance(layer, DynamicSlidingWindowLayer) else "full",
                "heads": layer.keys.shape[1],
                "k_dim": layer.keys.shape[-1],
                "v_dim": layer.values.shape[-1],
                "dtype": layer.keys.dtype,
                "window": getattr(layer, "sliding_window", None),
            }
        facts.append(fact)
    return facts


def _check_attention(spec, fact: dict, where) -> None:
    if isinstance(spec, MLASpec):  # transformers caches the latent as K, the rope part as V
        assert (fact["k_dim"], fact["v_dim"]) == (spec.kv_lora_rank, spec.rope_dim), where
    else:
        got = (fact["kind"], fact["heads"], fact["k_dim"], fact["v_dim"], fact["window"])
        want = (spec.kind, spec.num_kv_heads, spec.head_dim, spec.v_head_dim, spec.sliding_window)
        assert got == want, where
    assert fact["dtype"] == spec.dtype, where


@pytest.mark.parametrize("case", list(CASES))
def test_specs_match_what_transformers_caches(case: str) -> None:
    model_cls, make_config = CASES[case]
    config = make_config()
    facts = cache_facts(model_cls, config)
    model = model_specs_from_hf_config(config, page_size=4)  # bf16 K/V and conv, fp32 SSM
    assert model.num_hidden_layers == len(facts)
    for i, fact in enumerate(facts):
        subs = [sub for sub in model.subpools if i in sub.layers]
        kinds = {"state" if isinstance(s.spec, MambaSpec) else "attention" for s in subs}
        assert set(fact) == kinds and len(subs) == len(kinds), (i, fact, subs)
        assert model.layer_kinds[i] == ("+".join(s.name for s in subs) or "none")
        for sub in subs:
            if isinstance(sub.spec, MambaSpec):
                (conv,), ssm = sub.spec.conv, sub.spec.temporal
                want = {
                    "conv": (conv.shape, conv.dtype),
                    "ssm": None if ssm is None else (ssm.shape, ssm.dtype),
                }
                assert fact["state"] == want, (i, fact, sub.spec)
            else:
                _check_attention(sub.spec, fact["attention"], (i, fact, sub.spec))
    for sub in model.subpools:
        assert sub.spec.num_layers == len(sub.layers)
        assert sub.page_size == (1 if isinstance(sub.spec, MambaSpec) else 4)


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
    layer_types are re-derived by unikv's own rules and must agree. (A case whose
    layer_types is given explicitly keeps it: no rule could re-derive it.)"""
    config = CASES[case][1]()
    raw = json.loads(config.to_json_string(use_diff=False))
    if case not in EXPLICIT_LAYER_TYPES:
        raw.pop("layer_types", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    want = specs_from_hf_config(config)
    assert specs_from_hf_config(raw) == want
    assert specs_from_hf_config(tmp_path) == want
    assert specs_from_hf_config(str(tmp_path / "config.json")) == want


def test_zamba2_dict_without_derived_widths_and_with_hub_layer_names() -> None:
    """A Zamba2 config.json as the hub writes it: layers "mamba" / "hybrid", none of
    the widths transformers derives (attention_head_dim = 2 hidden / heads)."""
    config = CASES["zamba2"][1]()
    raw = json.loads(config.to_json_string(use_diff=False))
    for derived in ("attention_head_dim", "attention_hidden_size", "mamba_headdim", "head_dim"):
        raw.pop(derived, None)
    raw["layers_block_type"] = ["mamba", "hybrid", "mamba", "hybrid"]
    assert specs_from_hf_config(raw) == specs_from_hf_config(config)


def test_multimodal_gemma3_reads_its_text_config() -> None:
    text = CASES["gemma3"][1]()
    outer = T.Gemma3Config(text_config=text.to_dict())
    assert specs_from_hf_config(outer) == specs_from_hf_config(text)


@pytest.mark.parametrize(
    "outer, inner", [(T.Qwen3_5Config, "qwen3_5"), (T.Qwen3_5MoeConfig, "qwen3_5_moe")]
)
def test_multimodal_qwen3_5_reads_its_text_config(outer, inner) -> None:
    text = CASES[inner][1]()
    wrapper = outer(text_config=text.to_dict())
    want = specs_from_hf_config(text)
    assert specs_from_hf_config(wrapper) == want
    assert specs_from_hf_config(json.loads(wrapper.to_json_string(use_diff=False))) == want


def test_qwen3_5_dict_derives_layer_types_from_full_attention_interval() -> None:
    """transformers consumes full_attention_interval (config.json then stores
    layer_types); a hand-written dict with only the interval must agree."""
    fields = dict(num_hidden_layers=7, full_attention_interval=3, **HYBRID_QWEN)
    want = specs_from_hf_config(T.Qwen3_5TextConfig(**fields))
    assert specs_from_hf_config({"model_type": "qwen3_5_text", **fields}) == want
    assert [s.layers for s in want] == [(2, 5), (0, 1, 3, 4, 6)]


def test_falcon_h1_dict_without_d_ssm_uses_the_transformers_default() -> None:
    fields = {k: v for k, v in CASES["falcon_h1"][1]().to_dict().items() if k != "mamba_d_ssm"}
    fields.update(mamba_d_head="auto", mamba_n_heads=8)  # 8 heads divide 1024
    want = specs_from_hf_config(T.FalconH1Config(**fields))
    assert specs_from_hf_config(fields) == want
    assert want[1].spec.temporal.shape == (8, 128, 8)


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"model_type": "qwen3_next", "num_hidden_layers": 2, "layer_types": ["mamba2", "x"]},
            r"layer_types must list 2 entries out of .*'linear_attention'.* got \['mamba2', 'x'\]",
        ),
        (
            {"model_type": "nemotron_h", "hybrid_override_pattern": "M-X*"},
            r"hybrid_override_pattern 'M-X\*' has letters \['X'\]; NemotronH uses",
        ),
        (
            {"model_type": "nemotron_h", "layers_block_type": ["mamba", "attention"]},
            r"layer_types must list 2 entries .* got \['linear_attention', 'attention'\]",
        ),
        (
            {"model_type": "falcon_h1", "num_hidden_layers": 2, "layers_block_type": ["mamba"] * 2},
            r"falcon_h1 config must list 2 'hybrid' layers .* got layer types \['mamba', 'mamba'\]",
        ),
    ],
)
def test_a_bad_layer_pattern_is_a_clear_value_error(config, message) -> None:
    with pytest.raises(ValueError, match=message):
        specs_from_hf_config(config)


def test_mimo_v2_flash_hub_spelling_gives_the_transformers_specs() -> None:
    """The released config.json spells the layer pattern ``hybrid_layer_pattern`` (0 =
    full, 1 = sliding) and the sliding layers' shape ``swa_*``; read as a dict it gives
    the specs of transformers' own config object (which derives them by its rules)."""
    config = CASES["mimo_v2_flash"][1]()
    raw = json.loads(config.to_json_string(use_diff=False))
    raw.pop("layer_types")
    raw.update(
        hybrid_layer_pattern=[0, 1, 1, 1, 1, 0, 1],
        swa_num_key_value_heads=2,
        swa_head_dim=36,
        swa_v_head_dim=20,
    )
    want = specs_from_hf_config(config)
    assert specs_from_hf_config(raw) == want
    full, swa = want
    assert (full.layers, swa.layers) == ((0, 5), (1, 2, 3, 4, 6))
    assert (full.spec.num_kv_heads, swa.spec.num_kv_heads) == (1, 2)
    assert (swa.spec.head_dim, swa.spec.v_head_dim, swa.spec.sliding_window) == (36, 20, 3)
    with pytest.raises(ValueError, match=r"hybrid_layer_pattern must list .* got \[0, 2\]"):
        specs_from_hf_config({**raw, "num_hidden_layers": 2, "hybrid_layer_pattern": [0, 2]})


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
