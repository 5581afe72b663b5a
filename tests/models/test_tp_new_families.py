"""Tensor parallelism of issue 39's families over gloo (CPU processes on loopback), fp32:
Bamba (Mamba-2 + rope attention), Granite-4.0-H (its multipliers; MoE beside a shared
MLP with rope, a dense shared MLP without rope, MoE alone without rope), Zamba2 (Mamba-2 + shared attention blocks with per-layer LoRA adapters), LFM2
(short-convolution windows sharded by channels, projection biases drawn at random),
Qwen3.5-MoE (Gated DeltaNet + gated attention + routed and shared experts) and
Kimi-Linear (KDA heads beside MLA, the latent row whole) at TP 2; Qwen3.5-MoE (4 KV
heads) and Kimi-Linear (4 KDA and 4 MLA heads) at TP 4.

One spawn of four ranks runs them all (starting processes costs more than the tiny
models): the TP-2 families split between the rank pairs {0, 1} and {2, 3}, then the
TP-4 ones on all four (the same over NCCL, one GPU per rank, on a 4-GPU machine:
``-m gpu``). Checked against independent derivations in this process, with
the byte oracles of ``test_tp_recurrent.py``:

- greedy tokens equal transformers' (eager) and a TP-1 ``LLM``'s, on every rank;
  every sampled logit row within ``ATOL`` of TP 1's;
- each rank's pool holds only its shard: right after a request's prefill its state
  slot holds TP 1's conv window restricted to the channels of the rank's heads (their
  indices derived from transformers' own fields: Mamba-2's x channels of its heads and
  B / C of the groups they use, the delta rule's q / k / v channels of its heads, LFM2's
  contiguous 1/tp of the hidden channels) and TP 1's recurrent state restricted to its
  heads; attention K/V equal TP 1's restricted to its KV heads; Kimi's MLA latent rows
  equal TP 1's whole; the state slot is smaller than TP 1's;
- counts a TP size does not split are refused naming the HF fields, before any weight
  loads (``load_model`` on a config with no weights, and the model constructor).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from dist_fixtures import backends, init_group, rank_device, run_n, save_result
from engine_fixtures import hf_greedy, save_random_model
from family_fixtures import save_tiny_lfm2, tiny_qwen3_5_moe_config
from mamba_hybrid_fixtures import _hf_mixers, bamba_config, granite_config, save_hf, zamba2_config
from test_engine_granite_h import VARIANTS as GRANITE
from test_engine_kimi_linear import save_tiny_kimi, tiny_kimi_config
from test_tp_recurrent import (
    ATOL,
    NEW_TOKENS,
    OPTIONS,
    _generate,
    _prompts,
    _random_biases,
    delta_rule_shard,
    mamba_shard,
)

from unikv.engine import LLM
from unikv.models.family import named
from unikv.models.loader import load_model
from unikv.models.parallel import check_tp_config


def _qwen3_5_moe(path: str, **overrides):
    config = tiny_qwen3_5_moe_config(**overrides)
    config._attn_implementation = "eager"
    return save_random_model(config, path)


def _granite(variant: str):
    return lambda p: save_hf(granite_config(**GRANITE[variant]), p)


# (model, tp) -> (which TP-2 pair runs it, its family, how the tiny model is saved)
MODELS = {
    ("bamba", 2): (0, "bamba", lambda p: save_hf(bamba_config(), p)),
    ("granite_moe", 2): (0, "granitemoehybrid", _granite("moe")),
    ("granite_dense", 2): (0, "granitemoehybrid", _granite("dense")),
    ("zamba2", 2): (0, "zamba2", lambda p: save_hf(zamba2_config(), p)),
    ("granite_moe_only", 2): (1, "granitemoehybrid", _granite("moe_only")),
    ("lfm2", 2): (1, "lfm2", lambda p: _random_biases(save_tiny_lfm2(p), p)),
    ("qwen3_5_moe", 2): (1, "qwen3_5_moe", _qwen3_5_moe),
    ("kimi_linear", 2): (1, "kimi_linear", lambda p: save_tiny_kimi(p, linear_num_heads=4)),
    ("qwen3_5_moe", 4): (None, "qwen3_5_moe", lambda p: _qwen3_5_moe(p, num_key_value_heads=4)),
    ("kimi_linear", 4): (None, "kimi_linear", lambda p: save_tiny_kimi(p, linear_num_heads=4)),
}


def _worker(rank, port, out_dir, backend: str, paths: dict) -> None:
    """Four ranks: each pair its half of the TP-2 models, then the TP-4 ones."""
    device = init_group(rank, port, backend, world_size=4)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    result = {}
    for (name, size), path in paths.items():
        pair = MODELS[(name, size)][0]
        if size == 2 and pair != rank // 2:
            continue
        group = pairs[pair] if size == 2 else dist.group.WORLD
        result[(name, size)] = _generate(LLM(path, tp_group=group, device=device, **OPTIONS))
    save_result(out_dir, rank, result)
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=backends(4))  # gloo; NCCL on 4 GPUs (-m gpu)
def runs(request, tmp_path_factory):
    """Per (family, TP size): transformers' greedy tokens, the TP-1 run and the model;
    every rank's runs."""
    torch.set_num_threads(1)
    device = rank_device(request.param, 0)
    root = tmp_path_factory.mktemp("tp_new")
    paths, refs = {}, {}
    for key, (_, _, save) in MODELS.items():
        paths[key] = str(root / f"{key[0]}{key[1]}")
        hf = save(paths[key])
        refs[key] = {
            "hf": [hf_greedy(hf, p, NEW_TOKENS) for p in _prompts()],
            "tp1": _generate(LLM(paths[key], device=device, **OPTIONS)),
            "model": hf,
        }
    deadline = 600 if request.param == "nccl" else 300  # GPU ranks JIT their kernels
    ranks = run_n(4, _worker, str(root), request.param, paths, deadline_s=deadline)
    return {"refs": refs, "ranks": ranks}


def _cases(runs):
    """(family, size, reference, [(rank within the group, result)]) of every TP run."""
    for key, (_, family, _) in MODELS.items():
        size = key[1]
        ranks = [(r % size, got[key]) for r, got in enumerate(runs["ranks"]) if key in got]
        assert len(ranks) == size, key
        yield family, size, runs["refs"][key], ranks


def test_tokens_match_transformers_and_logits_match_tp1(runs):
    for family, size, ref, ranks in _cases(runs):
        assert ref["tp1"]["tokens"] == ref["hf"], family
        for r, got in ranks:
            assert got["tokens"] == ref["hf"], (family, size, r)
            rows, tp1 = got["rows"], ref["tp1"]["rows"]
            assert sorted(rows) == sorted(tp1)
            err = max((rows[k] - tp1[k]).abs().max().item() for k in tp1)
            assert err < ATOL, f"{family} TP {size} rank {r}: logits differ from TP 1 by {err}"


def _shard(hf, family: str, rank: int, size: int):
    """(conv channels, state heads or None) of ``rank``'s shard, from transformers'
    own config fields and mixer modules."""
    c = hf.config
    if family == "lfm2":
        step = c.hidden_size // size
        return list(range(rank * step, (rank + 1) * step)), None
    if family == "qwen3_5_moe":
        dims = (c.linear_num_key_heads, c.linear_num_value_heads)
        dims += (c.linear_key_head_dim, c.linear_value_head_dim)
        return delta_rule_shard(*dims, rank, size)
    if family == "kimi_linear":
        h, d = c.linear_num_heads, c.linear_head_dim
        return delta_rule_shard(h, h, d, d, rank, size)
    m = next(iter(_hf_mixers(hf).values()))  # Mamba-2
    return mamba_shard(m.num_heads, m.head_dim, m.n_groups, m.ssm_state_size, rank, size)


def test_each_rank_holds_only_its_state_shard(runs):
    for family, size, ref, ranks in _cases(runs):
        tp1 = ref["tp1"]["states"]
        for r, got in ranks:
            assert got["slot_bytes"] < ref["tp1"]["slot_bytes"], (family, size)
            channels, heads = _shard(ref["model"], family, r, size)
            assert sorted(got["states"]) == sorted(tp1) and tp1
            for rid, layers in tp1.items():
                assert sorted(got["states"][rid]) == sorted(layers) and layers
                for layer, (conv, state) in layers.items():
                    my_conv, my_state = got["states"][rid][layer]
                    where = f"{family} TP {size} rank {r} request {rid} layer {layer}"
                    assert my_conv.shape == (len(channels), conv.shape[1]), where
                    err = (my_conv - conv[channels]).abs().max().item()
                    assert err < ATOL and conv.abs().max() > 0, f"{where}: conv off by {err}"
                    if heads is None:  # a conv-only slot (LFM2)
                        assert state is None and my_state is None, where
                        continue
                    assert my_state.shape == (len(heads), *state.shape[1:]), where
                    err = (my_state - state[heads]).abs().max().item()
                    scale = state.abs().max().item()
                    assert scale > 0 and err <= 1e-5 * scale, f"{where}: state off by {err}"


def test_each_rank_caches_its_kv_heads_and_the_whole_latent(runs):
    for family, size, ref, ranks in _cases(runs):
        tp1 = ref["tp1"]["kv"]
        for r, got in ranks:
            assert sorted(got["kv"]) == sorted(tp1)
            for rid, layers in tp1.items():
                assert sorted(got["kv"][rid]) == sorted(layers) and layers
                for layer, full in layers.items():
                    mine = got["kv"][rid][layer]
                    where = f"{family} TP {size} rank {r} request {rid} layer {layer}"
                    if len(full) == 1:  # MLA: the latent row whole on every rank
                        assert mine[0].shape == full[0].shape, where
                        assert (mine[0] - full[0]).abs().max() < ATOL, where
                        continue
                    h = full[0].shape[1] // size
                    for m, f in zip(mine, full):
                        assert m.shape == (f.shape[0], h, f.shape[2]), where
                        err = (m - f[:, r * h : (r + 1) * h]).abs().max().item()
                        assert err < ATOL and f.abs().max() > 0, f"{where}: K/V off by {err}"


def _config_only(path, config) -> str:
    config.architectures = [config.architectures[0]] if config.architectures else None
    config.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    ("family", "make", "size", "named_fields"),
    [
        ("bamba", lambda: bamba_config(architectures=["BambaForCausalLM"]), 4,
         ["mamba_n_heads", "num_key_value_heads"]),
        ("granitemoehybrid", lambda: granite_config(
            architectures=["GraniteMoeHybridForCausalLM"], shared_intermediate_size=25), 2,
         ["shared_intermediate_size"]),
        ("zamba2", lambda: zamba2_config(architectures=["Zamba2ForCausalLM"], mamba_ngroups=3), 2,
         ["mamba_ngroups (3)"]),
        ("lfm2", lambda: __import__("transformers").Lfm2Config(
            architectures=["Lfm2ForCausalLM"], hidden_size=50, num_attention_heads=2,
            num_key_value_heads=2, layer_types=["conv", "full_attention"], num_hidden_layers=2,
            intermediate_size=96, block_multiple_of=8), 4,
         ["hidden_size", "num_attention_heads"]),
        ("qwen3_5_moe", lambda: tiny_qwen3_5_moe_config(
            architectures=["Qwen3_5MoeForCausalLM"], moe_intermediate_size=25), 2,
         ["moe_intermediate_size"]),
        ("kimi_linear", lambda: tiny_kimi_config(architectures=["KimiLinearForCausalLM"]), 2,
         ["linear_num_heads"]),
    ],
)  # fmt: skip
def test_indivisible_counts_are_refused_before_loading(tmp_path, family, make, size, named_fields):
    """``load_model`` on a config with no weights (the refusal comes first), the check
    it runs and the model's own constructor all name the fields."""
    from unikv.models import load_model_config

    path = _config_only(tmp_path, make())
    config = load_model_config(path)[0]
    fake = types.SimpleNamespace(size=size, rank=0)
    for refuse in (
        lambda: load_model(path, tp=fake),
        lambda: check_tp_config(config, size),
        lambda: named(family).model_class()(config, 8, fake),
    ):
        with pytest.raises(ValueError, match=f"tensor parallelism of {size}") as err:
            refuse()
        for field in named_fields:
            assert field in str(err.value), (field, str(err.value))
