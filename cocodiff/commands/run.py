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

``COCODIFF_FAULT`` injects a failure for tests (:mod:`cocodiff.runtime.faults`). This
module reads and checks the flags; the job itself is :mod:`cocodiff.runtime.job`, the
failure handling :mod:`cocodiff.runtime.failures`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from cocodiff.commands.given import record_given, refuse_plan_fixed
from cocodiff.commands.plan import (
    AUTO,
    PURE,
    add_degree_arguments,
    add_vmajor_arguments,
    explicit_layout,
    vmajor_from_arguments,
)
from cocodiff.models import TINY_NAMES
from cocodiff.runtime.failures import (
    EXIT_FAILURE,
    Interrupted,
    end_job_after_failure,
    raise_on_signals,
)
from cocodiff.util.errors import CocodiffError, one_line

DTYPES = ("float32", "bfloat16")
# --model without --plan (with it, the plan's model).
DEFAULT_MODEL = "tiny-flux"
# Flags (dests) that say what a plan file already says: refused beside --plan at any value
# (--layout is the old name of --grid and of --parallel-layout auto).
PLAN_FIXES = ("schedule", "steps", "dtype", "resolution", "frames", "grid", "layout",
              "parallel_layout", "ulysses", "ring", "batch", "ring_inner", "chunks",
              "vmajor_ratio_schedule", "vmajor_warmup", "vmajor_refresh", "pipefusion",
              "warmup", "patches")
# --timeout above this is a typo, not a wish: gloo's timeout is in int milliseconds.
MAX_TIMEOUT_S = 1e6
# PipeFusion's synchronous warm-up steps when --warmup is not given (xDiT's default).
DEFAULT_WARMUP = 1
# torch.Generator.manual_seed accepts [-2**63, 2**64).
SEED_RANGE = range(-(2**63), 2**64)
EXIT_USAGE = 2
# Why `run` executes no plan with overlapping PipeFusion steps (cocodiff.layout.PipelineLayout).
OVERLAP_REFUSED = ("run executes diffusers' loop, whose scheduler steps the whole latents "
                   "between two transformer calls, so each PipeFusion step fills and drains "
                   "the pipeline; overlapping steps (xDiT's engine) are for `cocodiff plan "
                   "--pipefusion-overlap` and `simulate --plan` only (make the plan without "
                   "--pipefusion-overlap to run it)")


def add_run_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    record_given(parser)  # --plan refuses the flags it fixes, given at any value
    parser.add_argument("--plan", type=Path, default=None, metavar="PATH",
                        help="execute this plan file (`cocodiff plan ... --out PATH`): it fixes "
                        "the schedule, steps, dtype, resolution, rank grid and layout; the "
                        "launch must have its rank count")
    parser.add_argument("--model", default=None,
                        help=f"a built-in tiny model ({', '.join(TINY_NAMES)}; tiny-digits is "
                        "trained on 8x8 digits and its prompt is a digit), or a local diffusers "
                        "pipeline directory (default: tiny-flux, or the plan's model)")
    parser.add_argument("--prompt", default=None,
                        help="the text prompt (default: 3 for tiny-digits, else 'a lighthouse "
                        "on a cliff at dawn')")
    parser.add_argument("--steps", type=positive_int, default=4,
                        help="denoising steps (default 4)")
    parser.add_argument("--resolution", default=None,
                        help="PIXELS or WIDTHxHEIGHT (default: the model's)")
    parser.add_argument("--frames", type=positive_int, default=None,
                        help="video frames (video models; default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial noise")
    parser.add_argument("--schedule", default="flat",
                        help="plan schedule: flat, tapa, vfirst or cocodiff; pipefusion "
                        "(pipeline stages, with --pipefusion); or diffusers: diffusers' own "
                        "Ulysses context parallelism, torch transport only (default: flat)")
    parser.add_argument("--pipefusion", type=positive_int, default=None, metavar="N",
                        help="--schedule pipefusion: N contiguous pipeline stages, each rank "
                        "holding only its stage's blocks; the ranks / N of a stage form a "
                        "Ulysses group (--ulysses, if given, must be that); docs/pipefusion.md")
    parser.add_argument("--warmup", type=positive_int, default=None, metavar="W",
                        help="--schedule pipefusion: synchronous steps before the pipelined "
                        "ones, which stream N patches through the stages with stale K/V "
                        "(lossy; --reference reports how much). Default 1 (xDiT's); "
                        "--warmup equal to --steps is exact")
    parser.add_argument("--patches", type=positive_int, default=None, metavar="M",
                        help="--schedule pipefusion: patches a pipelined step streams "
                        "(default: the stage count, xDiT's)")
    parser.add_argument("--pipefusion-overlap", action="store_true",
                        help="refused: `cocodiff plan --pipefusion-overlap` models xDiT's "
                        "engine, whose per-patch scheduler step overlaps consecutive steps; "
                        "`run` drives diffusers' loop, which fills and drains the pipeline "
                        "every step")
    parser.add_argument("--grid", default=None, metavar="NODESxGPUSxTILES",
                        help="the rank grid: where the launched ranks sit, e.g. 2x4x1: rank r "
                        "on node r // (GPUS*TILES); the product must be the number of ranks. "
                        "tapa and vfirst carry each all-to-all as one phase per level with more "
                        "than one member (default: the nodes the launch spans, found by host "
                        "and network namespace, one GPU per rank; on one node they carry each "
                        "all-to-all flat, like flat)")
    parser.add_argument("--parallel-layout", default=None, choices=(AUTO, PURE),
                        help="auto: the planner chooses the Ulysses x Ring x batch degrees for "
                        "the rank grid (`cocodiff plan`); pure: pure Ulysses over every rank "
                        "(default: pure, or the degrees --ulysses/--ring/--batch give)")
    parser.add_argument("--layout", default=None, metavar="NODESxGPUSxTILES|auto",
                        help="deprecated alias, kept for one release: --layout "
                        "NODESxGPUSxTILES is --grid, --layout auto is --parallel-layout auto")
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
                        help="auto, torch or mpi (auto: torch where the device has its own "
                        "collective backend, nccl or xccl; else mpi under mpiexec when mpi4py "
                        "is installed; else torch over gloo)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="activation dtype (default float32)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds a rank waits for its peers before giving up (default 60; "
                        "600 over xccl, whose set-up at scale is slow)")
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
    return run_on_every_rank("run", lambda launch: _run(args, launch))


def run_on_every_rank(command: str, body, usage_errors: tuple[type[Exception], ...] = ()
                      ) -> int:
    """Run ``body(launch)`` on this rank of a launched job and turn how it ends into the
    exit code and the one line every rank owes: a user error (``CocodiffError``,
    ``ValueError``, ``FileNotFoundError`` and ``usage_errors``) once from rank 0, an
    interruption or a failure (a peer died, a timeout, NaN) on every rank that saw it,
    the failure also ending the job."""
    from transports.launch import LaunchError, detect_launch

    try:
        launch = detect_launch()
    except ValueError as error:  # LaunchError, or a launcher variable that is not a number
        # No rank knows it is rank 0 here: every one says it, once.
        print(f"cocodiff {command}: error: {one_line(str(error))}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    user_errors: tuple[type[Exception], ...] = (CocodiffError, ValueError, FileNotFoundError,
                                                *usage_errors)
    with raise_on_signals() as signals:
        try:
            try:
                return body(launch)
            finally:
                # Once the run is over (done or failing), a signal (the launcher ending
                # the job) must not interrupt the reporting below with a traceback.
                signals.disarm()
        except LaunchError as error:
            # This rank's own launch is wrong (no XPU seen): the others may be right and
            # waiting for it, so it speaks for itself and ends the job.
            print(f"cocodiff {command}: rank {launch.rank}: error: {one_line(str(error))}",
                  file=sys.stderr, flush=True)
            end_job_after_failure(launch)
            return EXIT_USAGE
        except user_errors as error:
            _report(command, launch.rank == 0, str(error.args[0] if error.args else error))
            return EXIT_USAGE
        except Interrupted as interrupt:
            print(f"cocodiff {command}: rank {launch.rank}: interrupted by "
                  f"{interrupt.signal_name}", file=sys.stderr, flush=True)
            return 128 + interrupt.signum
        except Exception as error:  # say so on every rank that saw it
            print(f"cocodiff {command}: rank {launch.rank}: {type(error).__name__}: "
                  f"{one_line(_first_line(error))}", file=sys.stderr, flush=True)
            end_job_after_failure(launch)
            return EXIT_FAILURE


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


# torchrun kills every rank as soon as one exits non-zero; a user error that every rank
# hits must leave rank 0 the time to print its line first.
_NON_ROOT_EXIT_DELAY_S = 2.0


def _report(command: str, is_root: bool, message: str) -> None:
    if is_root:
        print(f"cocodiff {command}: error: {one_line(message)}", file=sys.stderr, flush=True)
    else:
        time.sleep(_NON_ROOT_EXIT_DELAY_S)


def _check_arguments(args: argparse.Namespace) -> None:
    """Everything about the arguments that can be checked before the expensive imports."""
    from cocodiff.models import parse_resolution
    from cocodiff.runtime.baseline import BASELINES
    from cocodiff.schedules import get_schedule
    from cocodiff.schedules.pipefusion import PIPELINE_SCHEDULES
    from cocodiff.util.atomic import check_output_paths
    from transports.registry import AUTO, TRANSPORTS, create_transport

    pipelined = args.schedule in PIPELINE_SCHEDULES
    if args.pipefusion_overlap:
        raise CocodiffError(OVERLAP_REFUSED)
    if args.schedule not in BASELINES and not pipelined:  # a baseline is not a plan schedule
        get_schedule(args.schedule)
    if (args.pipefusion is not None or args.warmup is not None
            or args.patches is not None) and not pipelined:
        raise CocodiffError("--pipefusion, --patches and --warmup are PipeFusion's: give "
                            "--schedule pipefusion")
    if pipelined and args.plan is None and args.pipefusion is None:
        raise CocodiffError("--schedule pipefusion needs --pipefusion N (the stage count)")
    if pipelined and args.warmup is not None and args.warmup > args.steps:
        raise CocodiffError(f"--warmup {args.warmup} > --steps {args.steps}: the warm-up is "
                            "the first steps of the run (--warmup equal to --steps makes "
                            "every step synchronous)")
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
    # A pipefusion run with pipelined steps is lossy too: --reference applies to it.
    lossy_pipeline = pipelined and not (args.warmup or DEFAULT_WARMUP) >= args.steps
    if lossy_pipeline and lossy_only == ["--reference"]:
        lossy_only = []
    elif pipelined and lossy_only == ["--reference"]:
        raise CocodiffError("--reference: every pipefusion step is synchronous here (--warmup "
                            "at least --steps), which is exact; give a smaller --warmup")
    if lossy_only and (args.schedule in BASELINES or pipelined
                       or not get_schedule(args.schedule).step_dependent):
        raise CocodiffError(f"{', '.join(lossy_only)}: V-Major options, for --schedule "
                            f"cocodiff (the {args.schedule} schedule is exact)")
    if args.timeout is not None and not (math.isfinite(args.timeout)
                                         and 0 < args.timeout <= MAX_TIMEOUT_S):
        raise CocodiffError(f"--timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, "
                            f"got {args.timeout}")
    if args.seed not in SEED_RANGE:
        raise CocodiffError(f"--seed must be in [-2**63, 2**64), got {args.seed}")
    if args.resolution is not None:
        parse_resolution(args.resolution)
    if args.chunks is not None and (args.schedule in BASELINES or pipelined
                                    or not get_schedule(args.schedule).phased):
        raise CocodiffError("--chunks pipelines the phases of tapa and vfirst exchanges; "
                            f"{args.schedule} has none")


def _apply_plan_file(args: argparse.Namespace, world_size: int):
    """``--plan``: read the plan file and take from it what the flags would say (refusing
    the flags it fixes, given at any value); without it, the default model. Returns the
    plan, or None.

    Raises:
        CocodiffError: the file is unreadable or malformed, a flag it fixes was given,
            or it is for another rank count.
    """
    if args.plan is None:
        args.model = args.model or DEFAULT_MODEL
        return None
    from cocodiff.schedules.run_plan import load_run_plan

    refuse_plan_fixed(args, PLAN_FIXES)
    run_plan = load_run_plan(args.plan)
    overlapping = [plan.pipeline for plan in run_plan.plans
                   if plan.pipeline is not None and plan.pipeline.overlap]
    if overlapping:  # whatever the launch: no launch runs it
        raise CocodiffError(f"the plan {args.plan} overlaps consecutive steps "
                            f"({overlapping[-1].name}): {OVERLAP_REFUSED}")
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


def parse_grid(text: str) -> tuple[int, int, int]:
    """``NODESxGPUSxTILES`` (e.g. ``2x4x1``) -> (nodes, GPUs per node, tiles per GPU).

    Raises:
        CocodiffError: not three positive integers joined by ``x``.
    """
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(part.isdecimal() and int(part) > 0 for part in parts):
        raise CocodiffError(f"--grid must be NODESxGPUSxTILES with positive integers, "
                            f"e.g. 2x4x1; got {text!r}")
    nodes, gpus, tiles = map(int, parts)
    return nodes, gpus, tiles


def rank_grid(grid: str | None, num_ranks: int):
    """The :class:`~cocodiff.schedules.RankGrid` of ``--grid`` over ``num_ranks``
    ranks (node-major), or None (no grid: the runtime's default line of ranks).

    Raises:
        CocodiffError: a malformed grid, or one that does not hold ``num_ranks`` ranks.
    """
    from cocodiff.schedules import RankGrid

    if grid is None:
        return None
    shape = parse_grid(grid)
    if shape[0] * shape[1] * shape[2] != num_ranks:
        raise CocodiffError(f"--grid {grid} holds {shape[0] * shape[1] * shape[2]} ranks, "
                            f"the launch has {num_ranks}")
    return RankGrid(shape, tuple(range(num_ranks)))


def _apply_layout_alias(args: argparse.Namespace) -> None:
    """The deprecated ``--layout``: ``NODESxGPUSxTILES`` is ``--grid``, ``auto`` is
    ``--parallel-layout auto``."""
    if args.layout is None:
        return
    new = "parallel_layout" if args.layout == AUTO else "grid"
    if getattr(args, new) is not None:
        raise CocodiffError(f"--layout is the old name of --{new.replace('_', '-')}: give "
                            "only the new one")
    setattr(args, new, args.layout)
    args.layout = None


def _explicit_parallel(args: argparse.Namespace, num_ranks: int):
    """The Ulysses x Ring x batch layout the flags give (None: pure Ulysses, or the
    planner's under ``--parallel-layout auto``), checked before any collective."""
    from cocodiff.runtime.baseline import BASELINES

    parallel = explicit_layout(args, num_ranks)
    if parallel is not None and args.parallel_layout is not None:
        raise CocodiffError(f"--parallel-layout {args.parallel_layout} and "
                            "--ulysses/--ring/--batch both choose the layout: give one")
    if parallel is None and args.parallel_layout != AUTO:
        return None
    if args.schedule in BASELINES:
        raise CocodiffError(f"--schedule {args.schedule} runs pure Ulysses only; Ring and batch "
                            "layouts run flat, tapa, vfirst and cocodiff")
    return parallel


def pipeline_layout(args: argparse.Namespace, num_ranks: int, run_plan=None):
    """``--schedule pipefusion``'s :class:`~cocodiff.layout.PipelineLayout` (the flags',
    or the plan file's), checked before any collective; None for other schedules.

    Raises:
        CocodiffError: stages that do not divide the ranks, a --ulysses or --ring/--batch
            that contradicts them, a plan file with pipelined steps.
    """
    from dataclasses import replace

    from cocodiff.layout import PipelineLayout
    from cocodiff.schedules.pipefusion import PIPELINE_SCHEDULES

    if args.schedule not in PIPELINE_SCHEDULES:
        return None
    if run_plan is not None:
        layouts = [plan.pipeline for plan in run_plan.plans if plan.pipeline is not None]
        if not layouts:
            raise CocodiffError(f"the plan {args.plan} has no pipeline layout")
        # Each step's plan records its patch count (1: synchronous).
        return replace(layouts[0], patches=max(layout.patches for layout in layouts))
    if args.ring is not None or args.batch is not None or args.parallel_layout is not None:
        raise CocodiffError("--schedule pipefusion runs pipeline stages x Ulysses inside each; "
                            "--ring, --batch and --parallel-layout do not combine with it")
    stages = args.pipefusion
    if num_ranks % stages:
        raise CocodiffError(f"--pipefusion {stages} does not divide the {num_ranks} ranks")
    ulysses = num_ranks // stages
    if args.ulysses is not None and args.ulysses != ulysses:
        raise CocodiffError(f"--pipefusion {stages} on {num_ranks} ranks leaves Ulysses "
                            f"{ulysses} inside each stage, not --ulysses {args.ulysses}")
    # N patches (xDiT's default, and `cocodiff plan`'s: the same flags make the same plan).
    return PipelineLayout(stages, ulysses, args.patches or stages,
                          DEFAULT_WARMUP if args.warmup is None else args.warmup)


def _run(args: argparse.Namespace, launch) -> int:
    from cocodiff.runtime.faults import fault_from_env

    fault = fault_from_env()  # read once; None (and nothing installed) when unset
    # Every rank checks the plan, the flags and the layout before any collective: all of
    # them stop, none hangs.
    _apply_layout_alias(args)
    run_plan = _apply_plan_file(args, launch.world_size)
    _check_arguments(args)
    pipeline = pipeline_layout(args, launch.world_size, run_plan)
    if run_plan is not None:
        grid, parallel = run_plan.grid, run_plan.parallel
    else:
        grid = rank_grid(args.grid, launch.world_size)
        parallel = None if pipeline is not None else _explicit_parallel(args,
                                                                         launch.world_size)
    if pipeline is not None:
        parallel = pipeline  # the job tells the two kinds of layout apart
    if args.record_activity and (not launch.is_distributed
                                 or grid is not None and grid.shape[0] == 1):
        raise CocodiffError("--record-activity: V-Major acts on the inter-node tier; launch "
                            "ranks on more than one node (or give such a --grid)")
    from transports.torch_dist import default_device

    default_device(launch.local_rank)  # an XPU build that sees no XPU: refused before loading

    from cocodiff.runtime.job import RunRequest, run_job
    from cocodiff.schedules import DEFAULT_CHUNKS, PlanOptions, VMajorOptions

    request = RunRequest(
        model=args.model, prompt=args.prompt, steps=args.steps, resolution=args.resolution,
        frames=args.frames, seed=args.seed, schedule=args.schedule,
        plan_layout=args.parallel_layout == AUTO, transport=args.transport, timeout_s=args.timeout,
        dtype=args.dtype, guards=not args.no_guards, progress=not args.quiet,
        reference=args.reference, record_activity=args.record_activity, output=args.output,
        json=args.json, save_latents=args.save_latents, latents_format=args.latents_format,
        # Every rank must run the same command: the job compares a digest of these.
        argv=(*sys.argv[1:], *([run_plan.sha256] if run_plan is not None else [])),
    )
    options = PlanOptions(chunks=args.chunks or DEFAULT_CHUNKS,
                          vmajor=vmajor_from_arguments(args) or VMajorOptions())
    run_job(request, launch, fault, run_plan, grid, parallel, options)
    return 0
