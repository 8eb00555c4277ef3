"""How fast the simulator is: one denoising step (flat Ulysses, FLUX.1-dev at 1024^2 by
default) on 1 to 64 Aurora nodes, with folding (the default) and, where it is
affordable, without.

Prints wall time (plan + simulation), SimPy events per second and flows per step, and
the ratio of the unfolded to the folded wall time measured side by side; checks that
both give the same predicted step time. Writes JSON (default results/sim_scaling.json).

    python bench/sim_scaling.py [--nodes 1,2,4,8,16,32,64] [--unfolded-up-to 8]
    python bench/sim_scaling.py --schedule cocodiff --resolution 2048 --nodes 128 \
        --unfolded-up-to 0 --json results/sim_scale_cocodiff.json

``--cli`` times what a user runs instead: the whole ``cocodiff simulate --nodes N``
(FLUX.1-dev, all four schedules, planner and ``--chunks auto`` on) in a child process
per node count, its wall time and peak memory (the child's own accounting), and with
``--plot`` draws both against nodes on log-log axes (docs/sim_scaling.png):

    python bench/sim_scaling.py --cli --nodes 8,16,32,64,128 --plot docs/sim_scaling.png \
        --json results/measured/sim_scaling_cli.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cocodiff.models import REGISTRY
from cocodiff.schedules import RankGrid, plan_for_step
from cocodiff.simulator.simulate import simulate_plan
from topology import Placement, build_topology, get_preset


def measure(nodes: int, fold: bool, model_name: str, resolution: int, schedule: str) -> dict:
    model = REGISTRY[model_name]
    began = time.perf_counter()
    topology = build_topology(get_preset("aurora", nodes))
    placement = Placement.node_major(topology)
    streams = (model.image_tokens(resolution, resolution), model.text_tokens)
    grid = RankGrid.from_placement(topology, placement)
    # A mid-generation step: V-Major (cocodiff) then caches about half of V.
    plan = plan_for_step(schedule, model, grid, streams, step=14, num_steps=28)
    result = simulate_plan(plan, topology, placement, fold=None if fold else False)
    wall_s = time.perf_counter() - began
    return {
        "nodes": nodes,
        "ranks": placement.num_ranks,
        "folded": result.folded,
        "simulated_ranks": result.simulated_ranks,
        "wall_s": wall_s,
        "events": result.num_events,
        "events_per_s": result.num_events / wall_s,
        "flows": result.num_flows,
        "step_time_s": result.step_time_s,
    }


def measure_cli(nodes: int, model_name: str) -> dict:
    """Wall time and peak memory of ``cocodiff simulate --nodes nodes`` in a child process
    (one child at a time, so RUSAGE_CHILDREN's peak is this child's once it exceeds the
    earlier ones'; each row's peak is read as the maximum so far, said in the JSON)."""
    command = [sys.executable, "-m", "cocodiff", "simulate", "--nodes", str(nodes),
               "--model", model_name]
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall_s = time.perf_counter() - began
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    last = (done.stderr.strip().splitlines() or [""])[-1]
    return {"nodes": nodes, "command": " ".join(["cocodiff", *command[3:]]),
            "returncode": done.returncode, "wall_s": wall_s,
            "peak_bytes_so_far": peak_kib * 1024,
            "refused": last if done.returncode else None}


def plot_cli(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [row for row in rows if row["returncode"] == 0]
    fig, (wall, memory) = plt.subplots(1, 2, figsize=(9, 3.6))
    wall.loglog([r["nodes"] for r in ran], [r["wall_s"] for r in ran], "o-")
    wall.set(xlabel="Aurora nodes", ylabel="wall time (s)", title="cocodiff simulate: wall")
    memory.loglog([r["nodes"] for r in ran], [r["peak_bytes_so_far"] / 1e9 for r in ran], "o-")
    memory.set(xlabel="Aurora nodes", ylabel="peak memory (GB)", title="peak memory")
    for axis in (wall, memory):
        axis.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main_cli(args) -> None:
    rows = []
    table = Table(title=f"cocodiff simulate --nodes N ({args.model}, all schedules, planner)")
    for column in ("nodes", "wall", "peak memory (max so far)", "result"):
        table.add_column(column, justify="right")
    for nodes in (int(n) for n in args.nodes.split(",")):
        row = measure_cli(nodes, args.model)
        rows.append(row)
        table.add_row(str(nodes), f"{row['wall_s']:.1f} s",
                      f"{row['peak_bytes_so_far'] / 1e9:.2f} GB",
                      "ran" if row["returncode"] == 0 else f"refused: {row['refused'][:80]}")
    Console(width=200).print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"model": args.model, "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    if args.plot is not None:
        plot_cli(rows, args.plot)
        print(f"wrote {args.plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,2,4,8,16,32,64")
    parser.add_argument("--unfolded-up-to", type=int, default=8,
                        help="also simulate every rank (no folding) up to this many nodes")
    parser.add_argument("--model", default="flux1-dev")
    parser.add_argument("--schedule", default="flat")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--json", type=Path, default=Path("results/sim_scaling.json"))
    parser.add_argument("--cli", action="store_true",
                        help="time the whole `cocodiff simulate --nodes N` per node count")
    parser.add_argument("--plot", type=Path, default=None,
                        help="with --cli: wall and memory against nodes, log-log (PNG)")
    args = parser.parse_args()
    if args.cli:
        main_cli(args)
        return
    rows = []
    table = Table(title=f"simulator speed: {args.schedule}, {args.model} {args.resolution}^2, "
                  "aurora")
    for column in ("nodes", "ranks", "simulated", "wall", "events/s", "flows",
                   "step time", "unfolded wall", "unfolded/folded"):
        table.add_column(column, justify="right")
    for nodes in (int(n) for n in args.nodes.split(",")):
        folded = measure(nodes, True, args.model, args.resolution, args.schedule)
        unfolded = (measure(nodes, False, args.model, args.resolution, args.schedule)
                    if nodes <= args.unfolded_up_to else None)
        if unfolded is not None:
            relative = abs(unfolded["step_time_s"] - folded["step_time_s"]) / folded["step_time_s"]
            if relative > 1e-9:
                raise SystemExit(f"folded and unfolded disagree at {nodes} nodes: {relative:.2e}")
        rows.append({"folded": folded, "unfolded": unfolded})
        table.add_row(
            str(nodes), str(folded["ranks"]), str(folded["simulated_ranks"]),
            f"{folded['wall_s']:.2f} s", f"{folded['events_per_s']:,.0f}", f"{folded['flows']:,}",
            f"{folded['step_time_s'] * 1e3:.2f} ms",
            f"{unfolded['wall_s']:.2f} s" if unfolded else "-",
            f"{unfolded['wall_s'] / folded['wall_s']:.1f}x" if unfolded else "-",
        )
    Console(width=200).print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"model": args.model, "resolution": args.resolution,
                                     "schedule": args.schedule, "rows": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
