"""A static split of the pool: each sub-pool confined to a fixed byte range.

unikv's default is a moving boundary (docs/design.md section 4). A static split is the
comparison point (SGLang's hybrid pools: Mamba bytes = 0.9 x full-attention
bytes, fixed at start-up) and an option for users who want fixed shares.

    byte 0   sink_bytes                                              total_bytes
    | sink | UP range: f_up x usable | FLOAT range | (unused) | DOWN range: f_down x usable |

``usable = total_bytes - sink_bytes``. Ranges follow the grow order (UP from the
sink floor, FLOAT right after it, DOWN ending at the top); bytes of a split
summing below 1 sit unused between FLOAT and DOWN. On its own page grid a
sub-pool's range is the whole pages inside its byte range: ``(lo, hi)`` half-open,
``lo >= first_page``. The allocator's packer keeps each band inside its range,
so no sub-pool ever takes bytes from another.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from unikv.placement import Grow

SUM_TOLERANCE = 1e-9  # 0.9 / 1.9 + 1 / 1.9 is 1 + 2e-16 in floating point
ORDER = (Grow.UP, Grow.FLOAT, Grow.DOWN)


def check_static_split(split: object, names: list[str]) -> dict[str, float]:
    """Validated ``{sub-pool name: fraction of the usable bytes}``; ValueError
    unless it names exactly the sub-pools ``names`` with positive fractions
    summing to at most 1 (TypeError when it is no mapping)."""
    if not isinstance(split, Mapping):
        raise TypeError(
            f"static_split must be a mapping {{sub-pool name: fraction}} over {names}, "
            f"got {split!r}"
        )
    if set(split) != set(names):
        raise ValueError(
            f"static_split must name exactly the pool's sub-pools {names}, got {list(split)}; "
            "give one fraction per sub-pool"
        )
    out = {}
    for name in names:
        f = split[name]
        ok = isinstance(f, (int, float)) and not isinstance(f, bool)
        if not ok or not math.isfinite(f) or f <= 0:
            raise ValueError(
                f"static_split[{name!r}] must be a positive fraction of the usable bytes, got {f!r}"
            )
        out[name] = float(f)
    total = sum(out.values())
    if total > 1 + SUM_TOLERANCE:
        raise ValueError(
            f"static_split fractions must sum to at most 1, got {total:.6g} ({out}); scale "
            "them down (e.g. SGLang's ratio: mamba 0.9/1.9, full 1/1.9)"
        )
    return out


def static_band_limits(
    subpools: Mapping[str, object], split: Mapping[str, float], sink_bytes: int, total_bytes: int
) -> dict[str, tuple[int, int]]:
    """Each sub-pool's fixed page range ``(lo, hi)`` on its own grid.

    subpools: ``{name: SubPool}`` (grow, page_bytes, first_page, num_pages used);
    split: validated fractions (``check_static_split``). ValueError when a range
    holds no whole page."""
    usable = total_bytes - sink_bytes
    scale = max(1.0, sum(split.values()))  # a sum a rounding error above 1 counts as 1
    size = {n: int(split[n] * usable / scale) for n in split}  # bytes per range
    limits, start = {}, sink_bytes
    for grow in ORDER:
        sub = next((s for s in subpools.values() if s.grow == grow), None)
        if sub is None:
            continue
        lo_byte = total_bytes - size[sub.name] if grow == Grow.DOWN else start
        hi_byte = lo_byte + size[sub.name]
        start = hi_byte
        lo = max(sub.first_page, -(-lo_byte // sub.page_bytes))
        hi = min(sub.num_pages, hi_byte // sub.page_bytes)
        if hi <= lo:
            raise ValueError(
                f"static_split gives sub-pool {sub.name!r} {size[sub.name]} bytes "
                f"(fraction {split[sub.name]:.4g}), less than one {sub.page_bytes}-byte page "
                "on its grid; raise its fraction or total_bytes"
            )
        limits[sub.name] = (lo, hi)
    return limits


def check_alone(pool, demand: Mapping[str, int], split: Mapping[str, float], tokens: int) -> None:
    """ValueError unless one worst-case request of ``tokens`` tokens (``demand``
    pages per sub-pool) fits inside every sub-pool's static range of ``pool``
    (a UnifiedPool whose ``band_limits`` are set)."""
    limits = pool.band_limits
    short = [n for n, d in demand.items() if d > limits[n][1] - limits[n][0]]
    if not short:
        return
    usable = pool.total_bytes - pool.sink_bytes
    need = {n: (demand[n] + 1) * pool.subpools[n].page_bytes / usable for n in short}
    fixes = ", ".join(f"{n!r} to at least {need[n]:.4g}" for n in short)
    raise ValueError(
        f"under static_split {dict(split)} one worst-case request of {tokens} tokens cannot run "
        f"alone: it needs pages {dict(demand)} but the fixed ranges hold "
        f"{ {n: hi - lo for n, (lo, hi) in limits.items()} }; raise the fraction of {fixes} "
        "(lowering the others), raise total_bytes, or lower max_request_tokens"
    )
