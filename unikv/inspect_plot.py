"""PNG byte map for `unikv inspect --plot` (imports matplotlib; loaded only when asked)."""

from __future__ import annotations


def plot_plan(name: str, plan: dict, path: str) -> None:
    """Draw one row per extreme of the moving boundary: the sink, the band that
    holds everything (pages, or slots = requests for a Mamba band), and the tail
    pad, on a byte axis in MiB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    budget, sink, pad = plan["budget_bytes"], plan["sink_bytes"], plan["tail_pad_bytes"]
    names = list(plan["subpools"])
    colors = dict(zip(names, ("tab:blue", "tab:orange", "tab:green")))
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * len(names)))
    for row, n in enumerate(names):
        s = plan["subpools"][n]
        band = s["pages_alone"] * s["page_bytes"]
        pb = s["page_bytes"]
        start = -(-sink // pb) * pb  # alone, a band spans every page of its grid above the sink
        ax.broken_barh([(0, sink / mib)], (row - 0.4, 0.8), color="0.4")
        ax.broken_barh([(start / mib, band / mib)], (row - 0.4, 0.8), color=colors[n])
        ax.broken_barh([(budget / mib, max(pad, 1) / mib)], (row - 0.4, 0.8), color="0.8")
        ax.text(
            start / mib + band / mib / 2,
            row,
            f"{n}: {s['pages_alone']} {'slots' if s['kind'] == 'mamba' else 'pages'}",
            ha="center",
            va="center",
            fontsize=8,
        )
    ax.set_yticks(range(len(names)), [f"all to {n} ({plan['subpools'][n]['grow']})" for n in names])
    ax.set_xlabel("byte offset (MiB); grey: sink, light grey: tail pad")
    ax.set_title(f"unikv pool plan: {name}, {budget / 2**30:.2f} GiB")
    ax.set_xlim(0, (budget + pad) / mib)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
