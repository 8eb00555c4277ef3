"""Where a real denoising step's time and CPU go, per rank: the evidence behind the host
model's terms (docs/host-model.md).

Run under a launcher, every rank on this machine:

    torchrun --nproc-per-node 4 bench/step_cpu.py --model DIR --resolution 256 \\
        --schedules flat,tapa,diffusers --grid 2x2x1 --json results/step_cpu.json

For each schedule (rounds interleave them), one generation per round; per step (the first
left out, medians over the rest and the rounds) each rank reports its wall time and
process CPU (every thread), and how the CPU splits: the transformer blocks, the plan's
compute steps inside the attention processor, each exchange's start (packing, posting),
wait and finish (unpacking), the forward's work outside the blocks, how long its
threads waited runnable for a core (Linux schedstat, every thread), and the core-seconds
the whole machine left idle (``/proc/stat``: a step that is a queue for the cores leaves
none). Timers wrap the runtime's backend methods and forward hooks; they cost a few
microseconds per call. ``diffusers`` (its own context parallelism) has no backend: its
exchange calls (``_all_to_all_single``: the collective and its wait) are timed as the wait,
and their packing stays in the blocks' CPU. With ``--standin`` the same steps run over
calibrate's stand-in transport (nothing communicated, every rank computing at once): what
calibrate times.
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
sys.path.insert(0, str(REPO))

# What the timers accumulate (process CPU seconds), and what a step reports.
METERED = ("forward_cpu", "blocks_cpu", "plan_compute_cpu", "exchange_start_cpu",
           "exchange_wait_cpu", "exchange_finish_cpu")
PARTS = ("wall", "cpu", *METERED[1:], "outside_blocks_cpu", "comm_wait_wall", "runqueue_wait",
         "machine_idle")


def runqueue_wait_s() -> float:
    """Seconds this process's threads have waited runnable for a core (Linux
    ``/proc/self/task/*/schedstat``, second field); 0 where it cannot be read."""
    total_ns = 0
    for stat in Path("/proc/self/task").glob("*/schedstat"):
        try:
            total_ns += int(stat.read_text().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total_ns * 1e-9


def machine_idle_s() -> float:
    """Core-seconds this machine's cores have idled since boot, every core summed (Linux
    ``/proc/stat``: idle and iowait); 0 where it cannot be read. Per step it says whether
    the ranks left the cores idle or queued for them."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        return (int(fields[3]) + int(fields[4])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class CpuMeter:
    """Process CPU accumulated per part, and the wall time of diffusers' exchange calls."""

    def __init__(self) -> None:
        self.cpu_s: dict[str, float] = dict.fromkeys(METERED, 0.0)
        self.baseline_comm_s = 0.0

    def timed(self, part: str, function):
        def wrapper(*args, **kwargs):
            began = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.cpu_s[part] += time.process_time() - began
        return wrapper


def instrument(meter: CpuMeter) -> None:
    """Wrap the runtime's backend: the plan's compute steps and each exchange's parts."""
    from cocodiff.runtime import backend

    for method, part in (("compute", "plan_compute_cpu"), ("start_exchange", "exchange_start_cpu"),
                         ("finish_exchange", "exchange_finish_cpu")):
        setattr(backend.TensorBackend, method,
                meter.timed(part, getattr(backend.TensorBackend, method)))
    backend.TimedHandle.wait = meter.timed("exchange_wait_cpu", backend.TimedHandle.wait)


def instrument_diffusers(meter: CpuMeter) -> None:
    """Wrap diffusers' Ulysses exchange (its attention looks the function up at each call):
    its CPU as the wait's, its wall time as the step's communication wait."""
    from diffusers.models import attention_dispatch

    timed = meter.timed("exchange_wait_cpu", attention_dispatch._all_to_all_single)

    def exchange(*args, **kwargs):
        began = time.perf_counter()
        try:
            return timed(*args, **kwargs)
        finally:
            meter.baseline_comm_s += time.perf_counter() - began

    attention_dispatch._all_to_all_single = exchange


def hook_blocks(transformer, meter: CpuMeter) -> None:
    """CPU inside the transformer blocks, and inside the forward as a whole."""
    began: dict[int, float] = {}

    def enter(module, *_args):
        began[id(module)] = time.process_time()

    def leave(part):
        def hook(module, *_args):
            meter.cpu_s[part] += time.process_time() - began[id(module)]
        return hook

    blocks = [module for name, module in transformer.named_children() if "blocks" in name]
    for block_list in blocks:
        for block in block_list:
            block.register_forward_pre_hook(enter)
            block.register_forward_hook(leave("blocks_cpu"))
    transformer.register_forward_pre_hook(enter)
    transformer.register_forward_hook(leave("forward_cpu"))


def generation(transport, args, schedule: str, grid, meter: CpuMeter) -> list[dict[str, float]]:
    """One generation of ``schedule``; per step, each part's seconds."""
    import torch

    from cocodiff.runtime.baseline import DIFFUSERS, enable_diffusers_ulysses
    from cocodiff.runtime.parallel import parallelize
    from cocodiff.runtime.pipelines import load_pipeline, run_pipeline

    pipe = load_pipeline(args.model, torch.float32)
    if args.standin:
        from cocodiff.calibration.standin import StandInTransport

        transport = StandInTransport(transport.rank, transport.world_size)
    runtime = None
    if schedule == DIFFUSERS:
        enable_diffusers_ulysses(pipe, transport)
    else:
        runtime = parallelize(pipe, transport, schedule, grid)
    meter.cpu_s["forward_cpu"] = 0.0
    hook_blocks(pipe.transformer, meter)
    steps: list[dict[str, float]] = []

    def reading() -> dict[str, float]:
        """Every counter a step's row is the difference of."""
        comm = meter.baseline_comm_s if schedule == DIFFUSERS else runtime.comm_s
        return {"wall": time.perf_counter(), "cpu": time.process_time(), "comm": comm,
                "runqueue": runqueue_wait_s(), "idle": machine_idle_s(), **dict(meter.cpu_s)}

    last = reading()

    def step_done(_done: int, _total: int) -> None:
        now = reading()
        row = {part: now[part] - last[part] for part in METERED}
        row["wall"], row["cpu"] = now["wall"] - last["wall"], now["cpu"] - last["cpu"]
        row["comm_wait_wall"] = now["comm"] - last["comm"]
        row["runqueue_wait"] = now["runqueue"] - last["runqueue"]
        row["machine_idle"] = now["idle"] - last["idle"]
        row["outside_blocks_cpu"] = (now["forward_cpu"] - last["forward_cpu"]
                                     - row["blocks_cpu"])
        steps.append(row)
        last.update(now)

    start = getattr(runtime, "start_generation", None)
    if start is not None:
        start(args.steps)
    transport.barrier()
    last.update(reading())
    size = int(args.resolution)
    with torch.no_grad():
        run_pipeline(pipe, "a lighthouse", args.steps, size, size, 1, 0, step_done,
                     max_sequence_length=args.text_tokens)
    return steps[1:]  # the first step warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-flux")
    parser.add_argument("--resolution", default="256")
    parser.add_argument("--schedules", default="flat,tapa")
    parser.add_argument("--grid", default=None, help="NODESxGPUSxTILES (default: one node)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--text-tokens", type=int, default=16)
    parser.add_argument("--standin", action="store_true",
                        help="run the steps over calibrate's stand-in transport (nothing is "
                             "communicated; every rank computes alone, all at once)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from cocodiff.schedules import RankGrid
    from transports.registry import create_transport

    transport = create_transport("torch")
    grid = None
    if args.grid:
        shape = tuple(int(v) for v in args.grid.split("x"))
        grid = RankGrid(shape, tuple(range(transport.world_size)))
    meter = CpuMeter()
    instrument(meter)
    instrument_diffusers(meter)
    schedules = args.schedules.split(",")
    rows: dict[str, list[dict[str, float]]] = {s: [] for s in schedules}
    for _ in range(args.rounds):
        for schedule in schedules:
            rows[schedule] += generation(transport, args, schedule, grid, meter)
    # /proc/stat counts in clock ticks (10 ms): its per-step figure is a mean, not a median.
    mine = {s: {part: (statistics.fmean if part == "machine_idle" else statistics.median)(
                    [r[part] for r in steps]) for part in PARTS}
            for s, steps in rows.items()}
    import torch.distributed as dist

    everyone: list = [None] * transport.world_size
    dist.all_gather_object(everyone, mine)
    if transport.rank == 0:
        print(f"per step, ms (median over {args.rounds} x {args.steps - 1} steps); "
              f"{transport.world_size} ranks")
        print(f"{'schedule':9s} {'rank':>4s} " + " ".join(f"{p[:14]:>14s}" for p in PARTS))
        for schedule in schedules:
            for rank, parts in enumerate(everyone):
                print(f"{schedule:9s} {rank:4d} "
                      + " ".join(f"{parts[schedule][p] * 1e3:14.2f}" for p in PARTS))
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "ranks": everyone}, indent=2))
    # Every rank past the report before any closes: a rank that tore its groups down while
    # rank 0 still wrote was aborted by gloo at exit ("terminate called without an active
    # exception").
    transport.barrier()
    transport.close()


if __name__ == "__main__":
    main()
