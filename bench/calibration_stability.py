"""Is calibration stable? Two ``cocodiff calibrate`` runs one after the other, under a real
launcher, and the simulator's prediction of a flat plan on each calibrated topology.

For each launcher (``--launchers``: ``mpiexec``, ``torchrun``), run ``cocodiff calibrate``
twice on ``--ranks`` local ranks described as ``--nodes`` nodes, then simulate the
``--schedule`` schedules (default ``flat``) of ``--model`` at ``--resolution`` on each
topology, and print both predictions and their ratio beside the numbers each calibration
wrote (tile rate, link fits, the host's exchange CPU). The target: predictions within 10%
of each other. Writes JSON (``--json``).

    python bench/calibration_stability.py --json results/calibration_stability.json

Each calibration is a microbenchmark run only; no step time is measured or fitted here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

def _tool(name: str) -> str:
    """``name`` beside this interpreter (a venv's launchers), else on ``PATH``."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which(name, path=search)
    if found is None:
        sys.exit(f"calibration_stability: {name} not found beside {sys.executable} or on PATH")
    return found


LAUNCHERS = {
    "mpiexec": lambda ranks: [_tool("mpiexec"), "-n", str(ranks)],
    "torchrun": lambda ranks: [_tool("torchrun"), "--nproc-per-node", str(ranks)],
}


def calibrate(launcher: str, args: argparse.Namespace, output: Path) -> dict:
    """One calibration under ``launcher``; returns its JSON record."""
    if launcher == "mpiexec":
        command = [*LAUNCHERS[launcher](args.ranks), sys.executable, "-m", "cocodiff",
                   "calibrate", "--transport", "mpi"]
    else:
        command = [*LAUNCHERS[launcher](args.ranks), "-m", "cocodiff", "calibrate"]
    command += ["--nodes", str(args.nodes), "--model", args.model, "--resolution",
                args.resolution, "--output", str(output),
                "--json", str(output.with_suffix(".json"))]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    began = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n"
                         f"{done.stderr[-2000:]}")
    print(done.stdout.strip())
    record = json.loads(output.with_suffix(".json").read_text())
    record["bench_wall_s"] = time.perf_counter() - began
    return record


def predict(topology: Path, args: argparse.Namespace) -> dict[str, float]:
    """Step time per schedule that the simulator predicts on ``topology``."""
    out = topology.with_name(topology.stem + "-sim.json")
    command = [sys.executable, "-m", "cocodiff", "simulate", "--topology", str(topology),
               "--model", args.model, "--resolution", args.resolution, "--steps",
               str(args.steps), "--dtype", "float32", "--schedule", args.schedule,
               "--layout", "pure", "--json", str(out)]
    done = subprocess.run(command, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"simulate failed:\n{done.stderr[-2000:]}")
    return {row["schedule"]: row["step_time_s"] for row in json.loads(out.read_text())["results"]}


def numbers(record: dict, topology: Path) -> dict:
    """What a calibration wrote that the prediction depends on."""
    sys.path.insert(0, str(REPO))
    from topology import load_topology

    spec = load_topology(topology)
    host = spec.host
    return {
        "tile_tflops": spec.tile_tflops,
        "tile_memory_gbps": spec.tile_memory_gbps,
        "intra_latency_us": 2 * spec.gpu_link.latency_us,
        "intra_gbps": spec.gpu_link.bandwidth_gbps,
        "inter_latency_us": 2 * spec.nic_link.latency_us,
        "inter_gbps": spec.nic_link.bandwidth_gbps,
        "call_cpu_us": None if host is None else host.call_cpu_us,
        "message_cpu_us": None if host is None else host.message_cpu_us,
        "copy_gbps": None if host is None else host.copy_gbps,
        "busy_poll": None if host is None else host.busy_poll,
        "cores": None if host is None else host.cores,
        "wait_spin": ((record.get("host") or {}).get("cpu") or {}).get("wait_spin"),
        "calibrate_wall_s": record.get("wall_s"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launchers", default="mpiexec,torchrun")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--model", default="tiny-flux")
    parser.add_argument("--resolution", default="512")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--schedule", default="flat",
                        help="schedules to predict, comma-separated (simulate --schedule)")
    parser.add_argument("--json", type=Path, default=Path("results/calibration_stability.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for launcher in args.launchers.split(","):
            if launcher not in LAUNCHERS:
                parser.error(f"unknown launcher {launcher!r} (valid: {', '.join(LAUNCHERS)})")
            runs = []
            for index in (1, 2):
                topology = Path(scratch) / f"{launcher}-{index}.toml"
                record = calibrate(launcher, args, topology)
                runs.append({"numbers": numbers(record, topology),
                             "predicted_step_s": predict(topology, args),
                             "topology_toml": topology.read_text()})
            for schedule in runs[0]["predicted_step_s"]:
                one, two = (run["predicted_step_s"][schedule] for run in runs)
                rows.append({"launcher": launcher, "schedule": schedule,
                             "first_s": one, "second_s": two, "ratio": two / one})
                print(f"{launcher:9s} {schedule:9s} first {one * 1e3:9.2f} ms  second "
                      f"{two * 1e3:9.2f} ms  ratio {two / one:.3f}")
            for key in runs[0]["numbers"]:
                first, second = (str(run["numbers"][key]) for run in runs)
                print(f"  {key:18s} {first:>24s} {second:>24s}")
            rows.append({"launcher": launcher, "calibrations": runs})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"config": vars(args) | {"json": str(args.json)},
                                     "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
