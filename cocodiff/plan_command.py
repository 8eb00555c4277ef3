"""``cocodiff plan``: rank every valid Ulysses x Ring x batch layout and schedule by
simulated step time on a machine; the layout flags ``simulate`` and ``run`` share, and
the machine and model flags ``simulate`` shares.

Layout flags: ``--layout auto`` (the planner's choice) or explicit ``--ulysses U
--ring R --batch B`` (a missing degree is filled so that they multiply to the rank
count); neither: pure Ulysses over every rank. ``--ring-inner`` places the Ring on the
fast tiers and Ulysses across the slow ones (the default is the opposite).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cocodiff.errors import CocodiffError
from cocodiff.layout import DEFAULT_ORDER, ParallelLayout, parse_degrees

AUTO = "auto"
RING_INNER_ORDER = ("batch", "ulysses", "ring")


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


def explicit_layout(args: argparse.Namespace, num_ranks: int) -> ParallelLayout | None:
    """The layout the degree flags name, or None when none is given."""
    if args.ulysses is None and args.ring is None and args.batch is None:
        if args.ring_inner:
            raise CocodiffError("--ring-inner places a Ring: give --ring (or --ulysses)")
        return None
    layout = parse_degrees(args.ulysses, args.ring, args.batch, num_ranks)
    order = RING_INNER_ORDER if args.ring_inner else DEFAULT_ORDER
    return ParallelLayout(layout.ulysses, layout.ring, layout.batch, order)


def add_machine_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    """The machine and the model (plan and simulate): ``--topology``, ``--nodes``,
    ``--model``, ``--resolution``, ``--frames`` and ``--collective``."""
    parser.add_argument("--topology", default="aurora",
                        help="a preset (aurora, dgx-h100, cluster) or a topology TOML file "
                        "(default: aurora)")
    parser.add_argument("--nodes", type=positive_int, default=None,
                        help="number of nodes (default: the preset's or file's)")
    parser.add_argument("--model", default="flux1-dev",
                        help="a model name or a diffusers transformer config.json / model "
                        "directory (default: flux1-dev)")
    parser.add_argument("--resolution", default="1024",
                        help="image size in pixels: 1024 or WIDTHxHEIGHT (default: 1024)")
    parser.add_argument("--frames", type=positive_int, default=1,
                        help="video frames (video models only; default: 1)")
    parser.add_argument("--collective", default=AUTO,
                        help="collective model: auto (the preset's), ideal (links only), "
                        "aurora, dgx-h100, cluster")


def add_plan_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    add_machine_arguments(parser, positive_int)
    parser.add_argument("--schedule", default="flat,tapa,vfirst",
                        help="Ulysses schedules to try inside each Ulysses group, "
                        "comma-separated (default: flat,tapa,vfirst)")
    parser.add_argument("--batch-size", type=positive_int, default=1,
                        help="samples per denoising step (2: a classifier-free-guidance "
                        "batch; default 1)")
    parser.add_argument("--top", type=positive_int, default=5,
                        help="how many of the best to print (default 5)")
    parser.add_argument("--json", type=Path, help="write every candidate as JSON here")


def collective_arg(name: str):
    from transports.sim import COLLECTIVE_MODELS

    if name != AUTO and name not in COLLECTIVE_MODELS:
        raise CocodiffError(f"unknown collective model {name!r}; valid: auto, "
                            f"{', '.join(COLLECTIVE_MODELS)}")
    return None if name == AUTO else COLLECTIVE_MODELS[name]


def plan_command(args: argparse.Namespace) -> int:
    from rich.table import Table

    from cocodiff import budget
    from cocodiff.atomic import atomic_write_text, check_output_paths
    from cocodiff.console import plain_console
    from cocodiff.models import load_model_spec, parse_resolution
    from cocodiff.planner import rank_layouts
    from cocodiff.schedules import get_schedule
    from topology import build_topology, resolve_topology

    check_output_paths((args.json,))
    names = [name.strip() for name in args.schedule.split(",") if name.strip()]
    if not names:
        raise CocodiffError("--schedule names no schedule")
    for name in names:
        get_schedule(name)
    collective = collective_arg(args.collective)
    machine = resolve_topology(args.topology, args.nodes)
    model = load_model_spec(args.model)
    width, height = parse_resolution(args.resolution)
    model.check_resolution(width, height)
    budget.check_estimate(
        budget.estimate_planner(machine, model.num_layers, model.num_heads, names,
                                args.batch_size, 1),
        f"ranking the layouts of {machine.num_tiles} ranks ({machine.num_nodes} node(s))")
    topology = build_topology(machine)
    streams = (model.image_tokens(width, height, args.frames), model.text_tokens)
    result = rank_layouts(model, topology, streams, names, args.batch_size, collective)
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
    best = result.best.step_time_s
    for index, c in enumerate(result.candidates[: args.top], start=1):
        table.add_row(str(index), c.layout.name, c.schedule, f"{c.step_time_s * 1e3:.2f} ms",
                      f"{c.compute_s * 1e3:.2f} ms", f"{c.bound_s * 1e3:.2f} ms",
                      f"{c.step_time_s / best:.2f}x")
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
    if args.json:
        atomic_write_text(args.json, json.dumps({
            "model": model.name, "topology": spec.name, "num_nodes": spec.num_nodes,
            "num_ranks": num_ranks, "resolution": [width, height], "frames": args.frames,
            "batch_size": args.batch_size, "planner_wall_s": result.wall_s,
            "candidates": [c.to_json() for c in result.candidates]}, indent=2))
    return 0
