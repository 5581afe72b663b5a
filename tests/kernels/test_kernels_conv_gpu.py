"""The Triton causal conv (``kernels/recurrent/conv.py``) on the GPU at real widths
(``pytest -m gpu``): Qwen3.5's conv (C = 2*16*128 + 32*128 = 8192) and NemotronH's
(C = 128*64 + 2*8*128 = 10240), K 4, over page-strided slot views of a pool whose
entries also hold a recurrent state.

Oracle: the torch reference (``recurrent_ref.causal_conv1d``) on a copy of the same
pool. Decode at B 1 / 64 / 256 (one, two and eight lanes per program), every block
size the benchmark sweeps (``bench_recurrent``'s DECODE_SWEEP / PREFILL_SWEEP, so a
default picked from its numbers is a tested one), varlen prefill with requests longer
than a chunk, and the decode step replayed from a CUDA graph with no host sync.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_recurrent import DECODE_SWEEP, PREFILL_SWEEP
from unikv import layout
from unikv.kernels.recurrent import conv as conv_ops
from unikv.kernels.recurrent import ref as recurrent_ref
from unikv.specs import MambaSpec, StatePart

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CHANNELS = {"qwen3_5": 2 * 16 * 128 + 32 * 128, "nemotron_h": 128 * 64 + 2 * 8 * 128}
WIDTH, NUM_SLOTS = 4, 300
PREFILL_LENS = [1, 700, 0, 2100, 3, 257]  # requests over several 256-token chunks, one empty
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative L2 error vs the reference


class Case:
    """A pool (conv (C, K) in ``dtype`` + a (64,) fp32 state per slot), a batch on
    random slots and its inputs; ``run(op)`` runs an op on a copy of the pool."""

    def __init__(self, model, lens, dtype, seed=0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        channels = CHANNELS[model]
        self.spec = MambaSpec(1, (StatePart((channels, WIDTH), dtype),), StatePart((64,)))
        self.buffer = torch.zeros(NUM_SLOTS * self.spec.entry_bytes, dtype=torch.uint8,
                                  device="cuda")  # fmt: skip
        self.window(self.buffer).normal_(generator=gen)
        perm = torch.randperm(NUM_SLOTS - 1, device="cuda", generator=gen)
        self.slots = perm[: len(lens)] + 1
        self.q_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device="cuda")
        self.q_indptr[1:] = torch.tensor(lens, device="cuda").cumsum(0)
        self.max_q_len = max(lens)
        r = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(dtype)
        self.x = r(sum(lens), channels + 64)[:, :channels]  # a column slice, as in the models
        self.w, self.b = 0.5 * r(channels, WIDTH), r(channels)

    def window(self, buffer):
        return layout.mamba_state_views(buffer, self.spec, NUM_SLOTS)["conv0"][0]

    def run(self, op, **kw):
        buffer = self.buffer.clone()
        out = op(self.x, self.window(buffer), self.slots, self.q_indptr, self.w, self.b,
                 max_q_len=self.max_q_len, activation="silu", **kw)  # fmt: skip
        return out, buffer


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _assert_matches(case, dtype, **kw):
    out, buffer = case.run(conv_ops.causal_conv1d, **kw)
    want, want_buffer = case.run(recurrent_ref.causal_conv1d)
    assert _rel(out, want) < TOL[dtype], kw
    got_w, want_w = case.window(buffer), case.window(want_buffer)
    assert _rel(got_w[case.slots], want_w[case.slots]) < TOL[dtype], kw
    keep = torch.ones(NUM_SLOTS, dtype=torch.bool, device="cuda")
    keep[case.slots] = False
    assert torch.equal(got_w[keep], case.window(case.buffer)[keep]), "wrote outside the batch"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("model", list(CHANNELS))
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_decode_matches_reference(model, batch, dtype):
    _assert_matches(Case(model, [1] * batch, dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("model", list(CHANNELS))
def test_prefill_matches_reference(model, dtype):
    _assert_matches(Case(model, PREFILL_LENS, dtype), dtype)


@pytest.mark.parametrize("model", list(CHANNELS))
def test_every_swept_block_size_matches_reference(model):
    decode = Case(model, [1] * 64, torch.bfloat16)
    for config in DECODE_SWEEP:
        _assert_matches(decode, torch.bfloat16, config=config)
    prefill = Case(model, PREFILL_LENS, torch.bfloat16)
    for config in PREFILL_SWEEP:
        _assert_matches(prefill, torch.bfloat16, config=config)


def test_decode_replays_from_a_graph_without_sync():
    case = Case("qwen3_5", [1] * 64, torch.bfloat16)
    window = case.window(case.buffer)
    args = (case.x, window, case.slots, case.q_indptr, case.w, case.b)
    want, want_buffer = case.run(recurrent_ref.causal_conv1d)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    saved = case.buffer.clone()
    with torch.cuda.stream(stream):  # warm up (compiles) off the capture
        conv_ops.causal_conv1d(*args, max_q_len=1, activation="silu")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = conv_ops.causal_conv1d(*args, max_q_len=1, activation="silu")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    case.buffer.copy_(saved)
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, want) < TOL[torch.bfloat16]
    assert _rel(window[case.slots], case.window(want_buffer)[case.slots]) < TOL[torch.bfloat16]
