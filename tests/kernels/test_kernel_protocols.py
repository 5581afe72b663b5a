"""Every variant of every backend op has the signature its Protocol states.

``KernelBackend``'s fields are typed by one ``typing.Protocol`` per op (the families'
``protocols`` modules). The oracle is ``inspect.signature`` of each implementation the
backends can hold: the torch references, the Triton backend built under every flag set
``get_backend`` decides from (the SDPA and Hopper fresh-prompt variants, the Hopper MoE),
and the Hopper MoE's ``run``. A variant must take the protocol's parameters by the same
names, kinds, order and defaults; it may add keyword-only parameters with defaults (a
plan's launch arguments), nothing else. A drifted signature fails here, not on a GPU.
"""

from __future__ import annotations

import inspect
import typing

import pytest
import torch

from unikv.kernels import backend as kb

P = inspect.Parameter
OPS = kb.OPS


def _protocols() -> dict[str, type]:
    hints = typing.get_type_hints(kb.KernelBackend)
    return {op: hints[op] for op in OPS}


def drift(impl, proto: type) -> list[str]:
    """How ``impl``'s signature departs from ``proto.__call__``'s (empty: it conforms)."""
    want = list(inspect.signature(proto.__call__).parameters.values())[1:]  # drop self
    got = inspect.signature(impl).parameters
    problems = []
    for p in want:
        if p.kind is P.VAR_KEYWORD:
            if not any(q.kind is P.VAR_KEYWORD for q in got.values()):
                problems.append(f"no **{p.name}")
            continue
        q = got.get(p.name)
        if q is None:
            problems.append(f"missing {p.name!r}")
        elif q.kind is not p.kind:
            problems.append(f"{p.name!r} is {q.kind.description}, want {p.kind.description}")
        elif q.default != p.default and not (q.default is P.empty and p.default is P.empty):
            problems.append(f"{p.name!r} defaults to {q.default!r}, want {p.default!r}")
    positional = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
    order_want = [p.name for p in want if p.kind in positional]
    order_got = [n for n, q in got.items() if q.kind in positional]
    if order_got != order_want:
        problems.append(f"positional order {order_got}, want {order_want}")
    names = {p.name for p in want}
    for n, q in got.items():
        extra_ok = q.kind is P.VAR_KEYWORD or (
            q.kind is P.KEYWORD_ONLY and q.default is not P.empty
        )
        if n not in names and not extra_ok:
            problems.append(f"extra {n!r} must be keyword-only with a default")
    return problems


def _variants() -> dict[str, kb.KernelBackend]:
    """Every backend ``get_backend`` can return on any device, by flag set."""
    out = {"torch": kb.get_backend("cpu", "torch")}
    pytest.importorskip("triton")
    for name, flags in {
        "triton": kb.Flags(),
        "triton-cuda": kb.Flags(cuda=True, extend_hopper=False),
        "triton-sdpa": kb.Flags(cuda=True, extend_sdpa=True, extend_hopper=False),
        "triton-hopper": kb.Flags(cuda=True, sm90=True),
        "triton-hopper-sdpa": kb.Flags(cuda=True, sm90=True, extend_sdpa=True),
    }.items():
        out[name] = kb._triton(flags)  # builds the ops only: no kernel runs
    return out


def test_every_op_is_typed_by_a_protocol_with_a_shape_docstring():
    for op, proto in _protocols().items():
        assert getattr(proto, "_is_protocol", False), f"KernelBackend.{op} is not a Protocol"
        doc = inspect.getdoc(proto.__call__) or ""
        assert len(doc) > 40, f"{proto.__name__}.__call__ states no shapes: {doc!r}"


def test_every_variant_of_every_op_has_the_protocols_signature():
    protos = _protocols()
    wrong = []
    for name, backend in _variants().items():
        for op in OPS:
            impl = getattr(backend, op)
            wrong += [f"{name}.{op}: {p}" for p in drift(impl, protos[op])]
    assert not wrong, "signatures that drifted from their Protocol:\n" + "\n".join(wrong)


def test_the_hopper_moe_run_has_its_protocols_signature():
    """``moe_repacked`` of an sm_90 backend: its ``run`` (the Gluon MoE) against
    ``MoERepackedRun`` (importable on any host with Triton's Gluon)."""
    pytest.importorskip("triton.experimental.gluon")
    repacked = kb._triton(kb.Flags(cuda=True, sm90=True)).moe_repacked(torch.bfloat16, 64, 64)
    assert repacked is not None and repacked.name == "hopper"
    hints = typing.get_type_hints(kb.MoERepacked)
    assert drift(repacked.run, hints["run"]) == []


def test_drift_catches_a_renamed_a_reordered_and_a_required_extra_parameter():
    """The checker itself: three ways a kernel can drift from ``StoreMLA``."""
    proto = _protocols()["store_mla"]

    def renamed(latent_cache, kernel_ids, latent, rope_rows): ...

    def reordered(latent_cache, latent, kernel_ids, rope): ...

    def required_extra(latent_cache, kernel_ids, latent, rope, *, config): ...

    def planned(latent_cache, kernel_ids, latent, rope, *, config=None): ...

    assert "missing 'rope'" in drift(renamed, proto)
    assert any("positional order" in p for p in drift(reordered, proto))
    assert drift(required_extra, proto) == ["extra 'config' must be keyword-only with a default"]
    assert drift(planned, proto) == []
