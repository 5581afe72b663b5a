"""Odd cache widths never crash (issue 38, item 6), on CPU.

- Every cache reader and writer, compiled for sm_90a here (``tests/ptx_alignment.py``,
  a subprocess without the interpreter), loads no wider than its strides allow: at rows
  of 26, 30 and 31 elements (MLA) and head dims 6 and 40 (MHA) no 8- or 16-byte vector
  load lands on a row that is not that aligned. The MLA kernels did before the fix
  (16-byte loads at 120-byte rows: the GPU's ``misaligned address``). Aligned rows keep
  their vector loads.
- The start-up check (``kernels/runtime/widths.py``): the MHA attention kernels that do not
  compile at head_dim 6 are exactly the ops it moves to the torch references; odd widths
  they take keep the Triton backend untouched; an odd rope width is refused naming
  ``qk_rope_head_dim``.
- ``LLM`` on the Triton backend (interpreter) at the odd widths: greedy tokens equal
  transformers'.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_fixtures import (
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_model,
)
from odd_width_cases import engine_tokens, hf_tokens, save_case

from unikv.kernels import get_backend
from unikv.kernels.runtime import widths as W
from unikv.placement import SubPoolConfig
from unikv.specs import MHASpec, MLASpec

HERE = Path(__file__).resolve().parents[1]  # tests/
PTXAS = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="needs Triton's ptxas")
def test_cache_readers_load_no_wider_than_their_strides_allow(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parent), env.get("PYTHONPATH", "")]
    )  # this tree's unikv
    run = subprocess.run([sys.executable, str(HERE / "ptx_alignment.py"), "all"], env=env,
                         capture_output=True, text=True, timeout=1200, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.splitlines()[-1])
    unsound, refused, widest = [], set(), {}
    for name, stride, item, got in results:
        if isinstance(got, str):  # did not compile
            refused.add(name.split("/")[0] + "/" + name.split("/")[2])
            continue
        widest[name, stride] = got
        if got > max(4, math.gcd(16, stride * item)):
            unsound.append((name, stride, item, got))
    assert not unsound, unsound
    # what does not compile is the attention at head_dim 6, which widths.py moves to torch
    assert refused == {"extend/d6", "decode/d6", "decode_rope/d6", "decode_store/d6"}, refused
    assert W.MIN_DOT_K > W._pow2(6) and W.MIN_DOT_K <= W._pow2(40)
    # aligned rows (32 fp32 = 128 bytes) still get 16-byte loads, odd ones none
    assert widest["mla_extend/fp32/ps4", 32] == 16 and widest["mla_extend/fp32/ps4", 30] == 4
    assert widest["mla_decode_split1/fp32/ps16", 32] == 16
    assert len(results) == 264  # every case compiled or was refused (none skipped)


def _mha(head_dim: int, ps: int = 4) -> list[SubPoolConfig]:
    return [SubPoolConfig("full", MHASpec(2, 2, head_dim, dtype=torch.float32), page_size=ps)]


def _mla(rank: int, rope: int, ps: int = 4) -> list[SubPoolConfig]:
    return [SubPoolConfig("mla", MLASpec(3, rank, rope, dtype=torch.float32), page_size=ps)]


class _Model:  # the fields of ModelConfig that widths.py reads
    def __init__(self, hidden_size: int = 48, head_dim: int = 24, **extra) -> None:
        self.hidden_size, self.head_dim, self.extra = hidden_size, head_dim, extra


def test_widths_the_kernels_take_keep_the_backend():
    tri = get_backend("cpu", "triton")
    for configs, model in [
        (_mla(24, 6), _Model(qk_nope_head_dim=12, qk_rope_head_dim=6)),
        (_mla(20, 6, ps=16), _Model(qk_nope_head_dim=12, qk_rope_head_dim=6)),
        (_mha(40), None),
        (_mha(9, ps=1), None),
    ]:
        assert W.triton_fallbacks(configs, model) == {}
        assert W.fit_backend(tri, configs, model) is tri


def test_head_dims_the_attention_kernels_cannot_tile_run_the_references():
    tri, ref = get_backend("cpu", "triton"), get_backend("cpu", "torch")
    fitted = W.fit_backend(tri, _mha(6), None)
    assert fitted.name == "triton"
    for op in W.ATTENTION_OPS:
        assert getattr(fitted, op) is getattr(ref, op)
        assert "head_dim 6" in W.triton_fallbacks(_mha(6))[op]
    for op in ("store_kv", "rope_store_kv", "copy_pages", "store_mla", "mla_attention"):
        assert getattr(fitted, op) is getattr(tri, op)
    # the expanded MLA prefill's head (nope + rope) follows the same rule
    small = W.triton_fallbacks(_mla(24, 4), _Model(qk_nope_head_dim=2, qk_rope_head_dim=4))
    assert "qk_nope_head_dim + qk_rope_head_dim 6" in small["extend_attention"]
    assert W.fit_backend(ref, _mha(6), None) is ref  # the references take anything


def test_odd_rope_width_is_refused_naming_the_field():
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match=r"qk_rope_head_dim is 7.*even.*config\.json"):
            W.fit_backend(get_backend("cpu", backend), _mla(24, 7), None)


def test_rows_wider_than_one_norm_program_are_refused_naming_the_field():
    """The row norms' limit (``elementwise.MAX_ROW``), stated at start-up: the widest
    row the kernel itself takes passes, one more is refused there, naming the field,
    as the kernel refuses it; the torch backend takes any width."""
    from unikv.kernels.linear.elementwise import MAX_ROW

    tri, ref = get_backend("cpu", "triton"), get_backend("cpu", "torch")
    widest = torch.ones(1, MAX_ROW)
    assert tri.rms_norm(widest, widest[0], 1e-6).shape == (1, MAX_ROW)  # the kernel's own limit
    with pytest.raises(ValueError, match=str(MAX_ROW)):
        tri.rms_norm(torch.ones(1, MAX_ROW + 1), torch.ones(MAX_ROW + 1), 1e-6)
    assert W.fit_backend(tri, _mha(40), _Model(hidden_size=MAX_ROW, head_dim=40)) is tri
    for field, model in [
        ("hidden_size", _Model(hidden_size=MAX_ROW + 1, head_dim=40)),
        ("head_dim", _Model(hidden_size=64, head_dim=MAX_ROW + 1)),
    ]:
        with pytest.raises(ValueError, match=rf"{field} is {MAX_ROW + 1}.*backend='torch'"):
            W.fit_backend(tri, _mha(40), model)
        assert W.fit_backend(ref, _mha(40), model) is ref


def test_odd_full_rope_head_dim_is_refused_naming_the_field(tmp_path):
    """A Llama of head_dim 7 (full rotary): rope has no partner for the last dim. The
    model load refuses it naming head_dim, before any kernel runs (the rope kernel
    would refuse the step: 2 * 4 rotated dims > 7)."""
    from unikv.models import load_model

    save_tiny_model("llama", str(tmp_path), head_dim=7)
    with pytest.raises(ValueError, match=r"head_dim is 7 with full rotary.*config\.json"):
        load_model(str(tmp_path))
    q = torch.ones(1, 2, 7)
    cos = torch.ones(4, 4)
    with pytest.raises(ValueError, match="rope_qk needs"):
        get_backend("cpu", "triton").rope_qk(
            q, q.clone(), cos, cos, torch.zeros(1, dtype=torch.long)
        )


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("case", "page_size"), [("mla30", 4), ("mla26", 16), ("mha6", 4)])
def test_triton_engine_at_odd_widths_matches_transformers(tmp_path, case, page_size):
    path = str(tmp_path)
    save_case(case, path)
    ours, info = engine_tokens(
        path, device="cpu", dtype=torch.float32, page_size=page_size, backend="triton"
    )
    assert ours == hf_tokens(path, "cpu", torch.float32)
    assert info["torch_ops"] == (["decode_attention", "extend_attention"] if case == "mha6" else [])


def test_tma_rules_refuse_boxes_wider_than_256_columns():
    """A TMA box is at most 256 columns: the launchers' host checks take the pointer path
    for wider heads or latent halves (a descriptor would fail to build)."""
    from unikv.kernels.mla import decode_fused as mla_decode_fused
    from unikv.kernels.runtime import checks as _checks

    if not _checks.has_tensor_descriptor():
        pytest.skip("Triton without host tensor descriptors")
    assert _checks.tma_ok(torch.zeros(4, 2, 256, dtype=torch.bfloat16))
    assert not _checks.tma_ok(torch.zeros(4, 1, 512, dtype=torch.bfloat16))
    assert not _checks.tma_ok(torch.zeros(4, 2, 40, dtype=torch.bfloat16))  # not a power of 2
    wide = torch.zeros(64, 512 + 64, dtype=torch.bfloat16)  # DeepSeek's rank 512 + rope 64
    assert mla_decode_fused.tma_ok(wide, 512, 64, 64)
    assert not mla_decode_fused.tma_ok(
        torch.zeros(64, 1024 + 64, dtype=torch.bfloat16), 1024, 64, 64
    )
    odd = torch.zeros(64, 30, dtype=torch.float32)  # 120-byte rows: no TMA
    assert not mla_decode_fused.tma_ok(odd, 24, 64, 64)
