"""FP8 linears under tensor parallelism of 2 (gloo, two CPU processes), fp32.

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
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_fixtures import init_group, run_two, save_result
from engine_fixtures import VOCAB, hf_greedy, save_tiny_model
from safetensors.torch import load_file
from test_models_fp8 import _write, naive_dequant, quantise_blocks

from unikv.engine import LLM, SamplingParams
from unikv.models import load_model
from unikv.models.fp8_linear import Fp8BlockLinear
from unikv.models.loader import packed_params

BLOCK = [16, 32]
PROMPT_LENS = [5, 17]
NEW_TOKENS = 10
OPTIONS = {"dtype": torch.float32, "page_size": 4, "max_num_seqs": 4, "max_model_len": 48}


def _quantised(root, block) -> tuple[str, str, dict]:
    """(FP8 checkpoint, its dequantisation as fp32, the FP8 tensors) of a tiny Qwen3."""
    tag = f"{block[0]}x{block[1]}"
    src, fp8, plain = (str(root / n) for n in ("src", f"fp8_{tag}", f"plain_{tag}"))
    if not os.path.isdir(src):
        save_tiny_model("qwen3", src)
    tensors, oracle = {}, {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        skip = ("embed_tokens", "norm")
        if name.endswith(".weight") and w.dim() == 2 and not any(s in name for s in skip):
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
    return {"tokens": [o.output_ids for o in outputs], "rows": rows, "fp8": fp8}


def _worker(rank: int, port: int, out_dir: str, path: str) -> None:
    device = init_group(rank, port, "gloo")
    llm = LLM(path, tp_group=dist.group.WORLD, device=device, **OPTIONS)
    save_result(out_dir, rank, _generate(llm))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_tp")
    torch.set_num_threads(1)
    fp8, plain, tensors = _quantised(root, BLOCK)
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    hf_tokens = [hf_greedy(hf, p, NEW_TOKENS) for p in _prompts()]
    tp1 = _generate(LLM(fp8, device="cpu", **OPTIONS))
    ranks = run_two(_worker, str(root), fp8)
    return hf_tokens, tp1, ranks, tensors, fp8, root


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
