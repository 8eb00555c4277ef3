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
                             collective, args.workers, auto_chunks=auto_chunks(args))
    if rows is None:  # another rank than 0: rank 0 reports
        return 0
    _print_rows(rows, shared.schedules)
    if args.json:
        atomic_write_text(args.json, json.dumps({"grid": {"models": models,
                                                          "resolutions": resolutions,
                                                          "nodes": nodes_list},
                                                 "steps": args.steps, "rows": rows}, indent=2))
    if args.plot:
        atomic_write(args.plot, lambda tmp: plot_sweep(rows, shared.schedules, tmp))
    return 0


def _print_rows(rows: list[dict], names: tuple[str, ...]) -> None:
    from rich.table import Table

    from cocodiff.util.console import plain_console

    table = Table(title="simulated speedup over flat Ulysses (Aurora)", title_justify="left")
    for column in ("model", "px", "nodes", *names, f"layout ({BASELINE} / {names[-1]})"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["model"], str(row["resolution"]), str(row["nodes"]),
                      *(f"{row['speedup'][name]:.2f}x" for name in names),
                      f"{row['layouts'][BASELINE]} / {row['layouts'][names[-1]]}")
    plain_console(width=None if sys.stdout.isatty() else 200).print(table)
    best = names[-1]
    speedups = [row["speedup"][best] for row in rows]
    peak = max(rows, key=lambda row: row["speedup"][best])
    print(f"{best} over flat: mean {sum(speedups) / len(speedups):.2f}x, peak "
          f"{peak['speedup'][best]:.2f}x ({peak['model']}, {peak['resolution']}px, "
          f"{peak['nodes']} nodes)", flush=True)
    for name in names[1:]:  # how many rows ran each chunk count
        counts: dict[int, int] = {}
        for row in rows:
            counts[row["chunks"][name]] = counts.get(row["chunks"][name], 0) + 1
        print(f"{name} chunks: " + ", ".join(f"{c} in {n} row(s)"
                                              for c, n in sorted(counts.items())), flush=True)


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
