"""An FP8 input GEMM whose x its pre-norm quantises (``decoder.Block.fp8``,
``RMSNorm.fp8_linear``, ``add_rms_norm_quant``), in tiny FP8 models on the Triton
backend (CPU, ``TRITON_INTERPRET=1``), bf16.

The checkpoints are ``test_models_fp8``'s writer's with scale blocks of 16 x 32 (the
w8a8 GEMM wants bk a multiple of its 16-wide K tile; 32 is a power of two, so the norm
may quantise), and the w8a8 variant is taken from 8 rows here (``W8A8_MIN_ROWS``
patched, its plan cache cleared) so that 21-token prompts quantise x.

- DeepSeek-V3 (q_lora 48: the packed q_a | kv_a GEMM in FP8) and MiMo-V2-Flash: the
  blocks an RMSNorm precedes an FP8 GEMM in take the fused path (DeepSeek: every MLA
  block and the dense MLP's; MiMo: its dense MLP's — its q, k, v stay three GEMMs the
  norm does not feed), and the logits equal those of the unfused path
  (``UNIKV_FP8_NORM_QUANT=0``: the norm, then the GEMM's own ``quantize_act``) bit for
  bit; the fused path's calls replace exactly that many of the GEMM's own
  quantisations; decode rows (below the w8a8 rows) take the norm unfused;
- the fused model on the FP8 checkpoint against transformers (fp32) on its naive
  dequantisation, over a prompt and transformers' greedy continuation: the logits
  within the bf16 W8A8 bound (``W8A8_MEAN``, ``W8A8_WORST``) and the argmax of every
  row whose transformers top-2 gap exceeds a tenth of its largest |logit|.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_fixtures import DenseAttention, DenseMLAStep, hf_logits, one_thread  # noqa: F401
from test_models_fp8 import Checkpoints

from unikv import env
from unikv.kernels import backend as kb
from unikv.kernels.linear import fp8_gemm
from unikv.models import load_model, loader

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = {"deepseek_v3_qkv": 4, "mimo": 1}  # the blocks whose FP8 GEMM the norm feeds
# The logits' distance to transformers' fp32 on the dequantised weights, ||ours - ref|| /
# ||ref|| per row (mean, worst): every FP8 GEMM on the path rounds x to e4m3 (within
# 2^-4 of each element, ~3.6 % rms: the dot products keep that relative error) and the
# rest is bf16; a tiny random model's ~10 quantised GEMMs in a row compound to ~0.1.
# Measured (the unfused W8A8 path's too: the same bits): DeepSeek-V3 0.080 / 0.118, MiMo
# 0.084 / 0.185 (bf16 without quantised x, w8a16: 0.023 / 0.033). A wrong code, scale
# or layout is O(1).
W8A8_MEAN, W8A8_WORST = 0.12, 0.3


@pytest.fixture(scope="module", params=list(ARCHS))
def ckpt(request, tmp_path_factory) -> Checkpoints:
    root = tmp_path_factory.mktemp(f"normquant_{request.param}")
    return Checkpoints(request.param, root, block=[16, 32])


class Absorbed(DenseMLAStep):
    def expands_mla(self, layer, **widths) -> bool:
        return False


class Counting:
    """A backend op that counts its calls."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kw):
        self.calls += 1
        return self.fn(*args, **kw)


def count_quantisation(monkeypatch, device: str) -> tuple[Counting, Counting]:
    """The model's Triton backend on ``device`` with ``add_rms_norm_quant`` counted, the
    GEMM's own ``quantize_act`` counted, and w8a8 from 8 rows."""
    monkeypatch.setattr(fp8_gemm, "W8A8_MIN_ROWS", 8)
    fp8_gemm.plan.cache_clear()
    inner = kb.get_backend(device, "triton")
    fused = Counting(inner.add_rms_norm_quant)
    ops = dataclasses.replace(inner, add_rms_norm_quant=fused)
    monkeypatch.setattr(loader, "get_backend", lambda device, backend=None: ops)
    own = Counting(fp8_gemm.quantize_act)
    monkeypatch.setattr(fp8_gemm, "quantize_act", own)
    return fused, own


@pytest.fixture
def counted(monkeypatch):
    yield count_quantisation(monkeypatch, "cpu")
    fp8_gemm.plan.cache_clear()


def forward(model, ids: list[int]) -> torch.Tensor:
    mla = hasattr(model.config, "extra") and "kv_lora_rank" in model.config.extra
    attn = Absorbed() if mla else DenseAttention(model.config.windows, model.config.sm_scale)
    with torch.no_grad():
        return model(torch.tensor(ids), torch.arange(len(ids)), attn)


def set_fused(monkeypatch, model, on: bool) -> None:
    monkeypatch.setattr(env, "FLAGS", dataclasses.replace(env.FLAGS, fp8_norm_quant=on))
    model.rebind()


def test_fused_logits_equal_the_unfused_bit_for_bit(ckpt, counted, monkeypatch):
    fused, own = counted
    model = load_model(ckpt.fp8, dtype=torch.bfloat16, kernels="triton")
    blocks = [b for layer in model.stack.layers for b in layer.blocks]
    assert sum(b.fp8 is not None for b in blocks) == ARCHS[ckpt.arch]
    ids = ckpt.ref.prompts[1]  # 21 rows: w8a8 (from 8 here), not a multiple of any tile
    got = forward(model, ids)
    fused_calls, own_fused = fused.calls, own.calls
    assert fused_calls == ARCHS[ckpt.arch]
    set_fused(monkeypatch, model, False)
    assert all(b.fp8 is None for b in blocks)
    want = forward(model, ids)
    assert fused.calls == fused_calls  # the unfused path never calls it
    assert own.calls - 2 * own_fused == fused_calls  # each fused call replaced one of the GEMM's
    assert torch.equal(got, want)
    set_fused(monkeypatch, model, True)
    before = fused.calls
    forward(model, ids[:5])  # decode-sized rows: w8a16, the norm unfused
    assert fused.calls == before


def test_fused_model_matches_transformers_on_the_dequantised_checkpoint(ckpt, counted):
    fused, _ = counted
    model = load_model(ckpt.fp8, dtype=torch.bfloat16, kernels="triton")
    ids = ckpt.ref.prompts[1] + ckpt.ref.greedy[1][:8]
    ours = forward(model, ids).float()
    assert fused.calls == ARCHS[ckpt.arch]
    ref = hf_logits(ckpt.ref.hf, ids)
    rows = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
    err, mean = rows.max().item(), rows.mean().item()
    top2 = ref.topk(2, dim=-1).values
    gap = (top2[:, 0] - top2[:, 1]) / ref.abs().amax(-1)
    clear = gap > 0.1
    agree = (ours.argmax(-1) == ref.argmax(-1))[clear]
    print(f"{ckpt.arch}: row rel err mean {mean:.4f} worst {err:.4f}; {int(clear.sum())} clear rows, "
          f"{int(agree.sum())} agree; min gap {gap.min():.4f}")  # fmt: skip
    assert mean < W8A8_MEAN and err < W8A8_WORST, (mean, err)
    assert clear.sum() >= len(ids) // 3 and agree.all()


def engine_runs(ckpt, fused: Counting, monkeypatch, device: str) -> list[tuple]:
    """(greedy tokens, sampled logit rows, fused calls) of a 12-token prompt and 4 new
    tokens, with the fused path on, then off."""
    from engine_fixtures import StepLogits

    from unikv.engine import LLM, SamplingParams

    runs = []
    for on in (True, False):
        monkeypatch.setattr(env, "FLAGS", dataclasses.replace(env.FLAGS, fp8_norm_quant=on))
        llm = LLM(ckpt.fp8, device=device, backend="triton", dtype=torch.bfloat16,
                  max_num_seqs=2, max_model_len=32, page_size=4)  # fmt: skip
        before, rows = fused.calls, StepLogits()
        params = SamplingParams(max_tokens=4, temperature=0.0)
        out = llm.generate([ckpt.ref.prompts[1][:12]], params, on_step=rows)
        runs.append((out[0].output_ids, list(rows.rows.values()), fused.calls - before))
    return runs


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively")
def test_engine_steps_take_the_fused_path_by_their_row_plan(tmp_path_factory, counted, monkeypatch):
    """Qwen3 (the shared decoder's q|k|v and gate|up, both FP8) in the engine (Triton
    under the interpreter, bf16): a 12-token prefill step's plan quantises x (w8a8 from
    8 rows here), so its blocks take the fused path, the decode steps' plans do not;
    the greedy tokens and every sampled logit row equal the unfused engine's."""
    fused, _ = counted
    ckpt = Checkpoints("qwen3", tmp_path_factory.mktemp("normquant_qwen3"), block=[16, 32])
    (tokens, logits, calls), (tokens_off, logits_off, calls_off) = engine_runs(
        ckpt, fused, monkeypatch, "cpu"
    )
    layers = 4
    assert calls == 2 * layers and calls_off == 0  # the prefill step's blocks only
    assert tokens == tokens_off
    assert all(torch.equal(a, b) for a, b in zip(logits, logits_off, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_fused_equals_unfused_gpu(ckpt, tmp_path_factory, monkeypatch):
    """On the GPU (compiled kernels, CUDA graphs for decode): DeepSeek-V3 and MiMo, the
    fused engine's tokens and sampled logit rows equal the unfused one's bit for bit."""
    fused, _ = count_quantisation(monkeypatch, "cuda")
    try:
        (tokens, logits, calls), (tokens_off, logits_off, calls_off) = engine_runs(
            ckpt, fused, monkeypatch, "cuda"
        )
    finally:
        fp8_gemm.plan.cache_clear()
    assert calls >= ARCHS[ckpt.arch] and calls_off == 0
    assert tokens == tokens_off
    assert all(torch.equal(a, b) for a, b in zip(logits, logits_off, strict=True))
