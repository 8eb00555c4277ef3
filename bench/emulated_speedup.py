"""Measured step times of Ulysses schedules and of diffusers' own context parallelism on an
emulated cluster, next to the simulator's prediction for each from a calibrated topology:
a thin loop over ``cocodiff validate`` runs.

For each configuration (nodes x ranks per node, inter-node tbf rate, transport, model
shape):

1. enlarge a built-in tiny model (more heads, channels, layers, tokens; same family, text
   encoders and VAE) and save it as a diffusers directory (once per shape);
2. build the emulated cluster (``bench.cluster``: nodes = network namespaces, inter-node
   links shaped with ``tc``) and run ``cocodiff calibrate`` across it at the model's
   shapes: the calibrated topology TOML and its collective model (JSON beside it);
3. run ``cocodiff validate`` across it on that topology: every schedule (``flat``,
   ``tapa``, ``vfirst``, ``cocodiff`` and ``diffusers``) ``--repeats`` rounds,
   interleaved, the order rotated every round, the first step of each run left out, and
   up to ``--max-repeats`` rounds while a row's 95% interval is wider than
   ``--precision``; the
   plans that ran simulated on the calibrated topology; the exact schedules' final
   latents (float32) checked against one single-process run.

Writes JSON (default ``results/emulated_speedup.json``: every configuration with
validate's report), prints a table per configuration, and with ``--plot`` /
``--markdown`` draws measured against predicted step times and writes the table
(``bench/emulated_report.py`` does both from the JSON).

    python bench/emulated_speedup.py --plot docs/validate_emulated.png \\
        --markdown results/emulated_speedup.md                     # the default 8 configurations
    python bench/emulated_speedup.py --configs results/regime_search.json --top 6
    python bench/emulated_speedup.py --configs 2x2@1 --repeats 1 --max-repeats 1 --steps 2 \\
        --quick-calibration --heads 4 --head-dim 16 --layers 1 --single-layers 1 \\
        --resolution 128                                                 # ~2 min smoke

``--schedules ...,pipefusion --layouts pure,U2xR2xB1,P2xU2xM2/w1`` measures PipeFusion and
Ring layouts beside pure Ulysses (validate's ``--layouts``); each configuration then also
prints its fastest pipeline row against its fastest sequence row, predicted and measured
(``families`` in the JSON; docs/pipefusion.md, "On the emulated cluster").

``--single-host`` runs, instead, the README's two commands on this machine as a user runs
them (no namespaces, no shaped link, no root): ``mpiexec -n N cocodiff calibrate`` then
``validate`` (and the same under ``torchrun``), 1 x 4 and 1 x 2 ranks, the built-in
tiny-flux (the README's default model) and the enlarged model (issue 38: on one host the
simulator missed such runs by 25-54%). Not run in CI (minutes; the path itself is tested
at small settings by ``tests/test_readme_validation.py``).

    python bench/emulated_speedup.py --single-host --json results/single_host.json

``--configs`` takes ``NODESxRANKS@GBIT[,...]`` (the model and transport from the flags) or
a JSON file: a list of configurations, or ``{"configs": [...]}`` as
``bench/regime_search.py`` writes it, each ``{"nodes", "ranks_per_node", "gbit",
"transport", "model": {"heads", "head_dim", "layers", "single_layers", "resolution"}}``
(``transport`` and ``model`` optional).

Needs root (network namespaces, tc).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
from bench.emulated_report import markdown_table, plot, text_table  # noqa: E402


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


DEFAULT_SCHEDULES = "flat,tapa,vfirst,cocodiff,diffusers"
TRANSPORTS = ("torch", "mpi")
# A small model (where each exchange's fixed cost dominates) and an enlarged one (more
# compute and bytes per exchange).
SMALL = EnlargedModel(heads=8, head_dim=16, layers=1, single_layers=1, resolution=256)
ENLARGED = EnlargedModel(heads=8, head_dim=32, layers=2, single_layers=4, resolution=512)


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """One emulated cluster and what runs on it.

    Attributes:
        nodes: network namespaces.
        ranks_per_node: ranks in each.
        gbit: the inter-node tbf rate, Gbit/s.
        transport: ``torch`` (gloo) or ``mpi``.
        model: how the tiny model is enlarged.
    """

    nodes: int
    ranks_per_node: int
    gbit: float
    transport: str = "torch"
    model: EnlargedModel | None = EnlargedModel()  # None: the built-in tiny-flux as it is
    single_host: bool = False  # the plain launcher on this machine: no namespaces, no link

    @property
    def label(self) -> str:
        m = self.model
        shape = ("tiny-flux" if m is None
                 else f"h{m.hidden_size}l{m.layers + m.single_layers}r{m.resolution}")
        where = "host" if self.single_host else f"@{self.gbit:g}"
        launcher = {"mpi": "mpiexec", "torch": "torchrun"}[self.transport] \
            if self.single_host else self.transport
        return f"{self.nodes}x{self.ranks_per_node}{where} {launcher} {shape}"

    @property
    def layout(self) -> str:
        return f"{self.nodes}x{self.ranks_per_node}x1"

    def to_json(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "ranks_per_node": self.ranks_per_node, "gbit": self.gbit,
                "transport": self.transport, "single_host": self.single_host,
                "model": None if self.model is None else dataclasses.asdict(self.model)}


# 2 x 2 and 4 x 2; a bandwidth-bound link (0.2 Gbit/s) and one where the CPU bounds the
# exchanges (5 Gbit/s: loopback TCP itself moves ~5.4 here); a small and an enlarged
# model: 8 configurations x 5 schedules = 40 rows.
DEFAULT_CONFIGS = tuple(
    Config(nodes, ranks, gbit, "torch", model)
    for nodes, ranks in ((2, 2), (4, 2)) for gbit in (0.2, 5.0) for model in (SMALL, ENLARGED)
)


# One host as the README runs it (issue 38): 1 x 4 and 1 x 2 ranks on this machine's cores,
# mpiexec (MPI) and torchrun (gloo), the built-in tiny-flux and the enlarged model.
SINGLE_HOST_CONFIGS = tuple(
    Config(1, ranks, 0.0, transport, model, single_host=True)
    for ranks in (4, 2) for transport in ("mpi", "torch") for model in (None, ENLARGED)
)


def parse_configs(text: str, model: EnlargedModel = EnlargedModel(),
                  transport: str = "torch") -> list[Config]:
    """``NODESxRANKS@GBIT[,...]`` (e.g. ``2x2@1,4x2@5``), or a JSON file of configurations
    (see the module docstring) -> configurations."""
    if text.endswith(".json"):
        return load_configs(Path(text))
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
        configs.append(Config(nodes, ranks, rate, transport, model))
    if not configs:
        raise ValueError("--configs names no configuration")
    return configs


def load_configs(path: Path) -> list[Config]:
    """Configurations from a JSON file (a list, or ``{"configs": [...]}``)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--configs {path}: {error}") from None
    items = data.get("configs") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise ValueError(f"--configs {path}: no list of configurations")
    configs = []
    for index, item in enumerate(items):
        try:
            model = EnlargedModel(**{key: item["model"][key] for key in
                                     ("heads", "head_dim", "layers", "single_layers",
                                      "resolution")}) if "model" in item else EnlargedModel()
            config = Config(int(item["nodes"]), int(item["ranks_per_node"]),
                            float(item["gbit"]), item.get("transport", "torch"), model)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"--configs {path}: configuration {index}: {error!r}") from None
        if config.transport not in TRANSPORTS or min(config.nodes, config.ranks_per_node) < 1 \
                or not config.gbit > 0:
            raise ValueError(f"--configs {path}: configuration {index} is not valid: {item}")
        configs.append(config)
    return configs


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
    parser.add_argument("--configs", default=None,
                        help="NODESxRANKS@GBIT comma-separated (model and transport from the "
                        "flags), or a JSON file of configurations (e.g. bench/regime_search.py's"
                        "); default: 2x2 and 4x2 at 0.2 and 5 Gbit/s, a small and an enlarged "
                        "model, gloo (8 configurations)")
    parser.add_argument("--single-host", action="store_true",
                        help="the README's calibrate + validate on this machine under mpiexec "
                        "and torchrun (1x4, 1x2; tiny-flux and the enlarged model), no "
                        "emulated cluster; not with --configs")
    parser.add_argument("--top", type=int, default=None,
                        help="with a JSON --configs: only its first N configurations")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="inter-node one-way delay (needs netem; default 0)")
    parser.add_argument("--schedules", default=DEFAULT_SCHEDULES,
                        help="comma-separated schedules, run interleaved; 'diffusers' is "
                        f"diffusers' own context parallelism; 'pipefusion' runs the pipeline "
                        f"layouts (default: {DEFAULT_SCHEDULES})")
    parser.add_argument("--layouts", default="auto",
                        help="validate's --layouts: auto (pure Ulysses, and with pipefusion "
                        "every pipeline of xDiT's defaults), or pure, U2xR2xB1-style and "
                        "P2xU2xM2/w1-style names, comma-separated (default: auto)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds over the schedules, at least (default 3)")
    parser.add_argument("--max-repeats", type=int, default=10,
                        help="rounds at most: after --repeats, validate adds rounds while a "
                        "row's 95%% interval neither resolves its error nor is within "
                        "--precision (default 10)")
    parser.add_argument("--precision", type=float, default=0.04,
                        help="a row whose 95%% interval is this narrow, as a fraction of its "
                        "step, needs no more rounds whatever its error (default 0.04: the "
                        "small model's runs vary ~11%% round to round here)")
    parser.add_argument("--steps", type=int, default=6,
                        help="denoising steps per run; the first is not counted (default 6)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="(default float32; the equality check runs in float32 only)")
    parser.add_argument("--transport", default="torch", choices=TRANSPORTS,
                        help="for NODESxRANKS@GBIT configurations (default torch)")
    parser.add_argument("--base", default="tiny-flux", choices=sorted(ENLARGERS))
    add_model_arguments(parser)
    parser.add_argument("--quick-calibration", action="store_true",
                        help="calibrate with fewer sizes and repeats")
    parser.add_argument("--fit-patterns", action="store_true",
                        help="calibrate with --fit-patterns: the collective also fitted on a "
                             "step's exchange patterns (what one cross-node transfer reaches)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per job, seconds")
    parser.add_argument("--json", type=Path, default=REPO / "results" / "emulated_speedup.json")
    parser.add_argument("--work", type=Path, default=None,
                        help="keep the calibrations, validations and logs here (default: a "
                        "new folder under the system's temporary directory, printed at the end)")
    parser.add_argument("--plot", type=Path, default=None, help="write the plot (PNG) here")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="write the Markdown table here")
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
    from cocodiff.util.errors import CocodiffError
    from cocodiff.validation import parse_schedules

    try:
        return parse_schedules(text)
    except CocodiffError as error:
        raise ValueError(str(error)) from None


def _check_layouts(text: str) -> None:
    from cocodiff.util.errors import CocodiffError
    from cocodiff.validation import parse_layouts

    try:
        parse_layouts(text)
    except CocodiffError as error:
        raise ValueError(str(error)) from None


def _configs(args: argparse.Namespace) -> list[Config]:
    if args.single_host:
        if args.configs is not None:
            raise ValueError("--single-host runs its own configurations: not with --configs")
        configs = list(SINGLE_HOST_CONFIGS)
    elif args.configs is None:
        configs = list(DEFAULT_CONFIGS)
    else:
        model = EnlargedModel(args.base, args.heads, args.head_dim, args.layers,
                              args.single_layers, args.resolution)
        configs = parse_configs(args.configs, model, args.transport)
    return configs[:args.top] if args.top is not None else configs


def _run(args: argparse.Namespace) -> int:
    schedules = _check_schedules(args.schedules)
    _check_layouts(args.layouts)
    configs = _configs(args)
    if args.steps < 2:
        raise ValueError(f"--steps must be at least 2 (the first is not counted), got {args.steps}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if args.max_repeats < args.repeats:
        raise ValueError(f"--max-repeats ({args.max_repeats}) is below --repeats "
                         f"({args.repeats})")
    began = time.monotonic()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    if args.work is None:
        work = Path(tempfile.mkdtemp(prefix="cocodiff-emulated-speedup-"))
    else:
        work = args.work
        work.mkdir(parents=True, exist_ok=True)
    model_dirs: dict[EnlargedModel, Path] = {}
    report_configs = []
    notes: list[str] = []
    for index, config in enumerate(configs):
        if config.model is not None and config.model not in model_dirs:
            model_dirs[config.model] = export_enlarged(config.model,
                                                       work / f"model-{len(model_dirs)}")
        measure = _measure_single_host if config.single_host else _measure_config
        report_configs.append(measure(args, config, schedules, model_dirs.get(config.model),
                                      work / f"c{index}", notes))
    report = {
        "steps": args.steps,
        "repeats": args.repeats,
        "max_repeats": args.max_repeats,
        "precision": args.precision,
        "dtype": args.dtype,
        "schedules": schedules,
        "layouts": args.layouts,
        "configs": report_configs,
        "notes": notes,
        "wall_s": time.monotonic() - began,
    }
    report.update(overall(report_configs))
    args.json.write_text(json.dumps(report, indent=2))
    for config in report_configs:
        print(text_table(config))
    for line in filter(None, map(families_text, report_configs)):
        print(line)
    for note in notes:
        print(f"note: {note}")
    print(overall_text(report))
    if args.plot is not None:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        families = "\n".join(f"- {line}" for line in filter(None, map(families_text,
                                                                         report_configs)))
        args.markdown.write_text(markdown_table(report) + "\n\n" + picks_table(report)
                                 + "\n\n" + (families + "\n\n" if families else "")
                                 + overall_text(report) + "\n")
        print(f"wrote {args.markdown}")
    print(f"wrote {args.json} in {report['wall_s']:.0f} s (work files in {work})")
    return 0


def overall(configs: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every configuration: median |error|, the fraction of rows within 15% and 20%,
    and in how many configurations the planner's pick was within 5% of the measured best."""
    import statistics

    errors = [abs(row["error"]) for config in configs for row in config["summary"].values()
              if row.get("error") is not None]
    picks = [config["validate"].get("pick_within_5pct") for config in configs]
    # A miss whose interval (paired by round) straddles 5%: the rounds could not tell.
    unresolved = [config["label"] for config in configs
                  if config["validate"].get("pick_within_5pct") is False
                  and config["validate"].get("pick_resolved") is False]
    return {"rows": len(errors),
            "median_abs_error": statistics.median(errors) if errors else None,
            "within_15pct": sum(e <= 0.15 for e in errors) / len(errors) if errors else None,
            "within_20pct": sum(e <= 0.20 for e in errors) / len(errors) if errors else None,
            "pick_within_5pct": f"{sum(bool(p) for p in picks)} of {len(picks)}",
            "picks_missed_unresolved": unresolved}


def picks_table(report: dict[str, Any]) -> str:
    """Per configuration: the planner's pick against the measured best."""
    lines = ["| cluster | rounds | planner's pick (predicted, measured) | measured best "
             "| pick slower by (95%, paired by round) |", "|---|---|---|---|---|"]
    for config in report["configs"]:
        validated = config["validate"]
        pick, best = validated.get("planner_pick"), validated.get("measured_best")
        if pick is None or best is None:
            continue
        interval = validated.get("pick_slower_95")
        paired = ("" if interval is None or interval == [0.0, 0.0]
                  else f" ({interval[0]:+.1%} to {interval[1]:+.1%}"
                  f"{'' if validated.get('pick_resolved', True) else ', unresolved'})")
        lines.append(
            f"| {config['label']} | {validated['rounds']} | `{pick['schedule']}` {pick['layout']} "
            f"({pick['predicted_step_s'] * 1e3:.1f} ms, {pick['measured_step_s'] * 1e3:.1f} ms)"
            f" | `{best['schedule']}` {best['layout']} ({best['measured_step_s'] * 1e3:.1f} ms)"
            f" | {validated['pick_slower_than_best']:+.1%}{paired}"
            f"{'' if validated['pick_within_5pct'] else ' (not within 5%)'} |")
    return "\n".join(lines)


def overall_text(report: dict[str, Any]) -> str:
    if not report["rows"]:
        return "no predicted rows"
    return (f"{report['rows']} rows: median |error| {report['median_abs_error']:.1%}, "
            f"{report['within_15pct']:.0%} within 15%, {report['within_20pct']:.0%} within "
            f"20%; the planner's pick within 5% of the measured best in "
            f"{report['pick_within_5pct']} configurations"
            + (f" (misses the rounds could not tell: {', '.join(unresolved)})"
               if (unresolved := report.get("picks_missed_unresolved")) else ""))


def single_process_env() -> dict[str, str]:
    """This environment without a launcher's variables: a child runs as one process."""
    import os

    from bench.cluster.jobs import LAUNCH_VARS

    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _measure_config(args, config: Config, schedules: list[str], model_dir: Path, here: Path,
                    notes: list[str]) -> dict[str, Any]:
    """Calibrate one cluster, then ``cocodiff validate`` across it; its report, and the
    rows keyed by schedule (``schedule@layout`` off pure Ulysses) with speedups."""
    cluster_spec = ClusterSpec(config.nodes, config.ranks_per_node, config.gbit, args.delay_ms)
    here.mkdir(parents=True)
    common = ["--model", str(model_dir), "--resolution", str(config.model.resolution)]
    print(f"{config.label}: {config.nodes} nodes x {config.ranks_per_node} ranks, "
          f"inter-node {config.gbit:g} Gbit/s, {config.transport}", flush=True)
    calibration = here / "calibrated.toml"
    validated = here / "validate.json"
    with EmulatedCluster(cluster_spec) as cluster:
        started = time.monotonic()
        calibrate_job(cluster, [*common, "--dtype", args.dtype, *calibrate_flags(args)],
                      calibration, args.timeout, here, notes, config.label, config.transport)
        print(f"  calibrated in {time.monotonic() - started:.0f} s", flush=True)
        started = time.monotonic()
        run_job(cluster, [sys.executable, "-m", "cocodiff", "validate", *common,
                          "--topology", str(calibration), "--steps", str(args.steps),
                          "--rounds", str(args.repeats), "--max-rounds", str(args.max_repeats),
                          "--precision", str(args.precision), "--schedules", ",".join(schedules),
                          "--layouts", args.layouts, "--transport", config.transport,
                          "--dtype", args.dtype, "--timeout", str(args.timeout), "--quiet",
                          "--json", str(validated)],
                config.transport, timeout_s=args.timeout, log_dir=here / "validate-logs")
        print(f"  validated in {time.monotonic() - started:.0f} s", flush=True)
    return config_report(config, {**dataclasses.asdict(cluster_spec), "layout": config.layout},
                         calibration, validated, notes)


def launcher_prefix(transport: str, ranks: int) -> list[str]:
    """How a user launches ``ranks`` ranks of ``cocodiff`` on this machine."""
    binaries = Path(sys.executable).parent
    if transport == "mpi":
        return [str(binaries / "mpiexec"), "-n", str(ranks), sys.executable, "-m", "cocodiff"]
    return [str(binaries / "torchrun"), "--nproc-per-node", str(ranks), "--no-python",
            sys.executable, "-m", "cocodiff"]


def _measure_single_host(args, config: Config, schedules: list[str], model_dir: Path | None,
                         here: Path, notes: list[str]) -> dict[str, Any]:
    """The README's two commands on this machine under the configuration's launcher:
    calibrate (its default settings, the model's size), then validate on its topology."""
    here.mkdir(parents=True)
    common = (["--model", "tiny-flux"] if model_dir is None or config.model is None else
              ["--model", str(model_dir), "--resolution", str(config.model.resolution)])
    launch = launcher_prefix(config.transport, config.ranks_per_node)
    calibration, validated = here / "calibrated.toml", here / "validate.json"
    print(f"{config.label}: {config.ranks_per_node} ranks on this host, {config.transport}",
          flush=True)
    env = single_process_env()
    for name, command in (
        ("calibrate", [*launch, "calibrate", *common, "--dtype", args.dtype,
                       *calibrate_flags(args),
                       "--transport", config.transport, "--output", str(calibration),
                       "--json", str(calibration.with_suffix(".json"))]),
        ("validate", [*launch, "validate", *common, "--topology", str(calibration),
                      "--steps", str(args.steps), "--rounds", str(args.repeats),
                      "--max-rounds", str(args.max_repeats), "--precision", str(args.precision),
                      "--schedules", ",".join(schedules), "--layouts", args.layouts,
                      "--transport", config.transport,
                      "--dtype", args.dtype, "--timeout", str(args.timeout), "--quiet",
                      "--json", str(validated)])):
        started = time.monotonic()
        log = here / f"{name}.log"
        with log.open("w") as out:
            done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=args.timeout, cwd=here)
        if done.returncode != 0:
            tail = log.read_text()[-500:].strip().splitlines()
            raise ValueError(f"{name} on {config.label} exited {done.returncode}: "
                             f"{tail[-1] if tail else 'no output'} (log: {log})")
        print(f"  {name}d in {time.monotonic() - started:.0f} s", flush=True)
    verdict = (read_json(calibration.with_suffix(".json")) or {}).get("verdict") or {}
    if verdict.get("holds") is False:
        notes.append(f"calibrate on {config.label}: {'; '.join(verdict['reasons'])}")
    return config_report(config, {"num_nodes": 1, "ranks_per_node": config.ranks_per_node,
                                  "inter_gbit": None, "layout": config.layout,
                                  "single_host": True}, calibration, validated, notes)


def config_report(config: Config, cluster: dict[str, Any], calibration: Path, validated: Path,
                  notes: list[str]) -> dict[str, Any]:
    """One configuration's entry: validate's report, the rows keyed by schedule
    (``schedule@layout`` off pure Ulysses) with speedups, and the calibration."""
    report = json.loads(validated.read_text())
    from cocodiff.commands.validate import machine_text

    print(f"  {machine_text(report['machine'])}", flush=True)
    for name, message in report["skipped"].items():
        notes.append(f"{name} skipped on {config.label}: the runtime refused it ({message})")
    summary = {(row["schedule"] if row["layout"] == "pure"
                else f"{row['schedule']}@{row['layout']}"): dict(row) for row in report["rows"]}
    for base in ("flat", "diffusers"):
        if base in summary:
            for row in summary.values():
                row[f"measured_speedup_over_{base}"] = (summary[base]["measured_step_s"]
                                                        / row["measured_step_s"])
                if row.get("predicted_step_s") and summary[base].get("predicted_step_s"):
                    row[f"predicted_speedup_over_{base}"] = (
                        summary[base]["predicted_step_s"] / row["predicted_step_s"])
    return {
        "cluster": cluster,
        "config": config.to_json(),
        "label": config.label,
        "calibration": {"topology": calibration.read_text(),
                        "measured": read_json(calibration.with_suffix(".json"))},
        "validate": report,
        "summary": summary,
        "families": pipeline_against_sequence(summary),
        "equality": report["exactness"],
    }


def pipeline_against_sequence(summary: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest PipeFusion row against the fastest row of the sequence family (every
    other schedule and layout), measured and predicted (each side's fastest by the
    simulator's prediction, as the planner would choose): ``sequence_over_pipeline`` > 1
    means the pipeline is faster by that factor. None without rows of both families."""
    from cocodiff.validation import PIPEFUSION

    families: dict[str, list[tuple[str, dict[str, Any]]]] = {"pipeline": [], "sequence": []}
    for name, row in summary.items():
        families["pipeline" if row["schedule"] == PIPEFUSION else "sequence"].append((name, row))
    if not all(families.values()):
        return None
    result: dict[str, Any] = {}
    for basis in ("measured", "predicted"):
        key = f"{basis}_step_s"
        best = {family: min(((name, row) for name, row in rows if row.get(key)),
                            key=lambda item, key=key: item[1][key], default=None)
                for family, rows in families.items()}
        if None in best.values():
            continue
        result[basis] = {
            **{family: {"row": name, "step_s": row[key]} for family, (name, row) in best.items()},
            "sequence_over_pipeline": best["sequence"][1][key] / best["pipeline"][1][key],
        }
    return result


def families_text(config: dict[str, Any]) -> str | None:
    """One line: the fastest pipeline row against the fastest sequence row, predicted
    then measured."""
    families = config.get("families")
    if not families or "measured" not in families:
        return None
    parts = []
    for basis in ("predicted", "measured"):
        if basis in families:
            side = families[basis]
            ratio = side["sequence_over_pipeline"]
            winner = "pipeline" if ratio > 1 else "sequence"
            parts.append(f"{basis} {side['pipeline']['row']} {side['pipeline']['step_s'] * 1e3:.1f}"
                         f" ms vs {side['sequence']['row']} "
                         f"{side['sequence']['step_s'] * 1e3:.1f} ms ({winner} "
                         f"{max(ratio, 1 / ratio):.2f}x faster)")
    return f"{config['label']}: " + "; ".join(parts)


def calibrate_flags(args: argparse.Namespace) -> list[str]:
    """calibrate's flags that the command line chose."""
    return [*(["--quick"] if args.quick_calibration else []),
            *(["--fit-patterns"] if args.fit_patterns else [])]


def calibrate_job(cluster, options: list[str], calibration: Path, timeout_s: float,
                  here: Path, notes: list[str], label: str, transport: str = "torch",
                  attempts: int = 2) -> None:
    """``cocodiff calibrate`` across the cluster, tried again once if a rank dies (a
    rank of gloo was seen aborting at exit, "terminate called without an active
    exception", after the outputs were written); each failure is kept in ``notes``."""
    for attempt in range(1, attempts + 1):
        try:
            run_job(cluster, [sys.executable, "-m", "cocodiff", "calibrate", *options,
                              "--transport", transport, "--output", str(calibration),
                              "--json", str(calibration.with_suffix(".json"))],
                    transport, timeout_s=timeout_s, log_dir=here / f"calibrate-logs-{attempt}")
            return
        except JobFailed as error:
            if attempt == attempts:
                raise
            notes.append(f"calibrate on {label}, attempt {attempt}, failed ({error}); "
                         "calibrated again")
            print(f"  calibrate failed ({error}); again", flush=True)


def read_json(path: Path) -> Any:
    """``path``'s JSON, or None when there is no such file."""
    return json.loads(path.read_text()) if path.is_file() else None


if __name__ == "__main__":
    sys.exit(main())
