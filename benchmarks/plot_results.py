"""Pictures from the saved benchmark results (matplotlib, PNG under ``docs/``).

- ``docs/decode_sweep.png``: the decode-kernel sweep against its peers
  (benchmarks/results/kernels_h200.json, written by
  ``benchmarks/bench_kernels.py``; the last committed one is at a3ee091): effective TB/s of unikv (CUDA
  graph replay where measured, else do_bench), torch SDPA on contiguous KV,
  FlashInfer paged and FlexAttention, per (B x L) shape and page size, with
  the device-copy ceiling measured in the same run.
- ``docs/occupancy_<model>_<scheme>.png``: pool occupancy by sub-pool over the
  simulated steps of ``bench_capacity.py`` (``benchmarks/results/capacity.json``).

Usage: ``python benchmarks/plot_results.py [--kernels JSON] [--capacity JSON] [--out docs]``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLORS = {"full": "#3b6fb6", "swa": "#e08a2c", "mamba": "#5aa55a", "mla": "#9b59b6"}
GIB = 1 << 30


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _kv_bytes(b: int, length: int, heads: int = 8, dim: int = 128) -> int:
    """K + V bytes of one layer read by decode (bf16), GQA 32/8, D 128 as in the sweep."""
    return 2 * b * length * heads * dim * 2


def decode_rows(kernels: dict) -> list[dict]:
    """One row per (B, L, page): TB/s of unikv and each peer (None when absent)."""
    rows = []
    for r in kernels["decode"]:
        nbytes = _kv_bytes(r["B"], r["L"])

        def tbps(us, nbytes=nbytes):
            return nbytes / us / 1e6 if us else None

        unikv_us = r.get("graph_us") or r["unikv_us"]
        rows.append(
            {
                "label": f"{r['B']} x {r['L'] // 1024}k",
                "page": r["page_size"],
                "unikv": tbps(unikv_us),
                "sdpa": tbps(r.get("sdpa_contig_us")),
                "flashinfer": tbps(r.get("flashinfer_graph_us") or r.get("flashinfer_us")),
                "flex": tbps(r.get("flex_contig_us")),
            }
        )
    return rows


def plot_decode_sweep(kernels: dict, out: Path) -> Path:
    """Grouped bars of decode TB/s per shape (one group per B x L, bars per page size)."""
    plt = _pyplot()
    rows = decode_rows(kernels)
    shapes = list(dict.fromkeys(r["label"] for r in rows))
    pages = sorted({r["page"] for r in rows})
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / (len(pages) + 2)
    for si, shape in enumerate(shapes):
        group = {r["page"]: r for r in rows if r["label"] == shape}
        any_row = next(iter(group.values()))
        for pi, page in enumerate(pages):
            value = group.get(page, {}).get("unikv")
            ax.bar(
                si + pi * width,
                value or 0,
                width,
                color=plt.cm.Blues(0.45 + 0.2 * pi),
                label=f"unikv page {page}" if si == 0 else None,
            )
            fi = group.get(page, {}).get("flashinfer")
            if fi:
                ax.plot(
                    si + pi * width,
                    fi,
                    "k_",
                    markersize=14,
                    mew=2,
                    label="FlashInfer paged (same page)" if si == 0 and pi == 0 else None,
                )
        ax.bar(
            si + len(pages) * width,
            any_row["sdpa"] or 0,
            width,
            color="#999999",
            label="torch SDPA, contiguous KV" if si == 0 else None,
        )
    ceiling = kernels["ceilings"]["d2d_GBps"] / 1e3
    ax.axhline(ceiling, color="red", ls="--", lw=1, label=f"device copy {ceiling:.2f} TB/s")
    ax.set_xticks([i + width * len(pages) / 2 for i in range(len(shapes))], shapes)
    ax.set_xlabel("batch x context (GQA 32/8, head dim 128, bf16, one layer)")
    ax.set_ylabel("KV read, TB/s")
    env = kernels.get("env", {})
    ax.set_title(
        f"Paged decode attention on {env.get('gpu', '?')} (torch {env.get('torch', '?')}, "
        f"FlashInfer {kernels.get('flashinfer', '?')}); unikv = CUDA-graph replay where measured"
    )
    ax.legend(fontsize=8, ncol=3, loc="lower right")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "decode_sweep.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _draw_live(ax, steps, trace, names, colors, regions) -> None:
    """Unified: live bytes stacked, bands dotted. Static split: each sub-pool
    drawn inside its own fixed region (the first from 0, the next from the
    boundary), the boundary dashed."""
    if not regions:
        stack = [[b / GIB for b in trace["live"][n]] for n in names]
        ax.stackplot(steps, *stack, labels=[f"{n} live" for n in names], colors=colors, alpha=0.8)
        for n, c in zip(names, colors):
            band = [b / GIB for b in trace["band"][n]]
            ax.plot(steps, band, color=c, lw=0.8, ls=":", label=f"{n} band (incl. holes)")
        return
    base = 0.0
    for n, c in zip(names, colors):
        top = [base + b / GIB for b in trace["live"][n]]
        ax.fill_between(steps, base, top, color=c, alpha=0.8, label=f"{n} live (own region)")
        base += regions[n] / GIB
        if base < sum(regions.values()) / GIB:
            ax.axhline(base, color="k", ls="--", lw=1.2, label="fixed region boundary")


def plot_occupancy(capacity: dict, out: Path) -> list[Path]:
    """One PNG per (model, scheme): stacked live bytes per sub-pool over the
    simulated steps, the sub-pools' bands (lines) and static regions (dashed)."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for model in capacity["models"]:
        budget = model["budget_bytes"]
        for scheme, res in model["schemes"].items():
            trace = res["trace"]
            fig, (ax, ax2) = plt.subplots(
                2, 1, figsize=(9, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
            )
            steps = trace["step"]
            names = list(trace["live"])
            colors = [COLORS.get(model["subpools"].get(n, {}).get("kind", n), None) for n in names]
            _draw_live(ax, steps, trace, names, colors, res.get("regions", {}))
            ax.axhline(budget / GIB, color="k", lw=1, label="budget")
            ax.set_ylabel("GiB")
            ax.set_title(
                f"{model['model']}, {scheme}: pool occupancy (simulated: scheduler + real allocator)"
            )
            ax.legend(fontsize=7, loc="upper right", ncol=2)
            ax2.plot(steps, trace["running"], color="k", lw=1)
            ax2.set_ylabel("running")
            ax2.set_xlabel(
                f"simulated step  (max concurrent {res['max_concurrent']}, "
                f"preemptions {res['preemptions']}, {res['output_tokens_per_step']:.1f} tok/step)"
            )
            fig.tight_layout()
            path = out / f"occupancy_{model['model']}_{scheme}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(path)
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", default=str(ROOT / "benchmarks/results/kernels_h200.json"))
    parser.add_argument("--capacity", default=str(ROOT / "benchmarks/results/capacity.json"))
    parser.add_argument("--out", default=str(ROOT / "docs"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if Path(args.kernels).is_file():
        print("wrote", plot_decode_sweep(json.loads(Path(args.kernels).read_text()), out))
    if Path(args.capacity).is_file():
        for p in plot_occupancy(json.loads(Path(args.capacity).read_text()), out):
            print("wrote", p)


if __name__ == "__main__":
    main()
