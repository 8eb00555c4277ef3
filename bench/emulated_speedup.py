"""Measured step times of Ulysses schedules and of diffusers' own context parallelism on an
emulated cluster, next to the simulator's prediction for each from a calibrated topology.

1. Enlarge a built-in tiny model so that communication matters (more heads, more layers,
   more tokens; same family, same text encoders and VAE), and save it as a diffusers
   directory that ``cocodiff run --model DIR`` loads. Run it once in one process in
   float32: the reference latents.
2. For each configuration (``--configs``: nodes x ranks per node @ inter-node Gbit/s),
   build the emulated cluster (``bench.cluster``: nodes = network namespaces, inter-node
   links shaped with ``tc``) and run ``cocodiff calibrate`` across it at the enlarged
   model's shapes: the calibrated topology TOML and collective model.
3. Run every schedule (``flat``, ``tapa``, ``vfirst``, ``cocodiff`` and ``diffusers``, i.e.
   ``ContextParallelConfig(ulysses_degree=P)`` on the same model, weights and inputs)
   ``--repeats`` rounds, interleaved, the order rotated every round, in one launch across
   the cluster (``bench/emulated_session.py``); every step time is recorded, the first
   step of each run left out (it builds plans and warms caches).
4. Check that the exact schedules' final latents (round 1, float32) equal the
   single-process reference within 1e-5; with ``--dtype bfloat16`` a second, float32
   session of the exact schedules does the check.
5. Simulate each schedule's plans (diffusers: the flat plan, which is what it does) on the
   calibrated topology with the calibrated collective model, and report each predicted
   step time and its error against the measured median.

Writes JSON (default ``results/emulated_speedup.json``), prints a table per configuration,
and with ``--plot`` draws measured against predicted step times
(``bench/emulated_report.py`` prints the README's table from the JSON).

    python bench/emulated_speedup.py --plot docs/emulated_speedup.png     # ~15-20 min
    python bench/emulated_speedup.py --configs 2x2@1 --repeats 1 --steps 2 \\
        --quick-calibration --heads 4 --head-dim 16 --layers 1 --single-layers 1 \\
        --resolution 128                                                 # ~2 min smoke

Needs root (network namespaces, tc).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO))

from bench.cluster import ClusterError, ClusterSpec, EmulatedCluster  # noqa: E402
from bench.cluster.jobs import JobFailed, run_job  # noqa: E402
from bench.emulated_report import plot, text_table  # noqa: E402
from cocodiff.schedules.registry import BASELINE  # noqa: E402
from cocodiff.schedules.registry import EXACT as PLAN_EXACT  # noqa: E402


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
    heads: int = 8  # 8 ranks (4 x 2) split them evenly, as diffusers' Ulysses requires
    head_dim: int = 16
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

    from cocodiff.models import TINY_MARKER
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


# Schedules the simulator predicts with another schedule's plan: diffusers' context
# parallelism is flat Ulysses (Q's, K's and V's all-to-alls over all ranks, each waited
# before the next starts, then the output's), exactly our flat plan.
PLAN_OF = {"diffusers": BASELINE}
# Schedules whose output must equal single-process diffusers (float32, atol 1e-5).
EXACT = (*PLAN_EXACT, "diffusers")
EXACT_ATOL = 1e-5
DEFAULT_CONFIGS = "2x2@1,2x2@5,4x2@1,4x2@5"
DEFAULT_SCHEDULES = "flat,tapa,vfirst,cocodiff,diffusers"


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """One emulated cluster: ``nodes`` x ``ranks_per_node`` ranks, inter-node ``gbit``."""

    nodes: int
    ranks_per_node: int
    gbit: float

    @property
    def label(self) -> str:
        return f"{self.nodes}x{self.ranks_per_node}@{self.gbit:g}"

    @property
    def layout(self) -> str:
        return f"{self.nodes}x{self.ranks_per_node}x1"


def parse_configs(text: str) -> list[Config]:
    """``NODESxRANKS@GBIT[,...]`` -> configurations (e.g. ``2x2@1,4x2@5``)."""
    configs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        shape, at, gbit = item.partition("@")
        parts = shape.lower().split("x")
        try:
            nodes, ranks = (int(part) for part in parts)
            rate = float(gbit)
        except ValueError:
            nodes = ranks = 0
            rate = 0.0
        if not at or len(parts) != 2 or nodes < 1 or ranks < 1 or not rate > 0:
            raise ValueError(f"--configs item {item!r} is not NODESxRANKS@GBIT (e.g. 2x2@1)")
        configs.append(Config(nodes, ranks, rate))
    if not configs:
        raise ValueError("--configs names no configuration")
    return configs


def predict(schedules: list[str], spec, resolution: int, topology_path: Path, steps: int,
            dtype: str, collective, tile_tflops: float | None = None
            ) -> dict[str, dict[str, Any]]:
    """Simulated step time of each schedule on the calibrated topology, averaged over the
    steps that are measured (all but the first); ``tile_tflops`` replaces the topology's
    compute rate (e.g. calibrate's matrix-product rate, to compare with the real blocks')."""
    from cocodiff.schedules import PlanOptions, RankGrid, plan_for_step
    from cocodiff.simulator.simulate import simulate_plan
    from topology import Placement, build_topology, load_topology

    described = load_topology(topology_path)
    if tile_tflops is not None:
        described = dataclasses.replace(described, tile_tflops=tile_tflops)
    topology = build_topology(described)
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    streams = (spec.image_tokens(resolution, resolution), spec.text_tokens)
    out = {}
    for name in schedules:
        plan_name = PLAN_OF.get(name, name)
        results = [
            simulate_plan(plan_for_step(plan_name, spec, grid, streams,
                                        PlanOptions(dtype=dtype), step, steps),
                          topology, placement, collective=collective)
            for step in range(1, steps)
        ]
        out[name] = {
            "predicted_with_plan": plan_name,
            "predicted_step_s": statistics.fmean(r.step_time_s for r in results),
            "predicted_compute_s": statistics.fmean(r.compute_s for r in results),
            "predicted_comm_exposed_s": statistics.fmean(r.comm_exposed_s for r in results),
        }
    return out


def collective_model(calibration_json: Path):
    """The simulator's collective model as calibrate fitted it (links only if it did
    not)."""
    from transports.sim import CollectiveModel

    measured = {}
    if calibration_json.is_file():
        measured = json.loads(calibration_json.read_text()).get("collective") or {}
    return CollectiveModel.from_json(measured, "calibrated")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="clusters to measure, NODESxRANKS@GBIT comma-separated "
                        f"(default {DEFAULT_CONFIGS})")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="inter-node one-way delay (needs netem; default 0)")
    parser.add_argument("--schedules", default=DEFAULT_SCHEDULES,
                        help="comma-separated schedules, run interleaved; 'diffusers' is "
                        f"diffusers' own context parallelism (default: {DEFAULT_SCHEDULES})")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the schedules")
    parser.add_argument("--steps", type=int, default=6,
                        help="denoising steps per run; the first is not counted (default 6)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="(default float32; the equality check always runs in float32)")
    parser.add_argument("--base", default="tiny-flux", choices=sorted(ENLARGERS))
    add_model_arguments(parser)
    parser.add_argument("--quick-calibration", action="store_true",
                        help="calibrate with fewer sizes and repeats")
    parser.add_argument("--timeout", type=float, default=600.0, help="per job, seconds")
    parser.add_argument("--json", type=Path, default=REPO / "results" / "emulated_speedup.json")
    parser.add_argument("--plot", type=Path, default=None, help="write the plot (PNG) here")
    return run_reporting_failures("emulated_speedup", _run, parser.parse_args(argv))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """How the tiny model is enlarged (:class:`EnlargedModel`)."""
    defaults = EnlargedModel()
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--single-layers", type=int, default=defaults.single_layers)
    parser.add_argument("--resolution", type=int, default=defaults.resolution)


def run_reporting_failures(prog: str, run, args: argparse.Namespace) -> int:
    """``run(args)``; a cluster, job or reference-run failure is one line and exit 1."""
    try:
        return run(args)
    except (ClusterError, ValueError) as error:
        kind = "job failed" if isinstance(error, JobFailed) else "error"
        print(f"{prog}: {kind}: {error}", file=sys.stderr)
        return 1
    except subprocess.SubprocessError as error:  # the single-process reference run
        print(f"{prog}: reference run failed: {error}", file=sys.stderr)
        return 1


def _check_schedules(text: str) -> list[str]:
    from cocodiff.runtime.baseline import BASELINES
    from cocodiff.schedules import get_schedule

    schedules = [name.strip() for name in text.split(",") if name.strip()]
    if not schedules:
        raise ValueError("--schedules names no schedule")
    for name in schedules:
        if name not in BASELINES:
            try:
                get_schedule(name)
            except ValueError as error:
                raise ValueError(f"{error}, or a baseline: {', '.join(BASELINES)}") from None
    if len(set(schedules)) != len(schedules):
        raise ValueError(f"--schedules repeats a schedule: {text}")
    return schedules


def _run(args: argparse.Namespace) -> int:
    schedules = _check_schedules(args.schedules)
    configs = parse_configs(args.configs)
    if args.steps < 2:
        raise ValueError(f"--steps must be at least 2 (the first is not counted), got {args.steps}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    began = time.monotonic()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    model = EnlargedModel(args.base, args.heads, args.head_dim, args.layers, args.single_layers,
                          args.resolution)
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
    # The equality check: every exact schedule's final latents against one single-process
    # run, in float32. With --dtype float32 the timed runs of round 1 are those runs.
    check_steps = args.steps if args.dtype == "float32" else 2
    reference = work / "reference.pt"
    subprocess.run([sys.executable, "-m", "cocodiff", "run", *common, "--steps",
                    str(check_steps), "--dtype", "float32", "--quiet",
                    # the sessions save run_pipeline's latents as they are (unpacked)
                    "--latents-format", "unpacked", "--save-latents", str(reference)],
                   check=True, env=_single_process_env(), cwd=REPO,
                   stdin=subprocess.DEVNULL, timeout=args.timeout)
    report_configs = []
    notes: list[str] = []
    for config in configs:
        report_configs.append(_measure_config(args, config, schedules, model_dir, spec, common,
                                              work, reference, check_steps, notes))
    report = {
        "model": {**dataclasses.asdict(model), "name": spec.name,
                  "hidden_size": spec.hidden_size, "num_heads": spec.num_heads,
                  "num_layers": spec.num_layers, "tokens": tokens, "image_tokens": image_tokens,
                  "text_tokens": spec.text_tokens, "dtype": args.dtype},
        "transport": "torch (gloo)",
        "steps": args.steps,
        "repeats": args.repeats,
        "schedules": schedules,
        "configs": report_configs,
        "notes": notes,
        "wall_s": time.monotonic() - began,
    }
    args.json.write_text(json.dumps(report, indent=2))
    for config in report_configs:
        print(text_table(config))
        equality = config["equality"]
        print(f"  equality ({equality['dtype']}, atol {EXACT_ATOL:g}): " + ", ".join(
            f"{name} {diff:.1e}" for name, diff in equality["max_abs_diff"].items())
              + f" -> {'passed' if equality['passed'] else 'FAILED'}")
    for note in notes:
        print(f"note: {note}")
    if args.plot is not None:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    print(f"wrote {args.json} in {report['wall_s']:.0f} s (work files in {work})")
    return 0


def _single_process_env() -> dict[str, str]:
    import os

    from bench.cluster.jobs import LAUNCH_VARS

    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _measure_config(args, config: Config, schedules: list[str], model_dir: Path, spec,
                    common: list[str], work: Path, reference: Path, check_steps: int,
                    notes: list[str]) -> dict[str, Any]:
    """Calibrate one cluster, run every schedule ``--repeats`` times interleaved, check the
    exact schedules' outputs and predict every step time."""
    cluster_spec = ClusterSpec(config.nodes, config.ranks_per_node, config.gbit, args.delay_ms)
    here = work / config.label
    here.mkdir()
    print(f"{config.label}: {config.nodes} nodes x {config.ranks_per_node} ranks, "
          f"inter-node {config.gbit:g} Gbit/s", flush=True)
    with EmulatedCluster(cluster_spec) as cluster:
        cluster.write_topology(here / "emulated.toml")
        calibration = here / "calibrated.toml"
        started = time.monotonic()
        calibrate_job(cluster, [*common, "--dtype", args.dtype,
                                *(["--quick"] if args.quick_calibration else [])],
                      calibration, args.timeout, here, notes, config.label)
        print(f"  calibrated in {time.monotonic() - started:.0f} s", flush=True)

        session = _run_session(args, cluster, config, schedules, model_dir, here / "session",
                               args.dtype, args.steps, args.repeats)
        if args.dtype != "float32":  # the equality check runs in float32
            exact = [name for name in schedules if name in EXACT]
            check = _run_session(args, cluster, config, exact, model_dir, here / "check",
                                 "float32", check_steps, 1)
            session["latents"] = check["latents"]
    runs = []
    for run in session["runs"]:
        counted = run["step_times_s"][1:]
        runs.append({**run, "median_step_s": statistics.median(counted)})
    skipped = session["skipped"]
    for name, message in skipped.items():
        notes.append(f"{name} skipped on {config.label}: the runtime refused it ({message})")
    latents = session["latents"]
    measured_schedules = [name for name in schedules if name not in skipped]
    equality = _equality(reference, latents)
    collective = collective_model(calibration.with_suffix(".json"))
    predicted = predict(measured_schedules, spec, args.resolution, calibration, args.steps,
                        args.dtype, collective)
    # calibrate writes the real blocks' effective rate when it timed them; the matrix
    # products' rate (what it wrote before) is predicted beside it.
    measured_compute = (_read_json(calibration.with_suffix(".json")) or {}).get("compute", {})
    matmul = None
    if measured_compute.get("block"):
        matmul = predict(measured_schedules, spec, args.resolution, calibration, args.steps,
                         args.dtype, collective, tile_tflops=measured_compute["tflops"])
    summary: dict[str, dict[str, Any]] = {}
    for name in measured_schedules:
        medians = [r["median_step_s"] for r in runs if r["schedule"] == name]
        measured = statistics.median(medians)
        summary[name] = {"measured_step_s": measured, "min_step_s": min(medians),
                         "max_step_s": max(medians), **predicted[name],
                         "error": predicted[name]["predicted_step_s"] / measured - 1}
        if matmul is not None:
            summary[name]["predicted_matmul_rate_step_s"] = matmul[name]["predicted_step_s"]
            summary[name]["error_matmul_rate"] = (matmul[name]["predicted_step_s"] / measured
                                                  - 1)
    for base in (BASELINE, "diffusers"):
        if base in summary:
            for row in summary.values():
                row[f"measured_speedup_over_{base}"] = (summary[base]["measured_step_s"]
                                                        / row["measured_step_s"])
                row[f"predicted_speedup_over_{base}"] = (summary[base]["predicted_step_s"]
                                                         / row["predicted_step_s"])
    return {
        "cluster": {**dataclasses.asdict(cluster_spec), "layout": config.layout},
        "calibration": {"topology": calibration.read_text(),
                        "collective": dataclasses.asdict(collective),
                        "measured": _read_json(calibration.with_suffix(".json"))},
        "runs": runs,
        "skipped": skipped,
        "equality": equality,
        "summary": summary,
    }


def calibrate_job(cluster, options: list[str], calibration: Path, timeout_s: float,
                  here: Path, notes: list[str], label: str, attempts: int = 2) -> None:
    """``cocodiff calibrate`` across the cluster, tried again once if a rank dies (a
    rank of gloo was seen aborting at exit, "terminate called without an active
    exception", after the outputs were written); each failure is kept in ``notes``."""
    for attempt in range(1, attempts + 1):
        try:
            run_job(cluster, [sys.executable, "-m", "cocodiff", "calibrate", *options,
                              "--transport", "torch", "--output", str(calibration),
                              "--json", str(calibration.with_suffix(".json"))],
                    "torch", timeout_s=timeout_s, log_dir=here / f"calibrate-logs-{attempt}")
            return
        except JobFailed as error:
            if attempt == attempts:
                raise
            notes.append(f"calibrate on {label}, attempt {attempt}, failed ({error}); "
                         "calibrated again")
            print(f"  calibrate failed ({error}); again", flush=True)


def _run_session(args, cluster, config: Config, schedules: list[str], model_dir: Path,
                 out: Path, dtype: str, steps: int, repeats: int) -> dict[str, Any]:
    """Run every schedule ``repeats`` rounds in one launch (``bench/emulated_session.py``);
    its runs, skipped schedules and saved latents."""
    out.mkdir()
    started = time.monotonic()
    result = run_job(
        cluster,
        [sys.executable, str(REPO / "bench" / "emulated_session.py"), str(model_dir),
         str(args.resolution), str(steps), config.layout, dtype, str(repeats),
         ",".join(schedules), str(out)],
        "torch", timeout_s=args.timeout, log_dir=out / "logs",
    )
    for line in result.output(0).splitlines():
        print(f"  {line}", flush=True)
    print(f"  session ({dtype}, {repeats} round(s)) in {time.monotonic() - started:.0f} s",
          flush=True)
    session = json.loads((out / "session.json").read_text())
    session["latents"] = {name: out / f"latents-{name}.pt" for name in schedules
                          if (out / f"latents-{name}.pt").is_file()}
    return session


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _equality(reference: Path, latents: dict[str, Path]) -> dict[str, Any]:
    """Max abs difference of each schedule's final latents from the single-process run;
    passed when every exact schedule's is within :data:`EXACT_ATOL`."""
    import torch

    expected = torch.load(reference, weights_only=True)
    diffs = {name: float((torch.load(path, weights_only=True) - expected).abs().max())
             for name, path in latents.items()}
    exact = {name: diff for name, diff in diffs.items() if name in EXACT}
    return {"dtype": "float32", "reference": "single process", "max_abs_diff": diffs,
            "atol": EXACT_ATOL, "checked": sorted(exact),
            "passed": bool(exact) and all(diff <= EXACT_ATOL for diff in exact.values())}


if __name__ == "__main__":
    sys.exit(main())
