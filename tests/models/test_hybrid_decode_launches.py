"""The launches one decode step makes per hybrid layer (Qwen3.5's Gated DeltaNet and
gated-attention layers, NemotronH's Mamba-2, attention and MLP blocks) and per DeepSeek
MLA layer, counted by a CPU spy over a real engine step.

The engine runs the Triton backend (TRITON_INTERPRET=1 on the CPU). Inside the decode
step of one request, every Triton kernel run (the interpreter's ``run``) and every
aten op that is not a view or an allocation (each a kernel launch on a GPU) is logged
between the layer module's forward hooks. The expected lists name each launch of the
layer as written in its forward, so a change that adds a launch (an unfused gate, a
derived parameter recomputed each step) fails here with the list it found:

    Qwen3.5 linear-attention layer  pre-norm (+ residual), in_proj GEMM, conv, gated
        delta rule (gates, GQA and l2 norms inside), gated RMSNorm, out_proj GEMM,
        post-norm (+ residual), gate|up GEMM, SiLU-mul, down GEMM: 10.
    NemotronH Mamba-2 block  norm (+ residual), in_proj GEMM, conv (bias, SiLU inside),
        SSD scan, gated RMSNorm, out_proj GEMM: 6 (A = -exp(A_log) is kept at load:
        before, exp and neg made 8).
    Qwen3-Next's (a dense-MLP layer)  the same 10: its per-key-head packed input GEMM's
        rows are regrouped at load into Qwen3.5's order (before, a concatenation: 11).
    Qwen3.5 full-attention layer  pre-norm (+ residual), q|gate|k|v GEMM, q and k norms,
        decode attention (rope and the K/V store inside), out * sigmoid(gate), o_proj
        GEMM, post-norm (+ residual), gate|up GEMM, SiLU-mul, down GEMM: 10 (before: the
        q and k norms two launches, rope and the store two of their own, the gate's
        sigmoid and mul two: 14).
    NemotronH attention block  norm (+ residual), q|k|v GEMM, decode attention (the K/V
        store inside, no rope: ``store_decode_attention``), o_proj GEMM: 4 (before: the
        store a launch of its own, 5; q, k, v three GEMMs, 7).
    NemotronH MLP block  norm (+ residual), up GEMM, relu(up) ** 2, down GEMM: 4 (before:
        relu and square: 5).

    Qwen3-Next's linear-attention layer with its MoE block  the GDN mixer's 6 as above,
        post-norm, the router and shared-expert gate GEMM (one: ``SparseMoE.router``),
        top-k and the softmax of the k logits (the renormalised top-k probabilities:
        ``moe.top_k_softmax``), the fused MoE (expert alignment, gate|up, down, the sum
        over the k experts), the shared expert's gate|up GEMM, SiLU-mul, down GEMM,
        routed + sigmoid(gate) * shared (one ``sigmoid_mul``): 18 (before: the two gate
        GEMMs and the add on their own, 20; softmax over every expert, top-k, sum,
        divide: 22).
    Gemma-3 layer  the previous layer's post-MLP norm (+ residual) with this layer's
        pre-norm (one ``sandwich_rms_norm``), q|k|v GEMM, q and k norms (one
        ``qk_rms_norm``), decode attention (rope and the K/V store inside), o_proj GEMM,
        post-attention norm (+ residual) with the pre-MLP norm (one sandwich), gate|up
        GEMM, GELU-mul, down GEMM: 9 (before: each post-norm a launch of its own, 11;
        the q and k norms two launches, 12).
    DeepSeek MLA layer (a dense MLP)  pre-norm (+ residual), the q / q_a|kv_a GEMMs (V3:
        the q_a norm, q_b GEMM), the latent norm, rope of q's and k's pair dims
        (``rope_pairs``), W_UK bmm, MLA decode (the latent store inside:
        ``store_mla_attention``), W_UV bmm, o_proj GEMM, post-norm, gate|up GEMM, SiLU-mul,
        down GEMM: V2 13, V3 14 (before: the store a launch of its own, 14, 15; the pair
        rope in torch ops, two table gathers and seven ops each for q and k: 29, 30).

On a GPU a one-request step's pre-norm runs inside the GEMV after it; on the CPU the
norm and the GEMM are two launches (both counted here).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from engine_fixtures import (  # noqa: F401  (one_thread: a fixture)
    one_thread,
    save_tiny_deepseek,
    save_tiny_gemma,
    save_tiny_hybrid,
    save_tiny_nemotron_h,
)
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime import interpreter

from unikv.engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="counts the interpreter's kernel runs"),
]
NO_LAUNCH = {"empty", "empty_strided", "empty_like", "detach", "alias", "lift_fresh"}
GDN_LAYER = Counter({"aten.linear": 4, "triton._rms_norm_kernel": 2, "triton._decode_kernel": 1,
                     "triton._gdn_kernel": 1, "triton._gated_rms_norm_kernel": 1,
                     "triton._act_mul_kernel": 1})  # fmt: skip
MAMBA_BLOCK = Counter({"aten.linear": 2, "triton._rms_norm_kernel": 1, "triton._decode_kernel": 1,
                       "triton._ssd_kernel": 1, "triton._gated_rms_norm_kernel": 1})  # fmt: skip
GATED_ATTENTION_LAYER = Counter({"aten.linear": 4, "triton._rms_norm_kernel": 2,
                                 "triton._qk_norm_kernel": 1, "triton._decode_split_kernel": 1,
                                 "triton._sigmoid_mul_kernel": 1,
                                 "triton._act_mul_kernel": 1})  # fmt: skip
ATTENTION_BLOCK = Counter({"aten.linear": 2, "triton._rms_norm_kernel": 1,
                           "triton._decode_split_kernel": 1})  # fmt: skip
MOE_GDN_LAYER = Counter({"aten.linear": 5, "triton._rms_norm_kernel": 2, "triton._decode_kernel": 1,
                         "triton._gdn_kernel": 1, "triton._gated_rms_norm_kernel": 1,
                         "aten.topk": 1, "aten.softmax": 1, "triton._align_kernel": 1,
                         "triton._gate_up_kernel": 1, "triton._down_kernel": 1, "aten.sum": 1,
                         "triton._act_mul_kernel": 1,
                         "triton._sigmoid_mul_kernel": 1})  # fmt: skip
GEMMA3_LAYER = Counter({"aten.linear": 4, "triton._sandwich_norm_kernel": 2,
                        "triton._qk_norm_kernel": 1, "triton._decode_split_kernel": 1,
                        "triton._act_mul_kernel": 1})  # fmt: skip
MLA_LAYER = Counter({"aten.linear": 5, "aten.bmm": 2, "triton._rms_norm_kernel": 3,
                     "triton._rope_pairs_kernel": 1, "triton._split_kernel": 1,
                     "triton._act_mul_kernel": 1})  # fmt: skip
MLP_BLOCK = Counter({"aten.linear": 2, "triton._rms_norm_kernel": 1,
                     "triton._relu_square_kernel": 1})  # fmt: skip


class Spy(TorchDispatchMode):
    """Logs launching aten ops into ``log`` while it is a list."""

    def __init__(self) -> None:
        super().__init__()
        self.log = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.log is not None and not func.is_view and name not in NO_LAUNCH:
            self.log.append("aten." + name)
        return func(*args, **(kwargs or {}))


def decode_launches(path: str, layer_index: int, monkeypatch) -> Counter:
    """The launches of model layer ``layer_index`` in the last decode step of one request."""
    llm = LLM(path, device="cpu", backend="triton", max_model_len=32, max_num_seqs=2)
    layers = next(m for name, m in llm.model.named_modules()
                  if name.endswith("layers") and isinstance(m, torch.nn.ModuleList))  # fmt: skip
    spy, seen = Spy(), []

    def start(module, args, kwargs):
        x = args[0] if args else next(iter(kwargs.values()))
        spy.log = [] if x.shape[0] == 1 else None  # one request: a decode step's one row

    def stop(module, args, kwargs, out):
        if spy.log is not None:
            seen.append(Counter(spy.log))
        spy.log = None

    layers[layer_index].register_forward_pre_hook(start, with_kwargs=True)
    layers[layer_index].register_forward_hook(stop, with_kwargs=True)
    run = interpreter.InterpretedFunction.run

    def counted_run(kernel, *args, **kwargs):
        log, spy.log = spy.log, None  # the interpreter's own host copies launch nothing
        if log is not None:
            log.append("triton." + kernel.fn.__name__)
        try:
            return run(kernel, *args, **kwargs)
        finally:
            spy.log = log

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted_run)
    with spy:
        llm.generate([[3, 1, 4, 1, 5]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(seen) == 2, f"expected two decode steps through layer {layer_index}, saw {seen}"
    assert seen[0] == seen[1], "every decode step launches the same ops"
    return seen[-1]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_qwen3_5_gated_deltanet_layer(tmp_path, monkeypatch, arch):
    hf = save_tiny_hybrid(arch, str(tmp_path))
    layer = hf.config.layer_types.index("linear_attention", 1)  # Qwen3-Next: a dense MLP
    assert decode_launches(str(tmp_path), layer, monkeypatch) == GDN_LAYER


def test_qwen3_5_gated_attention_layer(tmp_path, monkeypatch):
    hf = save_tiny_hybrid("qwen3_5", str(tmp_path))
    layer = hf.config.layer_types.index("full_attention")
    assert decode_launches(str(tmp_path), layer, monkeypatch) == GATED_ATTENTION_LAYER


@pytest.mark.parametrize("kind, want", [("M", MAMBA_BLOCK), ("*", ATTENTION_BLOCK),
                                        ("-", MLP_BLOCK)])  # fmt: skip
def test_nemotron_h_blocks(tmp_path, monkeypatch, kind, want):
    pattern = "M*M-*-"  # each kind measured where it follows another block
    save_tiny_nemotron_h(str(tmp_path), pattern)
    assert decode_launches(str(tmp_path), pattern.index(kind, 1), monkeypatch) == want


@pytest.mark.parametrize("version", [2, 3])
def test_deepseek_mla_layer(tmp_path, monkeypatch, version):
    save_tiny_deepseek(version, str(tmp_path), first_k_dense_replace=2)  # layer 1: dense
    want = MLA_LAYER + Counter({"triton._rms_norm_kernel": version - 2})  # V3: q_a's norm
    assert decode_launches(str(tmp_path), 1, monkeypatch) == want


def test_qwen3_next_moe_layer(tmp_path, monkeypatch):
    hf = save_tiny_hybrid("qwen3_next", str(tmp_path))
    layer = hf.config.layer_types.index("linear_attention", 2)  # sparse (not mlp_only)
    assert layer not in hf.config.mlp_only_layers
    assert decode_launches(str(tmp_path), layer, monkeypatch) == MOE_GDN_LAYER


def test_gemma3_layer(tmp_path, monkeypatch):
    hf = save_tiny_gemma("gemma3", str(tmp_path))
    layer = hf.config.layer_types.index("full_attention")
    assert decode_launches(str(tmp_path), layer, monkeypatch) == GEMMA3_LAYER
