"""Block-quantised FP8 checkpoints (DeepSeek-V3 / MiMo-V2-Flash / Qwen3-FP8 format,
``models/fp8.py``), kept in FP8 (``models/fp8_linear.py``).

Tiny DeepSeek-V3, MiMo-V2-Flash and Qwen3 models (``engine_fixtures.save_tiny_deepseek``,
``test_engine_mimo.save_tiny_mimo``, ``save_tiny_model("qwen3")``) are quantised here, by a writer of this file, to
float8_e4m3fn weights with fp32 ``weight_scale_inv`` per block of ``BLOCK`` = 16 rows x
24 columns (not square, so rows and columns cannot be swapped unnoticed; the tiny dims
24, 32, 40, 64, 72, 80, 144 leave partial edge blocks). Embeddings, norms, lm_head and
router gates stay fp32, and so do a few linears (``NOT_CONVERTED``, as the releases'
``modules_to_not_convert``): the loader finds quantised weights by their scales.

The oracle is a second checkpoint: the same FP8 bytes dequantised by a naive loop over
blocks and saved as plain fp32, which transformers loads.

- unikv's engine on the FP8 checkpoint gives transformers' greedy tokens on the
  dequantised one (24 new tokens, fp32, CPU), and every sampled logit row equals
  transformers' teacher-forced logits to 1e-4 (DeepSeek-V3's routed experts kept in
  FP8 too);
- bytes: each ``Fp8BlockLinear`` and expert ``Fp8Weight`` holds the file's FP8 bytes and
  scales (a fused one: its parts' concatenated), whose naive dequantisation is the plain
  loader's weight; every other parameter (DeepSeek's kv_b_proj, the unconverted linears)
  equals the plain loader's bit for bit (fp32, and rounded to bf16);
- ``dequantize_fp8`` against the naive loop for random shapes, block sizes, leading
  (expert) dims and chunk sizes (hypothesis);
- bad input is a ValueError: an unsupported fmt, activation scheme, block size or
  method; a scale of the wrong shape (expected vs given); a weight without its scale
  or a scale without its weight; scales under a config that is not FP8.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from engine_fixtures import (  # noqa: F401
    GreedyReference,
    StepLogits,
    check_engine_outputs,
    one_thread,
    save_tiny_deepseek,
    save_tiny_model,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from test_engine_mimo import save_tiny_mimo

from unikv.engine import LLM, SamplingParams
from unikv.hf_config import model_specs_from_hf_config
from unikv.models import load_model, load_model_config
from unikv.models.fp8 import Fp8Format, dequantize_fp8, fp8_format
from unikv.models.fp8_linear import Fp8BlockLinear
from unikv.models.loader import packed_params
from unikv.models.moe import Fp8Weight

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = [16, 24]
FP8_MAX = 448.0  # largest finite float8_e4m3fn
UNQUANTISED = ("embed_tokens", "lm_head", "norm", "layernorm", "mlp.gate.weight")
NOT_CONVERTED = {
    "deepseek_v3": ("kv_a_proj_with_mqa",),
    "deepseek_v3_qkv": ("layers.0.mlp.down_proj",),  # its q_a | kv_a GEMM in FP8
    "deepseek_v2": ("layers.0.mlp.down_proj",),
    "mimo": ("layers.0.self_attn.o_proj",),
    "qwen3": ("layers.1.mlp.down_proj",),
}
SAVE = {
    "deepseek_v3": lambda path: save_tiny_deepseek(3, path),
    # q_lora 48: q_a_proj in whole 16-row blocks, so q_a | kv_a (80 rows) stays FP8
    "deepseek_v3_qkv": lambda path: save_tiny_deepseek(3, path, q_lora_rank=48),
    "deepseek_v2": lambda path: save_tiny_deepseek(2, path),  # kv_a_proj_with_mqa alone
    "mimo": save_tiny_mimo,
    "qwen3": lambda path: save_tiny_model("qwen3", path, num_hidden_layers=4),
}
PROMPT_LENS = [9, 21]
NEW_TOKENS = 24


def quantise_blocks(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) fp32 -> (float8_e4m3fn (out, in), fp32 scale_inv (ceil(out/bn), ceil(in/bk))):
    each block scaled so its largest |value| maps to FP8_MAX."""
    bn, bk = block
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(math.ceil(w.shape[0] / bn), math.ceil(w.shape[1] / bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (
                (blk / scale[i, j]).clamp(-FP8_MAX, FP8_MAX).to(q.dtype)
            )
    return q, scale


def naive_dequant(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """The oracle: (..., out, in) FP8 -> fp32, one block at a time, one scalar scale each."""
    bn, bk = block
    qs, scales = q.reshape(-1, *q.shape[-2:]), scale.reshape(-1, *scale.shape[-2:])
    out = torch.empty(qs.shape, dtype=torch.float32)
    for e in range(qs.shape[0]):
        for i in range(scales.shape[1]):
            for j in range(scales.shape[2]):
                rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
                out[e, rows, cols] = qs[e, rows, cols].float() * scales[e, i, j]
    return out.reshape(q.shape)


def _is_quantised(name: str, tensor: torch.Tensor, arch: str) -> bool:
    skip = UNQUANTISED + NOT_CONVERTED[arch]
    return name.endswith(".weight") and tensor.dim() == 2 and not any(s in name for s in skip)


def _write(path: str, src: str, tensors: dict, quant: dict | None) -> None:
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(src):
        if name.endswith(".json") and name != "config.json":
            shutil.copy(os.path.join(src, name), path)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    if quant is not None:
        config["quantization_config"] = quant
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors")
    )


def quant_config(arch: str, **changes) -> dict:
    quant = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": BLOCK,
        "modules_to_not_convert": list(NOT_CONVERTED[arch]),
    }
    return quant | changes


class Checkpoints:
    """``fp8``: the quantised checkpoint dir; ``plain``: its naive dequantisation as fp32;
    ``fp8_tensors`` / ``oracle``: their tensors by name; ``ref``: transformers' greedy
    tokens on ``plain``. ``block``: the scale blocks (``BLOCK`` unless given)."""

    def __init__(self, arch: str, root, block=BLOCK) -> None:
        import transformers as tf

        src = str(root / "src")
        SAVE[arch](src)
        self.fp8_tensors, self.oracle = {}, {}
        for name, w in load_file(os.path.join(src, "model.safetensors")).items():
            if _is_quantised(name, w, arch):
                q, scale = quantise_blocks(w, block)
                self.fp8_tensors |= {name: q, name + "_scale_inv": scale}
                self.oracle[name] = naive_dequant(q, scale, block)
            else:
                self.fp8_tensors[name] = self.oracle[name] = w
        self.arch, self.fp8, self.plain = arch, str(root / "fp8"), str(root / "plain")
        _write(self.fp8, src, self.fp8_tensors, quant_config(arch, weight_block_size=list(block)))
        _write(self.plain, src, self.oracle, None)
        hf = tf.AutoModelForCausalLM.from_pretrained(
            self.plain,
            dtype=torch.float32,
            attn_implementation="eager",
            experts_implementation="eager",
        ).eval()
        self.ref = GreedyReference(hf, self.fp8, PROMPT_LENS, NEW_TOKENS)

    def variant(self, path, tensors: dict | None = None, *, quant: dict | None) -> str:
        """A copy of the FP8 checkpoint with other tensors and / or quantization_config."""
        _write(str(path), self.fp8, self.fp8_tensors if tensors is None else tensors, quant)
        return str(path)


@pytest.fixture(scope="module", params=["deepseek_v3", "mimo", "qwen3"])
def ckpt(request, tmp_path_factory) -> Checkpoints:
    return Checkpoints(request.param, tmp_path_factory.mktemp(f"fp8_{request.param}"))


def test_checkpoint_is_really_fp8(ckpt):
    """The writer quantised most linears and left the excluded ones alone."""
    scales = [n for n in ckpt.fp8_tensors if n.endswith("_scale_inv")]
    assert len(scales) > 20
    for name in scales:
        assert ckpt.fp8_tensors[name[: -len("_scale_inv")]].dtype == torch.float8_e4m3fn
    kept = [n for n in ckpt.fp8_tensors if any(s in n for s in NOT_CONVERTED[ckpt.arch])]
    assert kept and all(ckpt.fp8_tensors[n].dtype == torch.float32 for n in kept)


def test_greedy_tokens_and_logits_match_transformers_on_the_dequantised_checkpoint(ckpt):
    llm = LLM(ckpt.fp8, device="cpu", max_num_seqs=4, max_model_len=64, page_size=4)
    assert sum(isinstance(m, Fp8BlockLinear) for m in llm.model.modules()) >= 8
    if ckpt.arch == "deepseek_v3":  # its routed experts run in FP8 too (``moe_fp8``)
        assert sum(isinstance(m, Fp8Weight) for m in llm.model.modules()) >= 8
    rows = StepLogits()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    outputs = llm.generate(ckpt.ref.prompts, params, on_step=rows)
    check_engine_outputs(ckpt.ref, llm, outputs, rows, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linears_hold_the_files_bytes_and_the_rest_the_dequantisation(ckpt, dtype):
    """Changed when FP8 linears stopped being dequantised at load, and again when FP8
    experts did: each ``Fp8BlockLinear`` and each routed expert's ``Fp8Weight`` holds the
    checkpoint's FP8 bytes and fp32 scales as stored (a fused q|k|v or gate|up: its
    parts concatenated), and their naive dequantisation is the plain loader's weight
    (rounded to ``dtype``); every other parameter equals the plain loader's bit for bit,
    and each one whose checkpoint tensor is FP8 (DeepSeek's kv_b_proj) equals the oracle
    rounded to ``dtype``."""
    model = load_model(ckpt.fp8, dtype=dtype)
    plain = dict(load_model(ckpt.plain, dtype=dtype).named_parameters())
    packed = packed_params(model)
    kept = {n: m for n, m in model.named_modules() if isinstance(m, (Fp8BlockLinear, Fp8Weight))}
    assert len(kept) >= 8
    experts = [n for n, m in kept.items() if isinstance(m, Fp8Weight)]
    assert len(experts) >= (8 if ckpt.arch == "deepseek_v3" else 0)  # 2 layers x 4 x 3
    for name, module in kept.items():
        parts = packed.get(f"{name}.weight", (f"{name}.weight",))
        file_w = torch.cat([ckpt.fp8_tensors[p] for p in parts])
        file_s = torch.cat([ckpt.fp8_tensors[p + "_scale_inv"] for p in parts])
        assert module.weight.dtype == torch.float8_e4m3fn, name
        assert torch.equal(module.weight.view(torch.uint8), file_w.view(torch.uint8)), name
        assert module.weight_scale_inv.dtype == torch.float32, name
        assert torch.equal(module.weight_scale_inv, file_s), name
        real = naive_dequant(module.weight, module.weight_scale_inv, BLOCK).to(dtype)
        assert torch.equal(real, plain[f"{name}.weight"]), name
    fp8_params = {f"{n}.{p}" for n in kept for p in ("weight", "weight_scale_inv")}
    rest = {n: p for n, p in model.named_parameters() if n not in fp8_params}
    assert rest.keys() == plain.keys() - fp8_params
    checked = 0
    for name, param in rest.items():
        assert param.dtype == plain[name].dtype and torch.equal(param, plain[name]), name
        if name in ckpt.oracle and ckpt.fp8_tensors[name].dtype == torch.float8_e4m3fn:
            assert torch.equal(param, ckpt.oracle[name].to(param.dtype)), name
            checked += 1
    assert checked >= (3 if ckpt.arch == "deepseek_v3" else 0)  # kv_b_proj


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_teacher_forced_against_the_dequantised_twin_gpu(ckpt):
    """On the GPU in bf16 (Triton kernels, CUDA graphs): unikv on the FP8 checkpoint (its
    FP8 linears through the block-scaled GEMM, DeepSeek-V3's experts through ``moe_fp8``)
    against transformers on the dequantised twin, teacher-forced over unikv's own tokens:
    as close to transformers-fp32 as transformers-bf16 is, and on its argmax up to ties."""
    from gpu_fixtures import assert_bf16_close, bf16_token_checks, gpu_llm, hf_model, seeded_prompts

    hf16, hf32 = hf_model(ckpt.plain, torch.bfloat16), hf_model(ckpt.plain, torch.float32)
    llm = gpu_llm(ckpt.fp8, torch.bfloat16, max_model_len=128)
    assert llm.runner.graphs is not None
    assert sum(isinstance(m, Fp8BlockLinear) for m in llm.model.modules()) >= 8
    checks = bf16_token_checks(llm, hf16, hf32, seeded_prompts([5, 17, 40, 63]), 16)
    assert_bf16_close(checks, 0.25)


def test_config_and_inspect_accept_fp8(ckpt, capsys):
    """hf_config's sub-pools of the FP8 checkpoint are those of the plain one, and
    ``unikv inspect`` plans it (and the DeepSeek-V3 preset, which carries the release's
    quantization_config)."""
    from unikv.inspect import main

    assert model_specs_from_hf_config(ckpt.fp8) == model_specs_from_hf_config(ckpt.plain)
    assert fp8_format(load_model_config(ckpt.fp8)[1]) == Fp8Format(block=tuple(BLOCK))
    assert main([ckpt.fp8, "--budget", "64MiB"]) == 0
    assert main(["deepseek-v3", "--budget", "8GiB"]) == 0
    capsys.readouterr()


@settings(max_examples=40, deadline=None)
@given(
    lead=st.sampled_from([(), (3,)]),
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    bn=st.integers(1, 17),
    bk=st.integers(1, 17),
    chunk_bytes=st.sampled_from([1, 100, 1 << 20]),
    seed=st.integers(0, 2**16),
)
def test_dequantize_matches_the_naive_loop(lead, rows, cols, bn, bk, chunk_bytes, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(*lead, rows, cols, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX)
    q = q.to(torch.float8_e4m3fn)
    scale = torch.rand(*lead, math.ceil(rows / bn), math.ceil(cols / bk), generator=g) + 0.01
    got = dequantize_fp8(
        q, scale, Fp8Format(block=(bn, bk)), torch.float32, chunk_bytes=chunk_bytes
    )
    assert torch.equal(got, naive_dequant(q, scale, (bn, bk)))


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"fmt": "e5m2"}, "fmt"),
        ({"activation_scheme": "static"}, "activation_scheme"),
        ({"weight_block_size": [128]}, "weight_block_size"),
        ({"weight_block_size": [0, 128]}, "weight_block_size"),
        ({"weight_block_size": [128.0, 128]}, "weight_block_size"),
        ({"weight_block_size": None}, "per-tensor"),
        ({"scale_fmt": "int8"}, "scale_fmt"),
        ({"quant_method": "awq"}, "quant_method"),
    ],
)
def test_unsupported_quantization_config_is_refused(tmp_path, ckpt, changes, match):
    path = ckpt.variant(tmp_path, quant=quant_config(ckpt.arch, **changes))
    with pytest.raises(ValueError, match=match):
        load_model_config(path)


def test_scale_of_the_wrong_shape_says_expected_and_given(tmp_path, ckpt):
    name = next(n for n in ckpt.fp8_tensors if n.endswith("o_proj.weight_scale_inv"))
    bad = dict(ckpt.fp8_tensors)
    bad[name] = bad[name][:-1]
    given_shape = tuple(bad[name].shape)
    expected = tuple(ckpt.fp8_tensors[name].shape)
    path = ckpt.variant(tmp_path, bad, quant=quant_config(ckpt.arch))
    with pytest.raises(ValueError, match="expected") as err:
        load_model(path)
    assert name in str(err.value)
    assert str(expected) in str(err.value) and str(given_shape) in str(err.value)


def test_block_size_disagreeing_with_the_scales_is_refused(tmp_path, ckpt):
    path = ckpt.variant(tmp_path, quant=quant_config(ckpt.arch, weight_block_size=[24, 16]))
    with pytest.raises(ValueError, match=r"weight_block_size disagree"):
        load_model(path)


@pytest.mark.parametrize("drop", ["scale", "weight"])
def test_broken_pair_is_refused(tmp_path, ckpt, drop):
    scale = next(n for n in ckpt.fp8_tensors if n.endswith("_scale_inv"))
    weight = scale[: -len("_scale_inv")]
    bad = {k: v for k, v in ckpt.fp8_tensors.items() if k != (scale if drop == "scale" else weight)}
    path = ckpt.variant(tmp_path, bad, quant=quant_config(ckpt.arch))
    with pytest.raises(ValueError, match=scale if drop == "scale" else "pair is broken"):
        load_model(path)


def test_scales_without_an_fp8_config_are_refused(tmp_path, ckpt):
    path = ckpt.variant(tmp_path, quant=None)
    with pytest.raises(ValueError, match="quant_method 'fp8'"):
        load_model(path)


def test_scaled_weight_that_is_not_fp8_is_refused():
    w, scale = torch.randn(40, 64), torch.ones(3, 3)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8(w, scale, Fp8Format(block=(16, 24)), torch.float32)
    with pytest.raises(ValueError, match=r"given torch.int32"):
        dequantize_fp8(w.to(torch.float8_e4m3fn), scale.int(), Fp8Format((16, 24)), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dequantised_on_the_gpu_equals_the_cpu(ckpt):
    """Weights dequantised on the GPU (the FP8 bytes moved, then scaled there) equal the
    CPU's bit for bit, in bf16 (one fp32 product per element, then round to nearest)."""
    gpu = dict(load_model(ckpt.fp8, device="cuda", dtype=torch.bfloat16).named_parameters())
    cpu = dict(load_model(ckpt.fp8, dtype=torch.bfloat16).named_parameters())
    for name, param in gpu.items():
        assert param.device.type == "cuda" and torch.equal(param.cpu(), cpu[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_tokens_and_logits_on_the_gpu(ckpt):
    """fp32 on the GPU (the Triton FP8 GEMM's IEEE w8a16 path, CUDA graphs): the FP8
    linears stay FP8 on the device, the tokens are transformers' on the dequantised
    checkpoint and every sampled logit row is within 1e-4 of its teacher-forced one."""
    from engine_fixtures import hf_logits

    llm = LLM(
        ckpt.fp8, device="cuda", dtype=torch.float32, max_num_seqs=4, max_model_len=64, page_size=4
    )
    fp8 = [m for m in llm.model.modules() if isinstance(m, Fp8BlockLinear)]
    assert llm.backend.name == "triton" and len(fp8) >= 8
    assert all(m.weight.is_cuda and m.weight.dtype == torch.float8_e4m3fn for m in fp8)
    rows = StepLogits()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    outputs = llm.generate(ckpt.ref.prompts, params, on_step=rows)
    assert [o.output_ids for o in outputs] == ckpt.ref.greedy
    first_id = llm.requests.next_id - len(outputs)
    for k, out in enumerate(outputs):
        full = hf_logits(ckpt.ref.hf, out.prompt_ids + out.output_ids)
        for (rid, p), row in rows.rows.items():
            if rid == first_id + k:
                assert (row.cpu() - full[p - 1]).abs().max().item() < 1e-4, (k, p)


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively")
def test_triton_fp8_gemm_in_the_engine_under_the_interpreter(ckpt):
    """The engine on the Triton backend (the FP8 GEMM, attention, MLA under
    TRITON_INTERPRET=1 on CPU): transformers' greedy tokens on the dequantised model."""
    if ckpt.arch != "qwen3":
        pytest.skip("one family is enough for the interpreter's time")
    from engine_fixtures import hf_greedy

    prompts = [ckpt.ref.prompts[1][:12], ckpt.ref.prompts[0][:4]]
    llm = LLM(ckpt.fp8, device="cpu", backend="triton", max_num_seqs=4, max_model_len=32,
              page_size=4)  # fmt: skip
    assert llm.backend.name == "triton"
    assert any(isinstance(m, Fp8BlockLinear) for m in llm.model.modules())
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    assert [o.output_ids for o in outputs] == [hf_greedy(ckpt.ref.hf, p, 6) for p in prompts]
