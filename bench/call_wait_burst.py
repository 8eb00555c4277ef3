"""The wait of an exchange call after a compute burst, on cores shared by more ranks than
it has: does it grow with the burst, and does the simulator's wait per call hold?

Every rank loops [a burst of B of CPU, one all-to-all over the world of 2 KiB per peer],
every rank at once, for several B (calibrate's loaded loops with a burst of one layer's
Q/K/V projection, ``cocodiff.calibration.loaded``), beside the burst alone. Rank 0 then
simulates the same loops on a calibrated topology twice: with its ``[host] call_wait_us``
and with none; what the measured loop takes beyond the latter is the wait the calls
needed. A line through those leftovers says how the wait grows with the burst.

    mpiexec -n 4 python bench/call_wait_burst.py --topology m.toml --json results/wait_mpi.json
    torchrun --nproc-per-node 4 bench/call_wait_burst.py --topology t.toml \\
        --json results/wait_torch.json

(``m.toml`` from ``mpiexec -n 4 cocodiff calibrate --model tiny-flux --output m.toml --json
m.json``; the collective of the JSON beside the topology is used when there is one.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BURSTS_MS = (0.05, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0)
# Loop iterations: about this much wall time per loop, within the bounds below.
LOOP_WALL_S = 0.4


def measure(bursts_ms: list[float], rounds: int, iterations: int | None) -> list[dict]:
    """Every burst's loops on every rank (collective); rank 0's list of points, [] on the
    others."""
    from cocodiff.calibration.loaded import CallShape, compute_burst, measure_loaded
    from cocodiff.calibration.model_shapes import layer_shapes
    from transports.registry import auto_transport_name, create_transport

    name = auto_transport_name()
    transport = create_transport(name, **({"timeout_s": 120} if name == "torch" else {}))
    try:
        if transport.world_size < 2:
            raise SystemExit("call_wait_burst: run it under a launcher with at least 2 ranks "
                             "(mpiexec -n 4 ..., torchrun --nproc-per-node 4 ...)")
        shapes = layer_shapes("tiny-flux", None, None, transport.world_size)
        world = CallShape("world", (transport.world,))
        rows = []
        for burst_ms in bursts_ms:
            work = compute_burst(transport, shapes, "float32", burst_ms * 1e-3)
            count = iterations or max(10, min(200, round(LOOP_WALL_S / (4 * burst_ms * 1e-3))))
            burst_cpu, burst_wall, (point,) = measure_loaded(transport, [world], [2048], work,
                                                              count, rounds)
            rows.append({"burst_ms": burst_ms, "burst_cpu_s": burst_cpu,
                         "burst_wall_s": burst_wall, "iterations": count,
                         "point": point.to_json()})
        return rows if transport.rank == 0 else []
    finally:
        transport.close()


def predict(rows: list[dict], topology_path: Path, world: int) -> dict:
    """Each loop simulated on the calibrated topology with its wait per call and with none;
    the leftover per call and the line through the leftovers."""
    import dataclasses

    import numpy as np

    from cocodiff.calibration.loaded import LoadedPoint, predict_loop_s
    from topology import build_topology
    from topology.toml_format import load_topology
    from transports.sim import CollectiveModel

    spec = load_topology(topology_path)
    if spec.host is None:
        raise SystemExit(f"call_wait_burst: {topology_path} has no [host] table (a calibrate "
                         "output has one)")
    beside = topology_path.with_suffix(".json")
    measured = json.loads(beside.read_text()) if beside.is_file() else {}
    collective = (CollectiveModel.from_json(measured["collective"])
                  if measured.get("collective") else None)
    calibrated = build_topology(spec)
    without = build_topology(dataclasses.replace(
        spec, host=dataclasses.replace(spec.host, call_wait_us=0.0)))
    for row in rows:
        point = LoadedPoint(**row["point"])
        row["measured_s"] = point.wall_s
        row["simulated_s"] = predict_loop_s(calibrated, point, row["burst_cpu_s"], 1, world,
                                            collective)
        row["simulated_no_wait_s"] = predict_loop_s(without, point, row["burst_cpu_s"], 1,
                                                    world, collective)
        row["leftover_per_call_s"] = (point.wall_s - row["simulated_no_wait_s"]) / point.calls
    bursts = np.array([row["burst_cpu_s"] for row in rows])
    leftovers = np.array([row["leftover_per_call_s"] for row in rows])
    slope, intercept = (np.polyfit(bursts, leftovers, 1) if len(rows) > 1
                        else (0.0, float(leftovers[0])))
    return {"call_wait_us": spec.host.call_wait_us, "line_intercept_us": intercept * 1e6,
            "line_slope": float(slope)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", type=Path, required=True,
                        help="a calibrated topology (cocodiff calibrate --output)")
    parser.add_argument("--bursts", default=",".join(map(str, BURSTS_MS)),
                        help="CPU per burst, ms, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=None,
                        help="loop iterations (default: about 0.4 s of loop each)")
    parser.add_argument("--json", type=Path, default=REPO / "results" / "call_wait_burst.json")
    args = parser.parse_args(argv)
    try:
        bursts = [float(b) for b in args.bursts.split(",")]
    except ValueError:
        parser.error(f"--bursts takes milliseconds, comma-separated, got {args.bursts!r}")
    if not args.topology.is_file():
        parser.error(f"--topology {args.topology}: no such file")
    rows = measure(bursts, args.rounds, args.iterations)
    if not rows:  # another rank than 0
        return 0
    from transports.launch import detect_launch

    world = detect_launch().world_size
    line = predict(rows, args.topology, world)
    print(f"| burst CPU ms | measured ms | simulated, call_wait_us {line['call_wait_us']:.0f} "
          "| simulated, no wait | left per call ms |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['burst_cpu_s'] * 1e3:.3f} | {row['measured_s'] * 1e3:.3f} | "
              f"{row['simulated_s'] * 1e3:.3f} ({row['simulated_s'] / row['measured_s'] - 1:+.0%})"
              f" | {row['simulated_no_wait_s'] * 1e3:.3f} | "
              f"{row['leftover_per_call_s'] * 1e3:.3f} |")
    print(f"left per call ~ {line['line_intercept_us']:.0f} us + {line['line_slope']:.2f} x "
          f"burst CPU ({world} ranks; the calibrated constant: {line['call_wait_us']:.0f} us)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"topology": str(args.topology), "world": world,
                                     **line, "rows": rows}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
