"""Tensor parallelism of the recurrent hybrids over gloo (CPU processes on loopback),
fp32: Qwen3.5 and Qwen3-Next (Gated DeltaNet + gated attention, Qwen3-Next's MoE with a
shared expert), NemotronH (Mamba-2, attention, MLP and MoE layers) and Falcon-H1
(Mamba-2 beside attention, muP multipliers; one Mamba group shared by both ranks, its
gated norm on, random projection biases) at TP 2; Qwen3.5 (2 key heads for 4 ranks:
each rank reads one key head) and NemotronH (2 Mamba groups for 4 ranks: the gated
norm's group spans two ranks; a MoE in a latent space) at TP 4. One spawn of four
ranks runs both sizes (TP 2 on two pairs of ranks at once), since starting processes
costs more than the tiny models. The same over NCCL with one GPU per rank on a 4-GPU machine (``-m gpu``).
Checked against independent derivations in this process:

- greedy tokens equal transformers' (eager) and a TP-1 ``LLM``'s, on every rank, and
  every sampled logit row is within ``ATOL`` of TP 1's;
- each rank's pool holds only its shard: right after a request's prefill, its state
  slot (read through the runner's views of the raw pool) holds TP 1's conv window
  restricted to the channels of the rank's heads (q/k channels of the key heads its
  value heads read, v channels of its value heads; Mamba's x channels of its heads,
  B/C channels of the groups they use) and TP 1's recurrent state restricted to its
  heads; every attention layer's K/V equals TP 1's restricted to its KV heads; the
  rank's state slot is smaller than TP 1's;
- head and group counts a TP size does not split are refused, naming the HF fields,
  before any weight loads (a config with no weights).
"""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.distributed as dist
from dist_fixtures import backends, init_group, rank_device, run_n, save_result
from engine_fixtures import (
    VOCAB,
    hf_greedy,
    save_tiny_falcon_h1,
    save_tiny_hybrid,
    save_tiny_nemotron_h,
)

from unikv.engine import LLM, SamplingParams
from unikv.ids import VirtualTokenIds
from unikv.models import load_model_config
from unikv.models.parallel import check_tp_config

PROMPT_LENS = [3, 19, 30]
NEW_TOKENS = 8
ATOL = 1e-4
OPTIONS = {
    "dtype": torch.float32,
    "page_size": 4,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,  # chunked prefill
    "max_model_len": 48,
}
NEMOTRON_PATTERN = "M*-ME"
# (family, tp) -> how the tiny model is saved (path -> transformers' model)
MODELS = {
    ("qwen3_5", 2): lambda p: save_tiny_hybrid("qwen3_5", p),
    ("qwen3_next", 2): lambda p: save_tiny_hybrid("qwen3_next", p),
    ("nemotron_h", 2): lambda p: save_tiny_nemotron_h(p, NEMOTRON_PATTERN),
    ("falcon_h1", 2): lambda p: _random_biases(
        save_tiny_falcon_h1(
            p, mamba_n_groups=1, mamba_rms_norm=True, mamba_proj_bias=True, projectors_bias=True
        ),
        p,
    ),
    ("qwen3_5", 4): lambda p: save_tiny_hybrid("qwen3_5", p, num_key_value_heads=4),
    ("nemotron_h", 4): lambda p: save_tiny_nemotron_h(
        p, "M*E", num_key_value_heads=4, mamba_num_heads=8, moe_latent_size=16
    ),
}


def _random_biases(hf, path: str):
    """transformers initialises projection biases to zero, which would hide a
    row-parallel bias added on every rank: draw them at random and save again."""
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("proj.bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=g))
    hf.save_pretrained(path)
    return hf


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _prefilled(llm, r) -> tuple[dict, dict]:
    """Request ``r``'s state right after its prefill, read through the runner's views
    of the raw pool: per recurrent layer (conv window, recurrent state or None for a
    conv-only slot) of its state slot; per attention layer the K/V rows of its prompt
    (their kernel ids from the allocator's table), per MLA layer its latent rows (a
    1-tuple)."""
    slot = int(llm.alloc.mamba_slots(torch.tensor([r.slot])).data[0])
    states = {
        layer: (s.conv[slot].cpu(), None if s.temporal is None else s.temporal[slot].cpu())
        for layer, s in enumerate(llm.runner.states)
        if s is not None
    }
    virtual = llm.alloc.parts.requests.req_to_token[r.slot, : len(r.prompt_ids)]
    kv = {}
    for layer, c in enumerate(llm.runner.layers):
        if c is not None:
            ids = llm.alloc.translate(VirtualTokenIds(virtual), c.subpool).data.long()
            latent = getattr(c, "latent", None)
            kv[layer] = (
                (latent[ids].cpu(),) if latent is not None else (c.k[ids].cpu(), c.v[ids].cpu())
            )
    return states, kv


def _generate(llm: LLM) -> dict:
    """Tokens, sampled logit rows, each request's state and K/V right after its
    prefill (``_prefilled``), the state slot's bytes."""
    rows, states, kv = {}, {}, {}

    def record(llm, batch, logits):
        for i, r in enumerate(batch.requests):
            if r.num_pending == 1:
                rows[(r.request_id, r.seq_len - 1)] = logits[i].cpu()
            if r.num_cached == len(r.prompt_ids) and len(r.output_ids) == 1:
                states[r.request_id], kv[r.request_id] = _prefilled(llm, r)

    outputs = llm.generate(
        _prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), on_step=record
    )
    return {
        "tokens": [o.output_ids for o in outputs],
        "rows": rows,
        "states": states,
        "kv": kv,
        "slot_bytes": llm.pool.subpools["mamba"].page_bytes,
    }


def _worker(rank, port, out_dir, backend: str, paths: dict, bad: str) -> None:
    """Four ranks: the TP-2 models on two pairs of them at once (ranks 0, 1 and 2, 3:
    one spawn for both sizes), then the TP-4 models on all four."""
    device = init_group(rank, port, backend, world_size=4)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    result = {}
    for (family, size), path in paths.items():
        group = pairs[rank // 2] if size == 2 else dist.group.WORLD
        tp = {"tp_group": group, "device": device, **OPTIONS}
        result[(family, size)] = _generate(LLM(path, **tp))
        if family == "nemotron_h" and size == 2:
            try:  # 3 Mamba groups split over 2 ranks no way: refused before loading
                LLM(bad, **tp)
                result["bad"] = "no error"
            except ValueError as e:
                result["bad"] = str(e)
    save_result(out_dir, rank, result)
    dist.destroy_process_group()


BACKENDS = backends(4)  # gloo; NCCL on a 4-GPU machine (-m gpu)


@pytest.fixture(scope="module", params=BACKENDS)
def runs(request, tmp_path_factory):
    """Per (family, TP size): transformers' greedy tokens, the TP-1 run and the
    transformers config; and every rank's runs."""
    torch.set_num_threads(1)
    device = rank_device(request.param, 0)
    root = tmp_path_factory.mktemp("tp")
    paths, refs = {}, {}
    for (family, size), save in MODELS.items():
        paths[(family, size)] = str(root / f"{family}{size}")
        hf = save(paths[(family, size)])
        refs[(family, size)] = {
            "hf": [hf_greedy(hf, p, NEW_TOKENS) for p in _prompts()],
            "tp1": _generate(LLM(paths[(family, size)], device=device, **OPTIONS)),
            "config": hf.config,
        }
    bad = root / "bad"
    save_tiny_nemotron_h(str(bad), "M*", n_groups=3)
    (bad / "model.safetensors").unlink()  # the refusal comes before any weight loads
    deadline = 600 if request.param == "nccl" else 240  # GPU ranks JIT their kernels
    ranks = run_n(4, _worker, str(root), request.param, paths, str(bad), deadline_s=deadline)
    return {"refs": refs, "ranks": ranks}


def _cases(runs):
    """(family, size, ranks as (rank within the group, result)) of every TP run."""
    for family, size in sorted(runs["refs"]):
        ranks = [(r % size, rank[(family, size)]) for r, rank in enumerate(runs["ranks"])]
        yield family, size, runs["refs"][(family, size)], ranks


def test_tokens_match_transformers_and_logits_match_tp1(runs):
    for family, size, ref, ranks in _cases(runs):
        assert ref["tp1"]["tokens"] == ref["hf"], family
        for r, got in ranks:
            assert got["tokens"] == ref["hf"], (family, size, r)
            rows, tp1 = got["rows"], ref["tp1"]["rows"]
            assert sorted(rows) == sorted(tp1)
            err = max((rows[k] - tp1[k]).abs().max().item() for k in tp1)
            assert err < ATOL, f"{family} TP {size} rank {r}: logits differ from TP 1 by {err}"


def delta_rule_shard(hk: int, hv: int, dk: int, dv: int, rank: int, size: int):
    """(conv channels, state heads) of ``rank``'s Gated DeltaNet / KDA shard: value
    heads [rank * Hv / size, (rank + 1) * Hv / size), the key heads they read, and the
    conv's [q | k | v] channels of those heads."""
    heads = range(rank * hv // size, (rank + 1) * hv // size)
    keys = sorted({h // (hv // hk) for h in heads})
    q = [c for k in keys for c in range(k * dk, (k + 1) * dk)]
    k = [hk * dk + c for c in q]
    v = [2 * hk * dk + c for h in heads for c in range(h * dv, (h + 1) * dv)]
    return q + k + v, list(heads)


def mamba_shard(h: int, p: int, g: int, n: int, rank: int, size: int):
    """(conv channels, state heads) of ``rank``'s Mamba-2 shard: heads [rank * H / size,
    (rank + 1) * H / size), their x channels and the B / C channels of the groups they
    use (H heads of P, G groups of state size N)."""
    heads = range(rank * h // size, (rank + 1) * h // size)
    groups = sorted({i // (h // g) for i in heads})
    x = [c for i in heads for c in range(i * p, (i + 1) * p)]
    b = [h * p + c for j in groups for c in range(j * n, (j + 1) * n)]
    c = [g * n + ch for ch in b]
    return x + b + c, list(heads)


def _recurrent_shard(config, family: str, rank: int, size: int):
    """(the conv channels, the state heads) of ``rank``'s shard, from the HF fields:
    a rank holds value (Mamba) heads [rank * H / size, (rank + 1) * H / size) and the
    key heads (groups) those heads read."""
    if family.startswith("qwen3"):
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        return delta_rule_shard(hk, hv, dk, dv, rank, size)
    if family == "nemotron_h":
        h, p, g, n = config.mamba_num_heads, config.mamba_head_dim, config.n_groups, 0
        n = config.ssm_state_size
    else:
        h, g, n = config.mamba_n_heads, config.mamba_n_groups, config.mamba_d_state
        p = config.mamba_d_ssm // h
    return mamba_shard(h, p, g, n, rank, size)


def test_each_rank_holds_only_its_state_shard(runs):
    for family, size, ref, ranks in _cases(runs):
        tp1 = ref["tp1"]["states"]
        for r, got in ranks:
            assert got["slot_bytes"] < ref["tp1"]["slot_bytes"]
            channels, heads = _recurrent_shard(ref["config"], family, r, size)
            assert sorted(got["states"]) == sorted(tp1)
            for rid, layers in tp1.items():
                assert sorted(got["states"][rid]) == sorted(layers)
                for layer, (conv, state) in layers.items():
                    my_conv, my_state = got["states"][rid][layer]
                    assert my_conv.shape == (len(channels), conv.shape[1])
                    assert my_state.shape == (len(heads), *state.shape[1:])
                    err_conv = (my_conv - conv[channels]).abs().max().item()
                    err_state = (my_state - state[heads]).abs().max().item()
                    scale = state.abs().max().item()
                    where = f"{family} TP {size} rank {r} request {rid} layer {layer}"
                    assert err_conv < ATOL, f"{where}: conv off by {err_conv}"
                    assert err_state <= 1e-5 * scale, f"{where}: state off by {err_state}"
                    assert scale > 0  # a state that took the prompt in


def test_each_rank_caches_its_own_kv_heads(runs):
    for family, size, ref, ranks in _cases(runs):
        tp1 = ref["tp1"]["kv"]
        for r, got in ranks:
            assert sorted(got["kv"]) == sorted(tp1)
            for rid, layers in tp1.items():
                assert sorted(got["kv"][rid]) == sorted(layers) and layers
                for layer, (k1, v1) in layers.items():
                    k, v = got["kv"][rid][layer]
                    h = k1.shape[1] // size
                    assert k.shape == (k1.shape[0], h, k1.shape[2])
                    for mine, full in ((k, k1), (v, v1)):
                        err = (mine - full[:, r * h : (r + 1) * h]).abs().max().item()
                        where = f"{family} TP {size} rank {r} request {rid} layer {layer}"
                        assert err < ATOL, f"{where}: K/V off by {err}"
                        assert full.abs().max() > 0


def test_indivisible_groups_refused_before_loading(runs):
    for rank in runs["ranks"]:
        message = rank["bad"]
        assert "n_groups (3)" in message and "mamba_num_heads" in message, message


def _edit(path, **fields):
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **fields}))
    return load_model_config(str(path))[0]


@pytest.mark.parametrize(
    ("family", "fields", "size", "named"),
    [
        ("qwen3_5", {"linear_num_value_heads": 6, "linear_num_key_heads": 3}, 2,
         ["linear_num_key_heads (3)"]),
        ("qwen3_5", {"linear_num_value_heads": 4, "linear_num_key_heads": 4}, 8,
         ["linear_num_value_heads", "num_key_value_heads"]),
        ("qwen3_next", {"linear_num_value_heads": 8, "linear_num_key_heads": 2}, 4,
         ["linear_num_key_heads", "num_key_value_heads"]),
        ("nemotron_h", {"mamba_num_heads": 9, "n_groups": 3}, 2, ["mamba_num_heads"]),
        ("falcon_h1", {"mamba_n_heads": 6, "mamba_n_groups": 3, "mamba_d_ssm": 72, "mamba_d_head": 12}, 2,
         ["mamba_n_groups"]),
        ("falcon_h1", {"mamba_n_heads": 3, "mamba_d_ssm": 72, "mamba_d_head": 24}, 2, ["mamba_n_heads"]),
    ],
)  # fmt: skip
def test_indivisible_counts_are_refused_naming_the_fields(tmp_path, family, fields, size, named):
    """check_tp_config (what the loader runs first) and the model's own constructor."""
    import transformers as tf

    from unikv.models.family import named as family_named

    config = {
        "qwen3_5": lambda: tf.Qwen3_5TextConfig(architectures=["Qwen3_5ForCausalLM"]),
        "qwen3_next": lambda: tf.Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"]),
        "nemotron_h": lambda: tf.NemotronHConfig(architectures=["NemotronHForCausalLM"]),
        "falcon_h1": lambda: tf.FalconH1Config(architectures=["FalconH1ForCausalLM"]),
    }[family]()
    config.save_pretrained(tmp_path)
    config = _edit(tmp_path, **fields)
    for refuse in (
        lambda: check_tp_config(config, size),
        lambda: family_named(family).model_class()(
            config, 8, types.SimpleNamespace(size=size, rank=0)
        ),
    ):
        with pytest.raises(ValueError, match=f"tensor parallelism of {size}") as err:
            refuse()
        for field in named:
            assert field in str(err.value), (field, str(err.value))
