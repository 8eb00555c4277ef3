"""What TAPA's two phases cost beside the flat all-to-all of the same bytes: exchanges
alone, no compute, through the runtime's transport; with ``--topology``, the simulator's
time for each beside it.

Run across the emulated cluster (as root), 4 nodes of 2 ranks:

    python -m bench.cluster run --nodes 4 --ranks-per-node 2 --gbit 0.2 -- \\
        python bench/phase_coupling.py --topology calibrated.toml \\
        --json results/phase_coupling.json

Each rank holds ``--kib`` KiB and every pattern moves it through all-to-alls (a rank
keeps its own share, as the runtime's exchanges do):

* ``world``: one all-to-all over every rank (``flat``);
* ``node``: over the rank's node (TAPA's first phase);
* ``column``: over the ranks at its place on every node (TAPA's second phase);
* ``column+sync``: ``column``, then a one-row exchange over the node: the second phase
  with what couples it to the next exchange in a step;
* ``tapa``: ``node`` then ``column``.

Patterns run interleaved, ``--rounds`` times, each timed over ``--repeats`` back-to-back
calls between barriers; rank 0 prints the median per call and ``tapa`` over ``node`` +
``column`` (1.00: the phases cost what they cost apart). Measured on 2026-11-26, 4 x 2 at
0.2 Gbit/s over gloo (docs/changelog.md, "TAPA's phases on a shaped link").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `cocodiff` importable
    sys.path.insert(0, str(REPO))

from cocodiff.simulator.collective import (  # noqa: E402
    PATTERN_CALLS,
    PATTERNS,
    pattern_groups,
    simulate_pattern,
)

ROW_FLOATS = 256  # 1 KiB rows


def measure(transport, num_nodes: int, per_node: int, rows: int, rounds: int,
            repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per call of each pattern, one per round (the slowest rank's), and the
    process CPU seconds per call (every thread: the transport's own included), one per
    round (the mean over ranks)."""
    import torch

    from cocodiff.calibration.collect import gather_floats

    world = num_nodes * per_node
    # Every rank makes every group, in one order (making a group is collective).
    made = {members: transport.new_group(members) for members in sorted(
        {pattern_groups(num_nodes, per_node, rank)[name] for rank in range(world)
         for name in ("node", "column")})}
    made[tuple(range(world))] = transport.world
    by_group = {name: made[members] for name, members in
                pattern_groups(num_nodes, per_node, transport.rank).items()}
    mine = {name: group.ranks for name, group in by_group.items()}
    data = {name: torch.zeros(rows - rows % len(members), ROW_FLOATS)
            for name, members in mine.items()}
    one_row = torch.zeros(len(mine["node"]), ROW_FLOATS)

    def run(pattern: str) -> None:
        for name, tiny in PATTERN_CALLS[pattern]:
            group = by_group[name]
            send = one_row if tiny else data[name]
            split = [send.shape[0] // group.size] * group.size
            transport.all_to_all(send, split, split, group).wait()

    times: dict[str, list[float]] = {pattern: [] for pattern in PATTERNS}
    cpu: dict[str, list[float]] = {pattern: [] for pattern in PATTERNS}
    for _ in range(rounds):
        for pattern in PATTERNS:
            run(pattern)  # warm-up: connections made, buffers touched
            transport.barrier()
            began, began_cpu = time.perf_counter(), time.process_time()
            for _ in range(repeats):
                run(pattern)
            elapsed = (time.perf_counter() - began) / repeats
            spent = (time.process_time() - began_cpu) / repeats
            transport.barrier()
            rows_by_rank = gather_floats(transport, [elapsed, spent])
            times[pattern].append(max(row[0] for row in rows_by_rank))
            cpu[pattern].append(statistics.fmean(row[1] for row in rows_by_rank))
    return times, cpu


def simulated(topology_path: Path, num_nodes: int, per_node: int, rows: int
              ) -> dict[str, float]:
    """The simulator's seconds per call of each pattern on ``topology_path``."""
    from topology import build_topology
    from topology.toml_format import load_topology

    topology = build_topology(load_topology(topology_path))
    if (topology.num_nodes, topology.tiles_per_node) != (num_nodes, per_node):
        sys.exit(f"phase_coupling: {topology_path} describes {topology.num_nodes} x "
                 f"{topology.tiles_per_node} ranks, the launch {num_nodes} x {per_node}")
    row_bytes = ROW_FLOATS * 4
    return {pattern: simulate_pattern(topology, pattern, rows * row_bytes, row_bytes=row_bytes)
            for pattern in PATTERNS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kib", type=int, default=128, help="KiB each rank holds (default 128)")
    parser.add_argument("--ranks-per-node", type=int,
                        default=int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None,
                        help="(default: the launcher's LOCAL_WORLD_SIZE)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=8, help="calls timed per round")
    parser.add_argument("--transport", default="torch", help="torch (gloo) or mpi")
    parser.add_argument("--topology", type=Path, default=None,
                        help="a calibrated topology file: simulate each pattern on it too")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from transports.registry import create_transport

    transport = create_transport(args.transport)
    per_node = args.ranks_per_node
    if not per_node or transport.world_size % per_node:
        sys.exit(f"phase_coupling: {transport.world_size} ranks cannot sit {per_node} per node")
    num_nodes = transport.world_size // per_node
    rows = args.kib * 1024 // (ROW_FLOATS * 4)
    times, cpu = measure(transport, num_nodes, per_node, rows, args.rounds, args.repeats)
    transport.close()
    if transport.rank != 0:
        return 0
    medians = {pattern: statistics.median(values) for pattern, values in times.items()}
    cpu_medians = {pattern: statistics.median(values) for pattern, values in cpu.items()}
    predicted = (simulated(args.topology, num_nodes, per_node, rows)
                 if args.topology is not None else {})
    print(f"{num_nodes} x {per_node} ranks, {args.kib} KiB per rank, {args.transport}")
    for pattern in PATTERNS:
        line = (f"  {pattern:12s} measured {medians[pattern] * 1e3:8.2f} ms, "
                f"CPU {cpu_medians[pattern] * 1e3:6.2f} ms per rank")
        if predicted:
            line += (f"   simulated {predicted[pattern] * 1e3:8.2f} ms "
                     f"({predicted[pattern] / medians[pattern] - 1:+.0%})")
        print(line)
    coupling = medians["tapa"] / (medians["node"] + medians["column"])
    print(f"  tapa / (node + column) = {coupling:.2f}; tapa / world = "
          f"{medians['tapa'] / medians['world']:.2f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "num_nodes": num_nodes, "ranks_per_node": per_node, "kib_per_rank": args.kib,
            "transport": args.transport, "rounds": args.rounds, "repeats": args.repeats,
            "measured_s": times, "median_s": medians, "cpu_s": cpu,
            "cpu_median_s": cpu_medians, "simulated_s": predicted,
            "topology": str(args.topology) if args.topology else None,
            "tapa_over_phases_apart": coupling}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
