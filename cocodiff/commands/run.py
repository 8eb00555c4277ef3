"""``cocodiff run``: one denoising job on every rank of a launch.

Single process, under ``mpiexec -n N`` or under ``torchrun --nproc-per-node N``: every
rank loads the same model, the transformer is parallelised over the transport, and
rank 0 shows progress and writes the outputs (each written whole or not at all).
Errors that every rank hits the same way (a bad model directory) are printed once, by
rank 0; every rank exits non-zero.

Failures never hang the job:

* every wait on a peer is bounded by ``--timeout`` (both transports); a rank whose peer
  died or went silent prints one line naming itself and what it waited for, and exits 1;
  under mpiexec it then ends the whole job (``MPI_Abort``), since mpiexec would leave a
  silent peer running and MPI_Finalize may wait for a dead one;
* SIGINT and SIGTERM raise in the main thread, so ``finally`` blocks run (a half-written
  output's temporary file is removed) and the rank exits ``128 + signal``; a second signal
  ends it at once;
* NaN or Inf in a step stops the run with the step and layer (``--no-guards`` turns the
  checks off), before anything is written.

``COCODIFF_FAULT`` injects a failure for tests (:mod:`cocodiff.runtime.faults`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cocodiff.commands.plan import (
    AUTO,
    add_degree_arguments,
    add_vmajor_arguments,
    explicit_layout,
    vmajor_from_arguments,
)
from cocodiff.util.errors import CocodiffError, one_line

DTYPES = ("float32", "bfloat16")
# Defaults of the flags a plan file fixes (None on the parser: "given" is then visible).
DEFAULTS = {"model": "tiny-flux", "schedule": "flat", "steps": 4, "dtype": "float32"}
# Flags that say what a plan file already says: refused beside --plan.
PLAN_FIXES = ("schedule", "steps", "dtype", "resolution", "frames", "layout", "ulysses", "ring",
              "batch", "chunks", "vmajor_ratio_schedule", "vmajor_warmup", "vmajor_refresh")
# --timeout above this is a typo, not a wish: gloo's timeout is in int milliseconds.
MAX_TIMEOUT_S = 1e6
# torch.Generator.manual_seed accepts [-2**63, 2**64).
SEED_RANGE = range(-(2**63), 2**64)
EXIT_FAILURE = 1
ABORT_GRACE_S = 0.5
EXIT_USAGE = 2


class RankFailure(CocodiffError):
    """Something that stops the job on every rank."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; raised in the main thread so that cleanups run."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


def add_run_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    parser.add_argument("--plan", type=Path, default=None, metavar="PATH",
                        help="execute this plan file (`cocodiff plan ... --out PATH`): it fixes "
                        "the schedule, steps, dtype, resolution, rank grid and layout; the "
                        "launch must have its rank count")
    parser.add_argument("--model", default=None,
                        help="tiny-flux, tiny-sd3, tiny-qwen, tiny-wan, tiny-pixart, "
                        "tiny-digits (trained on 8x8 digits; the prompt is a digit), or a local "
                        "diffusers pipeline directory (default: tiny-flux, or the plan's model)")
    parser.add_argument("--prompt", default=None,
                        help="the text prompt (default: 3 for tiny-digits, else 'a lighthouse "
                        "on a cliff at dawn')")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="denoising steps (default 4)")
    parser.add_argument("--resolution", default=None,
                        help="PIXELS or WIDTHxHEIGHT (default: the model's)")
    parser.add_argument("--frames", type=positive_int, default=None,
                        help="video frames (video models; default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial noise")
    parser.add_argument("--schedule", default=None,
                        help="plan schedule: flat, tapa, vfirst or cocodiff; or diffusers: "
                        "diffusers' own Ulysses context parallelism, torch transport only "
                        "(default: flat)")
    parser.add_argument("--layout", default=None, metavar="NODESxGPUSxTILES|auto",
                        help="where the launched ranks sit, e.g. 2x4x1: rank r on node "
                        "r // (GPUS*TILES); the product must be the number of ranks. tapa and "
                        "vfirst carry each all-to-all as one phase per level with more than one "
                        "member (default: the nodes the launch spans, found by host and "
                        "network namespace, one GPU per rank; on one node they carry each "
                        "all-to-all flat, like flat). auto: those nodes, and the planner "
                        "chooses the Ulysses x Ring x batch degrees (`cocodiff plan`)")
    add_degree_arguments(parser, positive_int)
    parser.add_argument("--chunks", type=positive_int, default=None,
                        help="pipeline chunks of TAPA exchanges (tapa, vfirst, cocodiff; "
                        "default: 1)")
    add_vmajor_arguments(parser)
    parser.add_argument("--record-activity", type=Path, default=None, metavar="PATH",
                        help="cocodiff: write the V blocks each rank sent over the inter-node "
                        "tier, step by step (JSON, cocodiff-activity/1; `cocodiff simulate "
                        "--activity-trace PATH` replays it)")
    parser.add_argument("--reference", action="store_true",
                        help="cocodiff: also run the exact plan (V-Major off) and report PSNR "
                        "and SSIM of the image and the max abs error of the latents against it "
                        "(tiny-digits: and the digit its classifier reads in each image)")
    parser.add_argument("--transport", default="auto",
                        help="auto, torch or mpi (auto: mpi under mpiexec when mpi4py is "
                        "installed, else torch)")
    parser.add_argument("--dtype", default=None, choices=DTYPES,
                        help="activation dtype (default float32)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds a rank waits for its peers before giving up (default 60)")
    parser.add_argument("--output", type=Path, default=None, help="write the image here (PNG)")
    parser.add_argument("--json", type=Path, default=None, help="write timings as JSON here")
    parser.add_argument("--save-latents", type=Path, default=None,
                        help="write the final latents here (torch.save of one tensor)")
    parser.add_argument("--latents-format", default="diffusers",
                        choices=("diffusers", "unpacked"),
                        help="diffusers: what the pipeline returns with output_type='latent' "
                        "(FLUX and Qwen-Image packed 2x2; default); unpacked: the VAE's "
                        "layout (batch, channels, [frames,] height/8, width/8), float32")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--no-guards", action="store_true",
                        help="do not check each step for NaN/Inf (one isfinite per attention "
                        "layer and step)")


def run_command(args: argparse.Namespace) -> int:
    from transports.launch import detect_launch

    launch = detect_launch()
    is_root = launch.rank == 0
    with raise_on_signals() as signals:
        try:
            try:
                return _run(args, launch)
            finally:
                # Once the run is over (done or failing), a signal (the launcher ending
                # the job) must not interrupt the reporting below with a traceback.
                signals.disarm()
        except CocodiffError as error:
            _report(is_root, str(error))
            return EXIT_USAGE
        except (ValueError, FileNotFoundError) as error:
            _report(is_root, str(error.args[0] if error.args else error))
            return EXIT_USAGE
        except Interrupted as interrupt:
            print(f"cocodiff run: rank {launch.rank}: interrupted by {interrupt.signal_name}",
                  file=sys.stderr, flush=True)
            return 128 + interrupt.signum
        except Exception as error:  # a peer died, a timeout, NaN: say so on every rank that saw it
            print(f"cocodiff run: rank {launch.rank}: {type(error).__name__}: "
                  f"{one_line(_first_line(error))}", file=sys.stderr, flush=True)
            _end_job_after_failure(launch)
            return EXIT_FAILURE


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


# torchrun kills every rank as soon as one exits non-zero; a user error that every rank
# hits must leave rank 0 the time to print its line first.
_NON_ROOT_EXIT_DELAY_S = 2.0


def _report(is_root: bool, message: str) -> None:
    if is_root:
        print(f"cocodiff run: error: {one_line(message)}", file=sys.stderr, flush=True)
    else:
        time.sleep(_NON_ROOT_EXIT_DELAY_S)


class _SignalsRaise:
    """SIGINT and SIGTERM raise :class:`Interrupted` until :meth:`disarm`; after that the
    first one is ignored. Either way a second signal ends the process at once (the default
    action), without waiting for the cleanups the first one started."""

    WATCHED = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.armed = True

    def handler(self, signum: int, frame: Any) -> None:
        for sig in self.WATCHED:
            signal.signal(sig, signal.SIG_DFL)
        if self.armed:
            raise Interrupted(signum)

    def disarm(self) -> None:
        self.armed = False


@contextmanager
def raise_on_signals() -> Iterator[_SignalsRaise]:
    """Turn SIGINT and SIGTERM into :class:`Interrupted` for the duration (or until the
    yielded object's ``disarm()``), so that ``finally`` blocks and temporary-file cleanups
    run; the previous handlers are restored after."""
    signals = _SignalsRaise()
    try:
        previous = {sig: signal.signal(sig, signals.handler) for sig in signals.WATCHED}
    except ValueError:  # not the main thread: signals go to the main thread anyway
        yield signals
        return
    try:
        yield signals
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _end_job_after_failure(launch) -> None:
    """Under mpiexec, end every rank now: mpiexec leaves a silent peer running, and
    MPI_Finalize at exit may wait forever for a dead one."""
    from transports.launch import MPIEXEC

    mpi = sys.modules.get("mpi4py.MPI")
    if launch.launcher != MPIEXEC or mpi is None:
        return
    if mpi.Is_initialized() and not mpi.Is_finalized():
        sys.stdout.flush()
        sys.stderr.flush()
        # mpiexec forwards output asynchronously and drops what it has not forwarded when
        # the abort reaches it: give the line just printed time to get out.
        time.sleep(ABORT_GRACE_S)
        mpi.COMM_WORLD.Abort(EXIT_FAILURE)


def _check_arguments(args: argparse.Namespace) -> None:
    """Everything about the arguments that can be checked before the expensive imports."""
    from cocodiff.models import parse_resolution
    from cocodiff.runtime.baseline import BASELINES
    from cocodiff.schedules import get_schedule
    from cocodiff.util.atomic import check_output_paths
    from transports.registry import AUTO, TRANSPORTS, create_transport

    if args.schedule not in BASELINES:  # a baseline is not a plan schedule
        get_schedule(args.schedule)
    if args.transport != AUTO and args.transport not in TRANSPORTS:
        create_transport(args.transport)  # raises the registry's one-line error
    outputs = [path for path in (args.output, args.json, args.save_latents,
                                 args.record_activity) if path is not None]
    check_output_paths(outputs)
    if len({path.resolve() for path in outputs}) != len(outputs):
        raise CocodiffError(f"--output, --json, --save-latents and --record-activity name the "
                            f"same file: {', '.join(map(str, outputs))}")
    vmajor = vmajor_from_arguments(args)  # raises on values out of range
    lossy_only = [flag for flag, given in (("--vmajor-*", vmajor is not None),
                                           ("--record-activity", args.record_activity),
                                           ("--reference", args.reference)) if given]
    if lossy_only and (args.schedule in BASELINES
                       or not get_schedule(args.schedule).step_dependent):
        raise CocodiffError(f"{', '.join(lossy_only)}: V-Major options, for --schedule "
                            f"cocodiff (the {args.schedule} schedule is exact)")
    if not (math.isfinite(args.timeout) and 0 < args.timeout <= MAX_TIMEOUT_S):
        raise CocodiffError(f"--timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, "
                            f"got {args.timeout}")
    if args.seed not in SEED_RANGE:
        raise CocodiffError(f"--seed must be in [-2**63, 2**64), got {args.seed}")
    if args.resolution is not None:
        parse_resolution(args.resolution)
    if args.chunks is not None and (args.schedule in BASELINES
                                    or not get_schedule(args.schedule).phased):
        raise CocodiffError("--chunks pipelines the phases of tapa and vfirst exchanges; "
                            f"{args.schedule} has none")


def _apply_plan_file(args: argparse.Namespace, world_size: int):
    """``--plan``: read the plan file and take from it what the flags would say (refusing
    the flags it fixes); without it, the flags' defaults. Returns the plan, or None.

    Raises:
        CocodiffError: the file is unreadable or malformed, a flag it fixes was given,
            or it is for another rank count.
    """
    if args.plan is None:
        for name, value in DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        return None
    from cocodiff.plan.file import load_run_plan

    given = [name for name in PLAN_FIXES if getattr(args, name) not in (None, False)]
    if args.ring_inner:
        given.append("ring_inner")
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise CocodiffError(f"--plan fixes {flags}: drop {'it' if len(given) == 1 else 'them'}"
                            " (or make another plan)")
    run_plan = load_run_plan(args.plan)
    if run_plan.num_ranks != world_size:
        raise CocodiffError(f"the plan {args.plan} is for {run_plan.num_ranks} ranks, the "
                            f"launch has {world_size}")
    if run_plan.options.dtype not in DTYPES:
        raise CocodiffError(f"the plan's dtype {run_plan.options.dtype} does not run here; "
                            f"valid: {', '.join(DTYPES)}")
    args.model = args.model or run_plan.spec.name
    args.schedule = run_plan.schedule
    args.steps = run_plan.num_steps
    args.dtype = run_plan.options.dtype
    width, height = run_plan.resolution
    args.resolution, args.frames = f"{width}x{height}", run_plan.frames
    return run_plan


def parse_layout(text: str) -> tuple[int, int, int]:
    """``NODESxGPUSxTILES`` (e.g. ``2x4x1``) -> (nodes, GPUs per node, tiles per GPU).

    Raises:
        CocodiffError: not three positive integers joined by ``x``.
    """
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(part.isdecimal() and int(part) > 0 for part in parts):
        raise CocodiffError(f"--layout must be NODESxGPUSxTILES with positive integers, "
                            f"e.g. 2x4x1; got {text!r}")
    nodes, gpus, tiles = map(int, parts)
    return nodes, gpus, tiles


def rank_grid(layout: str | None, num_ranks: int):
    """The :class:`~cocodiff.schedules.RankGrid` of ``--layout`` over ``num_ranks``
    ranks (node-major), or None (no layout: the runtime's default line of ranks).

    Raises:
        CocodiffError: a malformed layout, or one that does not hold ``num_ranks`` ranks.
    """
    from cocodiff.schedules import RankGrid

    if layout is None or layout == AUTO:
        return None
    shape = parse_layout(layout)
    if shape[0] * shape[1] * shape[2] != num_ranks:
        raise CocodiffError(f"--layout {layout} holds {shape[0] * shape[1] * shape[2]} ranks, "
                            f"the launch has {num_ranks}")
    return RankGrid(shape, tuple(range(num_ranks)))


def launched_grid(transport):
    """The nodes the launch spans (host and network namespace), one GPU per rank, as a
    rank grid; None when every rank is on one node (collective).

    Raises:
        PlacementError: the ranks are not node-major on equal nodes.
    """
    from cocodiff.runtime.nodes import detect_nodes, node_major_shape
    from cocodiff.schedules import RankGrid

    num_nodes, per_node = node_major_shape(detect_nodes(transport))
    if num_nodes == 1:
        return None
    return RankGrid((num_nodes, per_node, 1), tuple(range(transport.world_size)))


def _explicit_parallel(args: argparse.Namespace, num_ranks: int):
    """The Ulysses x Ring x batch layout the flags give (None: pure Ulysses, or the
    planner's under ``--layout auto``), checked before any collective."""
    from cocodiff.runtime.baseline import BASELINES

    parallel = explicit_layout(args, num_ranks)
    if parallel is not None and args.layout == AUTO:
        raise CocodiffError("--layout auto lets the planner choose the degrees: drop "
                            "--ulysses/--ring/--batch, or give --layout NODESxGPUSxTILES")
    if parallel is None and args.layout != AUTO:
        return None
    if args.schedule in BASELINES:
        raise CocodiffError(f"--schedule {args.schedule} runs pure Ulysses only; Ring and batch "
                            "layouts run flat, tapa, vfirst and cocodiff")
    return parallel


def _planned_parallel(pipe, grid, num_ranks: int, width: int, height: int, frames: int):
    """``--layout auto``: the planner's layout for this model on a one-node machine of
    ``num_ranks`` ranks (the `cluster` preset; the ranks' grid when one is given)."""
    from cocodiff.models import spec_from_config
    from cocodiff.simulator.planner import rank_layouts
    from topology import build_topology
    from topology.presets import cluster

    transformer = pipe.transformer
    spec = spec_from_config({"_class_name": type(transformer).__name__,
                             **dict(transformer.config)}, name=type(transformer).__name__)
    nodes, gpus, tiles = grid.shape if grid is not None else (1, num_ranks, 1)
    topology = build_topology(cluster(num_nodes=nodes, ranks_per_node=gpus * tiles))
    streams = (spec.image_tokens(width, height, frames), spec.text_tokens)
    return rank_layouts(spec, topology, streams).best.layout


def _run(args: argparse.Namespace, launch) -> int:
    from cocodiff.runtime.faults import fault_from_env, install_faults

    fault = fault_from_env()  # read once; None (and nothing installed) when unset
    # Every rank checks the plan, the flags and the layout before any collective: all of
    # them stop, none hangs.
    run_plan = _apply_plan_file(args, launch.world_size)
    _check_arguments(args)
    if run_plan is not None:
        grid, parallel = run_plan.grid, run_plan.parallel
    else:
        grid = rank_grid(args.layout, launch.world_size)
        parallel = _explicit_parallel(args, launch.world_size)
    if args.record_activity and (not launch.is_distributed
                                 or grid is not None and grid.shape[0] == 1):
        raise CocodiffError("--record-activity: V-Major acts on the inter-node tier; launch "
                            "ranks on more than one node (or give such a --layout)")

    import torch

    from cocodiff.runtime.quiet import quiet_libraries

    # Library chatter (tokenizer length notes, deprecations, loading bars) would drown the
    # one line a user needs.
    quiet_libraries()

    from cocodiff.quality import compare
    from cocodiff.runtime.baseline import BASELINES
    from cocodiff.runtime.digits import READERS, read_agreement
    from cocodiff.runtime.guards import NumericsGuard
    from cocodiff.runtime.parallel import UlyssesRuntime, parallelize
    from cocodiff.runtime.pipelines import decode, load_pipeline, run_pipeline, tiny_name_of
    from cocodiff.runtime.tiny import DEFAULT_PROMPT, TINY_DEFAULTS
    from cocodiff.runtime.vmajor import gather_activity
    from cocodiff.schedules import DEFAULT_CHUNKS, PlanOptions, VMajorOptions
    from cocodiff.util.atomic import atomic_write_text
    from transports.registry import create_transport

    transport = None
    if launch.is_distributed:
        transport = create_transport(args.transport, timeout_s=args.timeout)
    try:
        transport, step_fault = install_faults(fault, transport, launch.rank)
        if transport is not None:
            # Ranks on other hosts may read another file of the same name: agree on content.
            _agree_on_arguments(transport, [*sys.argv[1:]]
                                + ([run_plan.sha256] if run_plan is not None else []))
            if grid is None:
                grid = launched_grid(transport)
            if args.record_activity and grid is None:
                raise CocodiffError("--record-activity: V-Major acts on the inter-node tier, "
                                    "and every rank is on one node; give --layout")
        dtype = getattr(torch, args.dtype)
        pipe = load_pipeline(args.model, dtype)
        tiny = tiny_name_of(args.model)
        if args.prompt is None:
            args.prompt = TINY_DEFAULTS[tiny].prompt if tiny else DEFAULT_PROMPT
        width, height, frames = _size(args, tiny)
        # Tiny models use short prompts; real ones keep their pipeline's default length.
        text_tokens = TINY_DEFAULTS[tiny].max_sequence_length if tiny else None
        runtime = None
        if transport is not None and args.schedule in BASELINES:
            runtime = BASELINES[args.schedule](pipe, transport)
        elif transport is not None:
            if args.layout == AUTO:
                parallel = _planned_parallel(pipe, grid, launch.world_size, width, height,
                                             frames)
            options = PlanOptions(chunks=args.chunks or DEFAULT_CHUNKS,
                                  vmajor=vmajor_from_arguments(args) or VMajorOptions())
            if parallel is not None and not parallel.is_pure_ulysses:
                from cocodiff.runtime.hybrid import parallelize_hybrid

                runtime = parallelize_hybrid(pipe, transport, args.schedule, parallel, grid,
                                             options=options, run_plan=run_plan)
            else:
                runtime = parallelize(pipe, transport, args.schedule, grid, options=options,
                                      run_plan=run_plan)
        ulysses = runtime if isinstance(runtime, UlyssesRuntime) else None
        guard = None if args.no_guards else NumericsGuard(launch.rank).install(pipe.transformer)
        step_times: list[float] = []
        # This rank's traffic after each step: bytes sent per tier, exchanges started.
        traffic: list[list[float]] = []
        with _progress(is_root=launch.rank == 0 and not args.quiet, steps=args.steps) as advance:
            last = time.perf_counter()
            started = last

            def on_step(done: int, total: int) -> None:
                nonlocal last
                now = time.perf_counter()
                step_times.append(now - last)
                last = now
                if guard is not None:
                    guard.end_step()
                if ulysses is not None:
                    traffic.append([*ulysses.bytes_by_tier.values(), ulysses.exchanges_started])
                if step_fault is not None:
                    step_fault.after_step(done)
                advance()

            if ulysses is not None:
                ulysses.start_generation(args.steps)
            latents = run_pipeline(pipe, args.prompt, args.steps, width, height, frames,
                                   args.seed, on_step, max_sequence_length=text_tokens)
            total_s = time.perf_counter() - started
        if guard is not None:
            guard.check_latents(latents)
        traffic_record = _traffic_per_step(transport, ulysses, traffic)
        vmajor_report, activity = None, None
        if ulysses is not None and ulysses.vmajor is not None:
            vmajor_report, activity = gather_activity(ulysses)
        reference = None
        if args.reference:
            reference = latents  # one process: nothing is lossy
            if ulysses is not None:
                reference = _exact_reference(args, pipe, ulysses, guard, launch.rank == 0,
                                             (width, height, frames), text_tokens)
        if launch.rank == 0:
            record: dict[str, Any] = {}
            if vmajor_report is not None:
                record["vmajor"] = vmajor_report.to_json()
                print(vmajor_report.summary(), flush=True)
            image = None
            if reference is not None:
                image = decode(pipe, latents)
                reference_image = decode(pipe, reference)
                quality = compare(reference, latents, reference_image, image)
                record["quality"] = quality.to_json()
                print(f"quality against the exact plan: {quality.summary()}", flush=True)
                if tiny in READERS:
                    agreement = read_agreement(READERS[tiny](), args.prompt, reference_image,
                                               image)
                    record["quality"]["classifier"] = agreement.to_json()
                    print(agreement.summary(), flush=True)
            if args.record_activity and activity is not None:
                atomic_write_text(args.record_activity, activity.to_json())
            _write_outputs(args, pipe, latents, image, {
                "model": args.model,
                "num_ranks": launch.world_size,
                "schedule": args.schedule,
                "layout": list(grid.shape) if grid else None,
                "parallel": parallel.name if parallel is not None else None,
                "transport": transport.name if transport else "none",
                "steps": args.steps,
                "resolution": [width, height],
                "frames": frames,
                "step_times_s": step_times,
                "total_s": total_s,
                "comm_s": runtime.comm_s if runtime else 0.0,
                "plan_sha256": (ulysses.run_plan.sha256 if ulysses is not None
                                and ulysses.run_plan is not None
                                else run_plan.sha256 if run_plan is not None else None),
                **traffic_record,
                "output": str(args.output) if args.output else None,
                **record,
            })
        if transport is not None:
            transport.barrier()
    finally:
        if transport is not None:
            transport.close()
    return 0


def _traffic_per_step(transport, runtime, traffic: list[list[float]]) -> dict[str, Any]:
    """What every rank's exchanges moved, summed over the ranks: bytes sent to other ranks
    per link tier (the mean of a denoising step) and exchanges started in each step, as
    ``cocodiff simulate`` reports them for the same plan. Collective: every rank calls it."""
    if runtime is None or not traffic:
        return {}
    import torch

    from cocodiff.runtime.exchange import all_gather_rows

    # (steps, tiers + 1), cumulative -> per step
    mine = torch.tensor(traffic, dtype=torch.float64)
    mine = torch.diff(mine, dim=0, prepend=torch.zeros_like(mine[:1]))
    # (ranks, steps, tiers + 1) -> summed over the ranks
    total = all_gather_rows(transport, mine.unsqueeze(0)).sum(dim=(0, 1))
    tiers = list(runtime.bytes_by_tier)
    steps = total.shape[0]
    return {
        "bytes_by_tier": {tier: float(total[:, i].sum()) / steps for i, tier in enumerate(tiers)},
        "exchanges_per_step": [int(n) for n in total[:, len(tiers)].tolist()],
    }


def _exact_reference(args: argparse.Namespace, pipe, runtime, guard, is_root: bool,
                     size: tuple[int, int, int], text_tokens: int | None):
    """The same generation with V-Major off (TAPA + V-First, exact): the final latents."""
    from cocodiff.runtime.pipelines import run_pipeline

    options, runtime.vmajor = runtime.vmajor, None
    try:
        runtime.start_generation(args.steps)
        with _progress(is_root=is_root and not args.quiet, steps=args.steps,
                       label="exact reference") as advance:
            def on_step(done: int, total: int) -> None:
                if guard is not None:
                    guard.end_step()
                advance()

            latents = run_pipeline(pipe, args.prompt, args.steps, *size, args.seed, on_step,
                                   max_sequence_length=text_tokens)
    finally:
        runtime.vmajor = options
    if guard is not None:
        guard.check_latents(latents)
    return latents


def _size(args: argparse.Namespace, tiny: str | None) -> tuple[int, int, int]:
    from cocodiff.models import parse_resolution
    from cocodiff.runtime.tiny import default_resolution

    width, height, frames = default_resolution(tiny) if tiny else (1024, 1024, 1)
    if args.resolution is not None:
        width, height = parse_resolution(args.resolution)
    if args.frames is not None:
        frames = args.frames
    return width, height, frames


def _agree_on_arguments(transport, argv: list[str]) -> None:
    """Every rank must run the same command: compare a digest of the arguments."""
    import torch

    from cocodiff.runtime.exchange import all_gather_rows

    digest = hashlib.sha256("\0".join(argv).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    everyone = all_gather_rows(transport, mine).flatten().tolist()
    differing = [rank for rank, value in enumerate(everyone) if value != everyone[0]]
    if differing:
        raise RankFailure(
            f"ranks disagree on arguments: ranks {differing} differ from rank 0"
        )


class _progress:
    """A rich progress bar over denoising steps on rank 0; nothing elsewhere."""

    def __init__(self, is_root: bool, steps: int, label: str = "denoising") -> None:
        self._enabled = is_root
        self._steps = steps
        self._label = label
        self._bar: Any = None

    def __enter__(self):
        if not self._enabled:
            return lambda: None
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn(self._label), BarColumn(), TextColumn("{task.completed}/"
                             "{task.total}"), TimeElapsedColumn(), transient=False)
        self._bar.start()
        task = self._bar.add_task("steps", total=self._steps)
        return lambda: self._bar.advance(task)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


def _write_outputs(args: argparse.Namespace, pipe, latents, image, record: dict) -> None:
    """Write what was asked for; ``image``: the decoded latents, or None (decoded here)."""
    import torch

    from cocodiff.runtime.pipelines import decode, diffusers_latents
    from cocodiff.util.atomic import atomic_write, atomic_write_text

    if args.save_latents:
        saved = latents if args.latents_format == "unpacked" else diffusers_latents(pipe, latents)
        atomic_write(args.save_latents, lambda tmp: torch.save(saved.detach().cpu(), tmp))
    if args.output:
        image = decode(pipe, latents) if image is None else image
        if isinstance(image, list):  # video: the frames side by side
            from PIL import Image

            strip = Image.new("RGB", (image[0].width * len(image), image[0].height))
            for index, frame in enumerate(image):
                strip.paste(frame, (index * frame.width, 0))
            image = strip
        atomic_write(args.output, lambda tmp: image.save(tmp, format="PNG"))
    if args.json:
        atomic_write_text(args.json, json.dumps(record, indent=2))
