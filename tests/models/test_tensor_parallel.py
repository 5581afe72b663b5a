"""Tensor parallelism of 2 over gloo (two CPU processes on loopback), fp32;
the same over NCCL with one GPU per rank on a 2-GPU machine (``-m gpu``).

For a tiny Llama (GQA 4/2 heads, llama3 rope, q/k/v/o and MLP biases) and a
tiny gpt-oss (sliding window 6 and full layers, sinks, MoE), all biases drawn
at random (a row-parallel bias must be added once), both ranks build
``LLM(..., tp_group=WORLD)`` and generate for a batch of prompts with chunked
prefill. Checked against independent derivations in this process:

- greedy tokens equal transformers' ``generate`` and a TP-1 ``LLM`` (same
  options), on both ranks;
- every sampled logit row is within ``ATOL`` of TP 1's (fp32; the all-reduce
  sums the partial products in another order, observed ~1e-6 on logits of std
  ~0.8);
- each rank's pool caches only its own KV heads: its spec has
  ``num_kv_heads / 2``, and every layer's dense K/V view equals TP 1's view
  restricted to the rank's head range (same pages: the allocator is
  deterministic and both pools have the same page counts);
- a model whose head counts 2 does not divide is refused on both ranks with a
  ValueError naming the fields, before any weight is loaded.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_fixtures import BACKENDS, init_group, rank_device, run_two, save_result
from engine_fixtures import VOCAB, hf_greedy, save_tiny_model, tiny_hf_config

from unikv.engine import LLM, SamplingParams

ARCHS = ["llama", "gpt_oss"]
PROMPT_LENS = [3, 19, 33]
NEW_TOKENS = 12
ATOL = 1e-4
BIASES = {"llama": {"attention_bias": True, "mlp_bias": True}, "gpt_oss": {}}  # gpt-oss has them
OPTIONS = {
    "dtype": torch.float32,
    "page_size": 4,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,
    "max_model_len": 64,
}


def _with_random_biases(hf, path: str):
    """transformers initialises biases to zero, which would hide a row-parallel
    bias added on every rank: draw them at random and save again."""
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=g))
    hf.save_pretrained(path)
    return hf


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _generate(llm: LLM) -> dict:
    """Tokens, sampled logit rows by (request, position), K/V views and spec heads."""
    rows = {}

    def record(_, batch, logits):
        for i, r in enumerate(batch.requests):
            if r.num_pending == 1:
                rows[(r.request_id, r.seq_len - 1)] = logits[i].cpu()

    outputs = llm.generate(
        _prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), on_step=record
    )
    return {
        "tokens": [o.output_ids for o in outputs],
        "rows": rows,
        "kv": [(c.k.cpu(), c.v.cpu()) for c in llm.runner.layers],
        "heads": {n: s.spec.num_kv_heads for n, s in llm.pool.subpools.items()},
        "num_pages": {n: s.num_pages for n, s in llm.pool.subpools.items()},
    }


def _worker(rank: int, port: int, out_dir: str, backend: str, paths: dict, bad: str) -> None:
    device = init_group(rank, port, backend)
    tp = {"tp_group": dist.group.WORLD, "device": device, **OPTIONS}
    result = {arch: _generate(LLM(path, **tp)) for arch, path in paths.items()}
    try:
        LLM(bad, **tp)
        result["bad"] = "no error"
    except ValueError as e:
        result["bad"] = str(e)
    save_result(out_dir, rank, result)
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=BACKENDS)
def runs(request, tmp_path_factory):
    """(per arch: transformers' greedy tokens and the TP-1 run; rank 0 and 1 results)."""
    backend = request.param
    root = tmp_path_factory.mktemp("tp")
    torch.set_num_threads(1)
    device = rank_device(backend, 0)
    paths, refs = {}, {}
    for arch in ARCHS:
        paths[arch] = str(root / arch)
        hf = _with_random_biases(save_tiny_model(arch, paths[arch], **BIASES[arch]), paths[arch])
        refs[arch] = {
            "hf": [hf_greedy(hf, p, NEW_TOKENS) for p in _prompts()],
            "tp1": _generate(LLM(paths[arch], device=device, **OPTIONS)),
        }
    bad = root / "bad"  # 3 query / 3 KV heads: 2 divides neither
    config = tiny_hf_config("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(bad)  # no weights: the check comes before loading
    return refs, run_two(_worker, str(root), backend, paths, str(bad))


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_tokens_match_tp1_and_transformers(runs, arch):
    refs, ranks = runs
    assert refs[arch]["tp1"]["tokens"] == refs[arch]["hf"]
    for rank in ranks:
        assert rank[arch]["tokens"] == refs[arch]["hf"]


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_logits_match_tp1(runs, arch):
    refs, ranks = runs
    tp1 = refs[arch]["tp1"]["rows"]
    for rank in ranks:
        rows = rank[arch]["rows"]
        assert sorted(rows) == sorted(tp1)
        err = max((rows[k] - tp1[k]).abs().max().item() for k in tp1)
        assert err < ATOL, f"TP 2 logits differ from TP 1 by {err}"


@pytest.mark.parametrize("arch", ARCHS)
def test_each_rank_caches_its_own_kv_heads(runs, arch):
    refs, ranks = runs
    tp1 = refs[arch]["tp1"]
    for r, rank in enumerate(ranks):
        got = rank[arch]
        assert got["num_pages"] == tp1["num_pages"]  # same grid: same placement
        assert got["heads"] == {n: h // 2 for n, h in tp1["heads"].items()}
        for layer, ((k, v), (k1, v1)) in enumerate(zip(got["kv"], tp1["kv"])):
            h = k.shape[1]
            assert h == k1.shape[1] // 2
            for part, full in (("k", k1), ("v", v1)):
                mine = k if part == "k" else v
                expected = full[:, r * h : (r + 1) * h]
                err = (mine - expected).abs().max().item()
                assert err < ATOL, f"rank {r} layer {layer} {part}: off by {err}"
        assert any(k.abs().max() > 0 for k, _ in got["kv"])  # something was cached


def test_indivisible_heads_are_refused(runs):
    _, ranks = runs
    for rank in ranks:
        message = rank["bad"]
        assert "num_attention_heads" in message and "num_key_value_heads" in message, message
        assert "divisible by 2" in message, message
