#!/usr/bin/env python
"""Plots a `kvzap-export bench --json` result: compaction time vs sequence length, per backend.

Usage: python scripts/plot_bench.py docs/bench/cpu-2026-11-23.json docs/bench/compaction_vs_seq.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: plot_bench.py BENCH.json OUT.png", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(open(argv[0]).read())
    series = defaultdict(list)
    for row in report["results"].get("compaction", []):
        series[row["backend"]].append((row["seq"], row["median_s"] * 1e3))
    if not series:
        print(f"{argv[0]}: no compaction results to plot; run `kvzap-export bench --only compaction --json`", file=sys.stderr)
        return 2
    fig, ax = plt.subplots(figsize=(6, 4))
    for backend, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=backend)
    ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="median time (ms)",
           title=f"threshold compaction, 8 KV heads — {report['machine']} ({report['device']}), {report['date']}")
    ax.title.set_fontsize(9)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(argv[1], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
