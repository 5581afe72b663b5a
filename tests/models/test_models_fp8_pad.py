"""DeepSeek's MLA input GEMMs kept in FP8 and held padded (``Fp8BlockLinear.pads``,
``finish_loading``): the packed q_a | kv_a ``qkv_a_proj`` (tiny V3 with q_lora 48: 80
rows) and the lone ``kv_a_proj_with_mqa`` (tiny V2: 32 rows), on CPU.

The torch backend holds no weight padded (no ``torch._scaled_mm``), so the tests build
one whose ``fp8_padded_rows`` asks for two more 16-row blocks than the weight spans: the
model then runs on (T, padded) products sliced to views, as the GPU's ``scaled_mm`` does.
Oracle: transformers on the checkpoint's naive dequantisation (``test_models_fp8``).

- the MLA input linears (only they) are held padded: zero rows and unit scale rows past
  the real ones, ``weight`` / ``weight_scale_inv`` views of the held storage that still
  hold the file's bytes (q_a's and kv_a's concatenated);
- the engine's greedy tokens equal transformers' and every sampled logit row its
  teacher-forced one to 1e-4 (fp32); on the GPU (Triton backend, the same padding):
  the tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_fixtures import StepLogits, check_engine_outputs, one_thread  # noqa: F401
from test_models_fp8 import NEW_TOKENS, Checkpoints

from unikv.engine import LLM, SamplingParams
from unikv.kernels import backend as kb
from unikv.models import loader
from unikv.models.fp8_linear import Fp8BlockLinear
from unikv.models.loader import packed_params

pytestmark = pytest.mark.usefixtures("one_thread")

PADDED = {"deepseek_v3_qkv": "qkv_a_proj", "deepseek_v2": "kv_a_proj_with_mqa"}


def extra_blocks(n: int, k: int, block) -> int:
    return (n // block[0] + 2) * block[0]


@pytest.fixture(scope="module", params=list(PADDED))
def mla(request, tmp_path_factory) -> Checkpoints:
    return Checkpoints(request.param, tmp_path_factory.mktemp(f"fp8pad_{request.param}"))


@pytest.fixture
def padding(monkeypatch):
    ops = dataclasses.replace(kb.get_backend("cpu", "torch"), fp8_padded_rows=extra_blocks)
    monkeypatch.setattr(loader, "get_backend", lambda device, backend=None: ops)


def test_padded_mla_inputs_hold_the_files_bytes_and_match_transformers(mla, padding):
    llm = LLM(mla.fp8, device="cpu", max_num_seqs=4, max_model_len=64, page_size=4)
    fp8 = {n: m for n, m in llm.model.named_modules() if isinstance(m, Fp8BlockLinear)}
    padded = {n: m for n, m in fp8.items() if m.padded}
    layers = llm.model.config.num_layers
    assert len(fp8) > len(padded) == layers
    assert {n.rsplit(".", 1)[1] for n in padded} == {PADDED[mla.arch]}
    packed = packed_params(llm.model)
    for name, m in padded.items():
        (bn, _), (n, k) = m.block, m.weight.shape
        rows = extra_blocks(n, k, m.block)
        assert m.held_weight.shape == (rows, k) and m.held_scale_inv.shape[0] == rows // bn
        parts = packed.get(f"{name}.weight", (f"{name}.weight",))
        file_w = torch.cat([mla.fp8_tensors[p] for p in parts])
        file_s = torch.cat([mla.fp8_tensors[p + "_scale_inv"] for p in parts])
        assert torch.equal(m.weight.view(torch.uint8), file_w.view(torch.uint8)), name
        assert torch.equal(m.weight_scale_inv, file_s), name
        assert m.weight.data_ptr() == m.held_weight.data_ptr()  # a view, not a copy
        assert not m.held_weight[n:].view(torch.uint8).any(), name
        assert torch.equal(m.held_scale_inv[file_s.shape[0] :], torch.ones(2, file_s.shape[1]))
    rows = StepLogits()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    outputs = llm.generate(mla.ref.prompts, params, on_step=rows)
    check_engine_outputs(mla.ref, llm, outputs, rows, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_padded_mla_inputs_on_the_gpu(mla, monkeypatch):
    """fp32 on the GPU (the Triton FP8 GEMM on the held weights, its outputs strided
    views into the Triton norms and rope, CUDA graphs): transformers' greedy tokens."""
    ops = dataclasses.replace(kb.get_backend("cuda"), fp8_padded_rows=extra_blocks)
    monkeypatch.setattr(loader, "get_backend", lambda device, backend=None: ops)
    llm = LLM(mla.fp8, device="cuda", dtype=torch.float32, max_num_seqs=4, max_model_len=64,
              page_size=4)  # fmt: skip
    padded = [m for m in llm.model.modules() if isinstance(m, Fp8BlockLinear) and m.padded]
    assert len(padded) == llm.model.config.num_layers and llm.backend.name == "triton"
    outputs = llm.generate(mla.ref.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    check_engine_outputs(mla.ref, llm, outputs)
