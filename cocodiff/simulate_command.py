"""``cocodiff simulate``: schedules side by side on one machine, or the paper's sweep.

Everything is validated before any simulation runs, and output files are written only
once every result exists.
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from cocodiff.errors import CocodiffError
from cocodiff.plan_command import (
    DEFAULT_TOPOLOGY,
    MAX_STEPS,
    add_degree_arguments,
    add_machine_arguments,
    add_schedule_option_arguments,
    collective_arg,
    explicit_layout,
    load_spec,
    plan_options,
    schedule_names,
)
from cocodiff.schedules.registry import BASELINE

PLAN_FIXES = ("model", "resolution", "frames", "steps", "schedule", "dtype", "batch_size",
              "chunks", "vmajor_ratio_schedule", "vmajor_warmup", "vmajor_refresh",
              "activity_trace", "layout", "ulysses", "ring", "batch", "ring_inner", "sweep")

# The paper's grid (arXiv 2604.14561): models x resolutions x Aurora nodes.
SWEEP = {
    "models": ("flux1-dev", "qwen-image", "sd35-large", "flux2-dev"),
    "resolutions": (768, 1536, 2304),
    "nodes": (1, 2, 4, 8),
}


def add_simulate_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    add_machine_arguments(parser, positive_int)
    parser.add_argument("--steps", type=positive_int, default=28,
                        help="denoising steps (default: 28)")
    parser.add_argument("--schedule", default="flat,tapa,vfirst,cocodiff",
                        help="schedule(s), comma-separated: flat, tapa, vfirst (TAPA + V-First), "
                        "cocodiff (TAPA + V-First + V-Major); default: all four")
    add_schedule_option_arguments(parser, positive_int)
    parser.add_argument("--plan", type=Path, default=None, metavar="PATH",
                        help="simulate this plan file (`cocodiff plan ... --out PATH`) on "
                        "--topology/--nodes (default: the machine it was made for); it fixes "
                        "the model, resolution, schedule, steps and layout")
    parser.add_argument("--activity-trace", type=Path, default=None,
                        help="replay a recorded V-Major activity trace (JSON, "
                        "cocodiff-activity/1) in the cocodiff schedule")
    parser.add_argument("--layout", default=None, choices=("auto",),
                        help="auto: each schedule on the planner's best Ulysses x Ring x batch "
                        "layout (`cocodiff plan`); default: pure Ulysses over every rank, or "
                        "the layout --ulysses/--ring/--batch give")
    add_degree_arguments(parser, positive_int)
    parser.add_argument("--sweep", action="store_true",
                        help="run the paper's grid (models flux1-dev, qwen-image, sd35-large, "
                        "flux2-dev; 768/1536/2304 px; 1/2/4/8 Aurora nodes); where there are "
                        "more ranks than heads, each schedule runs on the planner's layout")
    parser.add_argument("--sweep-models", default=None, help="restrict the sweep's models")
    parser.add_argument("--sweep-resolutions", default=None, help="restrict its resolutions")
    parser.add_argument("--sweep-nodes", default=None, help="restrict its node counts")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--trace", type=Path,
                        help="write a Chrome/Perfetto trace (open in ui.perfetto.dev)")
    parser.add_argument("--plot", type=Path,
                        help="write a PNG: a Gantt chart of one layer, or with --sweep the "
                        "speedup over flat against nodes per model")
    # The flags a plan file fixes, with their defaults: given otherwise beside --plan,
    # they are refused rather than silently overridden.
    parser.set_defaults(plan_fixed={name: parser.get_default(name) for name in PLAN_FIXES})


def simulate_command(args: argparse.Namespace) -> int:
    from cocodiff.atomic import check_output_paths

    check_output_paths((args.json, args.trace, args.plot))
    if args.plan is not None:
        return _from_plan_file(args)
    if args.steps > MAX_STEPS:
        raise CocodiffError(f"--steps {args.steps} is more than {MAX_STEPS}")
    names = schedule_names(args.schedule)
    options = plan_options(args)
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
        return _sweep(args, names, options, collective)
    return _single(args, names, options, collective)


def _from_plan_file(args) -> int:
    """``--plan``: simulate exactly the file's steps on the machine."""
    from cocodiff.plan_file import load_run_plan
    from cocodiff.simulate import simulate_run_plan
    from topology import Placement, build_topology, resolve_topology

    given = [name for name, default in args.plan_fixed.items() if getattr(args, name) != default]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise CocodiffError(f"--plan fixes {flags}: drop {'it' if len(given) == 1 else 'them'}"
                            " (or make another plan)")
    collective = collective_arg(args.collective)
    run_plan = load_run_plan(args.plan)
    machine = run_plan.machine or {}
    name = args.topology or machine.get("topology") or DEFAULT_TOPOLOGY
    nodes = args.nodes or (machine.get("nodes") if args.topology is None else None)
    topology = build_topology(resolve_topology(name, nodes))
    placement = Placement.node_major(topology)
    record = args.trace is not None or args.plot is not None
    result = simulate_run_plan(run_plan, topology, placement, collective=collective,
                               record_spans=record)
    model = run_plan.spec
    width, height = run_plan.resolution
    layouts = {run_plan.schedule: run_plan.parallel}
    title = (f"{model.name} {width}x{height}" + (f"x{run_plan.frames}f" if run_plan.frames > 1
                                                  else "")
             + f": plan {args.plan} ({run_plan.sha256[:12]}) on {topology.spec.name}, "
             f"{topology.spec.num_nodes} node(s), {placement.num_ranks} ranks; "
             f"{run_plan.num_steps} steps")
    return _report(args, [result], title, model, topology, placement, layouts, collective,
                   run_plan.num_steps, {
                       "plan": str(args.plan), "plan_sha256": run_plan.sha256,
                       "resolution": [width, height], "frames": run_plan.frames,
                       "sequence_tokens": sum(run_plan.stream_tokens),
                       "batch_size": run_plan.options.batch, "dtype": run_plan.options.dtype})


def _single(args, names, options, collective) -> int:
    from cocodiff.models import parse_resolution
    from cocodiff.simulate import simulate_schedule
    from topology import Placement, build_topology, resolve_topology

    machine = resolve_topology(args.topology or DEFAULT_TOPOLOGY, args.nodes)
    model = load_spec(args.model)
    width, height = parse_resolution(args.resolution)
    model.check_resolution(width, height)
    estimate = _check_resources(args, names, options, machine, model)
    topology = build_topology(machine)
    tokens = model.sequence_tokens(width, height, args.frames)
    streams = (model.image_tokens(width, height, args.frames), model.text_tokens)
    placement = Placement.node_major(topology)
    record = args.trace is not None or args.plot is not None
    layouts = _layouts(args, names, model, topology, streams, collective, placement.num_ranks)
    with _progress(names, args, options, estimate.wall_s) as advance:
        results = [
            simulate_schedule(name, model, topology, placement, streams, args.steps,
                              options=options, collective=collective, record_spans=record,
                              activity=args.activity, parallel=layouts[name],
                              on_plan=partial(advance, name))
            for name in names
        ]
    spec = topology.spec
    title = (
        f"{model.name} {width}x{height}" + (f"x{args.frames}f" if args.frames > 1 else "")
        + f": {tokens} tokens on {spec.name}, {spec.num_nodes} node(s), "
        f"{placement.num_ranks} ranks; {args.steps} steps"
    )
    return _report(args, results, title, model, topology, placement, layouts, collective,
                   args.steps, {"resolution": [width, height], "frames": args.frames,
                                "sequence_tokens": tokens, "batch_size": args.batch_size,
                                "dtype": args.dtype})


def _report(args, results, title, model, topology, placement, layouts, collective, steps,
            fields) -> int:
    """Print the table and notes, and write what was asked for."""
    from cocodiff.atomic import atomic_write_text
    from cocodiff.report import plot_layer_gantt, print_results

    spec = topology.spec
    notes = _notes(results, steps, collective, topology, model, placement, layouts)
    print_results(results, title, notes)
    if args.json:
        atomic_write_text(args.json, json.dumps({
            "model": model.name,
            "topology": spec.name,
            "num_nodes": spec.num_nodes,
            "num_ranks": placement.num_ranks,
            "steps": steps,
            **fields,
            "results": [{**r.to_json(), "layout": _layout_json(layouts[r.schedule])}
                        for r in results],
        }, indent=2))
    if args.trace:
        atomic_write_text(args.trace,
                          json.dumps(results[0].simulation.timeline.to_chrome_trace()))
    if args.plot:
        plot_layer_gantt(results[0], args.plot, title)
    return 0


def _check_resources(args, names, options, machine, model):
    """Refuse what would not fit in memory or would run for hours, before building
    anything (``cocodiff.budget``); returns the estimate."""
    from cocodiff import budget

    plans = {name: budget.distinct_plans(name, args.steps, options, args.activity)
             for name in names}
    estimate = budget.estimate_simulation(machine, model.num_layers, model.num_heads, plans,
                                          options.chunks, group=args.ulysses)
    if args.layout == "auto":  # the planner ranks every layout first
        estimate = budget.combine([estimate, budget.estimate_planner(
            machine, model.num_layers, model.num_heads, budget.ranked_schedules(names),
            options.batch, options.chunks)])
    ranks = machine.num_tiles
    budget.check_estimate(estimate, f"simulating {len(names)} schedule(s) of {model.name} on "
                          f"{machine.num_nodes} node(s) ({ranks} ranks)")
    return estimate


def _check_sweep_resources(args, names, options, specs, resolutions, nodes_list) -> None:
    """The resource guard over the whole grid: every row's simulations, and the
    planner's ranking where a row has more ranks than heads."""
    from cocodiff import budget
    from topology import get_preset

    plans = {name: budget.distinct_plans(name, args.steps, options, None) for name in names}
    ranked = budget.ranked_schedules(names)
    estimates = []
    for model in specs.values():
        for nodes in nodes_list:
            machine = get_preset("aurora", nodes)
            row = [budget.estimate_simulation(machine, model.num_layers, model.num_heads,
                                              plans, options.chunks)]
            if machine.num_tiles > model.num_heads:
                row.append(budget.estimate_planner(machine, model.num_layers, model.num_heads,
                                                   ranked, 1, options.chunks))
            estimates += row * len(resolutions)
    budget.check_estimate(budget.combine(estimates),
                          f"the sweep ({len(specs)} model(s) x {len(resolutions)} "
                          f"resolution(s) x nodes {','.join(map(str, nodes_list))})")


@contextmanager
def _progress(names, args, options, estimate_s: float):
    """A progress bar on a terminal's stderr for what is estimated to run long: one
    task per schedule, advanced per simulated plan. Yields ``advance(name)``."""
    import sys

    from cocodiff import budget

    if estimate_s < budget.PROGRESS_S or not sys.stderr.isatty():
        yield lambda name: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (TextColumn("simulating {task.description}"), BarColumn(),
               MofNCompleteColumn(), TextColumn("plans"), TimeElapsedColumn(),
               TextColumn(f"(estimated ~{estimate_s:.0f} s in all)"))
    with Progress(*columns, console=Console(stderr=True, markup=False),
                  transient=True) as bar:
        tasks = {name: bar.add_task(name, total=budget.distinct_plans(
            name, args.steps, options, args.activity)) for name in names}
        yield lambda name: bar.advance(tasks[name])


def _layouts(args, names, model, topology, streams, collective, num_ranks) -> dict:
    """Each schedule's parallel layout: None (pure Ulysses), the flags', or the planner's."""
    layout = explicit_layout(args, num_ranks)
    if layout is not None and args.layout == "auto":
        raise CocodiffError("--layout auto lets the planner choose: drop --ulysses/--ring/"
                            "--batch, or drop --layout")
    if layout is not None:
        layout.check(num_ranks, model.num_heads, args.batch_size)
        return dict.fromkeys(names, layout)
    if args.layout == "auto":
        if args.activity is not None:
            raise CocodiffError("--activity-trace replays a pure-Ulysses run; it cannot use "
                                "--layout auto")
        from cocodiff.planner import best_layout

        return {name: best_layout(model, topology, streams, name, plan_options(args),
                                  collective)
                for name in names}
    return dict.fromkeys(names)


def _layout_json(layout) -> dict | None:
    if layout is None:
        return None
    return {"name": layout.name, "ulysses": layout.ulysses, "ring": layout.ring,
            "batch": layout.batch, "order": list(layout.order)}


def _notes(results, steps, collective, topology, model, placement, layouts=None) -> list[str]:
    from transports.sim import collective_model_for

    model_used = collective or collective_model_for(topology.spec.name)
    notes = [f"collective model: {model_used.describe()}; bound = links only"]
    flat = next((r for r in results if r.schedule == BASELINE), None)
    for r in results:
        speedup = f", {flat.step_time_s / r.step_time_s:.2f}x over flat" if flat else ""
        notes.append(
            f"{r.schedule}: {steps} steps {sum(r.step_times_s) / len(r.step_times_s) * steps:.3f}"
            f" s{speedup}; all-to-all efficiency {r.efficiency:.2f} of the link bound "
            f"(simulated {r.simulated_ranks} of {r.num_ranks} ranks"
            + (", folded" if r.folded else "") + f", {r.wall_s:.2f} s wall)"
        )
    for name, layout in (layouts or {}).items():
        if layout is not None:
            notes.append(f"{name}: layout {layout.name} (Ulysses {layout.ulysses} x Ring "
                         f"{layout.ring} x batch {layout.batch})")
    heads = model.num_heads
    if placement.num_ranks > heads and not any((layouts or {}).values()):
        notes.append(f"{placement.num_ranks} ranks > {heads} heads: "
                     f"{placement.num_ranks - heads} ranks hold no head during attention "
                     "(the pure-Ulysses limit)")
    return notes


def _sweep(args, names, options, collective) -> int:
    from rich.table import Table

    from cocodiff.atomic import atomic_write, atomic_write_text
    from cocodiff.console import plain_console
    from cocodiff.models import load_model_spec
    from cocodiff.simulate import simulate_schedule
    from topology import Placement, build_topology, get_preset

    models = _sweep_values(args.sweep_models, SWEEP["models"], str, "model")
    resolutions = _sweep_values(args.sweep_resolutions, SWEEP["resolutions"], int, "resolution")
    nodes_list = _sweep_values(args.sweep_nodes, SWEEP["nodes"], int, "node count")
    specs = {name: load_model_spec(name) for name in models}
    if BASELINE not in names:
        names = [BASELINE, *names]
    _check_sweep_resources(args, names, options, specs, resolutions, nodes_list)
    rows = []
    for model_name in models:
        model = specs[model_name]
        for resolution in resolutions:
            model.check_resolution(resolution, resolution)
            streams = (model.image_tokens(resolution, resolution), model.text_tokens)
            for nodes in nodes_list:
                topology = build_topology(get_preset("aurora", nodes))
                placement = Placement.node_major(topology)
                # Past the head count pure Ulysses leaves ranks idle: every schedule then
                # runs on the planner's best layout for it (flat included: USP's baseline).
                layouts = (_planned_layouts(model, topology, streams, names, options,
                                            collective)
                           if placement.num_ranks > model.num_heads else dict.fromkeys(names))
                results = {name: simulate_schedule(name, model, topology, placement, streams,
                                                   args.steps, options=options,
                                                   collective=collective,
                                                   parallel=layouts[name])
                           for name in names}
                flat = results[BASELINE].step_time_s
                rows.append({
                    "model": model_name, "resolution": resolution, "nodes": nodes,
                    "num_ranks": placement.num_ranks,
                    "layouts": {name: layouts[name].name if layouts[name] else "pure"
                                for name in names},
                    "results": [r.to_json() for r in results.values()],
                    "speedup": {name: flat / r.step_time_s for name, r in results.items()},
                })
                print(f"{model_name} {resolution}px {nodes} node(s): " + ", ".join(
                    f"{name} {rows[-1]['speedup'][name]:.2f}x" for name in names), flush=True)
    table = Table(title="simulated speedup over flat Ulysses (Aurora)", title_justify="left")
    for column in ("model", "px", "nodes", *names, "layout (flat / " + names[-1] + ")"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["model"], str(row["resolution"]), str(row["nodes"]),
                      *(f"{row['speedup'][name]:.2f}x" for name in names),
                      f"{row['layouts'][BASELINE]} / {row['layouts'][names[-1]]}")
    plain_console(width=200).print(table)
    best = names[-1]
    speedups = [row["speedup"][best] for row in rows]
    peak = max(rows, key=lambda row: row["speedup"][best])
    print(f"{best} over flat: mean {sum(speedups) / len(speedups):.2f}x, peak "
          f"{peak['speedup'][best]:.2f}x ({peak['model']}, {peak['resolution']}px, "
          f"{peak['nodes']} nodes)")
    if args.json:
        atomic_write_text(args.json, json.dumps({"grid": {"models": models,
                                                          "resolutions": resolutions,
                                                          "nodes": nodes_list},
                                                 "steps": args.steps, "rows": rows}, indent=2))
    if args.plot:
        atomic_write(args.plot, lambda tmp: _plot_sweep(rows, names, tmp))
    return 0


def _planned_layouts(model, topology, streams, names, options, collective) -> dict:
    """The planner's best layout for each schedule, from one ranking (each schedule as its
    registry entry's ``ranked_as``: V-Major's ``cocodiff`` takes ``vfirst``'s, the same
    exchanges before V-Major trims them)."""
    from cocodiff.planner import rank_layouts
    from cocodiff.schedules import get_schedule

    ranked_as = {name: get_schedule(name).ranked_as for name in names}
    ranking = rank_layouts(model, topology, streams, tuple(dict.fromkeys(ranked_as.values())),
                           options, collective=collective)
    return {name: next(c.layout for c in ranking.candidates if c.schedule == ranked_as[name])
            for name in names}


def _sweep_values(text, default, kind, what):
    if text is None:
        return list(default)
    values = []
    for item in text.split(","):
        try:
            values.append(kind(item.strip()))
        except ValueError:
            raise CocodiffError(f"sweep {what} {item.strip()!r} is not valid") from None
    if kind is str:
        unknown = [v for v in values if v not in default]
        if unknown:
            raise CocodiffError(f"unknown sweep {what} {unknown[0]!r}; valid: "
                                f"{', '.join(default)}")
    elif any(v < 1 for v in values):
        raise CocodiffError(f"sweep {what}s must be positive, got {text!r}")
    return values


def _plot_sweep(rows, names, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(row["model"] for row in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for resolution in sorted({row["resolution"] for row in rows}):
            chosen = [row for row in rows if row["model"] == model
                      and row["resolution"] == resolution]
            for name, style in zip(names[1:], ("--", "-.", "-"), strict=False):
                ax.plot([row["nodes"] for row in chosen],
                        [row["speedup"][name] for row in chosen], style, marker="o",
                        label=f"{name} {resolution}px")
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("Aurora nodes")
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="grey", linewidth=0.8)
    axes[0][0].set_ylabel("speedup over flat Ulysses")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
