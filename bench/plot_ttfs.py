"""Plot bench/ttfs.py results: one group of four bars (cold, service, local, Mega-Cache) per
workload, each bar the median with the individual runs as dots.

    python bench/plot_ttfs.py docs/results/ttfs-gqa-h200.json docs/results/ttfs-drafter-h200.json \
        -o docs/ttfs-h200.png --title "H200: time to first step"

Needs matplotlib (not a cachekeeper dependency: `pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CASES = ("cold", "service", "local", "megacache")
LABELS = {
    "cold": "(a) cold",
    "service": "(b) cachekeeper prejob",
    "local": "(c) local warm dir",
    "megacache": "(d) Mega-Cache",
}
COLORS = {"cold": "#c0392b", "service": "#2471a3", "local": "#7f8c8d", "megacache": "#d4ac0d"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("-o", "--out", type=Path, required=True)
    parser.add_argument("--title", default="Time to first training step")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(p.read_text()) for p in args.results]
    fig, ax = plt.subplots(figsize=(3.2 + 2.6 * len(results), 4.2))
    width = 0.2
    for w, result in enumerate(results):
        for c, case in enumerate(CASES):
            x = w + (c - 1.5) * width
            median = result["median_s"][case]
            runs = [r["ttfs_s"] for r in result["runs_detail"][case]]
            ax.bar(
                x, median, width * 0.9, color=COLORS[case], label=LABELS[case] if w == 0 else None
            )
            ax.scatter([x] * len(runs), runs, color="black", s=8, zorder=3)
            ax.text(x, median, f"{median:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels(
        [f"{r['workload']}\n({r['cache_bytes'] / 1e6:.0f} MB, {r['device']})" for r in results]
    )
    ax.set_ylabel("seconds from process spawn to end of first step")
    ax.set_title(args.title)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
