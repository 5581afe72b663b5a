"""The launch plan of the MLA decode kernels (``mla_decode``): tile configs, the
(heads, page size) table, split-KV rules and the workspace size. Host ints only.

Variants (``Config.variant``), all writing the same split-KV workspace:

    split  one program per (head block, V part, request, split); NUM_V = 2 cuts the
           rank columns of V in two programs that both compute the full logits
           (today's kernel, ``mla_decode._split_kernel``; the fallback)
    fused  one program per (head block, request, split): logits once, all rank
           columns of V in two half-width fp32 accumulators; a tile inside one page
           (``page_size % block_n == 0``) is addressed from one block-table entry
           (``mla_decode_fused``)
    tma    fused, its full tiles loaded by TMA descriptors (needs page-aligned tiles
           and 16-byte-aligned rows, else it runs as fused)

Split rules (``Config.split_rule``): ``model`` minimises a wave model of the split
kernel plus the merge (``token_ns`` / ``ctas_per_sm`` are its estimates); ``fill``
takes the fewest splits that give every SM slot a program. Both use the block
table's capacity (never seq_lens), so the count is fixed for a CUDA graph.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from unikv.kernels.runtime.checks import device_sms, next_pow2, workspace_numel

VARIANTS = ("split", "fused", "tma")
SPLIT_RULES = ("model", "fill")


class Config(NamedTuple):
    """Heads per program, V parts (split: 1 or 2; fused / tma: 1), keys per tile,
    warps, pipeline stages; programs an SM holds at once and ns a key per program
    (the split model's estimates); kernel variant and split rule."""

    block_h: int
    num_v: int
    block_n: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int = 1
    token_ns: float = 32.0
    variant: str = "split"
    split_rule: str = "model"


# sm90 figures from ptxas (triton 3.6, rank 512 + rope 64, bf16): registers a thread, smem.
# wide*: heads are the wgmma M rows (64 per warpgroup), V in two programs of 256 columns;
#   wide128: 230 regs, 216 KB; wide64: 249 regs, 144 KB. narrow*: 16 heads, whole V,
#   mma.sync, warps along keys / V columns: narrow90 168 regs, 92 KB; narrow 205 regs, 55 KB.
# fused64 / tma64: 64 heads on 8 warps (two warpgroups share N), a 64 x 512 fp32
#   accumulator = 128 registers a thread; Q 72 KB + 36 KB a stage of smem (not measured).
# fp32: exact fp32 dots (no tensor cores), small tiles.
CONFIGS = {
    "wide128": Config(128, 2, 32, 8, 2, 1, 70.0),
    "wide64": Config(64, 2, 32, 4, 2, 1, 35.0),
    "narrow90": Config(16, 1, 64, 8, 2, 1, 32.0),
    "narrow": Config(16, 1, 32, 4, 2, 2, 32.0),
    "fp32": Config(16, 1, 16, 4, 1, 2, 64.0),
    "fused64": Config(64, 1, 32, 8, 2, 1, 45.0, "fused"),
    "tma64": Config(64, 1, 32, 8, 2, 1, 45.0, "tma"),
    "fused64n64": Config(64, 1, 64, 8, 2, 1, 45.0, "fused"),
    "tma64n64": Config(64, 1, 64, 8, 2, 1, 45.0, "tma"),
    # fused16n64: 16 heads (mma.sync), whole V, 64 keys a program, 4 warps; splits fill
    # the SMs (the 16-head decode reads its bytes: more programs in flight).
    "fused16n64": Config(16, 1, 64, 4, 2, 1, 45.0, "fused", "fill"),
}
# sm90, 16-bit queries: (heads bucket, page bucket) -> config, installed from H200 sweeps
# (``benchmarks/bench_mla_decode.py --sweep``; B 1-128 x 1k-32k at page 64 and B 32 x 8k
# at page 1; the runs: docs/perf.md). 128 heads: 1.19-1.39x the split kernel (wide128)
# on every shape. 64 and 16 heads: 64 heads 1.02-2.30x wide64, 16 heads
# 1.00-1.67x narrow90 (narrow90 stays fastest at B 1 x 8k only, by 0.4 %). Page 16 was
# not swept: it takes page 1's pick (tiles across pages, each key's entry looked up).
TABLE = {
    (128, 1): CONFIGS["fused64n64"],
    (128, 16): CONFIGS["fused64n64"],
    (128, 64): CONFIGS["tma64n64"],
    (64, 1): CONFIGS["fused64n64"],
    (64, 16): CONFIGS["fused64n64"],
    (64, 64): CONFIGS["tma64n64"],
    (16, 1): CONFIGS["fused16n64"],
    (16, 16): CONFIGS["fused16n64"],
    (16, 64): CONFIGS["fused16n64"],
}
MIN_SPLIT_TOKENS = 256  # never cut a request's keys into chunks shorter than this
MAX_SPLITS = 128
# split-count model (ns, rough H200 figures): a program costs PROGRAM_NS plus token_ns
# a key, in waves of sms * ctas_per_sm programs; splits > 1 add the merge (a launch and
# the fp32 partials written and read once).
PROGRAM_NS, MERGE_NS, HBM_BYTES_PER_NS = 2000.0, 4000.0, 3000.0


def heads_bucket(heads: int) -> int:
    return 128 if heads >= 128 else 64 if heads >= 64 else 16


def page_bucket(page_size: int) -> int:
    return 64 if page_size % 64 == 0 else 16 if page_size % 16 == 0 else 1


@functools.cache
def _capability(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def choose_config(
    heads: int, dtype: torch.dtype, device: torch.device, page_size: int = 16
) -> Config:
    """The config for a head count, query dtype and page size on a device (host only)."""
    if dtype == torch.float32:
        return CONFIGS["fp32"]
    if device.type != "cuda":
        return CONFIGS["narrow"]
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _capability(index) != 9:  # the wide / fused tiles are wgmma (sm90) tiles
        return CONFIGS["narrow"]
    return TABLE[heads_bucket(heads), page_bucket(page_size)]


def programs_per_split(batch: int, heads: int, config: Config) -> int:
    """Programs of one split: requests x head blocks (x V parts for ``split``)."""
    parts = config.num_v if config.variant == "split" else 1
    return batch * triton.cdiv(heads, config.block_h) * parts


@functools.lru_cache(maxsize=1024)
def choose_num_splits(
    batch: int, heads: int, rank: int, max_len: int, config: Config, sms: int
) -> int:
    """Splits per request by ``config.split_rule`` (1 <= S <= MAX_SPLITS, chunks of
    >= MIN_SPLIT_TOKENS when S > 1).

    batch: requests; max_len: the block table's capacity in tokens (never seq_lens, so
    the count is fixed for a CUDA graph); sms: streaming multiprocessors."""
    programs = programs_per_split(batch, heads, config)
    slots = max(1, sms * config.ctas_per_sm)
    cap = max(1, min(MAX_SPLITS, max_len // MIN_SPLIT_TOKENS))
    if config.split_rule == "fill":
        return min(cap, triton.cdiv(slots, programs))
    best, best_ns = 1, float("inf")
    for splits in range(1, cap + 1):
        chunk = triton.cdiv(triton.cdiv(max_len, splits), config.block_n) * config.block_n
        waves = triton.cdiv(programs * splits, slots)
        ns = waves * (chunk * config.token_ns + PROGRAM_NS)
        if splits > 1:
            ns += MERGE_NS + 8.0 * batch * heads * splits * rank / HBM_BYTES_PER_NS
        if ns < best_ns:
            best, best_ns = splits, ns
    return best


def decode_plan(
    batch: int,
    heads: int,
    rank: int,
    max_len: int,
    dtype: torch.dtype,
    device: torch.device,
    page_size: int = 16,
) -> tuple[Config, int, int]:
    """(config, num_splits, workspace fp32 elements) of a decode step of ``batch``
    one-token requests over a block table of ``max_len`` tokens: once per step."""
    config = choose_config(heads, dtype, device, page_size)
    splits = choose_num_splits(batch, heads, rank, max_len, config, device_sms(device))
    return config, splits, workspace_numel(batch, heads, rank, splits) if splits > 1 else 1


def check_config(config) -> Config:
    """A Config from a tuple (the first 5 to 9 fields); ValueError when malformed."""
    config = Config(*config)
    pow2 = all(x >= 16 and x == next_pow2(x) for x in (config.block_h, config.block_n))
    num_v_ok = config.num_v in ((1, 2) if config.variant == "split" else (1,))
    if (
        not pow2
        or not num_v_ok
        or config.variant not in VARIANTS
        or config.split_rule not in SPLIT_RULES
        or config.num_warps < 1
        or config.num_stages < 1
    ):
        raise ValueError(
            f"config must be (block_h, num_v, block_n, num_warps, num_stages[, ctas_per_sm, "
            f"token_ns, variant, split_rule]) with powers of two >= 16 for block_h / block_n, "
            f"num_v 1 or 2 (1 for fused / tma), variant in {VARIANTS}, split_rule in "
            f"{SPLIT_RULES}; got {config}"
        )
    return config
