"""`unikv inspect`: print the pool plan for a model config and a memory budget.

    unikv inspect [MODEL] [--budget 4GiB] [--page-size 16] [--dtype bf16]
                  [--max-tokens N] [--plot FILE] [--json]

MODEL is a built-in preset name (``unikv/presets/*.json``), a model directory
holding config.json, a config JSON file, or a Hugging Face repo id (org/name) in the
local cache; default ``gpt-oss-20b``. The pool is
built on the ``meta`` device, so no budget-sized memory is allocated.

Every plan says whether the engine runs the model, and why not when it does not
(``models/support.py``, from the family table); ``unikv inspect --presets`` says it
for every preset, one line each.

Hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, NemotronH, Falcon-H1, Jamba, Bamba,
Granite-4.0-H, Zamba2, LFM2) have a Mamba sub-pool of page size 1: one slot per
request holds every recurrent layer's
conv and SSM state, whatever the request's length. Its numbers are slots (=
requests), and its slot is usually the largest page, so the sink is one slot.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from unikv.hf_config import ModelSpecs, load_config, model_specs_from_hf_config
from unikv.models.support import Support, engine_support
from unikv.pool import INT32_LIMIT, Grow, UnifiedPool, worst_case_pages
from unikv.specs import MambaSpec, MHASpec

PRESET_DIR = Path(__file__).parent / "presets"
DEFAULT_MODEL = "gpt-oss-20b"
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def presets() -> list[str]:
    """Names of the built-in model presets."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def parse_bytes(text: str) -> int:
    """Bytes from "4GiB", "512 MiB", "1.5GB" or a plain integer."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise ValueError(
            f"a byte size must be a positive number with an optional unit out of "
            f"B, KiB, MiB, GiB, TiB, KB, MB, GB, TB (e.g. 4GiB); got {text!r}"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def resolve_model(model: str) -> tuple[str, Any]:
    """(display name, config dict) for a preset name, a model directory, a JSON file or
    a Hugging Face repo id in the local cache (``models/hub.py``: never downloaded)."""
    from unikv.models.hub import REPO_ID
    from unikv.models.hub import resolve_model as snapshot_of

    if os.path.exists(model):
        return model, load_config(model)
    if model in presets():
        return model, load_config(PRESET_DIR / f"{model}.json")
    if REPO_ID.fullmatch(model):  # ValueError naming where it looked, when not cached
        return model, load_config(snapshot_of(model))
    raise ValueError(
        f"no model {model!r}: give a directory with config.json, a config JSON file, "
        f"a Hugging Face repo id in the local cache, or one of the presets {presets()}"
    )


def _longest_request(pool: UnifiedPool, limit: int) -> int:
    """Largest token count (<= limit) whose worst-case request fits the empty pool; 0 if none."""

    def fits(tokens: int) -> bool:
        demand = {
            n: worst_case_pages(s.spec, s.page_size, tokens) for n, s in pool.subpools.items()
        }
        return pool.fits(demand)

    lo, hi = 0, limit
    while lo < hi:  # invariant: fits(lo) or lo == 0; not fits(hi + 1) or hi == limit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _concurrent_requests(pool: UnifiedPool, tokens: int) -> int:
    """How many worst-case requests of ``tokens`` tokens fit the empty pool at once."""
    demand = {n: worst_case_pages(s.spec, s.page_size, tokens) for n, s in pool.subpools.items()}
    lo, hi = 0, max(s.usable_pages for s in pool.subpools.values())
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if pool.fits({n: d * mid for n, d in demand.items()}) else (lo, mid - 1)
    return lo


def kv_layout_bytes(spec: MHASpec) -> dict[str, int]:
    """Bytes per token of an attention sub-pool under both asymmetric-K/V layouts,
    from the spec's raw fields (L layers, H KV heads, K width D, V width Dv):

        padded  K and V rows both max(D, Dv) wide:  2 * L * H * max(D, Dv) * itemsize
        exact   K rows D wide, V rows Dv wide:      L * H * (D + Dv) * itemsize

    plus ``stored``, the spec's ``entry_bytes`` (what this build's pool lays out).
    The two agree when D == Dv."""
    lh, width = spec.num_layers * spec.num_kv_heads, spec.itemsize
    return {
        "padded": 2 * lh * max(spec.head_dim, spec.v_head_dim) * width,
        "exact": lh * (spec.head_dim + spec.v_head_dim) * width,
        "stored": spec.entry_bytes,
    }


def _layout_numbers(pool: UnifiedPool, budget: int) -> dict:
    """Per attention sub-pool and summed over the token sub-pools: bytes per token
    padded / exact / stored (``kv_layout_bytes``; MLA rows have one width, so all
    three are its entry) and the tokens whose pages fit the budget under each
    (whole pages of ``budget``, before the sink)."""
    per_subpool, total = {}, {"padded": 0, "exact": 0, "stored": 0}
    for name, sub in pool.subpools.items():
        if isinstance(sub.spec, MambaSpec):
            continue
        if isinstance(sub.spec, MHASpec):
            layout = kv_layout_bytes(sub.spec)
        else:
            layout = dict.fromkeys(total, sub.spec.entry_bytes)
        ps = sub.page_size
        per_subpool[name] = {
            "bytes_per_token": layout,
            "tokens_in_budget": {k: budget // (ps * b) * ps for k, b in layout.items()},
        }
        total = {k: total[k] + layout[k] for k in total}
    return {"subpools": per_subpool, "bytes_per_token": total}


def _state_parts(spec: MambaSpec) -> list[dict]:
    """Per part of a Mamba slot: its per-layer shape, dtype and bytes."""
    return [
        {
            "part": name,
            "shape": list(p.shape),
            "dtype": str(p.dtype).removeprefix("torch."),
            "layer_bytes": p.layer_bytes,
        }
        for name, p in zip(spec.parts, spec.state_parts)
    ]


def build_plan(model: ModelSpecs, budget: int, max_tokens: int | None = None) -> dict:
    """The pool plan as plain numbers (what `unikv inspect --json` prints).

    Per sub-pool, ``sink_pages`` is how many pages (slots, for Mamba) of its grid lie
    in the sink; a Mamba sub-pool also lists its ``state_parts``, and its
    ``pages_alone`` counts slots, i.e. requests."""
    pool = UnifiedPool(list(model.subpools), budget, device="meta", max_request_tokens=max_tokens)
    subpools = {}
    for name, sub in pool.subpools.items():
        subpools[name] = {
            "kind": sub.spec.kind,
            "grow": sub.grow.value,
            "model_layers": list(sub.layers),
            "page_size": sub.page_size,
            "sliding_window": sub.spec.sliding_window,
            "entry_bytes": sub.spec.entry_bytes,
            "page_bytes": sub.page_bytes,
            "blocks_per_page": sub.spec.blocks_per_page,
            "pages_alone": sub.usable_pages,  # this band holds everything, the others are empty
            "tokens_alone": sub.usable_pages * sub.page_size,
            "sink_pages": sub.first_page,
            "kernel_id_limit": sub.kernel_id_limit,
            "kernel_id_headroom": INT32_LIMIT - sub.kernel_id_limit,
            "kernel_id_headroom_factor": INT32_LIMIT / sub.kernel_id_limit,
        }
        if isinstance(sub.spec, MambaSpec):
            subpools[name]["state_parts"] = _state_parts(sub.spec)
    limit = model.max_position_embeddings or 2**31
    plan = {
        "model_type": model.model_type,
        "layer_kinds": list(model.layer_kinds),
        "budget_bytes": budget,
        "sink_bytes": pool.sink_bytes,
        "tail_pad_bytes": pool.tail_pad_bytes,
        "buffer_bytes": budget + pool.tail_pad_bytes,
        "subpools": subpools,
        "max_position_embeddings": model.max_position_embeddings,
        "longest_request_alone": _longest_request(pool, limit),
        "kv_layout": _layout_numbers(pool, budget),
    }
    if max_tokens is not None:
        plan["max_tokens"] = max_tokens
        plan["worst_case_pages"] = {
            n: worst_case_pages(s.spec, s.page_size, max_tokens) for n, s in pool.subpools.items()
        }
        plan["concurrent_requests"] = _concurrent_requests(pool, max_tokens)
    return plan


def byte_map_lines(plan: dict, width: int = 64) -> list[str]:
    """The byte map as text: sink, the bands with their grow directions, tail pad."""
    budget, sink = plan["budget_bytes"], plan["sink_bytes"]
    by_grow = {s["grow"]: n for n, s in plan["subpools"].items()}
    held = ", ".join(
        f"{s['sink_pages']} {n} {_unit(s, s['sink_pages'])}" for n, s in plan["subpools"].items()
    )
    lines = [
        (
            f"  [0, {sink})  sink: page 0 of every sub-pool; padded lanes and tombstones land "
            f"here (it spans {held})"
        ),
    ]
    if Grow.UP.value in by_grow:
        lines.append(f"  [{sink}, ...)  {by_grow['up']} grows up from the sink floor ->")
    if Grow.FLOAT.value in by_grow:
        lines.append(f"  (...)  {by_grow['float']} floats between the other two bands")
    if Grow.DOWN.value in by_grow:
        lines.append(f"  (..., {budget})  <- {by_grow['down']} grows down from the top")
    lines.append(
        f"  [{budget}, {plan['buffer_bytes']})  tail pad: the last row-block's dense view runs past the last page"
    )
    sink_chars = max(1, round(sink / budget * width))
    inner = width - sink_chars
    left = f" {by_grow['up']} ->" if "up" in by_grow else ""
    mid = f"<- {by_grow['float']} ->" if "float" in by_grow else ""
    right = f"<- {by_grow['down']} " if "down" in by_grow else ""
    gap = max(inner - len(left) - len(mid) - len(right), 2)
    bar = left + " " * (gap // 2) + mid + " " * (gap - gap // 2) + right
    lines.append(
        "  |" + "#" * sink_chars + bar + "|" + ("+" if plan["tail_pad_bytes"] else "") + "|"
    )
    return lines


def _unit(subpool: dict, count: int) -> str:
    """ "slot(s)" for a Mamba sub-pool (page size 1, one per request), else "page(s)"."""
    word = "slot" if subpool["kind"] == "mamba" else "page"
    return word if count == 1 else word + "s"


def _subpool_lines(name: str, plan: dict) -> list[str]:
    s = plan["subpools"][name]
    layers = f"{len(s['model_layers'])} layers, grows {s['grow']}"
    if s["kind"] != "mamba":
        window = f", window {s['sliding_window']}" if s["sliding_window"] else ""
        return [
            (
                f"  {name}: {s['kind']}{window}, {layers}, page_size {s['page_size']}, entry "
                f"{s['entry_bytes']} B, page {s['page_bytes']} B ({human(s['page_bytes'])})"
            )
        ]
    parts = " + ".join(
        f"{p['part']} {tuple(p['shape'])} {p['dtype']} {p['layer_bytes']} B"
        for p in s["state_parts"]
    )
    lines = [
        (
            f"  {name}: mamba (recurrent state), {layers}, one slot per request whatever its "
            f"length: slot {s['entry_bytes']} B ({human(s['entry_bytes'])})"
        ),
        f"    per layer: {parts}",
    ]
    tokens = {n: t["entry_bytes"] for n, t in plan["subpools"].items() if t["kind"] != "mamba"}
    if tokens:
        lines.append(
            f"    one slot holds as many bytes as {s['entry_bytes'] / sum(tokens.values()):.0f} "
            f"tokens of {' + '.join(tokens)} K/V"
        )
    return lines


def _layout_lines(plan: dict) -> list[str]:
    """Bytes per token padded vs exact, for the asymmetric (K wider or narrower than
    V) sub-pools only; nothing for a model without any."""
    layout = plan["kv_layout"]
    asym = [
        n
        for n, s in layout["subpools"].items()
        if s["bytes_per_token"]["padded"] != s["bytes_per_token"]["exact"]
    ]
    if not asym:
        return []
    out = ["", "asymmetric K/V: bytes per token, K and V rows padded to the wider vs exact:"]
    rows = [(n, layout["subpools"][n]) for n in asym]
    rows.append(("every token sub-pool", {"bytes_per_token": layout["bytes_per_token"]}))
    for n, s in rows:
        b = s["bytes_per_token"]
        saved = 1 - b["exact"] / b["padded"]
        line = f"  {n}: padded {b['padded']} B, exact {b['exact']} B ({saved:.1%} less)"
        if "tokens_in_budget" in s:
            t = s["tokens_in_budget"]
            line += f"; tokens in the budget {t['padded']} padded, {t['exact']} exact"
        out.append(line + f"; this build stores {b['stored']} B")
    return out


def format_plan(name: str, plan: dict) -> str:
    kinds = plan["layer_kinds"]
    counts = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
    out = [
        f"model {name} ({plan['model_type']}): {len(kinds)} layers: {counts}",
        *([_engine_line(plan["engine"])] if "engine" in plan else []),
        (
            f"budget {plan['budget_bytes']} B ({human(plan['budget_bytes'])}) + tail pad "
            f"{plan['tail_pad_bytes']} B; sink {plan['sink_bytes']} B ({human(plan['sink_bytes'])})"
        ),
        "",
        "sub-pools:",
    ]
    for n in plan["subpools"]:
        out += _subpool_lines(n, plan)
    out += [
        "",
        "extremes of the moving boundary (one band holds everything, the others are empty):",
    ]
    for n, s in plan["subpools"].items():
        unit = "requests" if s["kind"] == "mamba" else "tokens"
        others = ", ".join(f"{o} 0 {_unit(t, 0)}" for o, t in plan["subpools"].items() if o != n)
        tail = f"; {others}" if others else ""
        out.append(
            f"  all to {n}: {n} {s['pages_alone']} {_unit(s, s['pages_alone'])} = "
            f"{s['tokens_alone']} {unit}{tail}"
        )
    out += _layout_lines(plan)
    out += ["", "kernel-id headroom (ids must stay below 2**31):"]
    for n, s in plan["subpools"].items():
        out.append(
            f"  {n}: ids below {s['kernel_id_limit']}; headroom {s['kernel_id_headroom']} "
            f"({s['kernel_id_headroom_factor']:.1f}x)"
        )
    out += ["", f"longest single request that fits alone: {plan['longest_request_alone']} tokens"]
    if "max_tokens" in plan:
        out.append(
            f"requests of {plan['max_tokens']} tokens (worst-case pages {plan['worst_case_pages']}) "
            f"that fit at once: {plan['concurrent_requests']}"
        )
    out += ["", "byte map:", *byte_map_lines(plan)]
    return "\n".join(out)


def _engine_line(engine: dict) -> str:
    if engine["runs"]:
        return f"engine: runs it (family {engine['family']!r})"
    return f"engine: does not run it: {engine['why_not']}"


def preset_lines() -> list[str]:
    """One line per preset: its architecture and the engine's verdict."""
    lines = []
    for name in presets():
        config = load_config(PRESET_DIR / f"{name}.json")
        arch = (config.get("architectures") or ["(no architecture)"])[0]
        verdict = engine_support(config).line().removeprefix("engine: ")
        lines.append(f"{name}: {arch}: {verdict}")
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unikv inspect", description=__doc__.split("\n")[0])
    p.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"preset name ({', '.join(presets())}), model dir or config JSON",
    )
    p.add_argument("--budget", default="4GiB", help="pool bytes, e.g. 4GiB, 512MiB, 1000000")
    p.add_argument("--page-size", type=int, default=16, help="slots per attention page")
    p.add_argument("--dtype", default="bf16", help="KV dtype: bf16, fp16, fp32, fp8, fp8_e5m2")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="check that one request this long fits alone; report how many fit at once",
    )
    p.add_argument("--plot", default=None, help="write the byte map as a PNG to this file")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--presets",
        action="store_true",
        help="list every preset and whether the engine runs it (why not, where it does not)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.presets:
        print("\n".join(preset_lines()))
        return 0
    support: Support | None = None
    try:
        name, config = resolve_model(args.model)
        support = engine_support(config)
        model = model_specs_from_hf_config(config, page_size=args.page_size, dtype=args.dtype)
        plan = build_plan(model, parse_bytes(args.budget), args.max_tokens)
    except ValueError as error:
        if support is not None:  # the verdict still holds where no pool can be planned
            print(support.line())
        print(f"unikv inspect: error: {error}", file=sys.stderr)
        return 2
    plan["engine"] = support.as_dict()
    print(json.dumps(plan, indent=2) if args.json else format_plan(name, plan))
    if args.plot:
        from unikv.inspect_plot import plot_plan  # matplotlib only when asked

        plot_plan(name, plan, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
