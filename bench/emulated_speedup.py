"""Measured step times of Ulysses schedules on an emulated cluster, next to the simulator's
prediction for them from a calibrated topology.

1. Enlarge a built-in tiny model so that communication matters (more heads' width, more
   layers, more tokens; same family, same text encoders and VAE), and save it as a
   diffusers directory that ``cocodiff run --model DIR`` loads.
2. Build the emulated cluster (``bench.cluster``: nodes = network namespaces, inter-node
   links shaped with ``tc``), and run ``cocodiff calibrate`` across it at the enlarged
   model's layer shapes: the calibrated topology TOML.
3. Run ``cocodiff run`` of each schedule, schedules interleaved, ``--repeats`` rounds, and
   record every step time (the first step of each run is left out: it builds plans and
   warms caches).
4. Simulate the same plans on the calibrated topology (the collective model's per-transfer
   start-up measured by calibrate, one engine) and report each schedule's predicted step
   time and its error against the measured median.

Writes JSON (default ``results/emulated_speedup.json``) and prints a table.

    python bench/emulated_speedup.py --schedules flat --repeats 3
    python bench/emulated_speedup.py --schedules flat,tapa,vfirst,cocodiff --gbit 1 \\
        --nodes 2 --ranks-per-node 2

Needs root (network namespaces, tc).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO))

from bench.cluster import ClusterError, ClusterSpec, EmulatedCluster  # noqa: E402
from bench.cluster.jobs import JOB_RUNNERS, JobFailed, run_job  # noqa: E402


@dataclasses.dataclass(frozen=True, slots=True)
class EnlargedModel:
    """How a tiny model is enlarged.

    Attributes:
        base: the tiny model it starts from (its family, text encoders and VAE).
        heads: attention heads (a multiple of the number of ranks).
        head_dim: channels per head; hidden size = ``heads * head_dim``.
        layers: transformer blocks (FLUX: double-stream blocks).
        single_layers: FLUX's single-stream blocks.
        resolution: image side in pixels (16 px per image token).
    """

    base: str = "tiny-flux"
    heads: int = 4
    head_dim: int = 32
    layers: int = 2
    single_layers: int = 4
    resolution: int = 512

    @property
    def hidden_size(self) -> int:
        return self.heads * self.head_dim


def _flux_transformer(model: EnlargedModel):
    from diffusers import FluxTransformer2DModel

    # RoPE over (text index, row, column): the axes share the head's channels 1:3:3 /4
    # halves, each even, as the tiny model's (4, 6, 6) for 16 channels.
    quarter = model.head_dim // 4
    rope = (quarter, (model.head_dim - quarter) // 2, (model.head_dim - quarter) // 2)
    if model.head_dim % 8 or sum(rope) != model.head_dim:
        raise ValueError(f"FLUX head_dim must be a multiple of 8, got {model.head_dim}")
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # as the tiny model: 16 latent channels packed 2x2
        num_layers=model.layers,
        num_single_layers=model.single_layers,
        attention_head_dim=model.head_dim,
        num_attention_heads=model.heads,
        joint_attention_dim=32,  # the tiny T5's width
        pooled_projection_dim=32,  # the tiny CLIP's width
        guidance_embeds=True,
        axes_dims_rope=rope,
    )


# Tiny model -> builder of its enlarged transformer (same constructor arguments the tiny
# pipeline's text encoders and VAE expect).
ENLARGERS = {"tiny-flux": _flux_transformer}


def export_enlarged(model: EnlargedModel, directory: Path) -> Path:
    """Save the tiny pipeline with an enlarged transformer (weights from a fixed seed).

    The directory is marked as the tiny model (``cocodiff_tiny.json``), so ``cocodiff run``
    keeps the tiny model's short prompt length.
    """
    import torch

    from cocodiff.runtime.pipelines import TINY_MARKER
    from cocodiff.runtime.tiny import build_tiny

    if model.base not in ENLARGERS:
        raise ValueError(f"cannot enlarge {model.base!r}; valid: {', '.join(ENLARGERS)}")
    pipe = build_tiny(model.base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = ENLARGERS[model.base](model).eval()
    pipe.register_modules(transformer=transformer)
    pipe.save_pretrained(directory, safe_serialization=True)
    (directory / TINY_MARKER).write_text(json.dumps({"tiny_model": model.base}))
    return directory


def model_spec(directory: Path, model: EnlargedModel):
    """The simulator's spec of the enlarged model (the tiny pipeline's text length)."""
    from cocodiff.models import load_model_spec
    from cocodiff.runtime.tiny import TINY_DEFAULTS

    spec = load_model_spec(str(directory))
    text = TINY_DEFAULTS[model.base].max_sequence_length if spec.text_tokens else 0
    return dataclasses.replace(spec, name=f"{model.base}-enlarged", text_tokens=text)


def predict(schedules: list[str], spec, resolution: int, topology_path: Path, steps: int,
            dtype_bytes: int, startup_us: float) -> dict[str, dict[str, Any]]:
    """Simulated step time of each schedule on the calibrated topology, averaged over the
    steps that are measured (all but the first)."""
    from cocodiff.schedules import RankGrid, plan_for_step
    from cocodiff.simulate import simulate_plan
    from topology import Placement, build_topology, load_topology
    from transports.sim import CollectiveModel

    topology = build_topology(load_topology(topology_path))
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    streams = (spec.image_tokens(resolution, resolution), spec.text_tokens)
    collective = CollectiveModel("calibrated", startup_us=startup_us, engines=1)
    out = {}
    for name in schedules:
        results = [
            simulate_plan(plan_for_step(name, spec, grid, streams, step, steps,
                                        dtype_bytes=dtype_bytes),
                          topology, placement, collective=collective)
            for step in range(1, steps)
        ]
        out[name] = {
            "predicted_step_s": statistics.fmean(r.step_time_s for r in results),
            "predicted_compute_s": statistics.fmean(r.compute_s for r in results),
            "predicted_comm_exposed_s": statistics.fmean(r.comm_exposed_s for r in results),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--gbit", type=float, default=1.0,
                        help="inter-node rate, Gbit/s per direction (default 1)")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="inter-node one-way delay (needs netem; default 0)")
    parser.add_argument("--schedules", default="flat",
                        help="comma-separated schedules, run interleaved (default: flat)")
    parser.add_argument("--transport", default="torch", choices=sorted(JOB_RUNNERS))
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the schedules")
    parser.add_argument("--steps", type=int, default=6,
                        help="denoising steps per run; the first is not counted (default 6)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--base", default="tiny-flux", choices=sorted(ENLARGERS))
    defaults = EnlargedModel()
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--single-layers", type=int, default=defaults.single_layers)
    parser.add_argument("--resolution", type=int, default=defaults.resolution)
    parser.add_argument("--calibration", type=Path, default=None,
                        help="use this calibrated topology TOML (with its --json beside it as "
                        "NAME.json) instead of calibrating")
    parser.add_argument("--timeout", type=float, default=600.0, help="per job, seconds")
    parser.add_argument("--json", type=Path, default=REPO / "results" / "emulated_speedup.json")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (ClusterError, ValueError) as error:
        kind = "job failed" if isinstance(error, JobFailed) else "error"
        print(f"emulated_speedup: {kind}: {error}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    schedules = [name.strip() for name in args.schedules.split(",") if name.strip()]
    if not schedules:
        raise ValueError("--schedules names no schedule")
    if args.steps < 2:
        raise ValueError(f"--steps must be at least 2 (the first is not counted), got {args.steps}")
    from cocodiff.schedules import get_schedule

    for name in schedules:
        get_schedule(name)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    model = EnlargedModel(args.base, args.heads, args.head_dim, args.layers, args.single_layers,
                          args.resolution)
    cluster_spec = ClusterSpec(args.nodes, args.ranks_per_node, args.gbit, args.delay_ms)
    work = Path(tempfile.mkdtemp(prefix="cocodiff-emulated-speedup-"))
    model_dir = export_enlarged(model, work / "model")
    spec = model_spec(model_dir, model)
    tokens = spec.sequence_tokens(args.resolution, args.resolution)
    image_tokens = spec.image_tokens(args.resolution, args.resolution)
    print(f"model: {spec.name}, {tokens} tokens ({image_tokens} image + {spec.text_tokens} "
          f"text at {args.resolution}px), hidden {spec.hidden_size} "
          f"({spec.num_heads} heads x {spec.head_dim}), {spec.num_layers} layers "
          f"({model.layers} double + {model.single_layers} single), {args.dtype}", flush=True)
    common = ["--model", str(model_dir), "--resolution", str(args.resolution)]
    runs: list[dict[str, Any]] = []
    with EmulatedCluster(cluster_spec) as cluster:
        cluster.write_topology(work / "emulated.toml")
        if args.calibration is None:
            calibration = work / "calibrated.toml"
            began = time.monotonic()
            run_job(cluster, [sys.executable, "-m", "cocodiff", "calibrate", *common,
                              "--dtype", args.dtype, "--transport", args.transport,
                              "--output", str(calibration),
                              "--json", str(calibration.with_suffix(".json"))],
                    args.transport, timeout_s=args.timeout, log_dir=work / "calibrate-logs")
            print(f"calibrated in {time.monotonic() - began:.0f} s -> {calibration}", flush=True)
        else:
            calibration = args.calibration
        for repeat in range(args.repeats):
            for name in schedules:
                out = work / f"run-{name}-{repeat}.json"
                result = run_job(
                    cluster,
                    [sys.executable, "-m", "cocodiff", "run", *common, "--steps", str(args.steps),
                     "--schedule", name, "--transport", args.transport, "--dtype", args.dtype,
                     "--quiet", "--json", str(out)],
                    args.transport, timeout_s=args.timeout, log_dir=work / f"logs-{name}-{repeat}",
                )
                record = json.loads(out.read_text())
                counted = record["step_times_s"][1:]
                runs.append({"schedule": name, "repeat": repeat, "wall_s": result.wall_s,
                             "step_times_s": record["step_times_s"],
                             "median_step_s": statistics.median(counted),
                             "comm_s": record.get("comm_s")})
                print(f"  {name} round {repeat + 1}: median step "
                      f"{runs[-1]['median_step_s'] * 1e3:.1f} ms over {len(counted)} steps",
                      flush=True)
    calibration_json = calibration.with_suffix(".json")
    startup_us = 0.0
    if calibration_json.is_file():
        startup_us = json.loads(calibration_json.read_text()).get("collective", {}).get(
            "startup_us", 0.0)
    dtype_bytes = 2 if args.dtype == "bfloat16" else 4
    predicted = predict(schedules, spec, args.resolution, calibration, args.steps, dtype_bytes,
                        startup_us)
    summary = {}
    for name in schedules:
        medians = [r["median_step_s"] for r in runs if r["schedule"] == name]
        measured = statistics.median(medians)
        summary[name] = {"measured_step_s": measured, "min_step_s": min(medians),
                         "max_step_s": max(medians), **predicted[name],
                         "error": predicted[name]["predicted_step_s"] / measured - 1}
    if "flat" in summary:
        for row in summary.values():
            row["measured_speedup_over_flat"] = summary["flat"]["measured_step_s"] / row[
                "measured_step_s"]
            row["predicted_speedup_over_flat"] = summary["flat"]["predicted_step_s"] / row[
                "predicted_step_s"]
    report = {
        "cluster": dataclasses.asdict(cluster_spec),
        "transport": args.transport,
        "model": {**dataclasses.asdict(model), "hidden_size": spec.hidden_size,
                  "num_layers": spec.num_layers, "tokens": tokens, "dtype": args.dtype},
        "steps": args.steps,
        "repeats": args.repeats,
        "calibration": {"topology": calibration.read_text(), "startup_us": startup_us},
        "runs": runs,
        "summary": summary,
    }
    args.json.write_text(json.dumps(report, indent=2))
    print(f"{'schedule':>10} {'measured':>10} {'(min-max)':>17} {'predicted':>10} {'error':>7}")
    for name, row in summary.items():
        print(f"{name:>10} {row['measured_step_s'] * 1e3:8.1f}ms "
              f"({row['min_step_s'] * 1e3:6.1f}-{row['max_step_s'] * 1e3:6.1f}ms) "
              f"{row['predicted_step_s'] * 1e3:8.1f}ms {row['error']:+7.0%}")
    print(f"wrote {args.json} (work files in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
