"""The paper's grid from ``cocodiff simulate --sweep --json`` records: the tables of
``docs/aurora-calibration.md`` (every configuration, the summary beside the paper's
figures, the SD3.5-Large 1536 px ablation) and the plot.

    cocodiff simulate --sweep --json sweep.json
    python bench/sweep_report.py sweep.json --plot docs/sweep.png

Several records (e.g. one per model, ``--sweep-models``) are merged in the order given.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# Published (arXiv 2604.14561; the secondary summaries' factors are unverified).
PAPER = {"mean": 3.6, "peak": 8.4, "peak_config": "SD3.5, 2304 px, 4 nodes",
         "share": "64-96%", "ablation": {"tapa": 2.2, "vfirst": 1.3, "cocodiff": 2.9}}
ABLATION = ("sd35-large", 1536)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", type=Path)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [row for path in args.records for row in json.loads(path.read_text())["rows"]]
    names = list(rows[0]["speedup"])
    best = names[-1]

    print("| model | px | nodes | " + " | ".join(f"{n} over flat" for n in names[1:])
          + " | flat all-to-all share | layout (flat / " + best + ") |")
    print("|---|---:|---:|" + "---:|" * (len(names) - 1) + "---:|---|")
    for row in rows:
        flat = next(r for r in row["results"] if r["schedule"] == "flat")
        print(f"| {row['model']} | {row['resolution']} | {row['nodes']} | "
              + " | ".join(f"{row['speedup'][n]:.2f}x" for n in names[1:])
              + f" | {flat['comm_share']:.0%} | {row['layouts']['flat']} / "
              f"{row['layouts'][best]} |")

    speedups = [row["speedup"][best] for row in rows]
    peak = max(rows, key=lambda row: row["speedup"][best])
    shares = [next(r for r in row["results"] if r["schedule"] == "flat")["comm_share"]
              for row in rows]
    multi = [row for row in rows if row["nodes"] > 1]
    print()
    print(f"| | simulated | paper |\n|---|---|---|\n"
          f"| `{best}` over `flat`, mean of {len(rows)} | {statistics.fmean(speedups):.2f}x "
          f"(geometric {statistics.geometric_mean(speedups):.2f}x; multi-node only "
          f"{statistics.fmean(r['speedup'][best] for r in multi):.2f}x) | {PAPER['mean']}x |\n"
          f"| peak | {peak['speedup'][best]:.2f}x ({peak['model']}, {peak['resolution']} px, "
          f"{peak['nodes']} nodes) | {PAPER['peak']}x ({PAPER['peak_config']}) |\n"
          f"| flat all-to-all share of step time | {min(shares):.0%}-{max(shares):.0%} | "
          f"{PAPER['share']} |")

    model, resolution = ABLATION
    print(f"\nAblation, {model} at {resolution} px (each factor over the schedule before it):\n")
    print("| nodes | layout (flat / vfirst) | TAPA over flat | + V-First | + V-Major | all |")
    print("|---:|---|---:|---:|---:|---:|")
    for row in rows:
        if (row["model"], row["resolution"]) != ABLATION:
            continue
        s = row["speedup"]
        print(f"| {row['nodes']} | {row['layouts']['flat']} / {row['layouts']['vfirst']} | "
              f"{s['tapa']:.2f}x | {s['vfirst'] / s['tapa']:.2f}x | "
              f"{s['cocodiff'] / s['vfirst']:.2f}x | {s['cocodiff']:.2f}x |")
    a = PAPER["ablation"]
    print(f"| paper (unverified summaries) | | {a['tapa']}x | {a['vfirst']}x (multi-node) | "
          f"{a['cocodiff']}x (multi-node) | |")
    if args.plot:
        # The same figure `cocodiff simulate --sweep --plot` draws.
        from cocodiff.simulator.sweep import plot_sweep
        from cocodiff.util.atomic import atomic_write

        atomic_write(args.plot, lambda tmp: plot_sweep(rows, names, tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
