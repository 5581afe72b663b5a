"""GPU tests of the recurrent-state ops at real shapes (``pytest -m gpu``).

Qwen3.5-like Gated DeltaNet (Hv 32, Dk = Dv = 128, conv K 4 over C = 2*16*128 + 32*128)
and NemotronH-like Mamba-2 (H 128, P 64, N 128, G 8, conv C = H*P + 2*G*N). Oracle:
the torch reference (``recurrent_ref``) on a copy of the same pool. Decode is also
run under ``set_sync_debug_mode("error")`` and replayed from a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from unikv import layout
from unikv.kernels.recurrent import fla_prefill as recurrent_fla
from unikv.kernels.recurrent import ref as recurrent_ref
from unikv.kernels.recurrent import triton_ops as recurrent
from unikv.specs import MambaSpec, StatePart

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NUM_SLOTS = 80
GDN = {"heads": 32, "dim_k": 128, "dim_v": 128, "channels": 2 * 16 * 128 + 32 * 128}
SSD = {"heads": 128, "dim_p": 64, "dim_n": 128, "groups": 8, "channels": 128 * 64 + 2 * 8 * 128}
WIDTH = 4
DECODE_LENS = [1] * 48  # the last 4 lanes are padding (slot 0)
PREFILL_LENS = [1, 37, 300, 0, 129, 64, 0]  # lane 3 is empty; the last lane is padding
TIGHT = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative L2 error vs the fp32 reference
CHUNKED = {torch.float32: 1e-2, torch.bfloat16: 3e-2}  # fla-core's chunked prefill


def _rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


class Pool:
    def __init__(self, temporal_shape, channels, conv_dtype, used, seed=0):
        self.spec = MambaSpec(
            1, (StatePart((channels, WIDTH), conv_dtype),), StatePart(temporal_shape)
        )
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.buffer = torch.randint(
            0, 256, (NUM_SLOTS * self.spec.entry_bytes,), dtype=torch.uint8, device="cuda",
            generator=gen,
        )  # fmt: skip
        self.used = used
        for view in self.views(self.buffer).values():
            view[0, used] = (
                0.5 * torch.randn(view[0, used].shape, device="cuda", generator=gen)
            ).to(view.dtype)

    def views(self, buffer):
        return layout.mamba_state_views(buffer, self.spec, NUM_SLOTS)

    def parts(self, buffer):
        views = self.views(buffer)
        return views["conv0"][0], views["temporal"][0]

    def masked(self, buffer):
        copy = buffer.clone()
        for view in self.views(copy).values():
            view[0, self.used] = 0
        copy[: self.spec.entry_bytes] = 0  # the sink
        return copy


def _batch(lens, seed=1):
    gen = torch.Generator().manual_seed(seed)
    num_pad = 4 if len(lens) == len(DECODE_LENS) else 1
    slots = torch.randperm(NUM_SLOTS - 1, generator=gen)[: len(lens)] + 1
    slots[len(lens) - num_pad :] = 0
    q_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    q_indptr[1:] = torch.tensor(lens).cumsum(0)
    return slots.cuda(), q_indptr.cuda(), len(lens) - num_pad


def _gdn_inputs(num_tokens, dtype, gen):
    h, dk, dv, c = GDN["heads"], GDN["dim_k"], GDN["dim_v"], GDN["channels"]
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    x, w, b = r(num_tokens, c).to(dtype), (0.5 * r(c, WIDTH)).to(dtype), r(c).to(dtype)
    q, k, v = (
        r(num_tokens, h, dk).to(dtype),
        r(num_tokens, h, dk).to(dtype),
        r(num_tokens, h, dv).to(dtype),
    )
    g = torch.nn.functional.logsigmoid(r(num_tokens, h) + 3)  # mild decay, fp32
    beta = torch.rand(num_tokens, h, device="cuda", generator=gen).to(dtype)
    return (x, w, b), (q, k, v, g, beta)


def _ssd_inputs(num_tokens, dtype, gen):
    h, p, n, grp, c = SSD["heads"], SSD["dim_p"], SSD["dim_n"], SSD["groups"], SSD["channels"]
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    x, w, b = r(num_tokens, c).to(dtype), (0.5 * r(c, WIDTH)).to(dtype), r(c).to(dtype)
    xs, dt = r(num_tokens, h, p).to(dtype), (r(num_tokens, h) - 2).to(dtype)
    A = -torch.rand(h, device="cuda", generator=gen) - 0.5
    B, C = (0.3 * r(num_tokens, grp, n)).to(dtype), (0.3 * r(num_tokens, grp, n)).to(dtype)
    D, dt_bias = r(h).to(dtype), r(h).to(dtype)
    return (x, w, b), (xs, dt, A, B, C, D, dt_bias)


def _run(impl, kind, conv_in, rec_in, conv, temporal, slots, q_indptr, max_q_len):
    x, w, b = conv_in
    y = impl.causal_conv1d(x, conv, slots, q_indptr, w, b, max_q_len=max_q_len, activation="silu")
    if kind == "gdn":
        o = impl.gated_delta_rule(
            *rec_in,
            temporal,
            slots,
            q_indptr,
            max_q_len=max_q_len,
            scale=128**-0.5,
            use_qk_l2norm=True,
        )
    else:
        o = impl.mamba2_ssd(
            *rec_in, temporal, slots, q_indptr, max_q_len=max_q_len, dt_softplus=True,
            dt_limit=(0.0, float("inf")),
        )  # fmt: skip
    return y, o


def _case(kind, lens, dtype):
    slots, q_indptr, real = _batch(lens)
    shape = (
        (GDN["heads"], GDN["dim_k"], GDN["dim_v"])
        if kind == "gdn"
        else (SSD["heads"], SSD["dim_p"], SSD["dim_n"])
    )
    channels = (GDN if kind == "gdn" else SSD)["channels"]
    pool = Pool(shape, channels, dtype, slots[:real].tolist())
    gen = torch.Generator(device="cuda").manual_seed(2)
    conv_in, rec_in = (_gdn_inputs if kind == "gdn" else _ssd_inputs)(sum(lens), dtype, gen)
    return pool, slots, q_indptr, real, conv_in, rec_in


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["gdn", "ssd"])
@pytest.mark.parametrize("path", ["decode", "prefill", "prefill_recurrent"])
def test_matches_reference(kind, path, dtype, monkeypatch):
    if path == "prefill_recurrent":  # the Triton fallback used when fla-core is missing
        monkeypatch.setattr(recurrent_fla, "use_fla", lambda device, dtype=None: False)
    elif path == "prefill" and not recurrent_fla.fla_available():
        pytest.skip("fla-core not installed")
    lens = DECODE_LENS if path == "decode" else PREFILL_LENS
    pool, slots, q_indptr, real, conv_in, rec_in = _case(kind, lens, dtype)
    bufs = {"triton": pool.buffer.clone(), "torch": pool.buffer.clone()}
    outs = {}
    for name, impl in (("triton", recurrent), ("torch", recurrent_ref)):
        outs[name] = _run(
            impl, kind, conv_in, rec_in, *pool.parts(bufs[name]), slots, q_indptr, max(lens)
        )
    rows = q_indptr[real].item()
    chunked = path == "prefill"  # fla's chunked kernels: tf32 / bf16 dots, other summation order
    limits = (TIGHT[dtype], CHUNKED[dtype] if chunked else TIGHT[dtype])  # conv, then SSM
    for name, got, want, limit in zip(("conv", kind), outs["triton"], outs["torch"], limits):
        err = _rel_err(got[:rows], want[:rows])
        print(f"{kind} {path} {dtype} {name} output rel err {err:.2e}")
        assert err < limit
    for name, got, want, limit in zip(("conv", kind), *map(pool.parts, bufs.values()), limits):
        err = _rel_err(got[slots[:real]], want[slots[:real]])
        print(f"{kind} {path} {dtype} {name} state rel err {err:.2e}")
        assert err < limit
    assert torch.equal(pool.masked(bufs["triton"]), pool.masked(bufs["torch"]))
    before = pool.parts(pool.buffer)[1]
    for b in (lens.index(0),) if 0 in lens[:real] else ():  # the empty lane keeps its state
        assert torch.equal(pool.parts(bufs["triton"])[1][slots[b]], before[slots[b]])


@pytest.mark.parametrize("kind", ["gdn", "ssd"])
def test_decode_has_no_sync_and_replays_from_a_graph(kind):
    pool, slots, q_indptr, real, conv_in, rec_in = _case(kind, DECODE_LENS, torch.bfloat16)
    graph_buf, eager_buf = pool.buffer.clone(), pool.buffer.clone()
    static = [t.clone() for t in (*conv_in, *rec_in)]
    args = (*pool.parts(graph_buf), slots, q_indptr, 1)
    _run(recurrent, kind, static[:3], static[3:], *args)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(recurrent, kind, static[:3], static[3:], *args)  # the hot path: no host sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph_buf.copy_(pool.buffer)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(recurrent, kind, static[:3], static[3:], *args)
    torch.cuda.current_stream().wait_stream(stream)
    graph_buf.copy_(pool.buffer)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, o = _run(recurrent, kind, static[:3], static[3:], *args)
    gen = torch.Generator(device="cuda").manual_seed(9)
    for _ in range(3):
        new = (_gdn_inputs if kind == "gdn" else _ssd_inputs)(len(DECODE_LENS), torch.bfloat16, gen)
        for dst, src in zip(static, (*new[0], *new[1])):
            dst.copy_(src)
        graph.replay()
        want = _run(recurrent, kind, new[0], new[1], *pool.parts(eager_buf), slots, q_indptr, 1)
        assert torch.equal(y[:real], want[0][:real]) and torch.equal(o[:real], want[1][:real])
        assert torch.equal(pool.masked(graph_buf), pool.masked(eager_buf))
        for got, ref in zip(pool.parts(graph_buf), pool.parts(eager_buf)):
            assert torch.equal(got[slots[:real]], ref[slots[:real]])
