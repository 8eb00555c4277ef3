"""``cocodiff simulate``: schedules side by side on one machine, or the paper's sweep.

Everything is validated before any simulation runs, and output files are written only
once every result exists.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cocodiff.errors import CocodiffError
from cocodiff.fanout import local_cores, map_local
from cocodiff.plan_command import (
    add_degree_arguments,
    add_machine_arguments,
    collective_arg,
    explicit_layout,
)
from cocodiff.schedules.vmajor import add_vmajor_arguments, vmajor_from_arguments

# --layout: the planner's layouts, or pure Ulysses over every rank.
AUTO, PURE = "auto", "pure"
LAYOUT_CHOICES = (AUTO, PURE)

# Denoising steps beyond any real sampler (V-Major plans are made per step).
MAX_STEPS = 10_000


def add_simulate_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    add_machine_arguments(parser, positive_int)
    parser.add_argument("--steps", type=positive_int, default=28,
                        help="denoising steps (default: 28)")
    parser.add_argument("--schedule", default="flat,tapa,vfirst,cocodiff",
                        help="schedule(s), comma-separated: flat, tapa, vfirst (TAPA + V-First), "
                        "cocodiff (TAPA + V-First + V-Major); default: all four")
    parser.add_argument("--chunks", type=positive_int, default=None,
                        help="pipeline chunks of TAPA exchanges (default: 1)")
    add_vmajor_arguments(parser)
    parser.add_argument("--activity-trace", type=Path, default=None,
                        help="replay a recorded V-Major activity trace (JSON, "
                        "cocodiff-activity/1) in the cocodiff schedule")
    parser.add_argument("--layout", default=None, choices=LAYOUT_CHOICES,
                        help="auto: each schedule on the planner's best Ulysses x Ring x batch "
                        "layout (`cocodiff plan`); pure: pure Ulysses over every rank; "
                        "default: pure up to the head count, auto past it (or the layout "
                        "--ulysses/--ring/--batch give)")
    add_degree_arguments(parser, positive_int)
    parser.add_argument("--batch-size", type=positive_int, default=1,
                        help="samples per denoising step (2: a classifier-free-guidance "
                        "batch; default 1)")
    parser.add_argument("--sweep", action="store_true",
                        help="run the paper's grid (models flux1-dev, qwen-image, sd35-large, "
                        "flux2-dev; 768/1536/2304 px; 1/2/4/8 Aurora nodes); where there are "
                        "more ranks than heads, each schedule runs on the planner's layout")
    parser.add_argument("--sweep-models", default=None, help="restrict the sweep's models")
    parser.add_argument("--sweep-resolutions", default=None, help="restrict its resolutions")
    parser.add_argument("--sweep-nodes", default=None, help="restrict its node counts")
    parser.add_argument("--workers", type=positive_int, default=None,
                        help="local processes to simulate on (default: every core this "
                        "process may use; under mpiexec, shared by the ranks of a host)")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--trace", type=Path,
                        help="write a Chrome/Perfetto trace (open in ui.perfetto.dev)")
    parser.add_argument("--plot", type=Path,
                        help="write a PNG: a Gantt chart of one layer, or with --sweep the "
                        "speedup over flat against nodes per model")


def simulate_command(args: argparse.Namespace) -> int:
    from cocodiff.atomic import check_output_paths
    from cocodiff.schedules import VMajorOptions, get_schedule

    check_output_paths((args.json, args.trace, args.plot))
    if args.steps > MAX_STEPS:
        raise CocodiffError(f"--steps {args.steps} is more than {MAX_STEPS}")
    names = [name.strip() for name in args.schedule.split(",") if name.strip()]
    if not names:
        raise CocodiffError("--schedule names no schedule")
    for name in names:
        get_schedule(name)
    vmajor = vmajor_from_arguments(args) or VMajorOptions()
    collective = collective_arg(args.collective)
    if args.activity_trace is not None:
        from cocodiff.schedules.activity import load_activity

        args.activity = load_activity(args.activity_trace)
        if args.sweep:
            raise CocodiffError("--activity-trace replays one run; it cannot drive --sweep")
    else:
        args.activity = None
    degrees = (args.ulysses, args.ring, args.batch)
    if args.sweep and (args.layout or args.ring_inner or args.batch_size != 1
                       or any(d is not None for d in degrees)):
        raise CocodiffError("--sweep chooses its own layouts (the planner's where pure Ulysses "
                            "cannot run); drop --layout, --ulysses/--ring/--batch, --batch-size")
    if args.sweep:
        from cocodiff.sweep import run_sweep

        return run_sweep(args, names, vmajor, collective)
    return _single(args, names, vmajor, collective)


def _single(args, names, vmajor, collective) -> int:
    from cocodiff.atomic import atomic_write_text
    from cocodiff.models import load_model_spec, parse_resolution
    from cocodiff.report import plot_layer_gantt, print_results
    from cocodiff.schedules import STEP_DEPENDENT
    from topology import Placement, build_topology, resolve_topology

    topology = build_topology(resolve_topology(args.topology, args.nodes))
    model = load_model_spec(args.model)
    width, height = parse_resolution(args.resolution)
    model.check_resolution(width, height)
    tokens = model.sequence_tokens(width, height, args.frames)
    streams = (model.image_tokens(width, height, args.frames), model.text_tokens)
    placement = Placement.node_major(topology)
    record = args.trace is not None or args.plot is not None
    layouts, known = _layouts(args, names, model, topology, streams, collective,
                              placement.num_ranks)
    context = {"positional": (model, topology, placement, streams, args.steps),
               "options": {"chunks": args.chunks, "vmajor": vmajor, "collective": collective,
                           "record_spans": record, "activity": args.activity,
                           "batch": args.batch_size},
               "layouts": layouts,
               # the planner's own simulation of a winner is that schedule's step, unless
               # --chunks makes the plan another
               "known": known if args.chunks is None else {}}
    # Schedules run side by side on the local cores, V-Major's (a plan per cache ratio,
    # the longest) first; a recorded timeline (trace, plot) stays in this process.
    longest_first = sorted(names, key=lambda name: name not in STEP_DEPENDENT)
    done = map_local(_simulate_one, context, longest_first, 1 if record else args.workers)
    by_name = dict(zip(longest_first, done, strict=True))
    results = [by_name[name] for name in names]
    spec = topology.spec
    title = (
        f"{model.name} {width}x{height}" + (f"x{args.frames}f" if args.frames > 1 else "")
        + f": {tokens} tokens on {spec.name}, {spec.num_nodes} node(s), "
        f"{placement.num_ranks} ranks; {args.steps} steps"
    )
    notes = _notes(results, args.steps, collective, topology, model, placement, layouts)
    print_results(results, title, notes,
                  layouts=[_layout_name(layouts[r.schedule], placement.num_ranks)
                           for r in results])
    if args.json:
        atomic_write_text(args.json, json.dumps({
            "model": model.name,
            "topology": spec.name,
            "num_nodes": spec.num_nodes,
            "num_ranks": placement.num_ranks,
            "resolution": [width, height],
            "frames": args.frames,
            "steps": args.steps,
            "sequence_tokens": tokens,
            "batch_size": args.batch_size,
            "results": [{**r.to_json(), "layout": _layout_json(layouts[r.schedule])}
                        for r in results],
        }, indent=2))
    if args.trace:
        atomic_write_text(args.trace,
                          json.dumps(results[0].simulation.timeline.to_chrome_trace()))
    if args.plot:
        plot_layer_gantt(results[0], args.plot, title)
    return 0


def _simulate_one(context: dict, name: str):
    """One schedule's :func:`cocodiff.simulate.simulate_schedule` (a local worker's job)."""
    from cocodiff.simulate import simulate_schedule

    result = simulate_schedule(name, *context["positional"], parallel=context["layouts"][name],
                               known=context["known"].get(name), **context["options"])
    if not context["options"]["record_spans"]:
        result.simulation = None  # nothing reads it, and a worker's result must pickle
    return result


def _layouts(args, names, model, topology, streams, collective, num_ranks
             ) -> tuple[dict, dict]:
    """Each schedule's parallel layout: None (pure Ulysses), the flags', or the planner's;
    and the steps the planner simulated for its choices (by schedule)."""
    layout = explicit_layout(args, num_ranks)
    if layout is not None and args.layout is not None:
        raise CocodiffError(f"--layout {args.layout} and --ulysses/--ring/--batch both choose "
                            "the layout: drop one")
    if layout is not None:
        layout.check(num_ranks, model.num_heads, args.batch_size)
        return dict.fromkeys(names, layout), {}
    choice = args.layout
    if choice is None:  # pure Ulysses leaves ranks idle past the head count
        auto = num_ranks > model.num_heads and args.activity is None
        choice = AUTO if auto else PURE
    if choice == AUTO:
        if args.activity is not None:
            raise CocodiffError("--activity-trace replays a pure-Ulysses run; it cannot use "
                                "--layout auto")
        from cocodiff.planner import choose_layouts

        choices = choose_layouts(model, topology, streams, names, args.batch_size, collective,
                                 workers=args.workers or local_cores())
        return ({name: c.layout for name, c in choices.items()},
                {name: c.result for name, c in choices.items() if c.result is not None})
    return dict.fromkeys(names), {}


def _layout_name(layout, num_ranks: int) -> str:
    return layout.name if layout is not None else f"pure U{num_ranks}"


def _layout_json(layout) -> dict | None:
    if layout is None:
        return None
    return {"name": layout.name, "ulysses": layout.ulysses, "ring": layout.ring,
            "batch": layout.batch, "order": list(layout.order)}


def _notes(results, steps, collective, topology, model, placement, layouts=None) -> list[str]:
    from transports.sim import collective_model_for

    model_used = collective or collective_model_for(topology.spec.name)
    notes = [f"collective model: {model_used.name} (per-transfer set-up "
             f"{model_used.startup_us:g} us, {model_used.engines} engine(s)); bound = links only"]
    flat = next((r for r in results if r.schedule == "flat"), None)
    for r in results:
        speedup = f", {flat.step_time_s / r.step_time_s:.2f}x over flat" if flat else ""
        notes.append(
            f"{r.schedule}: {steps} steps {sum(r.step_times_s) / len(r.step_times_s) * steps:.3f}"
            f" s{speedup}; all-to-all efficiency {r.efficiency:.2f} of the link bound "
            f"(simulated {r.simulated_ranks} of {r.num_ranks} ranks"
            + (", folded" if r.folded else "") + f", {r.wall_s:.2f} s wall)"
        )
    if any((layouts or {}).values()):
        notes.append("layout UxRxB = Ulysses x Ring x batch degrees ('/ring-inner': the Ring "
                     "on the fast tiers); `cocodiff plan` ranks them all")
    heads = model.num_heads
    if placement.num_ranks > heads and not any((layouts or {}).values()):
        notes.append(f"{placement.num_ranks} ranks > {heads} heads: "
                     f"{placement.num_ranks - heads} ranks hold no head during attention "
                     "(the pure-Ulysses limit)")
    return notes
