"""Start-up warm-up of the GEMM kernels the steps will launch (CUDA only).

CUDA loads a kernel at its first launch (lazy module loading, the default torch
sets), and that load may wait for the device to drain. cuBLAS picks its kernel
by the problem's shape, so the first step with a row count no earlier step had
can launch a kernel not loaded yet: its launch then blocks the host until the
device is idle, and the host's lead over the device is lost. On the H200 the
e2e's prefill showed it (``profile_engine.py --timeline --layers``; docs/perf.md):
``lm_head``'s launch took 14-35 ms of host time in the three steps where the
logits rows first grew past about 190, and the first layer's GEMMs 13 ms in the
last, shorter chunk; the device then idled 11-12 ms before each next step.

``warm_linears`` runs every distinct linear weight of the model (shape, dtype,
bias) once per row count of ``warm_rows``: every count up to ``EXACT_ROWS``, then
every ``GRID_ROWS``-th, up to the most rows a step can give it (the logits head:
max_num_seqs; the others: max_num_batched_tokens). A row count off the grid may
still pick a kernel the grid did not load (cuBLAS's choice need not be monotone in
the rows): the timeline is the check.

``warm_sampling`` runs the backend's greedy argmax once over a full batch of
logits, so its Triton kernels compile at start-up rather than in the first
decode step (gpt-oss's e2e once compiled them inside the timed run, docs/perf.md: 0.25 s,
about 0.2 s of the run's wall; the argmax kernels no longer specialise on the
row count since).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EXACT_ROWS = 256  # every row count up to this one
GRID_ROWS = 16  # then every GRID_ROWS-th
GEMM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what F.linear runs as it is


def warm_rows(max_rows: int) -> list[int]:
    """1..min(EXACT_ROWS, max_rows), then every GRID_ROWS-th count, then max_rows."""
    rows = list(range(1, min(EXACT_ROWS, max_rows) + 1))
    rows += range(EXACT_ROWS + GRID_ROWS, max_rows, GRID_ROWS)
    if max_rows > EXACT_ROWS:
        rows.append(max_rows)
    return rows


@torch.inference_mode()
def warm_linears(model: nn.Module, *, max_logit_rows: int, max_tokens: int) -> int:
    """Run each distinct linear weight of ``model`` at every row count of
    ``warm_rows`` (``lm_head``: up to max_logit_rows; the rest: max_tokens) on
    zeros; returns the number of GEMMs launched. Nothing is kept."""
    shapes: dict[tuple, tuple[nn.Linear, int]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and mod.weight.dtype in GEMM_DTYPES:
            limit = max_logit_rows if name.split(".")[-1] == "lm_head" else max_tokens
            key = (tuple(mod.weight.shape), mod.weight.dtype, mod.bias is not None)
            if key not in shapes or shapes[key][1] < limit:
                shapes[key] = (mod, limit)
    launched = 0
    for mod, limit in shapes.values():
        x = torch.zeros(limit, mod.in_features, dtype=mod.weight.dtype, device=mod.weight.device)
        for rows in warm_rows(limit):
            F.linear(x[:rows], mod.weight, mod.bias)
            launched += 1
    return launched


@torch.inference_mode()
def warm_sampling(backend, model: nn.Module, *, rows: int) -> None:
    """The backend's argmax over (1, V) and (rows, V) zeros of the logits ``model``
    returns: lm_head's dtype where it sets ``logits_dtype = None`` (the Llama
    family in the engine), else fp32."""
    head = model.lm_head
    keeps = hasattr(model, "logits_dtype") and model.logits_dtype is None
    dtype = head.weight.dtype if keeps else torch.float32
    for n in (1, rows):
        backend.argmax(torch.zeros(n, head.out_features, dtype=dtype, device=head.weight.device))
