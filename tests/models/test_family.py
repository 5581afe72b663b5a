"""The family table (unikv/models/family.py) is the one place a family is named.

- A family added to a copy of the table is resolved by the pool specs, the config
  reader and the model registry, with nothing else touched.
- Every preset's recurrent state, as the pool specs size it, is what transformers'
  own mixer caches (its conv weight and its state attributes) and what unikv's
  model builds (its mixers' tensors, shape for shape against transformers').
- Every preset's attention windows in ModelConfig are transformers' layer_types.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from unikv.hf_config import model_specs_from_hf_config, specs_from_hf_config
from unikv.models import family, model_config_from_hf
from unikv.models.hf import Fields, StateDims, kinds_from
from unikv.models.registry import model_class

PRESETS = sorted((Path(__file__).parents[2] / "unikv" / "presets").glob("*.json"))


# -- a family is one entry ----------------------------------------------------------------


def _toy_kinds(cfg: Fields) -> list[str]:  # even layers attention, odd layers recurrent
    return kinds_from(cfg, lambda i: "mamba" if i % 2 else "full")


def _toy_dims(cfg: Fields) -> StateDims:
    return StateDims(
        3 * cfg.need("toy_width"), cfg.get("toy_kernel", 4), (cfg.need("toy_heads"), 5)
    )


class ToyForCausalLM:
    pass


TOY = family.Family(
    "toy",
    {"toy_hybrid": _toy_kinds},
    ("ToyForCausalLM",),
    model=f"{__name__}:ToyForCausalLM",
    extras=lambda hf_config: {"toy_width": hf_config["toy_width"]},
    state_dims=_toy_dims,
)
TOY_CONFIG = {
    "architectures": ["ToyForCausalLM"],
    "model_type": "toy_hybrid",
    "num_hidden_layers": 4,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 50,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 64,
    "toy_width": 8,
    "toy_heads": 2,
}


def test_a_family_added_to_the_table_is_resolved_everywhere(monkeypatch) -> None:
    with pytest.raises(ValueError, match="unknown architecture 'toy_hybrid'"):
        specs_from_hf_config(TOY_CONFIG)
    with pytest.raises(ValueError, match="unsupported architecture 'ToyForCausalLM'"):
        model_config_from_hf(TOY_CONFIG)
    with pytest.raises(ValueError, match="no model family 'toy'"):
        model_class("toy")

    monkeypatch.setattr(family, "FAMILIES", (*family.FAMILIES, TOY))
    full, mamba = specs_from_hf_config(TOY_CONFIG, page_size=4)
    assert (full.layers, mamba.layers) == ((0, 2), (1, 3))
    assert (full.spec.num_kv_heads, full.spec.head_dim, full.spec.sliding_window) == (2, 8, None)
    assert mamba.spec.conv[0].shape == (24, 4) and mamba.spec.temporal.shape == (2, 5)
    config = model_config_from_hf(TOY_CONFIG)
    assert (config.architecture, config.family) == ("ToyForCausalLM", "toy")
    assert config.extra == {"toy_width": 8} and config.windows == (None,) * 4
    assert (config.state_dims.conv_dim, config.state_dims.state_shape) == (24, (2, 5))
    assert model_class("toy") is ToyForCausalLM


def test_a_specs_only_family_has_no_model_class() -> None:
    with pytest.raises(ValueError, match="family 'jamba' has no unikv model"):
        model_class("jamba")


def test_the_table_names_each_key_once() -> None:
    names = [f.name for f in family.FAMILIES]
    archs = [a for f in family.FAMILIES for a in f.architectures]
    types = [t for f in family.FAMILIES for t in f.model_types]
    for keys in (names, archs, types):
        assert len(keys) == len(set(keys)), keys
    for f in family.FAMILIES:
        assert set(f.text_decoders) <= set(f.architectures), f.name


def test_importing_the_table_imports_no_family_module() -> None:
    """The table names model code lazily: only the package's own imports (Llama's
    CausalLM, its public surface) are loaded with it."""
    refs = [r for f in family.FAMILIES for r in (f.model, f.extras, f.state_dims)]
    modules = {r.split(":")[0] for r in refs if isinstance(r, str)} - {"unikv.models.llama"}
    code = "import sys, unikv.models.family; print(' '.join(sorted(sys.modules)))"
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout.split())  # fmt: skip
    assert modules and not modules & loaded, sorted(modules & loaded)


# -- every preset: spec-side dims == model-side dims == transformers' --------------------

transformers = pytest.importorskip("transformers")


def _hf_config(raw: dict):
    fields = {k: v for k, v in raw.items() if not k.startswith("_")}
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def _state_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The recurrent mixers, in layer order: the modules that own a causal conv
    (``conv1d``; LFM2's short convolution calls it ``conv``)."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "conv1d", None), torch.nn.Module)
        or isinstance(getattr(m, "conv", None), torch.nn.Conv1d)
    ]


def _hf_state(mixer) -> tuple[tuple[int, int], tuple[int, ...]]:
    """transformers' mixer: (conv state shape, temporal state shape; () for none)."""
    if not hasattr(mixer, "conv1d"):  # LFM2's short convolution: a conv window alone
        c, _, k = mixer.conv.weight.shape
        return (c, k), ()
    c, _, k = mixer.conv1d.weight.shape
    if hasattr(mixer, "forget_gate"):  # Kimi Delta Attention: H heads of D for q, k, v
        return (c, k), (mixer.num_heads, mixer.head_dim, mixer.head_dim)
    if hasattr(mixer, "num_v_heads"):  # Gated DeltaNet
        return (c, k), (mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)
    if hasattr(mixer, "num_heads"):  # Mamba-2
        return (c, k), (mixer.num_heads, mixer.head_dim, mixer.ssm_state_size)
    return (c, k), (mixer.intermediate_size, mixer.ssm_state_size)  # Mamba-1


def _recurrent_presets() -> list[Path]:
    out = []
    for path in PRESETS:
        raw = json.loads(path.read_text())
        types = [raw.get("model_type"), raw.get("text_config", {}).get("model_type")]
        if not any(family.of_model_type(t) for t in types if t):
            continue  # a preset ahead of its family (Kimi-Linear): no specs (test_inspect)
        specs = model_specs_from_hf_config(raw)
        out += [path] if any(s.name == "mamba" for s in specs.subpools) else []
    return out


@pytest.mark.parametrize("path", _recurrent_presets(), ids=lambda p: p.stem)
def test_preset_state_dims_agree_between_specs_model_and_transformers(path: Path) -> None:
    raw = json.loads(path.read_text())
    (sub,) = [s for s in specs_from_hf_config(raw) if s.name == "mamba"]
    conv = sub.spec.conv[0].shape
    temporal = () if sub.spec.temporal is None else sub.spec.temporal.shape
    hf_config = _hf_config(raw)
    text = getattr(hf_config, "text_config", None) or hf_config
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        theirs = _state_modules(transformers.AutoModelForCausalLM.from_config(text))
    assert len(theirs) == len(sub.layers) > 0
    assert {_hf_state(m) for m in theirs} == {(conv, temporal)}

    fam = family.of_model_type(Fields(text).get("model_type"))
    if fam.model is None:
        return  # a specs-only family (Jamba): no unikv model to compare
    config = model_config_from_hf(hf_config)
    assert (config.state_dims.conv_dim, config.state_dims.conv_kernel) == conv
    assert tuple(config.state_dims.state_shape) == temporal
    if getattr(text, "num_experts", 0) > 8:  # no state depends on the expert count
        hf_small = _hf_config({**raw, **_fewer_experts(raw)})
        config = model_config_from_hf(hf_small)
    with torch.device("meta"):
        ours = _state_modules(model_class(config.family)(config, 64, None))
    assert len(ours) == len(theirs)
    for mine, hf_mixer in zip(ours, theirs):
        shapes = {n: p.shape for n, p in mine.named_parameters()}
        # Kimi's checkpoint keeps the decay's parameters where transformers nests them
        # under forget_gate (its conversion mapping), and names the output o_proj
        hf_named = {n.removeprefix("forget_gate."): p.shape for n, p in hf_mixer.named_parameters()}
        hf_shapes = {n: s for n, s in hf_named.items() if n in shapes}
        named = {"conv.weight", "in_proj.weight"} if temporal == () else {"conv1d.weight", "A_log"}
        assert named <= set(hf_shapes)
        assert {"out_proj.weight", "o_proj.weight"} & set(hf_shapes)
        assert hf_shapes == {n: shapes[n] for n in hf_shapes}, type(mine).__name__


def _fewer_experts(raw: dict) -> dict:
    if "text_config" in raw:
        return {"text_config": {**raw["text_config"], **_fewer_experts(raw["text_config"])}}
    return {"num_experts": 8, "num_experts_per_tok": min(raw.get("num_experts_per_tok", 2), 8)}


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_windows_are_transformers_layer_types(path: Path) -> None:
    """ModelConfig.windows (the model's attention) and the pool's SWA sub-pool (the
    cache) against transformers' own layer_types, where its config derives them."""
    raw = json.loads(path.read_text())
    if family.of_architecture((raw.get("architectures") or [""])[0]) is None:
        pytest.skip(f"unikv runs no model of {path.stem}")
    hf_config = _hf_config(raw)
    config = model_config_from_hf(hf_config)
    text = getattr(hf_config, "text_config", None) or hf_config
    swa = [s for s in specs_from_hf_config(raw) if s.name == "swa"]
    sliding = {i for i, w in enumerate(config.windows) if w is not None}
    assert sliding == (set(swa[0].layers) if swa else set())
    if sliding:
        assert {config.windows[i] for i in sliding} == {text.sliding_window}
    types = getattr(text, "layer_types", None)
    if types is not None:
        assert sliding == {i for i, t in enumerate(types) if t == "sliding_attention"}
