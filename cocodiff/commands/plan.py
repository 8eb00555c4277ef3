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
from dataclasses import replace
from pathlib import Path
from typing import Any

from cocodiff.layout import (
    DEFAULT_ORDER,
    RING_INNER_ORDER,
    ParallelLayout,
    PipelineLayout,
    parse_degrees,
)
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
    if host is None or not (host.call_cpu_us or host.call_wait_us or host.follow_wait_us):
        return None
    started = (f" ({host.wake_cpu_us:.0f} us less for a call done before its rank waits "
               "for it)" if host.wake_cpu_us else "")
    return (f"this host charges every exchange call {host.call_cpu_us:.0f} us of CPU"
            f"{started} + {host.message_cpu_us:.0f} us per message, a call completing on "
            f"busy cores {host.call_wait_us:.0f} us of waiting and one made straight after "
            f"another {host.follow_wait_us:.0f} us ([host]); each TAPA phase and chunk is a "
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
    parser.add_argument("--compute-mode", default=None, choices=("eager", "compiled"),
                        help="how the run issues its kernels, on a topology with kernel rates "
                        "(its tile's device; docs/compute-model.md): eager PyTorch, or "
                        "torch.compile's fused graph (default: eager)")


def with_compute_mode(machine, args: argparse.Namespace):
    """``machine`` (a ``TopologySpec``) in the ``--compute-mode`` the flags give."""
    import dataclasses

    mode = getattr(args, "compute_mode", None)
    return machine if mode is None else dataclasses.replace(machine, compute_mode=mode)


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
    def chunks(text: str) -> int | str:
        return AUTO if text == AUTO else positive_int(text)

    parser.add_argument("--chunks", type=chunks, default=None, metavar="auto|N",
                        help="pipeline chunks of the phased (TAPA) exchanges: a count, or "
                        "auto (default): the planner simulates 1, 2, 3, 4, 6, 8 on each "
                        "schedule's layout (until two in a row lose) and keeps the fastest")
    add_vmajor_arguments(parser)


def auto_chunks(args: argparse.Namespace) -> bool:
    """Whether the planner chooses the chunk count (``--chunks auto``, the default)."""
    return args.chunks is None or args.chunks == AUTO


def plan_options(args: argparse.Namespace):
    """The :class:`~cocodiff.schedules.PlanOptions` the flags give (one chunk under
    ``--chunks auto`` until the planner chooses: :func:`auto_chunks`)."""
    from cocodiff.schedules import DEFAULT_CHUNKS, PlanOptions, VMajorOptions

    return PlanOptions(dtype=args.dtype, batch=args.batch_size,
                       chunks=DEFAULT_CHUNKS if auto_chunks(args) else args.chunks,
                       vmajor=vmajor_from_arguments(args) or VMajorOptions())


def schedule_names(text: str, pipelines: bool = False) -> list[str]:
    """``--schedule``'s comma-separated names, each checked against the registry (and,
    with ``pipelines``, the pipeline schedules: ``cocodiff.schedules.pipefusion``)."""
    from cocodiff.schedules import get_schedule
    from cocodiff.schedules.pipefusion import PIPELINE_SCHEDULES

    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise CocodiffError("--schedule names no schedule")
    for name in names:
        if not (pipelines and name in PIPELINE_SCHEDULES):
            get_schedule(name)
    return names


def add_plan_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    add_machine_arguments(parser, positive_int)
    parser.add_argument("--schedule", default="flat,tapa,vfirst,pipefusion",
                        help="schedules to rank, comma-separated: Ulysses schedules inside "
                        "each Ulysses group (flat, tapa, vfirst), and pipefusion (pipeline "
                        "stages x Ulysses inside each; docs/pipefusion.md); default: "
                        "flat,tapa,vfirst,pipefusion")
    add_schedule_option_arguments(parser, positive_int)
    parser.add_argument("--pipefusion", type=positive_int, default=None, metavar="N",
                        help="rank only PipeFusion layouts of N stages (default: every stage "
                        "count from 2)")
    parser.add_argument("--patches", type=positive_int, default=None, metavar="M",
                        help="patches a PipeFusion step streams (default: the stage count, "
                        "xDiT's)")
    parser.add_argument("--warmup", type=int, default=1, metavar="W",
                        help="PipeFusion's synchronous warm-up steps (default: 1, xDiT's)")
    parser.add_argument("--pipefusion-overlap", action="store_true",
                        help="model xDiT's engine, whose per-patch scheduler step overlaps "
                        "consecutive steps; `run` does not (default: each step fills and "
                        "drains the pipeline, as `run` executes it)")
    add_degree_arguments(parser, positive_int)
    parser.add_argument("--steps", type=positive_int, default=28,
                        help="denoising steps the plan file covers (default: 28)")
    parser.add_argument("--top", type=positive_int, default=5,
                        help="how many of the best to simulate and print (default 5); the "
                        "others are pruned unsimulated where a lower bound shows they cannot "
                        "enter these")
    parser.add_argument("--json", type=Path, help="write every candidate as JSON here: "
                        "those simulated with their step (`candidates`), those pruned with "
                        "their floor (`pruned`)")
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


def _best_chunks(args, model, topology, streams, best, options, collective):
    """The chunk count of the planner's best (layout, schedule): the flag's, or under
    ``--chunks auto`` the fastest the planner simulates on that layout."""
    from cocodiff.simulator.planner import ChunkChoice, choose_chunks

    if not auto_chunks(args):
        return ChunkChoice(options.chunks, {}, None)
    return choose_chunks(best.schedule, model, topology, streams, best.layout, options,
                         collective)


def _rank_all(args, model, topology, streams, names, pipelined, options, collective,
              forced):
    """The sequence family's candidates and, when ``pipelined``, PipeFusion's, those that
    do not fit the device refused, ranked together with bounds
    (:func:`cocodiff.simulator.ranking.rank_with_floors`: the top ``--top`` simulated, the
    others pruned when their floor is above the ``--top``-th best step time).

    Raises:
        CocodiffError: no layout fits (the line says why for the first refused one).
    """
    from cocodiff.layout import PipelineLayout
    from cocodiff.simulator import budget
    from cocodiff.simulator.fanout import local_cores
    from cocodiff.simulator.pipelines import pipeline_layouts
    from cocodiff.simulator.planner import candidate_layouts
    from cocodiff.simulator.ranking import rank_with_floors

    num_ranks = len(topology.tiles)
    layouts = []
    if names:
        layouts = (candidate_layouts(num_ranks, model.num_heads, options.batch)
                   if forced is None else [forced])
    pipelines = []
    if pipelined and forced is None:
        if args.pipefusion is not None:
            if num_ranks % args.pipefusion:
                raise CocodiffError(f"--pipefusion {args.pipefusion} does not divide the "
                                    f"{num_ranks} ranks")
            pipelines = [PipelineLayout(args.pipefusion, num_ranks // args.pipefusion,
                                        args.patches or args.pipefusion, args.warmup,
                                        args.pipefusion_overlap)]
            pipelines[0].check(num_ranks, model.num_heads, model.num_layers)
        else:
            pipelines = pipeline_layouts(num_ranks, model, args.patches, args.warmup,
                                         args.pipefusion_overlap)
        if pipelines:  # simulated rank by rank: refused here if it would run for hours
            budget.check_estimate(
                budget.estimate_pipelines(topology.spec, model.num_layers, pipelines,
                                          args.steps),
                f"ranking {len(pipelines)} PipeFusion layout(s) of {num_ranks} ranks")
    result = rank_with_floors(model, topology, streams, names, layouts, pipelines, args.steps,
                              options, collective, top=args.top, workers=local_cores())
    if not result.candidates:
        why = f": {result.refused[0]}" if result.refused else ""
        raise CocodiffError(f"no valid layout of {num_ranks} ranks for {model.name} with "
                            f"batch size {args.batch_size}{why}")
    return result


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def plan_command(args: argparse.Namespace) -> int:
    from rich.table import Table

    from cocodiff.runtime.model_names import model_size, model_spec
    from cocodiff.schedules import DEFAULT_CHUNKS, RankGrid, get_schedule
    from cocodiff.schedules.run_plan import build_run_plan
    from cocodiff.simulator import budget
    from cocodiff.util.atomic import atomic_write_text, check_output_paths
    from cocodiff.util.console import plain_console
    from topology import Placement, build_topology, resolve_topology

    check_output_paths((args.json, args.out))
    if args.out is not None and args.json is not None \
            and args.out.resolve() == args.json.resolve():
        raise CocodiffError(f"--json and --out name the same file: {args.out}")
    if args.steps > MAX_STEPS:
        raise CocodiffError(f"--steps {args.steps} is more than {MAX_STEPS}")
    names = schedule_names(args.schedule, pipelines=True)
    pipelined = [name for name in names if name == "pipefusion"]
    names = [name for name in names if name != "pipefusion"]
    if args.warmup < 0:
        raise CocodiffError(f"--warmup must be 0 or more, got {args.warmup}")
    collective = collective_arg(args)
    options = plan_options(args)
    described = with_compute_mode(
        resolve_topology(args.topology or DEFAULT_TOPOLOGY, args.nodes), args)
    model = model_spec(args.model)
    width, height, args.frames = model_size(args.model, args.resolution, args.frames)
    model.check_resolution(width, height)
    if names:
        budget.check_estimate(
            budget.estimate_planner(described, model.num_layers, model.num_heads, names,
                                    options.batch, options.chunks),
            f"ranking the layouts of {described.num_tiles} ranks ({described.num_nodes} "
            "node(s))")
    topology = build_topology(described)
    streams = (model.image_tokens(width, height, args.frames), model.text_tokens)
    # --ulysses/--ring/--batch: rank that layout only (the schedules still compete).
    forced = explicit_layout(args, len(topology.tiles))
    if forced is not None:
        forced.check(len(topology.tiles), model.num_heads, options.batch)
    result = _rank_all(args, model, topology, streams, names, pipelined, options, collective,
                       forced)
    spec = topology.spec
    num_ranks = len(topology.tiles)
    title = (f"{model.name} {width}x{height}: {model.sequence_tokens(width, height, args.frames)}"
             f" tokens, {model.num_heads} heads on {spec.name}, {spec.num_nodes} node(s), "
             f"{num_ranks} ranks; batch {args.batch_size}")
    table = Table(title=title, title_justify="left")
    for column in ("#", "layout", "schedule", "step time", "compute", "comm bound",
                   "memory/rank", "vs best"):
        table.add_column(column, justify="left" if column in ("layout", "schedule") else "right")
    best_s = result.best.step_time_s
    for index, c in enumerate(result.candidates[: args.top], start=1):
        table.add_row(str(index), c.layout.name, c.schedule, f"{c.step_time_s * 1e3:.2f} ms",
                      f"{c.compute_s * 1e3:.2f} ms",
                      f"{c.bound_s * 1e3:.2f} ms" if c.bound_s is not None else "-",
                      f"{c.memory.total_bytes / 1e9:.1f} GB" if c.memory else "-",
                      f"{c.step_time_s / best_s:.2f}x")
    plain_console(width=200).print(table)
    layouts = len({c.layout.name for c in (*result.candidates, *result.pruned)})
    print("note: layout UxRxB = Ulysses x Ring x batch degrees; '/ring-inner' places the Ring "
          "on the fast tiers; PnxUuxMm/wW = PipeFusion's n stages x Ulysses u inside each, m "
          "patches, W warm-up steps, '/overlap' consecutive steps overlapped as in xDiT "
          "(its step time: the mean over the whole generation); comm "
          "bound = the links' lower bound for the step's exchanges; memory/rank: weights, "
          "buffers and the largest transient of one layer (cocodiff/memory.py)")
    for line in result.refused:
        print(f"note: refused: {line}")
    best = result.best
    pipeline_best = isinstance(best.layout, PipelineLayout)
    if pipeline_best:
        flags = (f"--schedule pipefusion --pipefusion {best.layout.stages} --patches "
                 f"{best.layout.patches} --warmup {best.layout.warmup} (Ulysses "
                 f"{best.layout.ulysses} inside each stage)"
                 + (" --pipefusion-overlap, which `run` refuses: a simulation of xDiT's "
                    "engine" if best.layout.overlap else ""))
    else:
        flags = (f"--ulysses {best.layout.ulysses} --ring {best.layout.ring} --batch "
                 f"{best.layout.batch}"
                 + (" --ring-inner" if best.layout.order == RING_INNER_ORDER
                    and best.layout.ring > 1 and best.layout.ulysses > 1 else "")
                 + f" --schedule {best.schedule}")
    pairs = len(result.candidates) + len(result.pruned)
    print(f"note: ranked {pairs} (layout, schedule) pairs over {layouts} layouts in "
          f"{result.wall_s:.2f} s; best: {flags}")
    if result.pruned:
        print(f"note: {len(result.candidates)} simulated; {len(result.pruned)} pruned "
              "unsimulated: a lower bound on each one's step time (its floor: compute, and "
              "its own messages at their fastest) is above the "
              f"{_ordinal(min(args.top, len(result.candidates)))} best step time, so none can "
              f"enter the top {args.top} (--json lists them with their floor)")
    calls = host_call_note(spec)
    if calls:
        print(f"note: {calls}")
    if pipeline_best and best.layout.warmup < args.steps:
        # A pick that trades exactness for speed must say so, as V-Major's quality is
        # always reported beside its speed.
        print(f"note: {best.layout.name} is lossy: after its {best.layout.warmup} warm-up "
              "step(s) each patch attends to the other patches' K/V from the step before; "
              "`cocodiff run --reference` reports its PSNR and SSIM against the exact run "
              "(every step synchronous: --warmup equal to --steps)")
    if pipeline_best:
        from cocodiff.simulator.planner import ChunkChoice

        chunks = ChunkChoice(options.chunks, {}, None)
    else:
        chunks = _best_chunks(args, model, topology, streams, best, options, collective)
        options = replace(options, chunks=chunks.chunks)
        if get_schedule(best.schedule).phased:  # flat has no phases to cut
            print(f"note: chunks of {best.layout.name} {best.schedule}: "
                  f"{chunks.describe()}" + (f"; the table ranks at {DEFAULT_CHUNKS} chunk(s)"
                                            if auto_chunks(args) else ""))
    run_plan = None
    if args.out:
        grid = RankGrid.from_placement(topology, Placement.node_major(topology))
        run_plan = build_run_plan(
            best.schedule, model, grid, streams, args.steps, options,
            parallel=None if pipeline_best else best.layout, resolution=(width, height),
            frames=args.frames,
            machine={"topology": args.topology or DEFAULT_TOPOLOGY,
                     "nodes": described.num_nodes},
            pipeline=best.layout if pipeline_best else None)
        print(f"note: wrote the plan of {best.layout.name} {best.schedule} for {args.steps} "
              f"steps to {args.out} (sha256 {run_plan.sha256[:12]})")
    if args.json:
        atomic_write_text(args.json, json.dumps({
            "model": model.name, "topology": spec.name, "num_nodes": spec.num_nodes,
            "num_ranks": num_ranks, "resolution": [width, height], "frames": args.frames,
            "batch_size": args.batch_size, "planner_wall_s": result.wall_s,
            "chunks": options.chunks, "chunks_auto": auto_chunks(args),
            "chunk_step_times_s": {str(c): t for c, t in chunks.step_times_s.items()},
            "candidates": [c.to_json() for c in result.candidates],
            "pruned": [c.to_json() for c in result.pruned]}, indent=2))
    if run_plan is not None:
        atomic_write_text(args.out, run_plan.to_json())
    return 0
