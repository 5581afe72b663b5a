"""The MoE in the kernel backend (issue 38, item 3): the variant is decided once, by
``get_backend``, and models take it at construction.

- The choice, with the "device is CUDA" inputs forced through the backend's seams (a
  faked sm_90 probe, ``UNIKV_MOE_HOPPER``): the torch backend always carries the torch
  reference and no re-packed variant; the Triton backend carries the Triton MoE, and the
  Hopper kernel for bf16 MXFP4 experts in whole 64-blocks, on sm_90 only.
- ``LLM(backend="torch")`` serving a tiny gpt-oss (MoE) model imports no ``triton``
  module (a subprocess, ``sys.modules``), nor does a model built for a CUDA device with
  the torch backend.
- Each backend's ``moe`` that runs on the CPU (the torch reference; Triton's under
  ``TRITON_INTERPRET=1``, set by conftest) against a per-token loop written here from
  the definition, and the models' experts through the backend they were built with.
- The loader builds every module with the one backend (no module keeps another's ops),
  and gpt-oss re-packs MXFP4 experts only where the backend says, through its variant.
- No per-call code of the kernels this item names reads ``os.environ``, and the
  device capability is read only by cached probes.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from unikv.kernels import backend as kb
from unikv.kernels.moe import ref as moe_ref
from unikv.kernels.moe.mxfp4_ref import dequantize_mxfp4

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_cache(monkeypatch):
    """An empty backend cache, so that faked devices never leak into other tests."""
    monkeypatch.setattr(kb, "_CACHE", {})


# -- the choice, decided once ------------------------------------------------------------


@pytest.mark.parametrize("sm90", [True, False])
def test_torch_backend_on_cuda_picks_the_torch_reference(monkeypatch, fresh_cache, sm90):
    """``get_backend("cuda", "torch")`` with the device probe answering "an sm_90 GPU":
    the MoE is the reference, nothing is re-packed, and the probe is never asked."""
    probed = []
    monkeypatch.setattr(kb, "_sm90", lambda device: probed.append(device) or sm90)
    ops = kb.get_backend("cuda", "torch")
    assert ops.name == "torch" and ops.moe is moe_ref.fused_moe
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert ops.moe_repacked(dtype, 128, 128) is None
    assert kb.flags_for("cuda", "torch") == kb.Flags()
    assert not probed


def test_triton_backend_variants_follow_the_device_and_the_switch(monkeypatch, fresh_cache):
    """The Triton backend on a faked CUDA device: Triton's MoE (the table's dispatch);
    the Hopper variant only on sm_90, for bf16 experts in whole 64-blocks, and not with
    ``UNIKV_MOE_HOPPER=0`` (``env.FLAGS.moe_hopper``, read when the backend is built)."""
    from unikv import env
    from unikv.kernels.moe import fused as moe
    from unikv.kernels.moe import hopper as moe_hopper

    monkeypatch.setattr(kb, "_sm90", lambda device: True)
    monkeypatch.setattr(env, "FLAGS", dataclasses.replace(env.FLAGS, moe_hopper=True))
    ops = kb.get_backend("cuda", "triton")
    assert ops.name == "triton" and ops.moe is moe.moe
    variant = ops.moe_repacked(torch.bfloat16, 128, 192)
    assert variant is not None and variant.name == "hopper"
    assert variant.run is moe_hopper.moe and variant.pack is moe_hopper.repack_in_place
    assert ops.moe_repacked(torch.float16, 128, 192) is None  # wgmma shares one type
    assert ops.moe_repacked(torch.float32, 128, 192) is None
    assert ops.moe_repacked(torch.bfloat16, 96, 128) is None  # hidden not 64-blocks
    assert ops.moe_repacked(torch.bfloat16, 128, 96) is None
    assert kb.get_backend("cuda", "triton") is ops  # decided once
    monkeypatch.setattr(env, "FLAGS", dataclasses.replace(env.FLAGS, moe_hopper=False))
    off = kb.get_backend("cuda", "triton")
    assert off is not ops and off.moe is moe.moe
    assert off.moe_repacked(torch.bfloat16, 128, 192) is None
    monkeypatch.setattr(env, "FLAGS", dataclasses.replace(env.FLAGS, moe_hopper=True))
    monkeypatch.setattr(kb, "_sm90", lambda device: False)  # an A100, say
    kb._CACHE.clear()
    assert kb.get_backend("cuda", "triton").moe_repacked(torch.bfloat16, 128, 192) is None
    # the interpreter's Triton backend: Triton's MoE, no device probe, no Hopper
    monkeypatch.setattr(kb, "_sm90", lambda device: pytest.fail("probed the CPU"))
    cpu = kb.get_backend("cpu", "triton")
    assert cpu.moe is moe.moe and cpu.moe_repacked(torch.bfloat16, 128, 192) is None


def test_extend_hopper_is_decided_by_the_backend(monkeypatch, fresh_cache):
    """The fresh-prompt Gluon attention: the CUDA Triton backend on sm_90 binds the
    kernel's shortest prompts into its ``plan_extend``, once; each step's plan then asks
    for ``hopper`` where the prompt is that long (per head dim). Elsewhere the plan holds
    no ``hopper`` key and the extend op is the plain one (whose default never probes the
    device). (Before the step plans, the backend bound ``hopper=True`` into its extend op
    and the op compared the length on every layer.)"""
    from unikv.kernels.attention import extend
    from unikv.kernels.attention import fresh_hopper as extend_hopper

    monkeypatch.setattr(kb, "_sm90", lambda device: True)
    monkeypatch.setattr(extend_hopper, "ENABLED", True)
    ops = kb.get_backend("cuda", "triton")
    assert ops.extend_attention is extend.extend_attention
    for dim, shortest in extend_hopper.MIN_Q_LEN.items():
        assert ops.plan_extend(1, max_q_len=shortest, head_dim=dim).launch == {"hopper": True}
        assert ops.plan_extend(3, max_q_len=shortest - 1, head_dim=dim).launch == {"hopper": False}
    assert ops.plan_extend(1, max_q_len=1 << 20, head_dim=96).launch == {"hopper": False}
    monkeypatch.setattr(extend_hopper, "ENABLED", False)  # UNIKV_EXTEND_HOPPER=0
    for device in ("cuda", "cpu"):
        ops = kb.get_backend(device, "triton")
        assert ops.extend_attention is extend.extend_attention
        assert ops.plan_extend(1, max_q_len=1 << 20, head_dim=128).launch == {}


def test_switches_are_read_at_import(tmp_path):
    """``UNIKV_EXTEND_HOPPER`` is read once, when the module loads (a subprocess)."""
    code = "from unikv.kernels.attention import fresh_hopper; print(fresh_hopper.ENABLED)"
    for value, want in (("0", "False"), ("1", "True")):
        env = {**os.environ, "UNIKV_EXTEND_HOPPER": value}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, cwd=ROOT, timeout=300, check=False)  # fmt: skip
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == want


# -- no Triton for the torch backend ----------------------------------------------------

_NO_TRITON = """
import sys, traceback


class NoTriton:
    \"\"\"Triton made unimportable; each attempt's importing frame is recorded.\"\"\"

    attempts = []

    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            frames = [f for f in traceback.extract_stack() if "importlib" not in f.filename]
            self.attempts.append(f"{frames[-2].filename}:{frames[-2].lineno}")
            raise ModuleNotFoundError(f"no {name} in this test")
        return None


sys.meta_path.insert(0, NoTriton())
import torch
from unikv.engine import LLM, SamplingParams
from unikv.kernels.backend import get_backend
from unikv.models.llama import CausalLM

llm = LLM(sys.argv[1], backend="torch", cuda_graphs=False)
assert llm.backend.name == "torch"
experts = [m for m in llm.model.modules() if type(m).__name__ == "Experts"]
assert experts and all(m.kernel is llm.backend.moe for m in experts)
out = llm.generate([[1, 2, 3, 4, 5], [7, 3]], SamplingParams(max_tokens=4, temperature=0.0))
assert [len(o.output_ids) for o in out] == [4, 4]
# a model built for a CUDA device with the torch backend (no device is touched)
ops = get_backend("cuda", "torch")
model = CausalLM(llm.model.config, 64, ops=ops)
assert all(m.ops is ops for m in model.modules() if hasattr(m, "ops"))
with torch.no_grad():
    model.model.layers[0].mlp(torch.randn(3, model.config.hidden_size))
loaded = sorted(n for n, m in sys.modules.items() if n.split(".")[0] == "triton" and m)
ours = [a for a in NoTriton.attempts if "/unikv/" in a]
print("TRITON", loaded, ours)
"""


def test_torch_backend_imports_no_triton(tmp_path):
    """``LLM(backend="torch")`` serving a tiny gpt-oss, and a model built for CUDA with
    the torch backend, in a fresh interpreter where Triton cannot be imported: they run
    (the reference MoE) and no unikv module even tries to import ``triton``
    (transformers' config reader does, through torch._dynamo; that is not ours)."""
    from engine_fixtures import save_tiny_model

    save_tiny_model("gpt_oss", str(tmp_path))  # here: saving imports Triton (transformers)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", _NO_TRITON, str(tmp_path)], env=env,
                         capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert "TRITON [] []" in run.stdout, run.stdout


# -- the backend's MoE against the definition --------------------------------------------


def _naive_moe(x, weights, ids, w1, w2, *, b1=None, b2=None, activation="silu",
               gate_up="concat", alpha=1.702, limit=7.0):  # fmt: skip
    """Per token, per chosen expert, from the definition (fp64)."""
    x, w1, w2 = x.double(), w1.double(), w2.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w1[e] @ x[t] + (b1[e].double() if b1 is not None else 0)
            if activation == "relu2":
                a = F.relu(h) ** 2
            else:
                g, u = (h[0::2], h[1::2]) if gate_up == "interleaved" else h.chunk(2)
                if activation == "silu":
                    a = F.silu(g) * u
                else:  # gpt_oss
                    g = g.clamp(max=limit)
                    a = (u.clamp(-limit, limit) + 1) * g * torch.sigmoid(alpha * g)
            y = w2[e] @ a + (b2[e].double() if b2 is not None else 0)
            out[t] += float(weights[t, j]) * y
    return out


CASES = [  # activation, gate_up, experts, top_k, hidden, intermediate, tokens, biases
    ("silu", "concat", 4, 2, 40, 24, 5, False),
    ("gpt_oss", "interleaved", 3, 2, 32, 16, 3, True),
    ("relu2", "concat", 5, 1, 24, 40, 4, False),
]


def _case(activation, gate_up, e, k, d, i, t, biases, seed=0):
    g = torch.Generator().manual_seed(seed)
    n1 = i if activation == "relu2" else 2 * i
    args = {
        "x": torch.randn(t, d, generator=g),
        "topk_weights": torch.rand(t, k, generator=g),
        "topk_ids": torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]),
        "w1": torch.randn(e, n1, d, generator=g) / d**0.5,
        "w2": torch.randn(e, d, i, generator=g) / i**0.5,
    }
    kw = {"activation": activation, "gate_up": gate_up}
    if biases:
        kw.update(b1=torch.randn(e, n1, generator=g), b2=torch.randn(e, d, generator=g))
    return args, kw


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_backend_moe_matches_the_definition(name, case):
    """Each backend's ``moe`` on the CPU (Triton through the interpreter) against the
    per-token loop: fp32, tolerance 1e-5 of the largest output."""
    ops = kb.get_backend("cpu", name)
    args, kw = _case(*case)
    want = _naive_moe(*args.values(), **kw)
    got = ops.moe(*args.values(), **kw)
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), (name, err)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_backend_moe_runs_mxfp4_experts_kept_packed(name):
    """MXFP4 experts as the checkpoint stores them, through each backend's ``moe``,
    against the loop on their dequantised bytes."""
    g = torch.Generator().manual_seed(3)
    e, k, d, i, t = 3, 2, 64, 32, 4
    blocks = [torch.randint(0, 256, (e, n, kk // 32, 16), dtype=torch.uint8, generator=g)
              for n, kk in ((2 * i, d), (d, i))]  # fmt: skip
    scales = [torch.randint(120, 128, b.shape[:3], dtype=torch.uint8, generator=g) for b in blocks]
    x = torch.randn(t, d, generator=g)
    weights = torch.rand(t, k, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    kw = {"activation": "gpt_oss", "gate_up": "interleaved"}
    dense = [dequantize_mxfp4(b, s).transpose(1, 2) for b, s in zip(blocks, scales, strict=True)]
    want = _naive_moe(x, weights, ids, *dense, **kw)
    got = kb.get_backend("cpu", name).moe(
        x, weights, ids, blocks[0], blocks[1], w1_scales=scales[0], w2_scales=scales[1], **kw
    )
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), (name, err)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_routed_experts_run_the_backend_they_were_built_with(name):
    """``RoutedExperts`` built with a backend (an argument, or the enclosing
    ``building``) keeps its MoE through a dtype change and gives the loop's output."""
    from unikv.models.moe import RoutedExperts

    ops = kb.get_backend("cpu", name)
    with kb.building(ops):
        experts = RoutedExperts(4, 40, 24, names=("w1", "w3", "w2"))
    assert experts.kernel is ops.moe
    assert RoutedExperts(4, 40, 24, ops=ops).kernel is ops.moe
    assert RoutedExperts(4, 40, 24).kernel is moe_ref.fused_moe  # outside any: the reference
    experts = experts.to(torch.float64).to(torch.float32)
    assert experts.kernel is ops.moe
    args, _ = _case("silu", "concat", 4, 2, 40, 24, 5, False, seed=1)
    with torch.no_grad():
        for e, expert in enumerate(experts):
            expert.w1.weight.copy_(args["w1"][e, :24])
            expert.w3.weight.copy_(args["w1"][e, 24:])
            expert.w2.weight.copy_(args["w2"][e])
        got = experts(args["x"], args["topk_weights"], args["topk_ids"])
    want = _naive_moe(*args.values())
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


# -- the loader: one backend for every module ---------------------------------------------


def _ops_of(model) -> set[str]:
    """The backend names the model's modules call (their ``ops`` and MoE kernels)."""
    from unikv.kernels.moe import fused as moe

    names = {m.ops.name for m in model.modules() if hasattr(m, "ops")}
    kernels = {m.kernel for m in model.modules() if hasattr(m, "kernel")}
    names |= {"torch" if k is moe_ref.fused_moe else "triton" if k is moe.moe else "?"
              for k in kernels}  # fmt: skip
    return names


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_loader_builds_every_module_with_one_backend(tmp_path, name):
    """gpt-oss and a MoE family on ``RoutedExperts`` (Mixtral) loaded with each backend:
    every norm, linear, rope and MoE kernel is that backend's; outside the loader, the
    scope is gone (a module built afterwards runs the references)."""
    import transformers as tf
    from engine_fixtures import TINY, save_random_model, save_tiny_model

    from unikv.models import load_model
    from unikv.models.layers import RMSNorm

    save_tiny_model("gpt_oss", str(tmp_path / "gpt_oss"))
    kw = {**TINY, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 40}
    save_random_model(tf.MixtralConfig(**kw), str(tmp_path / "mixtral"))
    for arch in ("gpt_oss", "mixtral"):
        model = load_model(str(tmp_path / arch), kernels=name)
        assert _ops_of(model) == {name}, arch
    assert RMSNorm(8, 1e-5).ops.name == "torch"


def test_gpt_oss_repacks_only_through_the_backends_variant(tmp_path, monkeypatch):
    """A packed gpt-oss checkpoint: on the torch backend (and the CPU's Triton one) the
    experts keep the checkpoint's layout; on a backend whose ``moe_repacked`` names a
    variant, ``finish_loading`` packs every layer once through it and runs its kernel."""
    from engine_fixtures import pack_gpt_oss_experts, save_tiny_model

    from unikv.models import loader

    save_tiny_model("gpt_oss", str(tmp_path), hidden_size=64, intermediate_size=64)
    pack_gpt_oss_experts(str(tmp_path), seed=4)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("torch", "triton"):
        model = loader.load_model(str(tmp_path), kernels=name)
        experts = [m for m in model.modules() if type(m).__name__ == "Experts"]
        assert experts and all(m.mxfp4 and m.fragments is None for m in experts)
        assert all(m.kernel is kb.get_backend("cpu", name).moe for m in experts)

    packed, asked = [], []

    def pack(w1, s1, w2, s2, gate_up):
        packed.append((w1.shape, gate_up))
        return ("fragments", w1)

    def run(x, topk_weights, topk_ids, frags, **kw):
        return torch.zeros_like(x)

    def repacked(dtype, hidden, inter):
        asked.append((dtype, hidden, inter))
        return kb.MoERepacked("fake", pack, run)

    ops = dataclasses.replace(kb.get_backend("cpu", "torch"), moe_repacked=repacked)
    monkeypatch.setattr(loader, "get_backend", lambda device, backend=None: ops)
    model = loader.load_model(str(tmp_path))
    experts = [m for m in model.modules() if type(m).__name__ == "Experts"]
    assert len(packed) == len(experts) == config["num_hidden_layers"]
    assert set(asked) == {(torch.float32, 64, 64)} and {p[1] for p in packed} == {"interleaved"}
    assert all(m.kernel is run and m.fragments[0] == "fragments" for m in experts)
    assert all(m.operands()["frags"] is m.fragments for m in experts)
    with pytest.raises(RuntimeError, match="re-packed"):
        model.to(torch.float64)


def test_hopper_repack_in_place_matches_pack_experts():
    """``moe_hopper.repack_in_place`` leaves the four tensors holding ``pack_experts``'
    bytes and returns views of them (CPU: the packing is plain torch)."""
    from unikv.kernels.moe import hopper as moe_hopper

    g = torch.Generator().manual_seed(7)
    e, d, i = 2, 64, 64
    w1 = torch.randint(0, 256, (e, 2 * i, d // 32, 16), dtype=torch.uint8, generator=g)
    s1 = torch.randint(118, 130, (e, 2 * i, d // 32), dtype=torch.uint8, generator=g)
    w2 = torch.randint(0, 256, (e, d, i // 32, 16), dtype=torch.uint8, generator=g)
    s2 = torch.randint(118, 130, (e, d, i // 32), dtype=torch.uint8, generator=g)
    want = moe_hopper.pack_experts(w1, s1, w2, s2, "interleaved")
    params = [t.clone() for t in (w1, s1, w2, s2)]
    got = moe_hopper.repack_in_place(*params, "interleaved")
    for a, b in zip(got[:4], want[:4], strict=True):
        assert a.dtype == b.dtype and torch.equal(a.reshape(b.shape), b)
    for view, param in zip(got[:4], params, strict=True):
        assert view.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
    assert got.one_mul == want.one_mul


# -- no per-call switches ---------------------------------------------------------------

# every kernel module (the op families' folders included)
PER_CALL_FREE = sorted(
    p.relative_to(ROOT / "unikv" / "kernels").with_suffix("").as_posix()
    for p in (ROOT / "unikv" / "kernels").rglob("*.py")
)


def _cached(func: ast.FunctionDef) -> bool:
    return any("cache" in ast.unparse(d) for d in func.decorator_list)


@pytest.mark.parametrize("module", PER_CALL_FREE)
def test_no_per_call_environment_or_capability_reads(module):
    """In these kernel modules ``os.environ`` / ``os.getenv`` is read only at module
    level, or in ``backend.flags_for`` (once per ``get_backend``); the device capability
    only inside a ``functools.cache`` probe."""
    tree = ast.parse((ROOT / "unikv" / "kernels" / f"{module}.py").read_text())
    wrong = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        text = ast.unparse(func)
        if ("os.environ" in text or "os.getenv" in text) and func.name != "flags_for":
            wrong.append(f"{func.name} reads the environment")
        if "get_device_capability" in text and not _cached(func):
            wrong.append(f"{func.name} reads the capability uncached")
    assert not wrong, f"{module}: {wrong}"


def test_models_import_no_kernel_module_but_the_backend():
    """``unikv/models``' MoE modules and the shared blocks reach kernels only through
    ``kernels/backend.py`` (``layers.py`` also names the feedback rule of the references)."""
    mine = ("moe", "gpt_oss", "mixtral", "qwen3_moe", "deepseek_moe", "mimo_v2", "llama",
            "loader", "rope")  # fmt: skip
    wrong = []
    for name in mine:
        tree = ast.parse((ROOT / "unikv" / "models" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if (module or "").startswith("unikv.kernels") and module != "unikv.kernels.backend":
                wrong.append(f"{name}: from {module} import ...")
    assert not wrong, wrong
