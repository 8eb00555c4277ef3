"""What the emulated cluster's shapers saw during real runs: packets dropped and bytes
sent, per schedule, summed over every node's and every switch port's ``tbf`` (``tc -s
qdisc``, read before and after each run on one cluster).

    python bench/shaper_drops.py --nodes 4 --ranks-per-node 2 --gbit 0.05 \\
        --layers 1 --single-layers 1 --resolution 512 --schedules flat,diffusers \\
        --json results/shaper_drops.json

Each schedule runs ``cocodiff run`` once across the cluster (gloo), on an enlarged tiny
FLUX (:class:`bench.emulated_speedup.EnlargedModel`). Drops at the shaper mean the link
lost what the simulator's links never lose (docs/validate.md, "The emulated link dropped
packets"). Needs root with ``ip`` and ``tc``, as every emulated-cluster tool.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO))

from bench.cluster import ClusterSpec, EmulatedCluster  # noqa: E402
from bench.cluster.jobs import run_job  # noqa: E402
from bench.emulated_speedup import (  # noqa: E402
    EnlargedModel,
    add_model_arguments,
    export_enlarged,
    run_reporting_failures,
)


def shaper_counters(cluster: EmulatedCluster) -> tuple[int, int]:
    """``(packets dropped, bytes sent)`` so far, summed over the cluster's qdiscs."""
    namespaces = [node.namespace for node in cluster.nodes] + [cluster.switch_namespace]
    text = "\n".join(subprocess.run(["tc", "-s", "-n", namespace, "qdisc", "show"],
                                    capture_output=True, text=True, check=True).stdout
                     for namespace in namespaces)
    return (sum(int(n) for n in re.findall(r"dropped (\d+)", text)),
            sum(int(n) for n in re.findall(r"Sent (\d+) bytes", text)))


def measure(args: argparse.Namespace) -> int:
    model = EnlargedModel(heads=args.heads, head_dim=args.head_dim, layers=args.layers,
                          single_layers=args.single_layers, resolution=args.resolution)
    work = Path(tempfile.mkdtemp(prefix="cocodiff-shaper-drops-"))
    model_dir = export_enlarged(model, work / "model")
    rows = []
    with EmulatedCluster(ClusterSpec(args.nodes, args.ranks_per_node, args.gbit)) as cluster:
        for schedule in args.schedules.split(","):
            dropped, sent = shaper_counters(cluster)
            command = [sys.executable, "-m", "cocodiff", "run", "--model", str(model_dir),
                       "--resolution", str(model.resolution), "--steps", str(args.steps),
                       "--schedule", schedule, "--transport", "torch", "--quiet"]
            run_job(cluster, command, "torch", timeout_s=args.timeout,
                    log_dir=work / f"logs-{schedule}")
            dropped_after, sent_after = shaper_counters(cluster)
            rows.append({"schedule": schedule, "dropped_packets": dropped_after - dropped,
                         "sent_bytes": sent_after - sent})
            print(f"{schedule}: {rows[-1]['dropped_packets']} packets dropped, "
                  f"{rows[-1]['sent_bytes'] / 1e6:.2f} MB sent by the shapers", flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "gbit": args.gbit,
            "steps": args.steps, "model": dataclasses.asdict(model), "rows": rows}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shaper_drops.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--gbit", type=float, default=0.05)
    parser.add_argument("--schedules", default="flat,diffusers")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    parser.add_argument("--json", type=Path)
    add_model_arguments(parser)
    return run_reporting_failures("shaper_drops.py", measure, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
