"""``cocodiff simulate``: schedules side by side on one machine, or the paper's sweep.

Everything is validated before any simulation runs, and output files are written only
once every result exists.
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from cocodiff.commands.given import record_given, refuse_plan_fixed
from cocodiff.commands.plan import (
    AUTO,
    DEFAULT_TOPOLOGY,
    MAX_STEPS,
    PURE,
    add_degree_arguments,
    add_machine_arguments,
    add_schedule_option_arguments,
    auto_chunks,
    collective_arg,
    explicit_layout,
    host_call_note,
    plan_options,
    schedule_names,
    with_compute_mode,
)
from cocodiff.schedules.registry import BASELINE
from cocodiff.simulator.fanout import local_cores, map_local
from cocodiff.util.errors import CocodiffError

# Flags (dests) that say what a plan file already says: refused beside --plan at any value.
PLAN_FIXES = ("model", "resolution", "frames", "steps", "schedule", "dtype", "batch_size",
              "chunks", "vmajor_ratio_schedule", "vmajor_warmup", "vmajor_refresh",
              "activity_trace", "parallel_layout", "ulysses", "ring", "batch", "ring_inner",
              "sweep", "pipefusion_overlap")

# --parallel-layout: the planner's layouts, or pure Ulysses over every rank.
LAYOUT_CHOICES = (AUTO, PURE)


def add_simulate_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    record_given(parser)  # --plan refuses the flags it fixes, given at any value
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
    parser.add_argument("--parallel-layout", "--layout", dest="parallel_layout", default=None,
                        choices=LAYOUT_CHOICES,
                        help="auto: each schedule on the planner's best Ulysses x Ring x batch "
                        "layout (`cocodiff plan`); pure: pure Ulysses over every rank; "
                        "default: pure up to the head count, auto past it (or the layout "
                        "--ulysses/--ring/--batch give). --layout is the old name, kept as an "
                        "alias for one release")
    add_degree_arguments(parser, positive_int)
    parser.add_argument("--sweep", action="store_true",
                        help="run the paper's grid (models flux1-dev, qwen-image, sd35-large, "
                        "flux2-dev; 768/1536/2304 px; 1/2/4/8 Aurora nodes); where there are "
                        "more ranks than heads, each schedule runs on the planner's layout")
    parser.add_argument("--sweep-models", default=None, help="restrict the sweep's models")
    parser.add_argument("--sweep-resolutions", default=None, help="restrict its resolutions")
    parser.add_argument("--sweep-nodes", default=None, help="restrict its node counts")
    parser.add_argument("--pipefusion-overlap", action="store_true",
                        help="with --sweep and pipefusion among the schedules: rank the "
                        "pipelines as xDiT's engine runs them (consecutive steps overlapped) "
                        "instead of as `cocodiff run` does")
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
    from cocodiff.util.atomic import check_output_paths

    check_output_paths((args.json, args.trace, args.plot))
    if args.plan is not None:
        return _from_plan_file(args)
    if args.steps > MAX_STEPS:
        raise CocodiffError(f"--steps {args.steps} is more than {MAX_STEPS}")
    requested = [name.strip() for name in args.schedule.split(",")]
    args.sweep_pipefusion = "pipefusion" in requested
    if args.sweep_pipefusion and not args.sweep:
        raise CocodiffError("simulate runs pipefusion from its plan file: `cocodiff plan "
                            "--schedule pipefusion [--pipefusion-overlap] --out PATH`, then "
                            "`cocodiff simulate --plan PATH` (docs/pipefusion.md); with "
                            "--sweep it ranks PipeFusion's layouts in every row")
    if args.pipefusion_overlap and not args.sweep_pipefusion:
        raise CocodiffError("--pipefusion-overlap needs --sweep with pipefusion among the "
                            "schedules (`cocodiff plan --pipefusion-overlap` for one machine)")
    # With --sweep the sequence schedules are a row's columns; PipeFusion's best joins them.
    names = schedule_names(",".join([name for name in requested if name != "pipefusion"]
                                    or [BASELINE]))
    options = plan_options(args)
    collective = collective_arg(args)
    if args.activity_trace is not None:
        from cocodiff.schedules.activity import load_activity

        args.activity = load_activity(args.activity_trace)
        if args.sweep:
            raise CocodiffError("--activity-trace replays one run; it cannot drive --sweep")
    else:
        args.activity = None
    degrees = (args.ulysses, args.ring, args.batch)
    if args.sweep and (args.parallel_layout or args.ring_inner or args.batch_size != 1
                       or any(d is not None for d in degrees)):
        raise CocodiffError("--sweep chooses its own layouts (the planner's where pure Ulysses "
                            "cannot run); drop --parallel-layout, --ulysses/--ring/--batch, "
                            "--batch-size")
    if args.sweep and args.compute_mode is not None:
        raise CocodiffError("--sweep runs the Aurora preset in its default compute mode "
                            "(eager); drop --compute-mode")
    if args.sweep:
        from cocodiff.commands.sweep import sweep_command

        return sweep_command(args, names, options, collective)
    return _single(args, names, options, collective)


def _from_plan_file(args) -> int:
    """``--plan``: simulate exactly the file's steps on the machine."""
    from cocodiff.schedules.run_plan import load_run_plan
    from cocodiff.simulator.simulate import simulate_run_plan
    from topology import Placement, build_topology, resolve_topology

    refuse_plan_fixed(args, PLAN_FIXES)
    collective = collective_arg(args)
    run_plan = load_run_plan(args.plan)
    machine = run_plan.machine or {}
    name = args.topology or machine.get("topology") or DEFAULT_TOPOLOGY
    nodes = args.nodes or (machine.get("nodes") if args.topology is None else None)
    topology = build_topology(with_compute_mode(resolve_topology(name, nodes), args))
    placement = Placement.node_major(topology)
    record = args.trace is not None or args.plot is not None
    result = simulate_run_plan(run_plan, topology, placement, collective=collective,
                               record_spans=record)
    model = run_plan.spec
    width, height = run_plan.resolution
    # A pipeline's layout is its plans' (the pipelined step's), else the file's parallel one.
    layouts = {run_plan.schedule: run_plan.plans[run_plan.step_plans[-1]].pipeline
               or run_plan.parallel}
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
                       "batch_size": run_plan.options.batch, "dtype": run_plan.options.dtype},
                   {run_plan.schedule: (run_plan.options.chunks,
                                        f"{run_plan.options.chunks} (the plan file's)")})


def _single(args, names, options, collective) -> int:
    from cocodiff.runtime.model_names import model_size, model_spec
    from topology import Placement, build_topology, resolve_topology

    machine = with_compute_mode(
        resolve_topology(args.topology or DEFAULT_TOPOLOGY, args.nodes), args)
    model = model_spec(args.model)
    width, height, args.frames = model_size(args.model, args.resolution, args.frames)
    model.check_resolution(width, height)
    estimate = _check_resources(args, names, options, machine, model)
    topology = build_topology(machine)
    tokens = model.sequence_tokens(width, height, args.frames)
    streams = (model.image_tokens(width, height, args.frames), model.text_tokens)
    placement = Placement.node_major(topology)
    record = args.trace is not None or args.plot is not None
    floors = None
    if _planner_chooses(args, model, placement.num_ranks):
        from cocodiff.simulator.planner import layout_floors

        # The candidates' floors first (no simulation): the guard then counts the
        # candidates the planner cannot prune, before it simulates any.
        floors = layout_floors(model, topology, streams, names, options, collective,
                               workers=args.workers or local_cores())
        estimate = _check_resources(args, names, options, machine, model, floors)
    layouts, known = _layouts(args, names, model, topology, streams, options, collective,
                              placement.num_ranks, floors)
    chunks = _chunks(args, names, model, topology, streams, options, collective, layouts,
                     known)
    context = {"positional": (model, topology, placement, streams, args.steps),
               "options": {"options": options, "collective": collective,
                           "record_spans": record, "activity": args.activity},
               "layouts": layouts,
               "chunks": {name: choice.chunks for name, choice in chunks.items()},
               # the planner's own simulation of a winner (same options) is that step
               "known": known}
    # Schedules run side by side on the local cores, the step-dependent ones (V-Major's:
    # a plan per cache ratio, the longest) first, their distinct plans shared out over
    # the workers; a recorded timeline (trace, plot) stays in this process.
    workers = 1 if record else (args.workers or local_cores())
    jobs = _jobs(names, context, workers)
    with _progress(len(jobs), estimate.wall_s) as advance:
        done = map_local(_simulate_job, context, jobs, workers, progress=advance)
    results = [_gathered(context, name, [out for (job_name, _), out
                                         in zip(jobs, done, strict=True) if job_name == name])
               for name in names]
    spec = topology.spec
    title = (
        f"{model.name} {width}x{height}" + (f"x{args.frames}f" if args.frames > 1 else "")
        + f": {tokens} tokens on {spec.name}, {spec.num_nodes} node(s), "
        f"{placement.num_ranks} ranks; {args.steps} steps"
    )
    return _report(args, results, title, model, topology, placement, layouts, collective,
                   args.steps, {"resolution": [width, height], "frames": args.frames,
                                "sequence_tokens": tokens, "batch_size": args.batch_size,
                                "dtype": args.dtype,
                                # what the resource guard expected this run to cost
                                "guard_estimate": {"cpu_s": estimate.wall_s,
                                                   "memory_bytes": estimate.memory_bytes}},
                   {name: (choice.chunks, choice.describe()) for name, choice in chunks.items()})


def _report(args, results, title, model, topology, placement, layouts, collective, steps,
            fields, chunks) -> int:
    """Print the table and notes, and write what was asked for (``chunks``: schedule ->
    (its chunk count, how it was chosen))."""
    from cocodiff.simulator.report import plot_layer_gantt, print_results
    from cocodiff.util.atomic import atomic_write_text

    spec = topology.spec
    notes = _notes(results, steps, collective, topology, model, placement, layouts)
    phased = [name for name in (r.schedule for r in results) if name in chunks]
    notes += [f"{name} chunks: {chunks[name][1]}" for name in phased]
    print_results(results, title, notes,
                  layouts=[_layout_name(layouts[r.schedule], placement.num_ranks)
                           for r in results])
    if args.json:
        atomic_write_text(args.json, json.dumps({
            "model": model.name,
            "topology": spec.name,
            "num_nodes": spec.num_nodes,
            "num_ranks": placement.num_ranks,
            "steps": steps,
            **fields,
            "results": [{**r.to_json(), "layout": _layout_json(layouts[r.schedule]),
                         "chunks": chunks.get(r.schedule, (1, ""))[0]}
                        for r in results],
        }, indent=2))
    if args.trace:
        atomic_write_text(args.trace,
                          json.dumps(results[0].simulation.timeline.to_chrome_trace()))
    if args.plot:
        plot_layer_gantt(results[0], args.plot, title)
    return 0


def _check_resources(args, names, options, machine, model, floors=None):
    """Refuse what would not fit in memory or would run for hours, before building
    anything (``cocodiff.simulator.budget``), and again with the planner's ``floors``
    once they are worked out; returns the estimate."""
    from cocodiff.simulator import budget

    plans = {name: budget.distinct_plans(name, args.steps, options, args.activity)
             for name in names}
    planned = args.parallel_layout == AUTO or (
        args.parallel_layout is None and args.activity is None and args.ulysses is None
        and args.ring is None and args.batch is None and machine.num_tiles > model.num_heads)
    record = args.trace is not None or args.plot is not None
    if planned and options.batch == 1 and not record:
        # What the planner simulates, then the schedules on its layouts, folded and
        # extrapolated as they run (docs/hardening.md measures it against runs).
        estimate = budget.estimate_planned(machine, model.num_layers, model.num_heads, plans,
                                           options.chunks, auto_chunks(args), floors)
    else:
        estimate = budget.estimate_simulation(machine, model.num_layers, model.num_heads,
                                              plans, options.chunks, group=args.ulysses)
        if planned:  # the planner ranks the layouts first (an upper bound: it prunes)
            estimate = budget.combine([estimate, budget.estimate_planner(
                machine, model.num_layers, model.num_heads, budget.ranked_schedules(names),
                options.batch, options.chunks)])
    ranks = machine.num_tiles
    budget.check_estimate(estimate, f"simulating {len(names)} schedule(s) of {model.name} on "
                          f"{machine.num_nodes} node(s) ({ranks} ranks)")
    return estimate


@contextmanager
def _progress(jobs: int, estimate_s: float):
    """A progress bar on a terminal's stderr for what is estimated to run long (the
    resource guard's estimate): simulation jobs done of ``jobs``. Yields the callback
    :func:`cocodiff.simulator.fanout.map_local` calls as each one finishes."""
    import sys

    from cocodiff.simulator import budget

    if estimate_s < budget.PROGRESS_S or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("simulating"), BarColumn(), MofNCompleteColumn(),
               TextColumn("jobs"), TimeElapsedColumn(),
               TextColumn(f"(estimated ~{estimate_s:.0f} s of CPU in all)"))
    with Progress(*columns, console=Console(stderr=True, markup=False),
                  transient=True) as bar:
        task = bar.add_task("jobs", total=jobs)
        yield lambda _index: bar.advance(task)


def _jobs(names, context: dict, workers: int) -> list[tuple[str, tuple[int, ...] | None]]:
    """The simulation jobs: (schedule, None) for a schedule's whole run, or (schedule,
    distinct plan indices) for a share of a step-dependent schedule's plans (V-Major: one
    per cache ratio, the longest job by far), one share per worker. The step-dependent
    first; their run plans are built here, into ``context["run_plans"]``, for the workers
    and for :func:`_gathered`."""
    from cocodiff.schedules import get_schedule

    context["run_plans"] = {}
    jobs: list[tuple[str, tuple[int, ...] | None]] = []
    for name in sorted(names, key=lambda name: not get_schedule(name).step_dependent):
        if workers > 1 and get_schedule(name).step_dependent:
            run_plan = context["run_plans"][name] = _run_plan(context, name)
            distinct = tuple(dict.fromkeys(run_plan.step_plans))
            shares = min(workers, len(distinct))
            jobs += [(name, distinct[share::shares]) for share in range(shares)]
        else:
            jobs.append((name, None))
    return jobs


def _run_plan(context: dict, name: str):
    """The schedule's run plan, as :func:`~cocodiff.simulator.simulate.simulate_schedule`
    builds it."""
    from cocodiff.schedules.grid import RankGrid
    from cocodiff.schedules.run_plan import build_run_plan

    model, topology, placement, streams, steps = context["positional"]
    options = context["options"]["options"]
    if name in context["chunks"]:
        options = replace(options, chunks=context["chunks"][name])
    return build_run_plan(name, model, RankGrid.from_placement(topology, placement), streams,
                          steps, options, parallel=context["layouts"][name],
                          activity=context["options"]["activity"])


def _simulate_job(context: dict, job: tuple[str, tuple[int, ...] | None]):
    """One job of :func:`_jobs` (a local worker's): a schedule's run plan
    (:func:`_run_plan`) through :func:`~cocodiff.simulator.simulate.simulate_run_plan`, or
    some of its distinct plans' :func:`~cocodiff.simulator.simulate.simulate_step_plans`."""
    from cocodiff.simulator.simulate import simulate_run_plan, simulate_step_plans

    name, indices = job
    _, topology, placement, _, _ = context["positional"]
    collective, record = context["options"]["collective"], context["options"]["record_spans"]
    if indices is not None:
        steps = simulate_step_plans(context["run_plans"][name], indices, topology, placement,
                                    collective)
        for step in steps.values():
            step.result.simulation = None  # a worker's result must pickle
        return steps
    result = simulate_run_plan(_run_plan(context, name), topology, placement,
                               collective=collective, record_spans=record,
                               known=context["known"].get(name))
    if not record:
        result.simulation = None  # nothing reads it, and a worker's result must pickle
    return result


def _gathered(context: dict, name: str, outputs: list):
    """A schedule's result from its jobs' ``outputs``: the one job's result, or the run's
    plans shared out, put together by
    :func:`~cocodiff.simulator.simulate.simulate_run_plan`."""
    from cocodiff.simulator.simulate import simulate_run_plan

    if name not in context["run_plans"]:
        (result,) = outputs
        return result
    steps = {index: step for out in outputs for index, step in out.items()}
    _, topology, placement, _, _ = context["positional"]
    return simulate_run_plan(context["run_plans"][name], topology, placement,
                             collective=context["options"]["collective"], done=steps)


def _planner_chooses(args, model, num_ranks) -> bool:
    """Whether the planner picks the layouts (:func:`_layouts`); refuses, in one line, a
    layout chosen twice and the planner over an activity trace."""
    layout = explicit_layout(args, num_ranks)
    if layout is not None and args.parallel_layout is not None:
        raise CocodiffError(f"--parallel-layout {args.parallel_layout} and "
                            "--ulysses/--ring/--batch both choose the layout: drop one")
    if layout is not None:
        return False
    choice = args.parallel_layout
    if choice is None:  # pure Ulysses leaves ranks idle past the head count
        auto = num_ranks > model.num_heads and args.activity is None
        choice = AUTO if auto else PURE
    if choice == AUTO and args.activity is not None:
        raise CocodiffError("--activity-trace replays a pure-Ulysses run; it cannot use "
                            "--parallel-layout auto")
    return choice == AUTO


def _layouts(args, names, model, topology, streams, options, collective, num_ranks,
             floors) -> tuple[dict, dict]:
    """Each schedule's parallel layout: None (pure Ulysses), the flags', or the planner's
    (walking ``floors``, :func:`cocodiff.simulator.planner.layout_floors`: given exactly
    when :func:`_planner_chooses`); and the steps the planner simulated for its choices
    (by schedule)."""
    if floors is not None:
        from cocodiff.simulator.planner import choose_layouts

        choices = choose_layouts(model, topology, streams, names, options, collective,
                                 workers=args.workers or local_cores(), floors=floors)
        return ({name: c.layout for name, c in choices.items()},
                {name: c.result for name, c in choices.items() if c.result is not None})
    layout = explicit_layout(args, num_ranks)
    if layout is not None:
        layout.check(num_ranks, model.num_heads, args.batch_size)
        return dict.fromkeys(names, layout), {}
    return dict.fromkeys(names), {}


def _chunks(args, names, model, topology, streams, options, collective, layouts, known
            ) -> dict:
    """Each phased schedule's chunk count (:class:`~cocodiff.simulator.planner.ChunkChoice`):
    the flag's, or under ``--chunks auto`` the planner's fastest on the schedule's layout;
    ``known`` is updated to the steps simulated at the chosen counts."""
    from cocodiff.schedules import get_schedule
    from cocodiff.simulator.planner import ChunkChoice

    phased = [name for name in names if get_schedule(name).phased]
    if not auto_chunks(args) or args.activity is not None:
        return {name: ChunkChoice(options.chunks, {}, None) for name in phased}
    # (ranked schedule, layout) -> choice: cocodiff chooses as vfirst; side by side on the
    # local cores.
    keys = list(dict.fromkeys((get_schedule(name).ranked_as, layouts[name]) for name in phased))
    # The planner's own step of a schedule on its layout, at this chunk count: not re-run.
    planned = {(name, layouts[name]): known[name] for name in known
               if name in layouts and get_schedule(name).ranked_as == name}
    context = (model, topology, streams, options, collective, planned)
    by_ranked = dict(zip(keys, map_local(_choose_chunks, context, keys,
                                         args.workers or local_cores()), strict=True))
    chosen: dict = {}
    for name in phased:
        key = (get_schedule(name).ranked_as, layouts[name])
        choice = by_ranked[key]
        chosen[name] = choice
        if choice.result is not None and key[0] == name:
            known[name] = choice.result
        elif choice.chunks != options.chunks:
            known.pop(name, None)  # the planner's step of the layout was at one chunk
    return chosen


def _choose_chunks(context: tuple, key: tuple):
    """One (schedule, layout)'s :func:`~cocodiff.simulator.planner.choose_chunks` (a local
    worker's job)."""
    from cocodiff.simulator.planner import choose_chunks

    model, topology, streams, options, collective, planned = context
    name, layout = key
    return choose_chunks(name, model, topology, streams, layout, options, collective,
                         known=planned.get(key))


def _layout_name(layout, num_ranks: int) -> str:
    return layout.name if layout is not None else f"pure U{num_ranks}"


def _layout_json(layout) -> dict | None:
    if layout is None:
        return None
    if not hasattr(layout, "ring"):  # a PipelineLayout
        return {"name": layout.name, "pipeline": layout.stages, "ulysses": layout.ulysses,
                "patches": layout.patches, "warmup": layout.warmup,
                "overlap": layout.overlap}
    return {"name": layout.name, "ulysses": layout.ulysses, "ring": layout.ring,
            "batch": layout.batch, "order": list(layout.order)}


def _notes(results, steps, collective, topology, model, placement, layouts=None) -> list[str]:
    from transports.sim import collective_model_for

    model_used = collective or collective_model_for(topology.spec.name)
    notes = [f"collective model: {model_used.describe()}",
             "link bound = the links alone, any schedule; model bound = the schedule's own "
             "collectives at the model's prices (set-up, per-rank rate, links shared "
             "max-min), chunks pipelined, no waiting"]
    flat = next((r for r in results if r.schedule == BASELINE), None)
    for r in results:
        speedup = f", {flat.step_time_s / r.step_time_s:.2f}x over flat" if flat else ""
        notes.append(
            f"{r.schedule}: {steps} steps {sum(r.step_times_s) / len(r.step_times_s) * steps:.3f}"
            f" s{speedup}; all-to-all efficiency {r.efficiency:.2f} of the link bound, "
            f"{r.model_efficiency:.2f} of the model bound "
            f"(simulated {r.simulated_ranks} of {r.num_ranks} ranks"
            + (", folded" if r.folded else "") + f", {r.wall_s:.2f} s wall)"
        )
    device = topology.spec.device
    notes.append(f"compute: the {device.name} kernel model, {topology.spec.compute_mode} "
                 "(docs/compute-model.md)" if device is not None else
                 "compute: the roofline of [tile] tflops and memory_gbps")
    overhead_us = topology.spec.tile_step_overhead_us
    sequence_us = topology.spec.tile_step_overhead_sequence_us
    if overhead_us or sequence_us:
        per_share = (f" + {sequence_us / 1e3:.3g} ms x the rank's share of the sequence "
                     "(step_overhead_sequence_us)" if sequence_us else "")
        notes.append(f"compute includes {overhead_us / 1e3:.3g} ms{per_share} per step and "
                     "rank outside the transformer's blocks, at one core ([tile] "
                     "step_overhead_us)")
    calls = host_call_note(topology.spec)
    if calls:
        notes.append(calls)
    if any((layouts or {}).values()):
        notes.append("layout UxRxB = Ulysses x Ring x batch degrees ('/ring-inner': the Ring "
                     "on the fast tiers); `cocodiff plan` ranks them all")
    heads = model.num_heads
    if placement.num_ranks > heads and not any((layouts or {}).values()):
        notes.append(f"{placement.num_ranks} ranks > {heads} heads: "
                     f"{placement.num_ranks - heads} ranks hold no head during attention "
                     "(the pure-Ulysses limit)")
    return notes
