"""``cocodiff validate``'s logic: run schedules for real, simulate the same plans, compare.

Every rank of a launch runs each case (a schedule on a parallel layout) round after
round, the order rotated every round so that no case always follows the same one; each
run is what ``cocodiff run`` does (load the pipeline, parallelise it, generate, time each
step between step callbacks). The first step of every run is left out (it builds plans
and warms caches). The plan each run executed (``runtime.run_plan``, made by
:func:`cocodiff.schedules.run_plan.build_run_plan`) is then simulated on the given topology
(:func:`cocodiff.simulator.simulate.simulate_run_plan`), so the prediction and the measurement are
of one plan; ``diffusers`` (diffusers' own context parallelism, which is flat Ulysses) is
predicted with the flat plan of the same run, its calls priced at what calibrate measured
diffusers' own exchange call to cost (``[host] diffusers_call_cpu_us``, where there is one).

How sure a measurement is comes from its rounds: each row's 95% interval over its round
medians (:func:`log_interval_95`), whether that interval resolves the row's error
(:func:`error_resolved`), and the pick's gap to the best paired round by round
(:func:`pick_against_best`); ``validate`` adds rounds, up to ``--max-rounds``, while a
row's interval neither resolves its error nor is within ``--precision``
(:func:`rows_to_resolve`).

PipeFusion rows (schedule ``pipefusion`` on a pipeline layout ``PnxUuxMm/wW``) run
:func:`cocodiff.runtime.pipefusion.parallelize_pipefusion`, whose plan fills and drains
the pipeline every step, as the runtime does (``PipelineLayout.overlap`` False). Their
row compares time per step like the others: the measured median of steps 2..T (all
pipelined with one warm-up step) against the simulated mean of the same steps, the
generation's simulated time less its first step's, over ``T - 1``
(:func:`pipeline_step_s`).

The argument parsing and printing live in :mod:`cocodiff.commands.validate`.
"""

from __future__ import annotations

import gc
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cocodiff.layout import DEFAULT_ORDER, ParallelLayout, PipelineLayout
from cocodiff.util.errors import CocodiffError

PURE = "pure"
AUTO = "auto"
PROMPT = "a lighthouse on a cliff at dawn"  # cocodiff run's default
# Schedules predicted with another schedule's plan: diffusers' context parallelism is
# flat Ulysses (Q's, K's and V's all-to-alls over all ranks, each waited before the next
# starts, then the output's), exactly the flat plan.
PLAN_OF = {"diffusers": "flat"}
EXACT_ATOL = 1e-5
PICK_TOLERANCE = 0.05  # the planner's pick counts as right within 5% of the measured best
# Student's t at 97.5% (a two-sided 95% interval) by degrees of freedom 1..30; beyond 30
# the normal's 1.96 is within 4% of it.
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
          2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069,
          2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
T = TypeVar("T")
_LAYOUT_NAME = re.compile(r"U(\d+)xR(\d+)xB(\d+)(/ring-inner)?")
# PipelineLayout.name without "/overlap": `run` executes no overlapping steps.
_PIPELINE_NAME = re.compile(r"P(\d+)xU(\d+)xM(\d+)/w(\d+)")
# The schedule a pipeline layout runs (cocodiff.schedules.pipefusion.PIPELINE_SCHEDULES).
PIPEFUSION = "pipefusion"


@dataclass(frozen=True, slots=True)
class Case:
    """One thing to measure: a schedule (or baseline) on a parallel layout.

    Attributes:
        schedule: a plan schedule's registry name, a baseline's (``diffusers``), or
            ``pipefusion``.
        layout: the Ulysses x Ring x batch layout, or PipeFusion's pipeline layout; None:
            pure Ulysses over every rank.
    """

    schedule: str
    layout: ParallelLayout | PipelineLayout | None = None

    @property
    def layout_name(self) -> str:
        return PURE if self.layout is None else self.layout.name

    @property
    def name(self) -> str:
        return self.schedule if self.layout is None else f"{self.schedule}@{self.layout.name}"


def parse_layout_name(text: str) -> ParallelLayout | PipelineLayout:
    """``U4xR2xB1`` or ``U4xR2xB1/ring-inner`` (:attr:`ParallelLayout.name`), or a
    PipeFusion layout ``P2xU2xM2/w1`` (:attr:`PipelineLayout.name`) -> the layout.

    Raises:
        CocodiffError: not such a name.
    """
    from cocodiff.layout import RING_INNER_ORDER

    pipeline = _PIPELINE_NAME.fullmatch(text)
    if pipeline is not None:
        stages, ulysses, patches, warmup = (int(group) for group in pipeline.groups())
        return PipelineLayout(stages, ulysses, patches, warmup)
    match = _LAYOUT_NAME.fullmatch(text)
    if match is None:
        raise CocodiffError(f"not a layout name (pure, U4xR2xB1[/ring-inner], or PipeFusion's "
                            f"P2xU2xM2/w1): {text!r}")
    ulysses, ring, batch = (int(group) for group in match.groups()[:3])
    order = RING_INNER_ORDER if match.group(4) else DEFAULT_ORDER
    return ParallelLayout(ulysses, ring, batch, order)


def parse_layouts(text: str) -> list[str]:
    """``--layouts``: ``auto``, or ``pure`` and layout names, comma-separated (checked)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise CocodiffError("--layouts names no layout")
    if AUTO in names and len(names) > 1:
        raise CocodiffError(f"--layouts auto chooses the layouts itself; got {text!r}")
    for name in names:
        if name not in (AUTO, PURE):
            parse_layout_name(name)
    return names


def parse_schedules(text: str) -> list[str]:
    """``--schedules``: plan schedules and baselines, comma-separated, each once."""
    from cocodiff.runtime.baseline import BASELINES
    from cocodiff.schedules import get_schedule

    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise CocodiffError("--schedules names no schedule")
    for name in names:
        if name not in BASELINES and name != PIPEFUSION:
            try:
                get_schedule(name)
            except ValueError as error:
                raise CocodiffError(f"{error}, {PIPEFUSION}, or a baseline: "
                                    f"{', '.join(BASELINES)}") from None
    if len(set(names)) != len(names):
        raise CocodiffError(f"--schedules names a schedule twice: {text}")
    return names


def make_cases(schedules: Sequence[str], layout_names: Sequence[str], num_ranks: int,
               num_heads: int, num_layers: int | None = None) -> list[Case]:
    """The cases to run. ``auto``: pure Ulysses where the heads split over every rank,
    else every batch-1 layout the planner considers (both placements). A layout without a
    Ulysses exchange (Ulysses degree 1) runs its first plan schedule only: every schedule
    makes the same plan there. Baselines run pure Ulysses only. ``pipefusion`` runs on
    PipeFusion layouts only (``P2xU2xM2/w1``), the other schedules on the others; with
    ``auto``, on every pipeline layout of two stages or more (patches = stages, one
    warm-up step: xDiT's defaults, as ``cocodiff plan`` ranks them).

    Args:
        num_layers: the model's layers (None: unknown, stages not checked against it).

    Raises:
        CocodiffError: a layout that does not hold ``num_ranks`` ranks or splits more
            heads than the model has; a pipeline layout without ``pipefusion`` or the
            reverse; nothing left to run.
    """
    from cocodiff.runtime.baseline import BASELINES
    from cocodiff.simulator.planner import candidate_layouts, divisors

    pipelined = PIPEFUSION in schedules
    schedules = [name for name in schedules if name != PIPEFUSION]
    layouts: list[ParallelLayout | None]
    if list(layout_names) == [AUTO]:
        layouts = (([None] if num_ranks <= num_heads
                    else list(candidate_layouts(num_ranks, num_heads, 1))) if schedules else [])
        pipelines = [PipelineLayout(stages, num_ranks // stages, stages, 1)
                     for stages in divisors(num_ranks)
                     if stages >= 2 and num_ranks // stages <= num_heads
                     and (num_layers is None or stages <= num_layers)] if pipelined else []
    else:
        parsed = [None if name == PURE else parse_layout_name(name) for name in layout_names]
        pipelines = [layout for layout in parsed if isinstance(layout, PipelineLayout)]
        layouts = [layout for layout in parsed if not isinstance(layout, PipelineLayout)]
        if pipelines and not pipelined:
            raise CocodiffError(f"--layouts {pipelines[0].name} is a PipeFusion layout: add "
                                f"{PIPEFUSION} to --schedules")
        if pipelined and not pipelines:
            raise CocodiffError(f"--schedules {PIPEFUSION} runs on PipeFusion layouts (e.g. "
                                "P2xU2xM2/w1, or --layouts auto): --layouts names none")
        if layouts and not schedules:
            names = ",".join(PURE if layout is None else layout.name for layout in layouts)
            raise CocodiffError(f"--layouts {names}: no schedule but {PIPEFUSION} to run on "
                                "them")
    for pipeline in pipelines:
        pipeline.check(num_ranks, num_heads, pipeline.stages if num_layers is None
                       else num_layers)
    for layout in layouts:
        if layout is None:
            if num_ranks > num_heads:
                raise CocodiffError(f"pure Ulysses over {num_ranks} ranks cannot split the "
                                    f"model's {num_heads} heads; give --layouts auto or "
                                    "Ulysses x Ring layouts")
            continue
        if layout.num_ranks != num_ranks:
            raise CocodiffError(f"layout {layout.name} holds {layout.num_ranks} ranks, the "
                                f"launch has {num_ranks}")
        if layout.ulysses > num_heads:
            raise CocodiffError(f"layout {layout.name}: Ulysses degree {layout.ulysses} is "
                                f"more than the model's {num_heads} heads")
    plan_schedules = [name for name in schedules if name not in BASELINES]
    cases = []
    for layout in layouts:
        if layout is None or layout.is_pure_ulysses:
            cases += [Case(name, layout) for name in schedules]
        elif layout.ulysses == 1:
            cases += [Case(name, layout) for name in plan_schedules[:1]]
        else:
            cases += [Case(name, layout) for name in plan_schedules]
    cases += [Case(PIPEFUSION, pipeline) for pipeline in pipelines]
    if not cases:
        raise CocodiffError("nothing to run: baselines run pure Ulysses only; add a plan "
                            "schedule or a pure layout")
    return cases


def round_order(cases: Sequence[T], round_index: int) -> list[T]:
    """Round ``round_index``'s order: the cases rotated by the round's number."""
    shift = round_index % len(cases)
    return [*cases[shift:], *cases[:shift]]


@dataclass(slots=True)
class RunResult:
    """What one run on one rank gives back.

    Attributes:
        step_times_s: every step's time (callback to callback; the first from the start).
        comm_s: the seconds this rank waited for exchanges (None: not exposed).
        run_plan: the plan the runtime executed (None for a baseline).
        latents: the final latents (run_pipeline's, unpacked).
    """

    step_times_s: list[float]
    comm_s: float | None
    run_plan: Any
    latents: Any


@dataclass(frozen=True, slots=True)
class RunSetup:
    """What every run of a validation shares.

    Attributes:
        model: a tiny model's name or a diffusers directory.
        dtype: the pipeline's torch dtype.
        steps: denoising steps per run.
        size: (width, height, frames).
        text_tokens: the prompt length a tiny model uses (None: the pipeline's default).
        grid: where the ranks sit (a :class:`~cocodiff.schedules.RankGrid`).
        seed: the initial noise's seed.
    """

    model: str
    dtype: Any
    steps: int
    size: tuple[int, int, int]
    text_tokens: int | None
    grid: Any
    seed: int = 0


def generate(setup: RunSetup, transport, case: Case,
             on_step: Callable[[], None] | None = None) -> RunResult:
    """Run ``case`` once on this rank (every rank calls it with the same case), as
    ``cocodiff run`` would: a fresh pipeline, parallelised, one generation.

    Raises:
        CocodiffError: the runtime refuses the case (the same on every rank, before any
            collective): e.g. diffusers' baseline over MPI.
    """
    import torch

    from cocodiff.runtime.baseline import BASELINES
    from cocodiff.runtime.model_names import model_spec
    from cocodiff.runtime.parallel import parallelize
    from cocodiff.runtime.pipelines import load_pipeline, run_pipeline
    from cocodiff.schedules.run_plan import Generation

    pipe = load_pipeline(setup.model, setup.dtype)
    width, height, frames = setup.size
    # The model as `cocodiff plan` names it, and the size: the plans are `run`'s and
    # `plan --out`'s for the same flags (the same hashes).
    generation = Generation(model_spec(setup.model), (width, height), frames)
    if case.schedule in BASELINES:
        runtime = BASELINES[case.schedule](pipe, transport)
    elif isinstance(case.layout, PipelineLayout):
        from cocodiff.runtime.pipefusion import parallelize_pipefusion

        if case.layout.warmup > setup.steps:  # as `run --warmup` refuses it
            raise CocodiffError(f"{case.name}: warm-up {case.layout.warmup} > --steps "
                                f"{setup.steps}")
        runtime = parallelize_pipefusion(pipe, transport, case.layout, setup.grid,
                                         generation=generation)
    elif case.layout is not None and not case.layout.is_pure_ulysses:
        from cocodiff.runtime.hybrid import parallelize_hybrid

        runtime = parallelize_hybrid(pipe, transport, case.schedule, case.layout, setup.grid,
                                     generation=generation)
    else:
        runtime = parallelize(pipe, transport, case.schedule, setup.grid,
                              generation=generation)
    step_times: list[float] = []
    transport.barrier()  # every rank starts the run together
    last = time.perf_counter()

    def step_done(done: int, total: int) -> None:
        nonlocal last
        now = time.perf_counter()
        step_times.append(now - last)
        last = now
        if on_step is not None:
            on_step()

    start_generation = getattr(runtime, "start_generation", None)
    if start_generation is not None:  # V-Major's ratio schedule spans the steps
        start_generation(setup.steps)
    with torch.no_grad():
        latents = run_pipeline(pipe, PROMPT, setup.steps, width, height, frames, setup.seed,
                               step_done, max_sequence_length=setup.text_tokens)
    result = RunResult(step_times, runtime.comm_s, getattr(runtime, "run_plan", None),
                       latents.detach().cpu())
    del pipe, runtime
    gc.collect()
    return result


def reference_latents(setup: RunSetup):
    """One single-process generation (no parallelism) in this process: the reference the
    exact schedules' final latents must equal."""
    import torch

    from cocodiff.runtime.pipelines import load_pipeline, run_pipeline

    pipe = load_pipeline(setup.model, setup.dtype)
    width, height, frames = setup.size
    with torch.no_grad():
        latents = run_pipeline(pipe, PROMPT, setup.steps, width, height, frames, setup.seed,
                               None, max_sequence_length=setup.text_tokens)
    return latents.detach().cpu()


@dataclass(slots=True)
class Measurements:
    """Every run of every case on rank 0, in the order they ran."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    plans: dict[Case, Any] = field(default_factory=dict)  # the plan each case executed
    first_latents: dict[Case, Any] = field(default_factory=dict)  # round 1's

    def add(self, case: Case, round_index: int, generation: RunResult) -> None:
        self.runs.append({"schedule": case.schedule, "layout": case.layout_name,
                          "round": round_index, "step_times_s": generation.step_times_s,
                          "comm_s": generation.comm_s})
        if generation.run_plan is not None:
            self.plans.setdefault(case, generation.run_plan)
        self.first_latents.setdefault(case, generation.latents)

    def medians(self, case: Case) -> list[float]:
        """Each run's median step, the first step left out."""
        return [statistics.median(run["step_times_s"][1:]) for run in self.runs
                if (run["schedule"], run["layout"]) == (case.schedule, case.layout_name)]


def blocks_layer_s(model: str, resolution: str | None, dtype_name: str,
                   transport) -> float | None:
    """The model's real blocks timed as ``calibrate --quick`` times them (every rank at
    once, CPU seconds per layer, the median over ranks; collective): how fast this machine
    computes now, to hold against the calibration's ``compute.block.layer_s``. Between a
    calibration and its validation, minutes apart, this machine's compute moved by up to
    26% (docs/changelog.md, 2026-11-27) while calibrate's own reference work did not show
    it. None (on every rank) when calibrate does not time this model's blocks."""
    from cocodiff.calibration.blocks import build_transformer, time_blocks, timed_model
    from cocodiff.calibration.collect import WorldLineup, gather_floats
    from cocodiff.calibration.options import CalibrateOptions
    from cocodiff.runtime.hooks import UnsupportedModelError

    timed = timed_model(CalibrateOptions(model=model, resolution=resolution,
                                         dtype=dtype_name, quick=True))
    if timed is None:
        return None
    config, _spec, streams = timed
    try:
        timing = time_blocks(build_transformer(config), streams, transport.world_size,
                             transport.rank, dtype_name, rounds=3, round_s=0.1,
                             lineup=WorldLineup(transport))
    except UnsupportedModelError:  # the same on every rank
        return None
    return statistics.median(row[0] for row in gather_floats(transport, [timing.layer_s]))


def machine_drift(layer_s: Sequence[float | None], calibrated_layer_s: float | None
                  ) -> dict[str, Any]:
    """The blocks' time per layer during a validation (at its start and end) against the
    calibration's: ``drift`` = their mean / the calibration's - 1 (None without both)."""
    timed = [value for value in layer_s if value is not None]
    drift = (statistics.fmean(timed) / calibrated_layer_s - 1
             if timed and calibrated_layer_s else None)
    return {"layer_s": list(layer_s), "calibrated_layer_s": calibrated_layer_s,
            "drift": drift}


def log_interval_95(values: Sequence[float]) -> tuple[float, float] | None:
    """A 95% interval of the values' geometric mean as ratios to it, ``(low, high)``:
    Student's t over their logs. Rounds are the independent units here (steps within one
    run share its state: on the emulated cluster a run's level moves by ~9% on the small
    model, its steps by ~19% about it), so the values are per-round. None under 2."""
    if len(values) < 2:
        return None
    logs = [math.log(value) for value in values]
    half = _T_975[min(len(logs) - 1, len(_T_975)) - 1] * statistics.stdev(logs) \
        / math.sqrt(len(logs))
    return math.exp(-half), math.exp(half)


def precision_95(values: Sequence[float]) -> float | None:
    """The relative half-width of :func:`log_interval_95` (its upper ratio - 1): how
    precisely the rounds pin a row's step. None under 2 values."""
    interval = log_interval_95(values)
    return None if interval is None else interval[1] - 1


def widest_precision(measurements: Measurements, cases: Sequence[Case]) -> float | None:
    """The least precise row's :func:`precision_95` (None while any has under 2 rounds)."""
    widths = [precision_95(measurements.medians(case)) for case in cases
              if case.name not in measurements.skipped]
    if not widths or any(width is None for width in widths):
        return None
    return max(width for width in widths if width is not None)


def error_resolved(error: float | None, precision: float | None) -> bool | None:
    """Whether a row's 95% interval tells its error from none: the prediction lies outside
    the interval of the measured step (``measured x [1 / (1 + p), 1 + p]``, p its
    :func:`precision_95`), i.e. ``|log(1 + error)| > log(1 + p)``. None without both (one
    round gives no interval)."""
    if error is None or precision is None:
        return None
    return abs(math.log1p(error)) > math.log1p(precision)


def rows_to_resolve(measurements: Measurements, cases: Sequence[Case],
                    predicted: Callable[[Case], float | None], precision: float) -> list[str]:
    """The rows another round can still help (by case name): under 2 rounds, or whose
    95% interval neither resolves its error (:func:`error_resolved`) nor is within
    ``precision``; and :data:`PICK` while the planner's pick against the measured best is
    unresolved (:func:`pick_against_best`: its interval straddles the 5% tolerance).
    ``predicted(case)``: the case's predicted step (None: none, and only the precision
    counts).

    Why the floor at ``precision``: an error of 1% would need a +-1% interval to be told
    from none, more rounds than a busy machine gives; within ``precision`` the row's
    step is pinned, whatever its error. The rule reads errors, so it stops sooner on a
    round that happens to widen one; rows start with ``--rounds`` rounds, and the
    reported errors of issue 38 (25-54%) are far beyond such a round's reach."""
    unresolved = []
    rows = []  # what pick_against_best reads of each row
    for case in cases:
        if case.name in measurements.skipped:
            continue
        medians = measurements.medians(case)
        step = predicted(case)
        measured = statistics.median(medians)
        rows.append({"schedule": case.schedule, "layout": case.layout_name,
                     "measured_step_s": measured, "predicted_step_s": step,
                     "round_medians_s": medians})
        width = precision_95(medians)
        if width is None:
            unresolved.append(case.name)
            continue
        error = None if step is None else step / measured - 1
        if width > precision and not error_resolved(error, width):
            unresolved.append(case.name)
    if not pick_against_best(rows).get("pick_resolved", True):
        unresolved.append(PICK)
    return unresolved


# What rows_to_resolve names when the pick's verdict, not a row, wants another round.
PICK = "the planner's pick"


def predict_case(case: Case, measurements: Measurements, topology, collective
                 ) -> dict[str, Any] | None:
    """The simulated step of the plan ``case`` ran (:func:`predicted_plan`, on its
    schedule's machine: :func:`topology_of`) with the plan's name and hash; None when
    there is no plan to simulate."""
    run_plan = predicted_plan(case, measurements)
    if run_plan is None:
        return None
    return {**predict_step_s(run_plan, topology_of(case.schedule, topology), collective),
            "predicted_with_plan": run_plan.schedule, "plan_sha256": run_plan.sha256}


def predicted_plan(case: Case, measurements: Measurements):
    """The plan the simulator runs for ``case``: the one it executed, or for a baseline
    the flat plan its pure-Ulysses peers executed (None when none ran)."""
    from cocodiff.schedules import PlanOptions
    from cocodiff.schedules.run_plan import build_run_plan

    if case in measurements.plans:
        return measurements.plans[case]
    plan_schedule = PLAN_OF.get(case.schedule)
    peer = next((plan for other, plan in measurements.plans.items()
                 if other.layout is None or (isinstance(other.layout, ParallelLayout)
                                             and other.layout.is_pure_ulysses)), None)
    if plan_schedule is None or peer is None:
        return None
    options = PlanOptions(dtype=peer.options.dtype, batch=peer.options.batch)
    return build_run_plan(plan_schedule, peer.spec, peer.grid, peer.stream_tokens,
                          peer.num_steps, options, resolution=peer.resolution,
                          frames=peer.frames)


def topology_of(schedule: str, topology):
    """The machine ``schedule`` is simulated on: ``topology``, except that diffusers'
    baseline pays its own exchange call's CPU (``[host] diffusers_call_cpu_us``) where ours
    pay ``call_cpu_us``: the same plan, made by other code."""
    import dataclasses

    from topology import build_topology

    host = topology.spec.host
    if schedule != "diffusers" or host is None or host.diffusers_call_cpu_us is None:
        return topology
    # The wake-up is a part of a call's price, whoever makes the call.
    return build_topology(dataclasses.replace(topology.spec, host=dataclasses.replace(
        host, call_cpu_us=host.diffusers_call_cpu_us,
        wake_cpu_us=min(host.wake_cpu_us, host.diffusers_call_cpu_us))))


def predict_step_s(run_plan, topology, collective) -> dict[str, Any]:
    """The simulated step of ``run_plan``, averaged over the steps that are measured (all
    but the first), with its compute and exposed communication."""
    from cocodiff.schedules.pipefusion import PIPELINE_SCHEDULES
    from cocodiff.simulator.simulate import simulate_run_plan

    result = simulate_run_plan(run_plan, topology, collective=collective, with_bound=False)
    if run_plan.schedule in PIPELINE_SCHEDULES:
        step_s = pipeline_step_s(run_plan, result.step_time_s, topology, collective)
        return {"predicted_step_s": step_s, "predicted_compute_s": result.compute_s,
                "predicted_comm_exposed_s": max(0.0, step_s - result.compute_s)}
    steps = result.step_times_s[1:] if len(result.step_times_s) > 1 else result.step_times_s
    return {"predicted_step_s": statistics.fmean(steps),
            "predicted_compute_s": result.compute_s,
            "predicted_comm_exposed_s": result.comm_exposed_s}


def pipeline_step_s(run_plan, generation_step_s: float, topology, collective) -> float:
    """A PipeFusion generation's simulated mean step over steps 2..T, what validate
    measures (the first step left out): ``(T g_T - g_1) / (T - 1)``, ``g_T`` the
    generation's simulated step (its time over T, each step's overhead in it; the simulator
    runs a pipeline's steps back to back, not one by one) and ``g_1`` that of the
    generation's first step alone. The first step alone ends when its last stage does;
    in the generation, stage 0 (rank 0, whose steps are timed) also waits for the latents
    sent back, one transfer that this counts in step 2."""
    from cocodiff.schedules.run_plan import build_run_plan
    from cocodiff.simulator.simulate import simulate_run_plan

    num_steps = run_plan.num_steps
    if num_steps < 2:
        return generation_step_s
    layout = run_plan.plans[run_plan.step_plans[-1]].pipeline
    first = build_run_plan(run_plan.schedule, run_plan.spec, run_plan.grid,
                           run_plan.stream_tokens, 1, run_plan.options, pipeline=layout,
                           resolution=run_plan.resolution, frames=run_plan.frames)
    first_s = simulate_run_plan(first, topology, collective=collective,
                                with_bound=False).step_time_s
    return (num_steps * generation_step_s - first_s) / (num_steps - 1)


def summarise(cases: Sequence[Case], measurements: Measurements, topology, collective,
              reference=None, predictions: dict[Case, Any] | None = None) -> dict[str, Any]:
    """The rows (measured, predicted, error), the planner's pick and the measured best.

    The planner's pick is the plan-schedule row the simulator predicts fastest (what
    ``cocodiff plan`` would choose among the cases run); the measured best is the
    fastest row measured, baselines included. ``reference``: single-process final
    latents; each row then gets its round-1 latents' max abs difference from them.
    ``predictions``: :func:`predict_case`'s results already made (by case), reused.
    Each row says whether its interval resolves its error (``error_resolved``).
    """
    from cocodiff.runtime.baseline import BASELINES
    from cocodiff.schedules import get_schedule

    rows = []
    for case in cases:
        if case.name in measurements.skipped:
            continue
        medians = measurements.medians(case)
        measured = statistics.median(medians)
        row: dict[str, Any] = {
            "schedule": case.schedule, "layout": case.layout_name,
            "measured_step_s": measured, "min_step_s": min(medians),
            "max_step_s": max(medians), "round_medians_s": medians,
            "precision_95": precision_95(medians),
        }
        comm = [run["comm_s"] for run in measurements.runs
                if (run["schedule"], run["layout"]) == (case.schedule, case.layout_name)
                and run["comm_s"] is not None]
        if comm:
            row["comm_s"] = statistics.median(comm)
        predicted = (predictions[case] if predictions is not None and case in predictions
                     else predict_case(case, measurements, topology, collective))
        if predicted is not None:
            row.update(predicted)
            row["error"] = row["predicted_step_s"] / measured - 1
        else:
            row.update(predicted_step_s=None, error=None)
        row["error_resolved"] = error_resolved(row["error"], row["precision_95"])
        if reference is not None and case in measurements.first_latents:
            diff = float((measurements.first_latents[case].float() - reference.float())
                         .abs().max())
            if isinstance(case.layout, PipelineLayout):  # exact with every step synchronous
                steps = next(len(run["step_times_s"]) for run in measurements.runs
                             if (run["schedule"], run["layout"])
                             == (case.schedule, case.layout_name))
                exact = case.layout.warmup >= steps
            else:
                exact = (case.schedule in BASELINES
                         or not get_schedule(case.schedule).step_dependent)
            row.update(max_abs_diff=diff, exact_schedule=exact,
                       exact=diff <= EXACT_ATOL if exact else None)
        rows.append(row)
    return {"rows": rows, **pick_against_best(rows), **error_summary(rows)}


def pick_against_best(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The planner's pick (least predicted step among plan schedules), the measured best
    (least measured step), and how much slower the pick measured than the best.

    With ``round_medians_s`` in the rows (the n-th of each row is round n's), the gap
    also gets a 95% interval paired by round (``pick_slower_95``: the rounds share the
    machine's load as it drifts, so their ratios vary less than either row), and
    ``pick_resolved`` says whether that interval lies on one side of the 5% tolerance:
    when it does not, the rounds cannot tell the pick's verdict, and more rounds can.
    """
    from cocodiff.runtime.baseline import BASELINES

    def brief(row: dict[str, Any]) -> dict[str, Any]:
        return {key: row[key] for key in ("schedule", "layout", "measured_step_s",
                                          "predicted_step_s")}

    planned = [row for row in rows if row["schedule"] not in BASELINES
               and row["predicted_step_s"] is not None]
    if not rows:
        return {"planner_pick": None, "measured_best": None}
    best = min(rows, key=lambda row: row["measured_step_s"])
    if not planned:
        return {"planner_pick": None, "measured_best": brief(best)}
    pick = min(planned, key=lambda row: row["predicted_step_s"])
    gap = pick["measured_step_s"] / best["measured_step_s"] - 1
    verdict: dict[str, Any] = {"planner_pick": brief(pick), "measured_best": brief(best),
                               "pick_slower_than_best": gap,
                               "pick_within_5pct": gap <= PICK_TOLERANCE}
    if pick is best:
        return {**verdict, "pick_slower_95": [0.0, 0.0], "pick_resolved": True}
    # Every row ran every round (a refused case is refused from round 1 and has no row).
    ratios = [mine / theirs for mine, theirs in zip(pick.get("round_medians_s", ()),
                                                   best.get("round_medians_s", ()), strict=True)]
    interval = log_interval_95(ratios)
    if interval is None:
        return {**verdict, "pick_slower_95": None, "pick_resolved": False}
    centre = statistics.geometric_mean(ratios)
    low, high = centre * interval[0] - 1, centre * interval[1] - 1
    return {**verdict, "pick_slower_95": [low, high],
            "pick_resolved": high <= PICK_TOLERANCE or low > PICK_TOLERANCE}


def error_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median |error| and the fraction of rows within 15% and 20%."""
    errors = [abs(row["error"]) for row in rows if row.get("error") is not None]
    if not errors:
        return {}
    return {"median_abs_error": statistics.median(errors),
            "within_15pct": sum(e <= 0.15 for e in errors) / len(errors),
            "within_20pct": sum(e <= 0.20 for e in errors) / len(errors)}


def layouts_json(cases: Sequence[Case]) -> list[str]:
    return list(dict.fromkeys(case.layout_name for case in cases))
