"""The search's picture: predicted step time against predicted peak memory per rank, one point
per layout that fits, the frontier joined and the budget drawn. Needs matplotlib; without it
nothing is drawn and the caller is told so."""

from __future__ import annotations

from pathlib import Path

from .result import SearchResult


def plot_frontier(result: SearchResult, path: str | Path) -> str:
    """Draw ``result`` to ``path`` (PNG, SVG, PDF: by its suffix); return what was done, in words."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # a file, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot drawn (pip install matplotlib)"
    everything = [*result.ranked, *result.others]
    if not everything:
        return "no layout fits the budget: nothing to plot"
    on_frontier = result.frontier()
    mib = 2.0**20
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([p.memory / mib for p in everything], [p.time * 1e3 for p in everything], s=14, color="0.6",
               label=f"{len(everything)} layouts that fit")
    ax.plot([p.memory / mib for p in on_frontier], [p.time * 1e3 for p in on_frontier], "o-", color="C3",
            label="frontier (nothing is both faster and smaller)")
    for p in on_frontier:
        ax.annotate(str(p.candidate), (p.memory / mib, p.time * 1e3), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.axvline(result.budget / mib, color="C0", linestyle="--", label="memory per rank")
    ax.set_xlabel("predicted peak memory per rank (MiB)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(f"layouts of {result.world} ranks (compute {result.compute_source})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    # matplotlib adds ".png" to a name without a suffix: say the file it wrote
    written = Path(path) if Path(path).suffix else Path(f"{path}.png")
    fig.savefig(written)
    plt.close(fig)
    return f"plot written to {written}"
