"""GPU only: ``unikv.kernels.runtime.launch`` gives the same results as ``kernel[grid]``
and the torch reference, for a hot-path kernel (keyed by dtype alone) and for a
kernel Triton specialises on ints equal to 1 / multiples of 16 and on pointer
alignment, and it reuses compiled kernels."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from unikv.kernels.runtime.launch import Launcher
from unikv.kernels.tables import ref as tables_ref
from unikv.kernels.tables import table_update

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CASES = [(1, 0), (16, 0), (17, 0), (1, 1), (33, 3), (256, 0), (299, 1), (17, 0)]  # (n, offset)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_direct_launch_matches_jit_launch_and_reference(dtype):
    torch.manual_seed(0)
    v2p = torch.randint(-1, 500, (600,), dtype=torch.int32, device="cuda")
    launch = Launcher(table_update._translate_kernel)
    base = torch.randint(-40, 9000, (300,), dtype=dtype, device="cuda")
    for n, offset in CASES:
        ids = base[offset : offset + n]  # offset 1 and 3: not 16-byte aligned
        expected = torch.empty(n, dtype=torch.int32, device="cuda")
        grid = (triton.cdiv(n, 256),)
        table_update._translate_kernel[grid](ids, v2p, expected, n, MULT=32, PS=16, BLOCK=256)
        reference = torch.empty(n, dtype=torch.int32, device="cuda")
        tables_ref.translate_ids_ref(ids, v2p, 16, 32, reference)  # torch reference
        torch.testing.assert_close(expected, reference, rtol=0, atol=0)
        for _ in range(2):  # the first call of a new key compiles, the second goes direct
            got = torch.full((n,), 12345, dtype=torch.int32, device="cuda")
            launch(grid, ids, v2p, got, n, MULT=32, PS=16, BLOCK=256)
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert len(launch.compiled) == 1  # no int or alignment specialisation: one kernel


@triton.jit
def _scaled_copy(src, dst, n, scale, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tl.store(dst + i, tl.load(src + i, mask=mask) * scale, mask=mask)


def test_specialised_kernel_gets_one_compiled_kernel_per_specialisation():
    """scale == 1 and n % 16 == 0 become compile-time facts in Triton: reusing a
    kernel compiled for them with other values would compute wrong results."""
    launch = Launcher(_scaled_copy)
    src = torch.arange(1, 301, dtype=torch.float32, device="cuda")
    for (n, offset), scale in zip(CASES, [1, 5, 1, 16, 3, 1, 32, 7]):
        x = src[offset : offset + n]
        for _ in range(2):
            out = torch.zeros(n, dtype=torch.float32, device="cuda")
            launch((triton.cdiv(n, 64),), x, out, n, scale, BLOCK=64)
            torch.testing.assert_close(out, x * scale, rtol=0, atol=0)
    assert len(launch.compiled) >= 5  # aligned/misaligned x {1, %16, other} combinations


def test_a_refused_direct_launch_falls_back_to_triton():
    """If the driver entry point rejects the arguments (another Triton's launcher
    signature), the call still runs through kernel[grid] and later calls stay there."""
    from types import SimpleNamespace

    def refuse(*args, **kwargs):
        raise TypeError("launcher signature differs")

    launch = Launcher(_scaled_copy)
    x = torch.arange(1, 65, dtype=torch.float32, device="cuda")
    out = torch.zeros(64, dtype=torch.float32, device="cuda")
    launch((1,), x, out, 64, 3, BLOCK=64)  # compiles and caches
    (key,) = launch.compiled
    launch.compiled[key] = SimpleNamespace(run=refuse, function=None, packed_metadata=None)
    for scale in (5, 7):
        out.zero_()
        launch((1,), x, out, 64, scale, BLOCK=64)
        torch.testing.assert_close(out, x * scale, rtol=0, atol=0)
    assert not launch.direct and not launch.compiled
