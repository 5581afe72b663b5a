"""GPU only: ``unikv.kernels.launch`` gives the same results as ``kernel[grid]``
for every specialisation Triton distinguishes (ints equal to 1 or multiples of
16, misaligned tensor slices, dtypes), and reuses the compiled kernel."""

from __future__ import annotations

import pytest
import torch

from unikv.kernels import table_update
from unikv.kernels.launch import Launcher

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_direct_launch_matches_jit_launch(dtype):
    torch.manual_seed(0)
    v2p = torch.randint(-1, 500, (600,), dtype=torch.int32, device="cuda")
    launch = Launcher(table_update._translate_kernel)
    base = torch.randint(-40, 9000, (300,), dtype=dtype, device="cuda")
    for n, offset in [(1, 0), (16, 0), (17, 0), (1, 1), (33, 3), (256, 0), (299, 1), (17, 0)]:
        ids = base[offset : offset + n]  # offset 1 and 3: not 16-byte aligned
        expected = torch.empty(n, dtype=torch.int32, device="cuda")
        got = torch.full((n,), 12345, dtype=torch.int32, device="cuda")
        grid = (triton_cdiv(n, 256),)
        table_update._translate_kernel[grid](ids, v2p, expected, n, MULT=32, PS=16, BLOCK=256)
        reference = torch.empty(n, dtype=torch.int32, device="cuda")
        table_update.translate_ids_ref(ids, v2p, 16, 32, reference)  # torch reference
        torch.testing.assert_close(expected, reference, rtol=0, atol=0)
        for _ in range(2):  # the first call of a new key compiles, the second goes direct
            got.fill_(12345)
            launch(grid, ids, v2p, got, n, MULT=32, PS=16, BLOCK=256)
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # one compiled kernel per distinct (alignment, int class) key, reused afterwards
    assert 1 < len(launch.compiled) <= 6


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
