"""Programmatic dependent launch (PDL) for the decode step's Triton kernels on Hopper.

A kernel launched with ``launch_pdl`` may start while the kernel before it in the
stream drains; one request's decode step is a chain of about 120 short kernels, so
every launch latency it hides is step time saved. Every kernel taking ``PDL`` keeps
one contract, in each of its programs:

    1. before ``wait``: reads of data no kernel of the step writes (weights), only;
       or, in a kernel that says so (one request's decode attention, ``decode.PRELOAD``),
       of data only kernels two or more launches back wrote: this kernel's programs
       run only once the kernel just before has triggered, which is after its own
       wait, so every kernel before that one has completed (the step's tables, the
       cache rows of earlier steps);
    2. ``wait`` (``gdc_wait``) before the first read of an earlier kernel's output and
       before any store, so a kernel completes only after the one before it (the
       chain is ordered transitively, however far back the data came from);
    3. ``trigger`` (``gdc_launch_dependents``) only after ``wait``, once the program
       has issued its long work: the next kernel's programs then launch, do their
       step 1 and wait. A trigger before the wait would let every later kernel's
       programs occupy the SMs waiting (measured, docs/perf.md: GEMMs 1.44 ms).

A program that never triggers triggers when it exits. ``UNIKV_PDL=0`` launches
everything plainly and ``UNIKV_PDL_TRIGGER=0`` drops the early triggers (both fixed at
import: the A/B switches). One request's ITL on the H200 (one run, docs/perf.md): 0.983 ms
plain, 0.919 waiting only, 0.907 with the triggers. Asking L2 for each GEMV program's
first 2048 weight columns before the wait (``prefetch.global.L2``) made it 1.016 ms,
1.035 without the triggers, and was removed.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from unikv.env import FLAGS

ENABLED = FLAGS.pdl
TRIGGER = tl.constexpr(FLAGS.pdl_trigger)


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device launch with PDL (CUDA, Hopper or newer)."""
    return ENABLED and t.is_cuda and _capability(t.device) >= 9


def launch_options(on: bool) -> dict:
    """The launch keywords for ``kernel[grid](...)``: ``launch_pdl`` when ``on``."""
    return {"launch_pdl": True} if on else {}


@functools.cache
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


@triton.jit
def wait(PDL: tl.constexpr):
    """Step 2: wait for the kernel before to complete (a no-op without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def trigger(PDL: tl.constexpr):
    """Step 3: let the next kernel launch (a no-op without PDL or with TRIGGER off)."""
    if PDL and TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
