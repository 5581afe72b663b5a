"""DeepSeek-V2 / V3 on unikv's layers against transformers' own models (no pool).

Tiny random-init transformers models (``engine_fixtures.tiny_deepseek_config``:
kv_lora_rank 24, rope 8, nope 12, v_head_dim 20, 4 heads, a dense first layer then
MoE with 4 experts in 2 groups and shared experts) are saved with
``save_pretrained`` and loaded by unikv. The step objects are
``AbsorbedStep`` (``engine_fixtures.DenseMLAStep``: the absorbed latent attention
written from its definition) and ``ExpandedStep`` (the expanded form written from
its definition: K/V up-projected through kv_b_proj, full-width queries), so these
tests check the model's two branches (projections, rope layouts, the W_UK / W_UV
absorption, the expanded queries, YaRN scales, routing) against transformers'
attention.

Variants: V2 as in the fixture (no q_lora, group-limited greedy, YaRN with
mscale != mscale_all_dim); V2 with q_lora and greedy routing; V3 as in the
fixture (q_lora, sigmoid routing with correction bias, interleaved rope); V3
with NeoX rope (``rope_interleave`` False) and YaRN.

Tolerance: fp32, max abs error 1e-4 on logits of std ~0.8 (measured ~3e-6).
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    DenseMLAStep,
    hf_logits,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_deepseek,
    tiny_deepseek_config,
)

from unikv.hf_config import specs_from_hf_config
from unikv.kernels.moe import ref as moe_ref
from unikv.models import load_model, model_config_from_hf

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 2.0,
    "mscale": 0.9,
    "mscale_all_dim": 1.2,
    "original_max_position_embeddings": 256,
}
VARIANTS = {
    "v2": (2, {}),
    "v2_qlora_greedy": (2, {"q_lora_rank": 40, "topk_method": "greedy", "n_group": None}),
    "v3": (3, {}),
    "v3_neox_yarn": (3, {"rope_interleave": False, "rope_parameters": YARN}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
    """(transformers model, unikv model) on the same weights."""
    version, overrides = VARIANTS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    hf = save_tiny_deepseek(version, path, **overrides)
    return hf, load_model(path)


class AbsorbedStep(DenseMLAStep):
    """DenseMLAStep, asked for the absorbed form."""

    def expands_mla(self, layer, **widths) -> bool:
        return False


class ExpandedStep(AbsorbedStep):
    """The expanded form for ONE sequence, from its definition: the kept latent rows
    (``rows[layer]``, as DenseMLAStep) up-projected per head, k = [W_UK c | k_rope],
    v = W_UV c, causal softmax of the full queries."""

    def expands_mla(self, layer, **widths) -> bool:
        return True

    def mla_expanded(self, layer, q, latent, rope, kv_b_weight, sm_scale):
        new = torch.cat([latent, rope], dim=-1)
        rows = torch.cat([self.rows[layer], new]) if layer in self.rows else new
        self.rows[layer] = rows
        (t, heads, _), rank, total = q.shape, latent.shape[1], rows.shape[0]
        w = kv_b_weight.view(heads, -1, rank)  # (H, nope + v, rank)
        nope = q.shape[2] - rope.shape[1]
        k_nope = torch.einsum("hdr,lr->lhd", w[:, :nope], rows[:, :rank])
        v = torch.einsum("hdr,lr->lhd", w[:, nope:], rows[:, :rank])
        k_rope = rows[:, None, rank:].expand(total, heads, -1)
        logits = torch.einsum("thd,lhd->htl", q, torch.cat([k_nope, k_rope], dim=-1))
        visible = torch.arange(total)[None, :] <= torch.arange(total - t, total)[:, None]
        probs = torch.softmax((logits * sm_scale).masked_fill(~visible, float("-inf")), dim=-1)
        return torch.einsum("htl,lhd->thd", probs, v)


STEPS = [AbsorbedStep, ExpandedStep]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _forward(model, step, tokens: list[int], start: int) -> torch.Tensor:
    return model(torch.tensor(tokens), torch.arange(start, start + len(tokens)), step)


@pytest.mark.parametrize("step_kind", STEPS)
def test_logits_match_transformers(saved, step_kind):
    hf, model = saved
    tokens = _tokens(40, 1)
    err = (_forward(model, step_kind(), tokens, 0) - hf_logits(hf, tokens)).abs().max()
    assert err < ATOL


@pytest.mark.parametrize("step_kind", STEPS)
def test_stepwise_forward_and_cached_latents(saved, step_kind):
    """A sequence fed in chunks (7, 13 tokens) then one token at a time: every step's
    logits equal transformers' whole-sequence logits, and the latent rows the model
    handed to the step (every layer, every position) equal transformers' own cache
    (its compressed kv: normalised c and the rotated, shared k_rope, in its layout)."""
    hf, model = saved
    tokens = _tokens(30, 3)
    ref = hf_logits(hf, tokens)
    step = step_kind()
    for a, b in itertools.pairwise([0, 7, 20, *range(21, 31)]):
        err = (_forward(model, step, tokens[a:b], a) - ref[a:b]).abs().max()
        assert err < ATOL, f"tokens [{a}, {b}): logits differ by {err}"
    with torch.no_grad():
        cache = hf(torch.tensor([tokens]), use_cache=True).past_key_values
    rank = hf.config.kv_lora_rank
    assert sorted(step.rows) == list(range(hf.config.num_hidden_layers))
    for layer, rows in step.rows.items():
        c, k_rope = cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]  # (L, *)
        assert rows.shape == (30, rank + hf.config.qk_rope_head_dim)
        torch.testing.assert_close(rows[:, :rank], c, atol=ATOL, rtol=0)
        torch.testing.assert_close(rows[:, rank:], k_rope, atol=ATOL, rtol=0)


def test_sparse_expert_loop_matches(saved, monkeypatch):
    """The prefill (sparse) expert loop gives transformers' logits too."""
    hf, model = saved
    monkeypatch.setattr(moe_ref, "DENSE_MAX_TOKENS", 0)  # the rule dense_rows reads
    tokens = _tokens(24, 2)
    err = (_forward(model, AbsorbedStep(), tokens, 0) - hf_logits(hf, tokens)).abs().max()
    assert err < ATOL


def test_softmax_scale_matches_transformers(saved):
    """The YaRN softmax mscale (or none) is transformers' own ``scaling``."""
    hf, model = saved
    attn = model.model.layers[0].self_attn
    assert attn.sm_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)


def test_router_choices_match_transformers(saved):
    """Routing weights and expert sets of every MoE layer equal transformers' router
    on the same hidden states (V3: through the fp32 correction bias)."""
    hf, model = saved
    x = torch.randn(50, hf.config.hidden_size, generator=torch.Generator().manual_seed(4))
    for layer in range(hf.config.first_k_dense_replace, hf.config.num_hidden_layers):
        _, want_w, want_i = hf.model.layers[layer].mlp.gate(x)
        got_w, got_i = model.model.layers[layer].mlp.gate(x)
        order_w, order_g = want_i.sort(dim=-1), got_i.sort(dim=-1)
        assert torch.equal(order_w.values, order_g.values)
        torch.testing.assert_close(
            got_w.gather(1, order_g.indices), want_w.gather(1, order_w.indices)
        )


def test_bf16_correction_bias_stays_fp32(tmp_path):
    save_tiny_deepseek(3, str(tmp_path))
    model = load_model(str(tmp_path), dtype=torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.dtype == torch.float32
    assert gate.weight.dtype == torch.bfloat16


def _arch_config(version: int, **overrides):
    arch = f"DeepseekV{version}ForCausalLM"
    return tiny_deepseek_config(version, architectures=[arch], **overrides)


@pytest.mark.parametrize("version", [2, 3])
def test_missing_kv_lora_rank_raises(version):
    """A config object (transformers' own refuses None, so a plain namespace) and a
    config dict without kv_lora_rank: ValueError naming the field, from the model
    config and from the pool specs."""
    as_dict = _arch_config(version).to_dict()
    del as_dict["kv_lora_rank"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        model_config_from_hf(types.SimpleNamespace(**as_dict))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        specs_from_hf_config(as_dict)


def test_bad_routing_raises():
    with pytest.raises(ValueError, match="topk_method"):
        model_config_from_hf(_arch_config(2, topk_method="noaux_tc"))
    with pytest.raises(ValueError, match="n_group"):
        model_config_from_hf(_arch_config(3, n_group=3))
    with pytest.raises(ValueError, match="two best experts"):
        model_config_from_hf(_arch_config(3, n_group=4, topk_group=2))


def test_tensor_parallel_refuses_indivisible_heads():
    """TP shards the MLA heads (``test_tp_families.py`` runs it); a size that does not
    divide the 4 query heads is refused, naming the field."""
    from unikv.models.parallel import check_tp_config

    config = model_config_from_hf(_arch_config(3))
    check_tp_config(config, 2)
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_tp_config(config, 3)


def test_mla_subpool_spec_from_config():
    """hf_config puts every layer in one "mla" sub-pool of rank + rope wide rows."""
    (sub,) = specs_from_hf_config(_arch_config(3), page_size=4, dtype=torch.float32)
    assert sub.name == "mla" and sub.layers == (0, 1, 2)
    assert (sub.spec.kv_lora_rank, sub.spec.rope_dim) == (24, 8)
