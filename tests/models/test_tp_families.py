"""Tensor parallelism of Gemma, MiMo-V2-Flash, DeepSeek (MLA), Mixtral and Qwen3-MoE
over gloo (CPU processes on loopback), fp32, against independent derivations.

The tiny models are the engine tests' (``test_engine_*.py``, ``engine_fixtures``),
with the few overrides TP needs (MiMo: 2 full-layer KV heads, so 4 on sliding
layers; DeepSeek-V2: attention and MLP biases, so o_proj's and the shared experts'
row-parallel biases are counted once or the logits are off). Every bias is drawn
at random (transformers initialises them to zero, which would hide a bias added on
every rank). One spawn of four ranks (imports dominate a spawn's CPU time) runs
them all: two TP-2 groups, {0, 1} and {2, 3}, each one half of the families, then
one TP-4 group for the two whose tiny widths allow it (DeepSeek-V3's 4 MLA heads,
and Gemma-3 given 4 KV heads). Each rank builds ``LLM(..., tp_group=group)`` and
generates a batch with chunked prefill (the same over NCCL, one GPU per rank, on a
4-GPU machine: ``-m gpu``). Checked:

- greedy tokens equal transformers' ``generate`` (eager) and a TP-1 ``LLM``, on
  every rank; every sampled logit row within ``ATOL`` of TP 1's (the all-reduce
  sums in another order: rounding only);
- each rank's pool holds only its shard: attention specs with ``num_kv_heads / tp``
  and every layer's K and V view equal to TP 1's restricted to the rank's KV-head
  range (same pages: the allocator is deterministic and the page counts equal);
  MLA: the spec and page bytes equal TP 1's, and every layer's latent view equals
  TP 1's whole (kv_a_proj is replicated, the latent row is not split);
- a size that does not divide a family's sharded counts is refused before any
  weight loads (a config with no weights), the error naming the HF fields.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from dist_fixtures import backends, init_group, rank_device, run_n, save_result
from engine_fixtures import (
    VOCAB,
    hf_greedy,
    save_tiny_deepseek,
    save_tiny_gemma,
    tiny_deepseek_config,
    tiny_gemma_config,
)
from test_engine_mimo import save_tiny_mimo, tiny_mimo_config
from test_engine_mixtral import save_tiny_mixtral
from test_engine_qwen3_moe import save_tiny_qwen3_moe

from unikv.engine import LLM, SamplingParams
from unikv.models.loader import load_model

PROMPT_LENS = [3, 19, 30]
NEW_TOKENS = 8
ATOL = 1e-4
OPTIONS = {
    "dtype": torch.float32,
    "page_size": 4,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,
    "max_model_len": 64,
}

# name -> (saver(path) -> fp32 transformers model, the TP sizes it runs at)
MODELS = {
    "gemma2": (lambda p: save_tiny_gemma("gemma2", p, tie_word_embeddings=False), (2,)),
    "gemma3": (  # 4 KV heads: TP 4
        lambda p: save_tiny_gemma("gemma3", p, tie_word_embeddings=False, num_key_value_heads=4),
        (4,),
    ),
    "mimo_v2": (lambda p: save_tiny_mimo(p, num_key_value_heads=2, attention_bias=True), (2,)),
    "deepseek_v2": (
        lambda p: save_tiny_deepseek(2, p, attention_bias=True, mlp_bias=True),
        (2,),
    ),
    "deepseek_v3": (lambda p: save_tiny_deepseek(3, p), (2, 4)),
    "mixtral": (save_tiny_mixtral, (2,)),
    "qwen3_moe": (save_tiny_qwen3_moe, (2,)),
}


def _randomise_biases(hf, path: str) -> None:
    """Draw every linear bias at random (transformers' are zero) and save again."""
    g = torch.Generator().manual_seed(4)
    biases = [p for n, p in hf.named_parameters() if n.endswith(".bias")]
    with torch.no_grad():
        for param in biases:
            param.copy_(0.2 * torch.randn(param.shape, generator=g))
    if biases:
        hf.save_pretrained(path)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


class PrefillRows:
    """Step hook: each request's pool rows (every layer, the prompt positions it still
    holds) right after the step that completed its prefill, read through the (page,
    slot) views at the physical pages the allocator reports: request id -> layer ->
    {"pos": positions, "k"/"v" (P, H, D) or "latent" (P, rank + rope)}."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[int, dict[str, torch.Tensor]]] = {}

    def __call__(self, llm, batch, logits) -> None:
        for r in batch.requests:
            if r.slot is None or r.num_cached != len(r.prompt_ids) or r.output_ids[1:]:
                continue
            pages, per_layer = llm.alloc.request_pages(r.slot), {}
            for name, sub in llm.pool.subpools.items():
                cols, phys = pages[name]
                ps, page_of = sub.page_size, dict(zip(cols.tolist(), phys.tolist()))
                pos = torch.tensor([p for p in range(len(r.prompt_ids)) if p // ps in page_of])
                where = torch.tensor([page_of[p // ps] for p in pos.tolist()], dtype=torch.long)
                parts = ("latent",) if sub.spec.kind == "mla" else ("k", "v")
                for index, layer in enumerate(sub.layers):
                    views = sub.paged_views[index]
                    views = (views,) if sub.spec.kind == "mla" else views
                    rows = {p: v[where, pos % ps].cpu().clone() for p, v in zip(parts, views)}
                    per_layer[layer] = {"pos": pos, **rows}
            self.rows[r.request_id] = per_layer


def _generate(llm: LLM) -> dict:
    """Tokens, sampled logit rows by (request, position), pool views and specs."""
    rows, prefill = {}, PrefillRows()

    def record(llm, batch, logits):
        prefill(llm, batch, logits)
        for i, r in enumerate(batch.requests):
            if r.num_pending == 1:
                rows[(r.request_id, r.seq_len - 1)] = logits[i].cpu()

    outputs = llm.generate(
        _prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), on_step=record
    )
    subs = llm.pool.subpools.items()
    return {
        "tokens": [o.output_ids for o in outputs],
        "rows": rows,
        "prefill": prefill.rows,
        "specs": {n: dataclasses.asdict(s.spec) for n, s in subs},
        "page_bytes": {n: s.page_bytes for n, s in subs},
        "num_pages": {n: s.num_pages for n, s in subs},
    }


def _worker(rank: int, port: int, out_dir: str, backend: str, tp2: list[dict], tp4: dict) -> None:
    """Four ranks, one spawn: ranks {0, 1} and {2, 3} are two TP-2 groups, each running
    its half of the TP-2 models (``tp2[rank // 2]``), then all four run ``tp4``."""
    device = init_group(rank, port, backend, world_size=4)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    result = {}
    for size, group, paths in ((2, pairs[rank // 2], tp2[rank // 2]), (4, None, tp4)):
        tp = {"tp_group": group or dist.group.WORLD, "device": device, **OPTIONS}
        for name, path in paths.items():
            result[name, size] = (dist.get_rank(tp["tp_group"]), _generate(LLM(path, **tp)))
    save_result(out_dir, rank, result)
    dist.destroy_process_group()


BACKENDS = backends(4)  # gloo; NCCL on a 4-GPU machine (-m gpu)


@pytest.fixture(scope="module", params=BACKENDS)
def runs(request, tmp_path_factory):
    """name -> {"hf": transformers' tokens, "tp1": the TP-1 run, size: [results by
    rank in the TP group]}."""
    backend = request.param
    root = tmp_path_factory.mktemp("tp_families")
    device = rank_device(backend, 0)
    torch.set_num_threads(1)
    paths, refs = {}, {}
    for name, (save, _) in MODELS.items():
        paths[name] = str(root / name)
        hf = save(paths[name])
        _randomise_biases(hf, paths[name])
        refs[name] = {
            "hf": [hf_greedy(hf, p, NEW_TOKENS) for p in _prompts()],
            "tp1": _generate(LLM(paths[name], device=device, **OPTIONS)),
        }
    tp2 = [n for n in MODELS if 2 in MODELS[n][1]]
    halves = [{n: paths[n] for n in tp2[k::2]} for k in (0, 1)]
    tp4 = {n: paths[n] for n in MODELS if 4 in MODELS[n][1]}
    for rank_result in run_n(4, _worker, str(root), backend, halves, tp4):
        for (name, size), (group_rank, result) in rank_result.items():
            refs[name].setdefault(size, {})[group_rank] = result
    for ref in refs.values():
        for size in (2, 4):
            if size in ref:
                ref[size] = [ref[size][r] for r in range(size)]
    return refs


CASES = [(name, size) for name, (_, sizes) in MODELS.items() for size in sizes]
IDS = [f"{name}-tp{size}" for name, size in CASES]


@pytest.mark.parametrize(("name", "size"), CASES, ids=IDS)
def test_tokens_match_tp1_and_transformers(runs, name, size):
    ref = runs[name]
    assert ref["tp1"]["tokens"] == ref["hf"]
    for r, rank in enumerate(ref[size]):
        assert rank["tokens"] == ref["hf"], f"rank {r}"


@pytest.mark.parametrize(("name", "size"), CASES, ids=IDS)
def test_logits_match_tp1(runs, name, size):
    tp1 = runs[name]["tp1"]["rows"]
    for r, rank in enumerate(runs[name][size]):
        assert sorted(rank["rows"]) == sorted(tp1)
        err = max((rank["rows"][k] - tp1[k]).abs().max().item() for k in tp1)
        assert err < ATOL, f"rank {r}: logits differ from TP 1 by {err}"


@pytest.mark.parametrize(("name", "size"), CASES, ids=IDS)
def test_each_rank_pool_holds_its_shard(runs, name, size):
    tp1 = runs[name]["tp1"]
    for r, rank in enumerate(runs[name][size]):
        assert rank["num_pages"] == tp1["num_pages"]  # same grid: same placement
        for sub, spec in tp1["specs"].items():
            if spec.get("num_kv_heads") is None:  # MLA: the latent whole on every rank
                assert rank["specs"][sub] == spec
                assert rank["page_bytes"][sub] == tp1["page_bytes"][sub]
            else:
                assert rank["specs"][sub] == {**spec, "num_kv_heads": spec["num_kv_heads"] // size}
                assert rank["page_bytes"][sub] < tp1["page_bytes"][sub]
        assert sorted(rank["prefill"]) == sorted(tp1["prefill"]) != []
        for request, layers in tp1["prefill"].items():
            for layer, full in layers.items():
                mine = rank["prefill"][request][layer]
                assert mine.keys() == full.keys() and torch.equal(mine["pos"], full["pos"])
                for part in set(full) - {"pos"}:
                    want = full[part]
                    if part != "latent":  # (P, H, D): this rank's KV heads
                        h = want.shape[1] // size
                        assert mine[part].shape[1] == h
                        want = want[:, r * h : (r + 1) * h]
                    err = (mine[part] - want).abs().max().item()
                    where = f"rank {r} request {request} layer {layer} {part}"
                    assert err < ATOL, f"{where}: off by {err}"
                    assert want.abs().max() > 0, f"{where}: nothing cached"


# name -> (transformers config with counts 2 does not divide, fields named, fields not)
BAD = {
    "gemma2": (
        lambda: tiny_gemma_config(
            "gemma2", hidden_size=48, num_attention_heads=3, num_key_value_heads=3
        ),
        ["num_attention_heads", "num_key_value_heads"],
        ["intermediate_size"],
    ),
    "mimo_v2": (  # 1 KV head on full layers (2 on sliding ones, which 2 divides)
        lambda: tiny_mimo_config(moe_intermediate_size=33),
        ["num_key_value_heads", "moe_intermediate_size"],
        ["swa_num_key_value_heads", "num_attention_heads"],
    ),
    "deepseek_v3": (
        lambda: tiny_deepseek_config(3, num_attention_heads=3, num_key_value_heads=3),
        ["num_attention_heads"],
        ["num_key_value_heads", "moe_intermediate_size"],
    ),
    "mixtral": (
        lambda: _mixtral_config(intermediate_size=41),
        ["intermediate_size"],
        ["num_attention_heads"],
    ),
    "qwen3_moe": (
        lambda: _qwen3_moe_config(moe_intermediate_size=25),
        ["moe_intermediate_size"],
        ["'intermediate_size'", "num_attention_heads"],
    ),
}


def _mixtral_config(**overrides):
    import transformers as tf
    from engine_fixtures import TINY

    kw = {**TINY, "hidden_size": 48, "num_local_experts": 5, "num_experts_per_tok": 2}
    return tf.MixtralConfig(**{**kw, **overrides})


def _qwen3_moe_config(**overrides):
    import transformers as tf
    from engine_fixtures import TINY

    kw = {**TINY, "hidden_size": 48, "intermediate_size": 40, "head_dim": 16, "num_experts": 7}
    kw.update(num_experts_per_tok=2, num_hidden_layers=3, mlp_only_layers=[1])
    return tf.Qwen3MoeConfig(**{**kw, **overrides})


@pytest.mark.parametrize("name", sorted(BAD))
def test_indivisible_counts_are_refused_naming_the_fields(name, tmp_path):
    config, named, unnamed = BAD[name]
    hf = config()
    hf.architectures = [type(hf).__name__.replace("Config", "ForCausalLM")]
    hf.save_pretrained(tmp_path)  # no weights: the check must come before loading
    with pytest.raises(ValueError, match="divisible by 2") as err:
        load_model(str(tmp_path), tp=SimpleNamespace(size=2, rank=0))
    message = str(err.value)
    for field in named:
        assert field in message, message
    for field in unnamed:
        assert field not in message.split("got")[0], message
