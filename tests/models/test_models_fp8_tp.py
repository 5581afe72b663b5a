"""FP8 linears and FP8 experts under tensor parallelism of 2 (gloo, two CPU processes),
fp32.

A tiny Qwen3 (q|k|v 128 | 64 | 64 rows, gate|up 2 x 128, hidden 64) quantised by
``test_models_fp8.quantise_blocks`` in blocks of 16 rows x 32 columns: every rank's
slice is whole blocks, so the weights stay FP8 and the scales shard with them.

- both ranks generate transformers' greedy tokens on the dequantised checkpoint, and
  every sampled logit row is within 1e-4 of the TP-1 run's;
- each rank's ``Fp8BlockLinear`` holds exactly its slice of the file's bytes: column
  linears rows [r * out / 2, (r + 1) * out / 2) of each part (parts concatenated) and
  their block rows, row linears the matching columns and block columns;
- in one process (no collective runs while loading): blocks that a rank's slice would
  cut (24 columns of a row-parallel rank's 64; 64 rows of a column-parallel rank's 32
  k_proj rows) are refused before any weight loads.

FP8 experts, in the same spawn: a tiny Qwen3-MoE (7 experts of 64 intermediate rows)
whose routed experts alone are quantised in blocks of 16 x 32. Both ranks generate
transformers' greedy tokens on the dequantised checkpoint, logits within 1e-4 of TP 1's;
each rank's experts hold their slice of the file's bytes (gate and up rows
[r * 32, (r + 1) * 32) with their block rows, down columns with their block columns),
never dequantised; a size that cuts the experts' blocks is refused before loading.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_fixtures import init_group, run_two, save_result
from engine_fixtures import VOCAB, hf_greedy, save_tiny_model
from safetensors.torch import load_file
from test_engine_qwen3_moe import save_tiny_qwen3_moe
from test_models_fp8 import _write, naive_dequant, quantise_blocks

from unikv.engine import LLM, SamplingParams
from unikv.models import load_model
from unikv.models.fp8_linear import Fp8BlockLinear
from unikv.models.loader import packed_params
from unikv.models.moe import Fp8Weight

BLOCK = [16, 32]
MOE_ROWS = 32  # each rank's intermediate rows of every expert: 2 row blocks, 1 column block
PROMPT_LENS = [5, 17]
NEW_TOKENS = 10
OPTIONS = {"dtype": torch.float32, "page_size": 4, "max_num_seqs": 4, "max_model_len": 48}


def _quantised(root, block, moe: bool = False) -> tuple[str, str, dict]:
    """(FP8 checkpoint, its dequantisation as fp32, the FP8 tensors) of a tiny Qwen3 (every
    linear but the embedding quantised), or with ``moe`` of a tiny Qwen3-MoE (its routed
    experts only)."""
    tag = f"{'moe_' if moe else ''}{block[0]}x{block[1]}"
    names = ("src_moe" if moe else "src", f"fp8_{tag}", f"plain_{tag}")
    src, fp8, plain = (str(root / n) for n in names)
    if not os.path.isdir(src):
        if moe:
            save_tiny_qwen3_moe(src, moe_intermediate_size=2 * MOE_ROWS)
        else:
            save_tiny_model("qwen3", src)
    tensors, oracle = {}, {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        skip = ("embed_tokens", "norm")
        chosen = ".experts." in name if moe else not any(s in name for s in skip)
        if name.endswith(".weight") and w.dim() == 2 and chosen:
            q, scale = quantise_blocks(w, block)
            tensors |= {name: q, name + "_scale_inv": scale}
            oracle[name] = naive_dequant(q, scale, block)
        else:
            tensors[name] = oracle[name] = w
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": block}
    _write(fp8, src, tensors, quant)
    _write(plain, src, oracle, None)
    return fp8, plain, tensors


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _generate(llm: LLM) -> dict:
    rows = {}

    def record(_, batch, logits):
        for i, r in enumerate(batch.requests):
            if r.num_pending == 1:
                rows[(r.request_id, r.seq_len - 1)] = logits[i].cpu()

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    outputs = llm.generate(_prompts(), params, on_step=record)
    fp8 = {n: (m.weight.view(torch.uint8).clone(), m.weight_scale_inv.clone(), m.parallel)
           for n, m in llm.model.named_modules() if isinstance(m, Fp8BlockLinear)}  # fmt: skip
    experts = {n: (m.weight.view(torch.uint8).clone(), m.weight_scale_inv.clone())
               for n, m in llm.model.named_modules() if isinstance(m, Fp8Weight)}  # fmt: skip
    tokens = [o.output_ids for o in outputs]
    return {"tokens": tokens, "rows": rows, "fp8": fp8, "experts": experts}


def _worker(rank: int, port: int, out_dir: str, paths: dict) -> None:
    device = init_group(rank, port, "gloo")
    result = {}
    for key, path in paths.items():
        result[key] = _generate(LLM(path, tp_group=dist.group.WORLD, device=device, **OPTIONS))
    save_result(out_dir, rank, result)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """Per checkpoint ("dense": every linear FP8; "moe": the experts): transformers'
    greedy tokens on its dequantisation, the TP-1 run, the file's tensors and path;
    every rank's runs (one spawn for both)."""
    root = tmp_path_factory.mktemp("fp8_tp")
    torch.set_num_threads(1)
    import transformers as tf

    refs, paths = {}, {}
    for key in ("dense", "moe"):
        fp8, plain, tensors = _quantised(root, BLOCK, moe=key == "moe")
        hf = tf.AutoModelForCausalLM.from_pretrained(
            plain, dtype=torch.float32, attn_implementation="eager",
            experts_implementation="eager",
        ).eval()  # fmt: skip
        hf_tokens = [hf_greedy(hf, p, NEW_TOKENS) for p in _prompts()]
        tp1 = _generate(LLM(fp8, device="cpu", **OPTIONS))
        refs[key], paths[key] = (hf_tokens, tp1, tensors, fp8), fp8
    ranks = run_two(_worker, str(root), paths)
    return refs, ranks, root


@pytest.fixture(scope="module")
def run(spawned):
    refs, ranks, root = spawned
    hf_tokens, tp1, tensors, fp8 = refs["dense"]
    return hf_tokens, tp1, [r["dense"] for r in ranks], tensors, fp8, root


def test_tp2_tokens_and_logits_equal_tp1_and_transformers(run):
    hf_tokens, tp1, ranks, *_ = run
    assert tp1["tokens"] == hf_tokens
    for rank in ranks:
        assert rank["tokens"] == hf_tokens
        assert rank["rows"].keys() == tp1["rows"].keys()
        for key, row in rank["rows"].items():
            assert (row - tp1["rows"][key]).abs().max().item() < 1e-4, key


def test_each_rank_holds_its_slice_of_the_files_bytes(run):
    _, tp1, ranks, tensors, fp8, _ = run
    packed = packed_params(load_model(fp8))
    assert len(tp1["fp8"]) >= 8 and all(r["fp8"].keys() == tp1["fp8"].keys() for r in ranks)
    for name in tp1["fp8"]:
        parts = packed.get(f"{name}.weight", (f"{name}.weight",))
        for r, rank in enumerate(ranks):
            weight, scale, parallel = rank["fp8"][name]
            dim = 0 if parallel == "column" else 1
            assert parallel in ("column", "row"), name
            want_w, want_s = [], []
            for p in parts:
                w, s = tensors[p], tensors[p + "_scale_inv"]
                step_w, step_s = w.shape[dim] // 2, s.shape[dim] // 2
                want_w.append(w.view(torch.uint8).narrow(dim, r * step_w, step_w))
                want_s.append(s.narrow(dim, r * step_s, step_s))
            assert torch.equal(weight, torch.cat(want_w)), (name, r)
            assert torch.equal(scale, torch.cat(want_s)), (name, r)


class _FakeTP:
    """A group of two seen from rank 0: enough to build and load (no collective runs
    until a forward)."""

    rank, size = 0, 2


@pytest.mark.parametrize(
    ("block", "width", "dim"),
    [([16, 24], 24, 1), ([64, 32], 64, 0)],  # o/down_proj's 64 columns; k_proj's 32 rows
)
def test_tp_size_that_cuts_a_block_is_refused_before_loading(run, block, width, dim):
    *_, root = run
    cut, _, _ = _quantised(root, block)
    with pytest.raises(ValueError, match=rf"cuts the FP8 weight's {width}-wide scale blocks "
                       rf"along dim {dim}") as err:  # fmt: skip
        load_model(cut, tp=_FakeTP())
    assert "tensor-parallel size" in str(err.value)


def test_fp8_experts_tp2_tokens_and_logits_equal_tp1_and_transformers(spawned):
    refs, ranks, _ = spawned
    hf_tokens, tp1, _, _ = refs["moe"]
    assert tp1["tokens"] == hf_tokens
    for rank in ranks:
        got = rank["moe"]
        assert got["tokens"] == hf_tokens
        assert got["rows"].keys() == tp1["rows"].keys()
        for key, row in got["rows"].items():
            assert (row - tp1["rows"][key]).abs().max().item() < 1e-4, key


def test_each_rank_holds_its_slice_of_the_experts_bytes(spawned):
    """gate / up: rows [r * 32, (r + 1) * 32) and block rows [2 r, 2 r + 2); down: the
    same columns and block column r; TP 1 holds the file's whole."""
    refs, ranks, _ = spawned
    _, tp1, tensors, _ = refs["moe"]
    names = sorted(tp1["experts"])
    assert len(names) == 2 * 7 * 3  # 2 sparse layers x 7 experts x (gate, up, down)
    for name in names:
        w, s = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"]
        assert torch.equal(tp1["experts"][name][0], w.view(torch.uint8)), name
        assert torch.equal(tp1["experts"][name][1], s), name
        dim = 1 if name.endswith("down_proj") else 0
        for r, rank in enumerate(ranks):
            weight, scale = rank["moe"]["experts"][name]
            step_s = MOE_ROWS // BLOCK[dim]
            want_w = w.view(torch.uint8).narrow(dim, r * MOE_ROWS, MOE_ROWS)
            assert torch.equal(weight, want_w), (name, r)
            assert torch.equal(scale, s.narrow(dim, r * step_s, step_s)), (name, r)


def test_tp_size_that_cuts_the_experts_blocks_is_refused_before_loading(spawned):
    *_, root = spawned
    cut, _, _ = _quantised(root, [16, 64], moe=True)  # a rank's 32 down columns of 64
    with pytest.raises(ValueError, match="FP8 experts: tensor parallelism of 2") as err:
        load_model(cut, tp=_FakeTP())
    assert "16 x 64 scale blocks" in str(err.value)
