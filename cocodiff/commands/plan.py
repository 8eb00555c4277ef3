"""``cocodiff plan``: rank every valid Ulysses x Ring x batch layout and schedule by
simulated step time on a machine; the layout flags ``simulate`` and ``run`` share, and
the machine and model flags ``simulate`` shares.

Layout flags: ``--parallel-layout auto`` (the planner's choice) or explicit ``--ulysses U
--ring R --batch B`` (a missing degree is filled so that they multiply to the rank
count); neither: pure Ulysses over every rank. ``--ring-inner`` places the Ring on the
fast tiers and Ulysses across the slow ones (the default is the opposite).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cocodiff.layout import DEFAULT_ORDER, RING_INNER_ORDER, ParallelLayout, parse_degrees
from cocodiff.util.errors import CocodiffError

# --parallel-layout: the planner's choice, or pure Ulysses over every rank.
AUTO, PURE = "auto", "pure"
DEFAULT_TOPOLOGY = "aurora"
# Denoising steps beyond any real sampler (V-Major plans are made per step).
MAX_STEPS = 10_000


def add_degree_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    """``--ulysses``, ``--ring``, ``--batch`` and ``--ring-inner`` (simulate and run)."""
    parser.add_argument("--ulysses", type=positive_int, default=None,
                        help="Ulysses degree: ranks that exchange heads for tokens (at most "
                        "the head count)")
    parser.add_argument("--ring", type=positive_int, default=None,
                        help="Ring degree: Ulysses groups that pass K/V blocks around a ring")
    parser.add_argument("--batch", type=positive_int, default=None,
                        help="batch/CFG degree: groups that each take a share of the step's "
                        "samples (must divide them)")
    parser.add_argument("--ring-inner", action="store_true",
                        help="place the Ring on the fast tiers and Ulysses across the slow "
                        "ones (default: Ulysses inside, Ring across)")


def host_call_note(spec) -> str | None:
    """What the topology's host charges per exchange call, said where schedules are ranked:
    on shared cores every extra call the mechanisms make (each TAPA phase and chunk) has a
    fixed cost that small messages do not repay. None when calls cost nothing."""
    host = spec.host
    if host is None or not (host.call_cpu_us or host.call_wait_us):
        return None
    return (f"this host charges every exchange call {host.call_cpu_us:.0f} us of CPU + "
            f"{host.message_cpu_us:.0f} us per message, and a call completing on busy cores "
            f"{host.call_wait_us:.0f} us of waiting ([host]); each TAPA phase and chunk is a "
            "call, so the mechanisms' extra calls pay only where they save more")


def explicit_layout(args: argparse.Namespace, num_ranks: int) -> ParallelLayout | None:
    """The layout the degree flags name, or None when none is given."""
    if args.ulysses is None and args.ring is None and args.batch is None:
        if args.ring_inner:
            raise CocodiffError("--ring-inner places a Ring: give --ring (or --ulysses)")
        return None
    layout = parse_degrees(args.ulysses, args.ring, args.batch, num_ranks)
    order = RING_INNER_ORDER if args.ring_inner else DEFAULT_ORDER
    return ParallelLayout(layout.ulysses, layout.ring, layout.batch, order)


def add_vmajor_arguments(parser: argparse.ArgumentParser) -> None:
    """The V-Major options of ``cocodiff simulate`` and ``cocodiff run``."""
    from cocodiff.schedules.vmajor import VMajorOptions

    defaults = VMajorOptions()
    parser.add_argument("--vmajor-ratio-schedule", default=None, metavar="SCHEDULE",
                        help="V-Major's cached fraction of V blocks over the steps: linear[:MAX] "
                        "(ramps from 0 after the warm-up to MAX at the last step) or constant:R "
                        f"(default: {defaults.schedule}:{defaults.max_ratio:g})")
    parser.add_argument("--vmajor-warmup", type=int, default=None, metavar="STEPS",
                        help=f"first steps that send all of V (default: {defaults.warmup})")
    parser.add_argument("--vmajor-refresh", type=int, default=None, metavar="N",
                        help="every N-th step sends all of V (default: "
                        f"{defaults.refresh or 'never'})")


def vmajor_from_arguments(args: argparse.Namespace):
    """The :class:`~cocodiff.schedules.vmajor.VMajorOptions` given on the command line,
    or None when none was.

    Raises:
        ScheduleError: a value out of range or an unknown ratio schedule.
    """
    from cocodiff.schedules.vmajor import VMajorOptions

    given = (args.vmajor_ratio_schedule, args.vmajor_warmup, args.vmajor_refresh)
    if given == (None, None, None):
        return None
    defaults = VMajorOptions()
    return VMajorOptions.parse(
        args.vmajor_ratio_schedule or f"{defaults.schedule}:{defaults.max_ratio}",
        defaults.warmup if args.vmajor_warmup is None else args.vmajor_warmup,
        defaults.refresh if args.vmajor_refresh is None else args.vmajor_refresh,
    )


def add_machine_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    """The machine and the model (plan and simulate): ``--topology``, ``--nodes``,
    ``--model``, ``--resolution``, ``--frames`` and ``--collective``."""
    parser.add_argument("--topology", default=None,
                        help="a preset (aurora, dgx-h100, cluster) or a topology TOML file "
                        f"(default: {DEFAULT_TOPOLOGY})")
    parser.add_argument("--nodes", type=positive_int, default=None,
                        help="number of nodes (default: the preset's or file's)")
    parser.add_argument("--model", default="flux1-dev",
                        help="a model name or a diffusers transformer config.json / model "
                        "directory (default: flux1-dev)")
    parser.add_argument("--resolution", default=None,
                        help="image size in pixels: 1024 or WIDTHxHEIGHT (default: 1024; a "
                        "tiny model's own, as run gives it: 128 for tiny-flux)")
    parser.add_argument("--frames", type=positive_int, default=None,
                        help="video frames (video models only; default: 1, a tiny video "
                        "model's own)")
    parser.add_argument("--collective", default=AUTO, metavar="auto|NAME|FILE.json",
                        help=COLLECTIVE_HELP)


def add_schedule_option_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    """The schedule options (:class:`~cocodiff.schedules.PlanOptions`) plan and simulate
    share: ``--dtype``, ``--batch-size``, ``--chunks`` and the V-Major flags."""
    from cocodiff.schedules import DTYPE_BYTES
    from cocodiff.schedules.options import DEFAULT_DTYPE

    parser.add_argument("--dtype", default=DEFAULT_DTYPE, choices=tuple(DTYPE_BYTES),
                        help=f"activation dtype of the exchanges (default: {DEFAULT_DTYPE})")
    parser.add_argument("--batch-size", type=positive_int, default=1,
                        help="samples per denoising step (2: a classifier-free-guidance "
                        "batch; default 1)")
    parser.add_argument("--chunks", type=positive_int, default=None,
                        help="pipeline chunks of TAPA exchanges (default: 1)")
    add_vmajor_arguments(parser)


def plan_options(args: argparse.Namespace):
    """The :class:`~cocodiff.schedules.PlanOptions` the flags give."""
    from cocodiff.schedules import DEFAULT_CHUNKS, PlanOptions, VMajorOptions

    return PlanOptions(dtype=args.dtype, batch=args.batch_size,
                       chunks=args.chunks or DEFAULT_CHUNKS,
                       vmajor=vmajor_from_arguments(args) or VMajorOptions())


def schedule_names(text: str) -> list[str]:
    """``--schedule``'s comma-separated names, each checked against the registry."""
    from cocodiff.schedules import get_schedule

    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise CocodiffError("--schedule names no schedule")
    for name in names:
        get_schedule(name)
    return names


def add_plan_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    add_machine_arguments(parser, positive_int)
    parser.add_argument("--schedule", default="flat,tapa,vfirst",
                        help="Ulysses schedules to try inside each Ulysses group, "
                        "comma-separated (default: flat,tapa,vfirst)")
    add_schedule_option_arguments(parser, positive_int)
    add_degree_arguments(parser, positive_int)
    parser.add_argument("--steps", type=positive_int, default=28,
                        help="denoising steps the plan file covers (default: 28)")
    parser.add_argument("--top", type=positive_int, default=5,
                        help="how many of the best to print (default 5)")
    parser.add_argument("--json", type=Path, help="write every candidate as JSON here")
    parser.add_argument("--out", type=Path, metavar="PATH",
                        help="write the best (layout, schedule)'s plan for a whole run here: "
                        "`cocodiff simulate --plan PATH` and `cocodiff run --plan PATH` "
                        "execute it")


COLLECTIVE_HELP = ("the simulator's collective model: a name (ideal: links only; aurora, "
                   "dgx-h100, cluster), or calibrate's --json file (its `collective`); auto: "
                   "the JSON beside a topology TOML (same name, .json) when calibrate wrote "
                   "one, else the topology's preset model")


def calibration_beside(topology: str | None) -> Path | None:
    """calibrate's JSON beside a topology TOML (same name, ``.json``), when there is one."""
    if not topology or not topology.endswith(".toml"):
        return None
    beside = Path(topology).with_suffix(".json")
    return beside if beside.is_file() else None


def collective_source(source: str, topology: str | None) -> tuple[Any, str]:
    """(the collective model ``--collective source`` names, None for the topology's preset
    model; where it came from). One rule for plan, simulate, collective and validate, so a
    calibrated cluster is predicted with its fitted collective wherever it is simulated."""
    from cocodiff.util.jsonfile import read_json
    from transports.sim import COLLECTIVE_MODELS, CollectiveModel

    if source == AUTO:
        beside = calibration_beside(topology)
        if beside is None:
            return None, "the topology's preset model"
        path = beside
    elif source in COLLECTIVE_MODELS:
        return COLLECTIVE_MODELS[source], source
    elif source.endswith(".json"):
        path = Path(source)
    else:
        raise CocodiffError(f"unknown collective model {source!r}; valid: auto, "
                            f"{', '.join(COLLECTIVE_MODELS)}, or calibrate's JSON file")
    data = read_json(path, "calibration file", CocodiffError)
    measured = data.get("collective") if isinstance(data, dict) else None
    if not isinstance(measured, dict):
        if source == AUTO:  # a JSON beside the topology that is not calibrate's
            return None, "the topology's preset model"
        raise CocodiffError(f"{path} holds no fitted collective model (`collective`); "
                            "write it with `cocodiff calibrate --json PATH`")
    return CollectiveModel.from_json(measured, "calibrated"), str(path)


def collective_arg(args: argparse.Namespace):
    """The collective model of ``args.collective`` (None: the topology's preset model)."""
    return collective_source(args.collective, args.topology)[0]


def plan_command(args: argparse.Namespace) -> int:
    from rich.table import Table

    from cocodiff.calibration.model_shapes import model_size, model_spec
    from cocodiff.plan.file import build_run_plan
    from cocodiff.schedules import RankGrid
    from cocodiff.simulator import budget
    from cocodiff.simulator.planner import rank_layouts
    from cocodiff.util.atomic import atomic_write_text, check_output_paths
    from cocodiff.util.console import plain_console
    from topology import Placement, build_topology, resolve_topology

    check_output_paths((args.json, args.out))
    if args.out is not None and args.json is not None \
            and args.out.resolve() == args.json.resolve():
        raise CocodiffError(f"--json and --out name the same file: {args.out}")
    if args.steps > MAX_STEPS:
        raise CocodiffError(f"--steps {args.steps} is more than {MAX_STEPS}")
    names = schedule_names(args.schedule)
    collective = collective_arg(args)
    options = plan_options(args)
    described = resolve_topology(args.topology or DEFAULT_TOPOLOGY, args.nodes)
    model = model_spec(args.model)
    width, height, args.frames = model_size(args.model, args.resolution, args.frames)
    model.check_resolution(width, height)
    budget.check_estimate(
        budget.estimate_planner(described, model.num_layers, model.num_heads, names,
                                options.batch, options.chunks),
        f"ranking the layouts of {described.num_tiles} ranks ({described.num_nodes} node(s))")
    topology = build_topology(described)
    streams = (model.image_tokens(width, height, args.frames), model.text_tokens)
    # --ulysses/--ring/--batch: rank that layout only (the schedules still compete).
    forced = explicit_layout(args, len(topology.tiles))
    if forced is not None:
        forced.check(len(topology.tiles), model.num_heads, options.batch)
    result = rank_layouts(model, topology, streams, names, options, collective,
                          layouts=None if forced is None else [forced])
    if not result.candidates:
        raise CocodiffError(f"no valid layout of {len(topology.tiles)} ranks for "
                            f"{model.name} with batch size {args.batch_size}")
    spec = topology.spec
    num_ranks = len(topology.tiles)
    title = (f"{model.name} {width}x{height}: {model.sequence_tokens(width, height, args.frames)}"
             f" tokens, {model.num_heads} heads on {spec.name}, {spec.num_nodes} node(s), "
             f"{num_ranks} ranks; batch {args.batch_size}")
    table = Table(title=title, title_justify="left")
    for column in ("#", "layout", "schedule", "step time", "compute", "comm bound",
                   "vs best"):
        table.add_column(column, justify="left" if column in ("layout", "schedule") else "right")
    best_s = result.best.step_time_s
    for index, c in enumerate(result.candidates[: args.top], start=1):
        table.add_row(str(index), c.layout.name, c.schedule, f"{c.step_time_s * 1e3:.2f} ms",
                      f"{c.compute_s * 1e3:.2f} ms",
                      f"{c.bound_s * 1e3:.2f} ms" if c.bound_s is not None else "-",
                      f"{c.step_time_s / best_s:.2f}x")
    plain_console(width=200).print(table)
    layouts = len({c.layout.name for c in result.candidates})
    print("note: layout UxRxB = Ulysses x Ring x batch degrees; '/ring-inner' places the Ring "
          "on the fast tiers; comm bound = the links' lower bound for the step's exchanges")
    print(f"note: ranked {len(result.candidates)} (layout, schedule) pairs over {layouts} "
          f"layouts in {result.wall_s:.2f} s; best: --ulysses {result.best.layout.ulysses} "
          f"--ring {result.best.layout.ring} --batch {result.best.layout.batch}"
          + (" --ring-inner" if result.best.layout.order == RING_INNER_ORDER
             and result.best.layout.ring > 1 and result.best.layout.ulysses > 1 else "")
          + f" --schedule {result.best.schedule}")
    calls = host_call_note(spec)
    if calls:
        print(f"note: {calls}")
    run_plan = None
    if args.out:
        best = result.best
        grid = RankGrid.from_placement(topology, Placement.node_major(topology))
        run_plan = build_run_plan(
            best.schedule, model, grid, streams, args.steps, options,
            parallel=best.layout, resolution=(width, height), frames=args.frames,
            machine={"topology": args.topology or DEFAULT_TOPOLOGY,
                     "nodes": described.num_nodes})
        print(f"note: wrote the plan of {best.layout.name} {best.schedule} for {args.steps} "
              f"steps to {args.out} (sha256 {run_plan.sha256[:12]})")
    if args.json:
        atomic_write_text(args.json, json.dumps({
            "model": model.name, "topology": spec.name, "num_nodes": spec.num_nodes,
            "num_ranks": num_ranks, "resolution": [width, height], "frames": args.frames,
            "batch_size": args.batch_size, "planner_wall_s": result.wall_s,
            "candidates": [c.to_json() for c in result.candidates]}, indent=2))
    if run_plan is not None:
        atomic_write_text(args.out, run_plan.to_json())
    return 0
