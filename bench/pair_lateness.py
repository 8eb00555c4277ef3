"""What a pair exchange costs when one side calls it late: the cross-node pairs of a 2-node
grid exchange ``--kib`` KiB each way through the runtime's transport, first every rank
calling at once, then the second node's ranks calling ``--late-ms`` later (as a Ring's
pass or a pipeline's transfer meets a peer that is behind). Each side's time from the
common start to its call's completion, both printed, and the late side's over the
same side's on time.

Run across the emulated cluster (as root), 2 nodes of 2 ranks:

    python -m bench.cluster run --nodes 2 --ranks-per-node 2 --gbit 0.2 -- \\
        python bench/pair_lateness.py --json results/pair_lateness.json

Measured on 2026-11-30 (docs/pipefusion.md, "On the emulated cluster"): with 560 KB
each way per rank, at 0.2 Gbit/s, every rank calling at once completes in 37-54 ms; with
the second node 6 ms late, the first node completes at 51-53 ms and the late node at
85-94 ms, about the two directions one after the other: under gloo the early side's
data waits for the late side's, which goes first on their connection. The simulator
starts both directions when the last side calls unless the topology says
``[host] late_peer_first``, which calibrate measures on one pair
(``cocodiff.calibration.lateness``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `cocodiff` importable
    sys.path.insert(0, str(REPO))

MODES = ("on time", "late")


def measure(transport, kib: int, late_s: float, rounds: int, whole_world: bool = False
            ) -> dict[str, list[float]]:
    """This rank's seconds from the common start (a barrier) to its pair exchange's
    completion (``whole_world``: its world all-to-all's), one per round and mode; the second
    half of the ranks (the second node under node-major placement) call ``late_s`` late
    in the ``late`` mode."""
    import torch

    from cocodiff.calibration.lateness import exchange_time

    world, rank = transport.world_size, transport.rank
    half = world // 2
    # Every rank makes every pair, in one order (making a group is collective).
    pairs = {i: transport.new_group((i, i + half)) for i in range(half)}
    group = transport.world if whole_world else pairs[rank % half]
    # A row per member: one kept (a rank keeps its own share), one to each other.
    rows = torch.zeros(group.size, kib * 256)
    late = rank >= half
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _round in range(rounds):
        for mode in MODES:
            transport.barrier()
            delay_s = late_s if late and mode == "late" else 0.0
            times[mode].append(exchange_time(transport, group, rows, delay_s))
    return times


def summarise(per_rank: list[dict[str, list[float]]], half: int) -> dict[str, dict[str, float]]:
    """Median seconds of each side (the first node's ranks, the second's) in each mode."""
    sides = {"first": per_rank[:half], "second": per_rank[half:]}
    return {mode: {side: statistics.median(t for times in ranks for t in times[mode])
                   for side, ranks in sides.items()} for mode in MODES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kib", type=int, default=547,
                        help="KiB each rank sends its partner (default 547: 560 KB)")
    parser.add_argument("--late-ms", type=float, default=6.0,
                        help="how late the second node's ranks call (default 6)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds (default 6)")
    parser.add_argument("--world", action="store_true",
                        help="a world all-to-all (--kib to every other rank) in place of "
                        "the cross-node pairs")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    from cocodiff.calibration.collect import gather_floats
    from transports.registry import create_transport

    transport = create_transport("torch", timeout_s=120)
    if transport.world_size % 2:
        print("pair_lateness: needs an even number of ranks (two nodes)", file=sys.stderr)
        return 2
    times = measure(transport, args.kib, args.late_ms * 1e-3, args.rounds, args.world)
    rows = gather_floats(transport, [t for mode in MODES for t in times[mode]])
    per_rank = [{mode: list(row[i * args.rounds:(i + 1) * args.rounds])
                 for i, mode in enumerate(MODES)} for row in rows]
    if transport.rank == 0:
        half = transport.world_size // 2
        medians = summarise(per_rank, half)
        for mode in MODES:
            print(f"{mode:8s} first node {medians[mode]['first'] * 1e3:7.1f} ms, "
                  f"second node {medians[mode]['second'] * 1e3:7.1f} ms")
        ratio = medians["late"]["second"] / medians["on time"]["second"]
        print(f"the late node's exchange over its exchange on time: {ratio:.2f}x "
              f"({args.late_ms:g} ms late, {args.kib} KiB each way per "
              f"{'pair of ranks, world all-to-all' if args.world else 'rank'})")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({
                "kib": args.kib, "late_ms": args.late_ms, "rounds": args.rounds,
                "exchange": "world" if args.world else "pairs",
                "world": transport.world_size, "median_s": medians,
                "late_over_on_time": ratio, "per_rank_s": per_rank}, indent=1))
    transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
