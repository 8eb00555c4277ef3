"""The ``cocodiff`` command line.

User errors (an unknown preset, a malformed topology file, ``--nodes 0``, ...) print
one line on stderr and exit with code 2; no output file is written unless the whole
command succeeded.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from cocodiff.errors import CocodiffError
from cocodiff.runtime.run import add_run_arguments, run_command

EXIT_USAGE = 2


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line, not the usage text plus the error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="cocodiff",
        description="Topology-aware Ulysses sequence parallelism for Diffusion Transformers.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    simulate = commands.add_parser(
        "simulate",
        help="simulate one denoising step of a DiT on a machine",
        description="Simulate one denoising step of a DiT under Ulysses sequence parallelism "
        "on a machine topology, and report step time, exposed communication and traffic.",
    )
    simulate.add_argument(
        "--topology", default="aurora",
        help="a preset (aurora, dgx-h100, cluster) or a topology TOML file (default: aurora)",
    )
    simulate.add_argument("--nodes", type=positive_int, default=None,
                          help="number of nodes (default: the preset's or file's)")
    simulate.add_argument("--model", default="flux1-dev",
                          help="a model name or a diffusers transformer config.json / model "
                          "directory (default: flux1-dev)")
    simulate.add_argument("--resolution", default="1024",
                          help="image size in pixels: 1024 or WIDTHxHEIGHT (default: 1024)")
    simulate.add_argument("--frames", type=positive_int, default=1,
                          help="video frames (video models only; default: 1)")
    simulate.add_argument("--steps", type=positive_int, default=28,
                          help="denoising steps, for the total time (default: 28)")
    simulate.add_argument("--schedule", default="flat",
                          help="schedule name(s), comma-separated (default: flat)")
    simulate.add_argument("--json", type=Path, help="write the results as JSON here")
    simulate.add_argument("--trace", type=Path,
                          help="write a Chrome/Perfetto trace (open in ui.perfetto.dev)")
    simulate.add_argument("--plot", type=Path,
                          help="write a PNG Gantt chart of one layer (ranks and busiest links)")
    simulate.set_defaults(handler=_cmd_simulate)

    run = commands.add_parser(
        "run",
        help="run a diffusers model Ulysses-parallel (under mpiexec or torchrun)",
        description="Generate with a diffusers DiT, Ulysses-parallel over every rank of the "
        "launch: `mpiexec -n N cocodiff run ...` or `torchrun --nproc-per-node N -m cocodiff "
        "run ...`; single-process without a launcher.",
    )
    add_run_arguments(run, positive_int)
    run.set_defaults(handler=run_command)

    export = commands.add_parser(
        "export-tiny",
        help="save a built-in tiny model as a diffusers directory",
        description="Save a built-in tiny model (random weights from a fixed seed) as a "
        "diffusers pipeline directory that `cocodiff run --model DIR` loads back.",
    )
    export.add_argument("name", help="tiny-flux, tiny-sd3, tiny-qwen, tiny-wan or tiny-pixart")
    export.add_argument("directory", type=Path, help="where to write it")
    export.set_defaults(handler=_cmd_export_tiny)
    return parser


def _cmd_export_tiny(args: argparse.Namespace) -> int:
    from cocodiff.runtime.pipelines import export_tiny
    from cocodiff.runtime.tiny import TINY_MODELS

    if args.name not in TINY_MODELS:
        raise CocodiffError(
            f"unknown tiny model {args.name!r}; valid: {', '.join(TINY_MODELS)}"
        )
    if args.directory.exists() and any(args.directory.iterdir()):
        raise CocodiffError(f"{args.directory} exists and is not empty")
    export_tiny(args.name, args.directory)
    print(f"saved {args.name} to {args.directory}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except CocodiffError as error:
        return _fail(args.command, str(error))
    except (ValueError, FileNotFoundError, KeyError) as error:
        # Validation errors raised at the boundary by topology/, cocodiff.models and the
        # schedulers all derive from ValueError and carry a one-line message.
        message = error.args[0] if error.args else repr(error)
        return _fail(args.command, str(message))


def _fail(command: str, message: str) -> int:
    print(f"cocodiff {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _check_output_dirs(*paths: Path | None) -> None:
    for path in paths:
        if path is not None and not path.parent.is_dir():
            raise CocodiffError(f"output directory {path.parent} does not exist (for {path})")


def _cmd_simulate(args: argparse.Namespace) -> int:
    # Imported here so that `cocodiff --help` stays instant.
    from cocodiff.atomic import atomic_write_text
    from cocodiff.models import load_model_spec, parse_resolution
    from cocodiff.report import plot_layer_gantt, print_results
    from cocodiff.schedules import get_schedule
    from cocodiff.simulate import simulate_plan
    from topology import Placement, build_topology, resolve_topology

    _check_output_dirs(args.json, args.trace, args.plot)
    topology = build_topology(resolve_topology(args.topology, args.nodes))
    model = load_model_spec(args.model)
    width, height = parse_resolution(args.resolution)
    model.check_resolution(width, height)
    names = [name.strip() for name in args.schedule.split(",") if name.strip()]
    schedulers = {name: get_schedule(name) for name in names}
    if not schedulers:
        raise CocodiffError("--schedule names no schedule")
    tokens = model.sequence_tokens(width, height, args.frames)
    streams = (model.image_tokens(width, height, args.frames), model.text_tokens)
    placement = Placement.node_major(topology)
    record = args.trace is not None or args.plot is not None
    results = []
    for scheduler in schedulers.values():
        plan = scheduler(model, placement.num_ranks, streams)
        results.append(simulate_plan(plan, topology, placement, record_spans=record))
    layout = plan.layout
    spec = topology.spec
    title = (
        f"{model.name} {width}x{height}"
        + (f"x{args.frames}f" if args.frames > 1 else "")
        + f": {tokens} tokens on {spec.name}, {spec.num_nodes} node(s), "
        f"{placement.num_ranks} ranks; {args.steps} steps"
    )
    notes = [
        f"{args.steps} steps of {r.schedule}: {r.step_time_s * args.steps:.3f} s "
        f"(simulated {r.simulated_ranks} of {r.num_ranks} ranks"
        + (", node-folded" if r.folded else "") + f", {r.wall_s:.2f} s wall)"
        for r in results
    ]
    idle = sum(1 for heads in layout.heads if heads == 0)
    if idle:
        notes.append(
            f"{placement.num_ranks} ranks > {model.num_heads} heads: {idle} ranks hold no head "
            "during attention (the pure-Ulysses limit)"
        )
    print_results(results, title, notes)
    if args.json:
        record_json = {
            "model": model.name,
            "topology": spec.name,
            "num_nodes": spec.num_nodes,
            "num_ranks": placement.num_ranks,
            "resolution": [width, height],
            "frames": args.frames,
            "steps": args.steps,
            "sequence_tokens": tokens,
            "heads_per_rank": list(layout.heads),
            "results": [r.to_json() for r in results],
        }
        atomic_write_text(args.json, json.dumps(record_json, indent=2))
    if args.trace:
        atomic_write_text(args.trace, json.dumps(results[0].simulation.timeline.to_chrome_trace()))
    if args.plot:
        plot_layer_gantt(results[0], args.plot, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
