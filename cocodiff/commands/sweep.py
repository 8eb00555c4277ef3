"""``cocodiff simulate --sweep``: the grid's flags in; the table, JSON and plot out.

The grid itself runs in :mod:`cocodiff.simulator.sweep` (side by side on the local
cores, and split across the ranks under ``mpiexec``).
"""

from __future__ import annotations

import argparse
import json
import sys

from cocodiff.schedules import BASELINE, PlanOptions
from cocodiff.simulator.sweep import SWEEP, plot_sweep, run_sweep
from cocodiff.util.errors import CocodiffError
from transports.sim import CollectiveModel


def sweep_command(args: argparse.Namespace, names: list[str], options: PlanOptions,
                  collective: CollectiveModel | None) -> int:
    """The ``--sweep`` handler: read the grid's flags, run it, print and write on rank 0."""
    from cocodiff.util.atomic import atomic_write, atomic_write_text

    models = sweep_values(args.sweep_models, SWEEP["models"], str, "model")
    resolutions = sweep_values(args.sweep_resolutions, SWEEP["resolutions"], int, "resolution")
    nodes_list = sweep_values(args.sweep_nodes, SWEEP["nodes"], int, "node count")
    from cocodiff.commands.plan import auto_chunks

    shared, rows = run_sweep(models, resolutions, nodes_list, names, args.steps, options,
                             collective, args.workers, auto_chunks=auto_chunks(args),
                             pipefusion=args.sweep_pipefusion, overlap=args.pipefusion_overlap)
    if rows is None:  # another rank than 0: rank 0 reports
        return 0
    _print_rows(rows, shared.schedules)
    if args.json:
        atomic_write_text(args.json, json.dumps({"grid": {"models": models,
                                                          "resolutions": resolutions,
                                                          "nodes": nodes_list},
                                                 "steps": args.steps,
                                                 "pipefusion_overlap": args.pipefusion_overlap,
                                                 "rows": rows}, indent=2))
    if args.plot:
        atomic_write(args.plot, lambda tmp: plot_sweep(rows, shared.schedules, tmp))
    return 0


def _print_rows(rows: list[dict], names: tuple[str, ...]) -> None:
    from rich.table import Table

    from cocodiff.util.console import plain_console

    table = Table(title="simulated speedup over flat Ulysses (Aurora)", title_justify="left")
    best = names[-1]
    pipelines = "pipefusion" in rows[0]
    columns = ["model", "px", "nodes", *names, f"layout ({BASELINE} / {best})",
               f"memory ({best})"]
    if pipelines:
        columns += ["pipefusion", "its layout", "its memory"]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        cells = [row["model"], str(row["resolution"]), str(row["nodes"]),
                 *(f"{row['speedup'][name]:.2f}x" for name in names),
                 f"{row['layouts'][BASELINE]} / {row['layouts'][best]}",
                 _memory(row["memory_gb"].get(best), row["tile_memory_gb"])]
        if pipelines:
            pipeline = row["pipefusion"]
            cells += (["-", "none fits", "-"] if pipeline["layout"] is None else
                      [f"{pipeline['speedup']:.2f}x", pipeline["layout"],
                       _memory(pipeline["memory_gb"], row["tile_memory_gb"])])
        table.add_row(*cells)
    plain_console(width=None if sys.stdout.isatty() else 240).print(table)
    over = [row for row in rows if row["memory_gb"].get(best, 0) > row["tile_memory_gb"] > 0]
    if over:
        print(f"note: '!' marks a rank that needs more than the {over[0]['tile_memory_gb']:g} GB "
              f"of a tile ({len(over)} row(s) of {best}: the whole model on every rank); "
              "the speedups are simulated all the same", flush=True)
    speedups = [row["speedup"][best] for row in rows]
    peak = max(rows, key=lambda row: row["speedup"][best])
    print(f"{best} over flat: mean {sum(speedups) / len(speedups):.2f}x, peak "
          f"{peak['speedup'][best]:.2f}x ({peak['model']}, {peak['resolution']}px, "
          f"{peak['nodes']} nodes)", flush=True)
    if pipelines:
        wins = [row for row in rows if row["pipefusion"]["layout"] is not None
                and row["pipefusion"]["speedup"] > row["speedup"][best]]
        print(f"pipefusion ahead of {best} in {len(wins)} of {len(rows)} row(s)"
              + (": " + ", ".join(f"{row['model']} {row['resolution']}px {row['nodes']} nodes"
                                  for row in wins) if wins else ""), flush=True)
    for name in names[1:]:  # how many rows ran each chunk count
        counts: dict[int, int] = {}
        for row in rows:
            counts[row["chunks"][name]] = counts.get(row["chunks"][name], 0) + 1
        print(f"{name} chunks: " + ", ".join(f"{c} in {n} row(s)"
                                              for c, n in sorted(counts.items())), flush=True)


def _memory(gigabytes: float | None, tile_gb: float) -> str:
    """Memory per rank in GB, marked '!' past the tile's memory."""
    if gigabytes is None:
        return "-"
    return f"{gigabytes:.1f} GB" + ("!" if 0 < tile_gb < gigabytes else "")


def sweep_values(text, default, kind, what):
    if text is None:
        return list(default)
    values = []
    for item in text.split(","):
        try:
            values.append(kind(item.strip()))
        except ValueError:
            raise CocodiffError(f"sweep {what} {item.strip()!r} is not valid") from None
    if kind is str:
        unknown = [v for v in values if v not in default]
        if unknown:
            raise CocodiffError(f"unknown sweep {what} {unknown[0]!r}; valid: "
                                f"{', '.join(default)}")
    elif any(v < 1 for v in values):
        raise CocodiffError(f"sweep {what}s must be positive, got {text!r}")
    return values
