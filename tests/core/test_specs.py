"""Specs: validation messages, frozen-ness, fingerprints, and derived sizes
checked against torch's own byte counts and docs/design.md's page diagram."""

from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unikv.specs import MambaSpec, MHASpec, MLASpec, StatePart

FP8 = torch.float8_e4m3fn
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo
CONV = StatePart((4, 3), torch.bfloat16)
SSM = StatePart((2, 4, 8), torch.float32)


def mha(**kw):
    return MHASpec(**{"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, **kw})


def mla(**kw):
    return MLASpec(**{"num_layers": 2, "kv_lora_rank": 16, "rope_dim": 4, **kw})


def mamba(**kw):
    return MambaSpec(**{"num_layers": 2, "conv": (CONV,), "temporal": SSM, **kw})


# (builder, field name in the message, bad value, words of the rule)
BAD_VALUES = [
    (mha, "MHASpec.num_layers", 0, "positive int"),
    (mha, "MHASpec.num_layers", -3, "positive int"),
    (mha, "MHASpec.num_layers", 2.0, "positive int"),
    (mha, "MHASpec.num_layers", True, "positive int"),
    (mha, "MHASpec.num_kv_heads", 0, "positive int"),
    (mha, "MHASpec.head_dim", "64", "positive int"),
    (mha, "MHASpec.v_head_dim", 0, "positive int"),
    (mha, "MHASpec.sliding_window", 0, "positive int"),
    (mha, "MHASpec.dtype", torch.int32, "must be one of"),
    (mha, "MHASpec.dtype", "bfloat16", "must be one of"),
    (mla, "MLASpec.num_layers", -1, "positive int"),
    (mla, "MLASpec.kv_lora_rank", 0, "positive int"),
    (mla, "MLASpec.rope_dim", 1.5, "positive int"),
    (mla, "MLASpec.dtype", torch.float64, "must be one of"),
    (mamba, "MambaSpec.num_layers", 0, "positive int"),
    (mamba, "MambaSpec.conv", (), "non-empty tuple of StatePart"),
    (mamba, "MambaSpec.conv", CONV, "non-empty tuple of StatePart"),
    (mamba, "MambaSpec.conv", ((4, 3),), "non-empty tuple of StatePart"),
    (mamba, "MambaSpec.temporal", (2, 4, 8), "must be a StatePart"),
    (StatePart, "StatePart.shape", (), "non-empty tuple of positive ints"),
    (StatePart, "StatePart.shape", (3, 0), "non-empty tuple of positive ints"),
    (StatePart, "StatePart.shape", (2.0,), "non-empty tuple of positive ints"),
    (StatePart, "StatePart.shape", 5, "non-empty tuple of positive ints"),
    (StatePart, "StatePart.dtype", torch.int64, "must be one of"),
]


@pytest.mark.parametrize(
    "build, field, value, rule", BAD_VALUES, ids=[f"{f}={v!r}" for _, f, v, _ in BAD_VALUES]
)
def test_bad_spec_value_names_field_value_and_rule(build, field, value, rule) -> None:
    name = field.split(".")[1]
    kwargs = {name: value}
    if build is StatePart and name == "dtype":
        kwargs["shape"] = (2,)
    with pytest.raises(ValueError) as info:
        build(**kwargs)
    message = str(info.value)
    assert field in message and rule in message and repr(value) in message, message


@pytest.mark.parametrize("spec", [mha(), mla()])
@pytest.mark.parametrize("page_size", [0, -1, 1.0, None])
def test_bad_page_size_names_it(spec, page_size) -> None:
    with pytest.raises(ValueError, match=rf"page_size must be a positive int, got {page_size!r}"):
        spec.page_bytes(page_size)
    with pytest.raises(ValueError, match="page_size"):
        spec.view_tail_pad_bytes(page_size)


def test_mamba_page_size_is_always_one() -> None:
    with pytest.raises(ValueError, match="page_size 1, got 4"):
        mamba().page_bytes(4)


def test_specs_are_frozen() -> None:
    for spec in (mha(), mla(), mamba(), CONV):
        field = dataclasses.fields(spec)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(spec, field, 7)


def test_kinds() -> None:
    assert mha().kind == "full" and mha(sliding_window=128).kind == "swa"
    assert mla().kind == "mla" and mamba().kind == "mamba"


# -- derived sizes against torch's own byte counts --------------------------------


@settings(max_examples=40, deadline=None)
@given(
    num_layers=st.integers(1, 6),
    heads=st.integers(1, 4),
    head_dim=st.integers(1, 9),
    v_head_dim=st.integers(1, 9),
    page_size=st.integers(1, 32),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.uint8, FP8]),
)
def test_mha_sizes_match_a_torch_tensor_of_one_slot(
    num_layers, heads, head_dim, v_head_dim, page_size, dtype
) -> None:
    spec = MHASpec(num_layers, heads, head_dim, v_head_dim, dtype)
    # one slot: every layer's K row and V row, each at its own width (no padding)
    k_rows = torch.empty(num_layers, heads, head_dim, dtype=dtype)
    v_rows = torch.empty(num_layers, heads, v_head_dim, dtype=dtype)
    slot_bytes = k_rows.nbytes + v_rows.nbytes
    assert spec.entry_bytes == slot_bytes
    assert spec.page_bytes(page_size) == page_size * slot_bytes
    if head_dim == v_head_dim:  # docs/design.md section 1's formula
        assert spec.entry_bytes == num_layers * (heads * head_dim * 2) * k_rows.element_size()
        # the last row-block's dense view runs (B - 1) * ps rows past the last page
        assert (
            spec.view_tail_pad_bytes(page_size)
            == spec.page_bytes(page_size) - page_size * k_rows[0].nbytes
        )
        assert spec.blocks_per_page == 2 * num_layers
    else:  # page-strided views end inside their page; kernel ids are physical ids
        assert spec.view_tail_pad_bytes(page_size) == 0
        assert spec.blocks_per_page == 1


def test_asymmetric_rows_have_no_single_width() -> None:
    spec = mha(head_dim=12, v_head_dim=8)
    assert (spec.part_row_bytes("k"), spec.part_row_bytes("v")) == (2 * 12 * 2, 2 * 8 * 2)
    with pytest.raises(ValueError, match="part_row_elems"):
        _ = spec.row_bytes
    assert spec.fingerprint() != mha(head_dim=12, v_head_dim=12).fingerprint()


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_mla_sizes_match_a_torch_tensor_of_one_slot(dtype) -> None:
    spec = mla(num_layers=3, dtype=dtype)
    slot = torch.empty(3, 16 + 4, dtype=dtype)
    assert spec.entry_bytes == slot.nbytes
    assert spec.page_bytes(8) == 8 * slot.nbytes


def test_page_envelope_order_follows_design_diagram() -> None:
    """[L0_K x ps | L0_V x ps | L1_K x ps | ...]: sorting (layer, part) by offset
    gives that order, and consecutive blocks are ps rows apart."""
    spec, ps = mha(num_layers=3), 4
    pairs = [(layer, part) for layer in range(3) for part in ("v", "k")]
    ordered = sorted(pairs, key=lambda lp: spec.part_offset(*lp, ps))
    assert ordered == [(0, "k"), (0, "v"), (1, "k"), (1, "v"), (2, "k"), (2, "v")]
    row = torch.empty(2, 8, dtype=torch.bfloat16).nbytes
    offsets = [spec.part_offset(*lp, ps) for lp in ordered]
    assert offsets[0] == 0 and all(b - a == ps * row for a, b in itertools.pairwise(offsets))
    with pytest.raises(ValueError, match="layer must be in"):
        spec.part_offset(3, "k", ps)
    with pytest.raises(ValueError, match="part must be one of"):
        spec.part_offset(0, "latent", ps)


def test_mamba_entry_holds_every_part_aligned() -> None:
    spec = MambaSpec(3, (StatePart((3,), torch.uint8), StatePart((2, 2), torch.bfloat16)), SSM)
    parts = [torch.empty(3, *p.shape, dtype=p.dtype) for p in spec.state_parts]
    raw = sum(t.nbytes for t in parts)
    assert raw <= spec.entry_bytes < raw + 4 * len(parts)  # at most alignment slack
    assert spec.entry_bytes % 4 == 0  # a multiple of the widest itemsize (fp32)
    for name, t in zip(spec.parts, parts):
        assert spec.part_offset(0, name) % t.element_size() == 0
    assert spec.view_tail_pad_bytes() == 0


def test_fp8_is_stored_as_uint8() -> None:
    for spec in (mha(dtype=FP8), mla(dtype=torch.float8_e5m2)):
        assert spec.storage_dtype == torch.uint8 and spec.itemsize == 1
    assert StatePart((2,), FP8).itemsize == 1


# -- fingerprints ----------------------------------------------------------------------

SPEC_STRATEGY = st.one_of(
    st.builds(
        MHASpec,
        st.integers(1, 3),
        st.integers(1, 3),
        st.integers(1, 4),
        st.sampled_from([None, 2, 4]),
        st.sampled_from([torch.bfloat16, FP8]),
        st.sampled_from([None, 64]),
    ),
    st.builds(MLASpec, st.integers(1, 3), st.integers(1, 4), st.integers(1, 4)),
    st.builds(
        MambaSpec,
        st.integers(1, 3),
        st.lists(
            st.builds(
                StatePart,
                st.tuples(st.integers(1, 3)),
                st.sampled_from([torch.bfloat16, torch.float32]),
            ),
            min_size=1,
            max_size=2,
        ).map(tuple),
        st.builds(StatePart, st.tuples(st.integers(1, 3), st.integers(1, 3))),
    ),
)


@settings(max_examples=200, deadline=None)
@given(a=SPEC_STRATEGY, b=SPEC_STRATEGY)
def test_fingerprints_differ_exactly_when_specs_differ(a, b) -> None:
    assert (a.fingerprint() == b.fingerprint()) == (a == b and type(a) is type(b))


def test_fingerprint_is_stable_across_processes() -> None:
    specs = (
        "[MHASpec(2, 2, 8, 4, torch.bfloat16, 128), MLASpec(3, 16, 4), "
        "MambaSpec(2, (StatePart((4, 3), torch.bfloat16),), StatePart((2, 4, 8)))]"
    )
    code = f"import torch; from unikv.specs import *; print([s.fingerprint() for s in {specs}])"
    runs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": ROOT}
        runs.append(
            subprocess.run(
                [sys.executable, "-c", code],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
    here = str([s.fingerprint() for s in eval(specs)]) + "\n"
    assert runs[0] == runs[1] == here
