"""What a call started ahead saves: flat's and V-First's exchange calls timed one by one,
on cores shared by more ranks than it has, beside the simulator's loops of the same shape.

Every rank loops a step's shape, every rank at once: per layer, compute, then Q's, K's and
V's all-to-alls one after the other, compute, the output's (flat); or compute, V's started
ahead, more compute, Q's and K's, V's waited for, compute, the output's (V-First); then the
tail and one more call (the gather). Each call's wall and process CPU is recorded (rank 0's
CPU includes its transport's threads, so a call started ahead shows its CPU spread over
what follows it). With ``--topology`` (a calibrated one: ``cocodiff calibrate --output``)
rank 0 simulates both loops on it, so that a reader sees whether the host model gives
V-First what it measures (issue 38; docs/host-model.md).

    torchrun --nproc-per-node 4 bench/call_ahead.py --topology t.toml --json results/ahead.json
    mpiexec -n 4 python bench/call_ahead.py --topology m.toml
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# CPU ms of tiny-flux's forward on one of 4 ranks, as calibrate's loops time it: per layer
# (before V's call, between V's and Q's, the attention), then the tail.
LAYERS_MS = ((1.4, 0.7, 0.15), (1.1, 0.5, 0.2))
TAIL_MS = 0.35
SCHEDULES = ("flat", "vfirst")


def _layers(text: str) -> tuple[tuple[float, float, float], ...]:
    try:
        layers = tuple(tuple(float(part) for part in layer.split(":"))
                       for layer in text.split(","))
    except ValueError:
        layers = ()
    if not layers or any(len(layer) != 3 or min(layer) < 0 for layer in layers):
        raise argparse.ArgumentTypeError(
            f"expected BEFORE_V:AFTER_V:ATTENTION ms per layer, comma-separated, got {text!r}")
    return layers  # type: ignore[return-value]


class Loop:
    """One rank's loops: bursts of matrix products and the transport's all-to-alls,
    each call's wall and CPU recorded by name."""

    def __init__(self, transport, kib: int, torch) -> None:
        from cocodiff.calibration.loaded import start_all_to_all

        self.transport, self.torch = transport, torch
        # As calibrate's loops start theirs: kib KiB to every other rank.
        self.start = start_all_to_all(transport, transport.world, kib * 1024, torch)
        self.matrix = torch.randn(64, 64)
        self.product_ms = self._product_ms()
        self.wall: dict[str, list[float]] = defaultdict(list)
        self.cpu: dict[str, list[float]] = defaultdict(list)

    def _product_ms(self) -> float:
        for _ in range(50):
            self.matrix @ self.matrix
        began = time.process_time()
        for _ in range(2000):
            self.matrix @ self.matrix
        return (time.process_time() - began) / 2000 * 1e3

    def _timed(self, name: str, work):
        wall, cpu = time.perf_counter(), time.process_time()
        result = work()
        self.wall[name].append(time.perf_counter() - wall)
        self.cpu[name].append(time.process_time() - cpu)
        return result

    def burst(self, name: str, ms: float) -> None:
        def work() -> None:
            for _ in range(max(1, round(ms / self.product_ms))):
                self.matrix @ self.matrix
        self._timed(name, work)

    def call(self, name: str) -> None:
        self._timed(name, lambda: self.start().wait())

    def iteration(self, schedule: str, layers, tail_ms: float) -> None:
        for index, (before_v, after_v, attention) in enumerate(layers):
            name = f"L{index} "
            if schedule == "flat":
                self.burst(name + "compute", before_v + after_v)
                for tensor in ("q", "k", "v"):
                    self.call(name + tensor)
            else:
                self.burst(name + "compute", before_v)
                started = self._timed(name + "v start", self.start)
                self.burst(name + "after v", after_v)
                self.call(name + "q")
                self.call(name + "k")
                self._timed(name + "v wait", started.wait)
            self.burst(name + "attention", attention)
            self.call(name + "out")
        self.burst("tail", tail_ms)
        self.call("gather")


def measure(layers, tail_ms: float, kib: int, iterations: int, rounds: int) -> dict | None:
    """Both loops on every rank (collective), the rounds interleaved; rank 0's record of
    each loop's wall per iteration (the slowest rank's, the median round) and each call's
    wall and CPU (means over ranks and iterations); None on the other ranks."""
    import torch

    from cocodiff.calibration.collect import gather_floats
    from transports.registry import auto_transport_name, create_transport

    torch.set_num_threads(1)
    name = auto_transport_name()
    transport = create_transport(name, **({"timeout_s": 120} if name == "torch" else {}))
    try:
        if transport.world_size < 2:
            raise SystemExit("call_ahead: run it under a launcher with at least 2 ranks "
                             "(mpiexec -n 4 ..., torchrun --nproc-per-node 4 ...)")
        loops = {schedule: Loop(transport, kib, torch) for schedule in SCHEDULES}
        walls: dict[str, list[float]] = defaultdict(list)
        for _ in range(rounds):
            for schedule, loop in loops.items():
                loop.iteration(schedule, layers, tail_ms)  # warm-up, not recorded
                loop.wall.clear()
                loop.cpu.clear()
                transport.barrier()
                began = time.perf_counter()
                for _ in range(iterations):
                    loop.iteration(schedule, layers, tail_ms)
                own = (time.perf_counter() - began) / iterations
                walls[schedule].append(max(row[0] for row in gather_floats(transport, [own])))
        calls = {}
        for schedule, loop in loops.items():
            names = list(loop.wall)
            means = [statistics.mean(loop.wall[n]) for n in names] + [
                statistics.mean(loop.cpu[n]) for n in names]
            rows = gather_floats(transport, means)
            calls[schedule] = {
                n: {"wall_s": statistics.mean(row[i] for row in rows),
                    "cpu_s": statistics.mean(row[len(names) + i] for row in rows)}
                for i, n in enumerate(names)}
        burst_cpu_s = sum(sum(layer) for layer in layers) * 1e-3 + tail_ms * 1e-3
        record = {"world": transport.world_size, "transport": transport.name, "kib": kib,
                  "layers_ms": [list(layer) for layer in layers], "tail_ms": tail_ms,
                  "compute_cpu_s": burst_cpu_s, "iterations": iterations, "rounds": rounds,
                  "measured_s": {s: statistics.median(w) for s, w in walls.items()},
                  "calls": calls}
        return record if transport.rank == 0 else None
    finally:
        transport.close()


def simulate(record: dict, topology_path: Path) -> dict[str, float]:
    """Both loops' wall per iteration simulated on ``topology_path`` (its ``[host]``),
    the compute at the CPU the loops measured for it."""
    from cocodiff.calibration.options import ROW_BYTES
    from cocodiff.commands.plan import AUTO, collective_source
    from cocodiff.cost import Cost, compute_seconds
    from cocodiff.plan.steps import (
        Compute,
        Exchange,
        HeadSplit,
        LayerPlan,
        Plan,
        RankProgram,
        Wait,
    )
    from cocodiff.simulator.simulate import simulate_plan
    from topology import build_topology
    from topology.toml_format import load_topology

    spec = load_topology(topology_path)
    if spec.host is None:
        raise SystemExit(f"call_ahead: {topology_path} has no [host] table (a calibrate "
                         "output has one)")
    collective, _ = collective_source(AUTO, str(topology_path))  # calibrate's, beside it
    world = record["world"]
    group = tuple(range(world))
    rows = max(1, record["kib"] * 1024 // ROW_BYTES)
    seconds_per_tflop = compute_seconds(Cost(1e12, 0.0), spec)

    def compute(schedule: str, name: str) -> Compute:
        cpu_s = record["calls"][schedule][name]["cpu_s"]  # as the loop measured it
        return Compute("mlp", Cost(cpu_s / seconds_per_tflop * 1e12, 0.0))

    def program(schedule: str, rank: int) -> tuple:
        splits = tuple(0 if member == rank else rows for member in group)

        def exchange(tensor: str) -> Exchange:
            return Exchange(tensor, group, splits, splits, ROW_BYTES, "scatter_heads")

        steps: list = []
        for index in range(len(record["layers_ms"])):
            name = f"L{index} "
            if schedule == "flat":
                steps += [compute(schedule, name + "compute")]
                for tensor in ("q", "k", "v"):
                    steps += [exchange(f"{name}{tensor}"), Wait(f"{name}{tensor}")]
            else:
                steps += [compute(schedule, name + "compute"), exchange(name + "v"),
                          compute(schedule, name + "after v"), exchange(name + "q"),
                          Wait(name + "q"), exchange(name + "k"), Wait(name + "k"),
                          Wait(name + "v")]
            steps += [compute(schedule, name + "attention"), exchange(name + "out"),
                      Wait(name + "out")]
        steps += [compute(schedule, "tail"), exchange("gather"), Wait("gather")]
        return (LayerPlan((), tuple(steps), ()),)

    topology = build_topology(spec)
    simulated = {}
    for schedule in SCHEDULES:
        programs = tuple(RankProgram(rank, program(schedule, rank)) for rank in range(world))
        plan = Plan("flat", "call-ahead", HeadSplit(world, world, (1,) * world, 8), programs,
                    shift_period=None)
        simulated[schedule] = simulate_plan(plan, topology, fold=False, collective=collective,
                                            denoising_step=False).step_time_s
    return simulated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", type=Path, default=None,
                        help="a calibrated topology (cocodiff calibrate --output) to simulate "
                        "the loops on (default: measure only)")
    parser.add_argument("--layers", type=_layers,
                        default=",".join(":".join(map(str, layer)) for layer in LAYERS_MS),
                        help="per layer, CPU ms before V's call, between V's and Q's, and of "
                        "the attention, as BEFORE:AFTER:ATTENTION, comma-separated (default: "
                        "tiny-flux on one of 4 ranks)")
    parser.add_argument("--tail", type=float, default=TAIL_MS,
                        help="CPU ms after the last layer, before the gather")
    parser.add_argument("--kib", type=int, default=4, help="KiB per peer per call")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=REPO / "results" / "call_ahead.json")
    args = parser.parse_args(argv)
    if args.topology is not None and not args.topology.is_file():
        parser.error(f"--topology {args.topology}: no such file")
    if min(args.kib, args.iterations, args.rounds) < 1 or args.tail < 0:
        parser.error("--kib, --iterations and --rounds take positive counts, --tail >= 0 ms")
    record = measure(args.layers, args.tail, args.kib, args.iterations, args.rounds)
    if record is None:  # another rank than 0
        return 0
    if args.topology is not None:
        record["topology"] = str(args.topology)
        record["simulated_s"] = simulate(record, args.topology)
    flat, first = (record["calls"][s] for s in SCHEDULES)
    print(f"{record['world']} ranks over {record['transport']}, {record['kib']} KiB per peer; "
          "mean per call over ranks, wall / process CPU ms")
    print("| call | flat | vfirst |")
    print("|---|---:|---:|")
    for name in dict.fromkeys([*flat, *first]):
        cells = [f"{c[name]['wall_s'] * 1e3:.3f} / {c[name]['cpu_s'] * 1e3:.3f}" if name in c
                 else "" for c in (flat, first)]
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    measured = record["measured_s"]
    print(f"iteration (slowest rank, median round): flat {measured['flat'] * 1e3:.2f} ms, "
          f"vfirst {measured['vfirst'] * 1e3:.2f} ms: vfirst / flat "
          f"{measured['vfirst'] / measured['flat']:.3f}")
    if "simulated_s" in record:
        simulated = record["simulated_s"]
        print(f"simulated on {args.topology}: flat {simulated['flat'] * 1e3:.2f} ms "
              f"({simulated['flat'] / measured['flat'] - 1:+.0%}), vfirst "
              f"{simulated['vfirst'] * 1e3:.2f} ms "
              f"({simulated['vfirst'] / measured['vfirst'] - 1:+.0%}): vfirst / flat "
              f"{simulated['vfirst'] / simulated['flat']:.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
