"""Executing a plan in the simulator: the SimPy driver of :mod:`cocodiff.plan.executor`.

Every simulated rank is a SimPy process that runs the shared executor; compute steps
take the cost model's roofline time on the rank's tile, exchanges go through the
simulated transport as flows on the topology's links.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from cocodiff.layout import ParallelLayout
from cocodiff.memory import RankMemory, pipeline_memory, sequence_memory
from cocodiff.models import ModelSpec
from cocodiff.plan.executor import Execution, run_program
from cocodiff.plan.gather import GatherStage
from cocodiff.plan.lazy import exemplar_programs, with_layers
from cocodiff.plan.passes import Finder, plan_passes, repeated_passes, with_passes
from cocodiff.plan.steps import Plan
from cocodiff.schedules import (
    BASELINE,
    DEFAULT_OPTIONS,
    PlanOptions,
    RankGrid,
    get_schedule,
    plan_for_step,
)
from cocodiff.schedules.activity import ActivityTrace
from cocodiff.schedules.gather import output_gather
from cocodiff.schedules.pipefusion import PIPELINE_SCHEDULES
from cocodiff.schedules.tapa import check_chunks
from cocodiff.simulator.backend import SimBackend, generation_execution, rank_process
from cocodiff.simulator.bounds import model_bound_s, plan_bound_s
from cocodiff.simulator.results import SimResult, busiest_links
from cocodiff.simulator.symmetry import fold_period_nodes
from sim import Simulation
from sim.timeline import merged_length
from topology import TIERS, Placement, Topology
from transports.sim import (
    CollectiveModel,
    FlowCache,
    IdentityMemo,
    SimWorld,
    collective_model_for,
)

if TYPE_CHECKING:
    from cocodiff.schedules.run_plan import RunPlan


def simulate_plan(
    plan: Plan,
    topology: Topology,
    placement: Placement | None = None,
    fold: bool | None = None,
    record_spans: bool = False,
    collective: CollectiveModel | None = None,
    denoising_step: bool = True,
    gathers: tuple[GatherStage, ...] = (),
    cache: FlowCache | None = None,
    execution: Callable[[int, SimBackend], Execution] | None = None,
) -> SimResult:
    """Run one denoising step of ``plan`` on ``topology`` (or, ``denoising_step`` False,
    the plan alone: a microbenchmark's exchanges, without the topology's step overhead).

    Args:
        plan: the plan (all ranks).
        topology: the machine.
        placement: rank -> tile; node-major over the first ``plan.num_ranks`` tiles
            by default.
        fold: simulate node 0 only and fold node-symmetric traffic (exact; see
            ``transports.sim``). Default: whenever plan and placement allow it.
        record_spans: keep per-rank compute/comm spans and link intervals on the
            timeline (for traces and plots).
        collective: how collectives are carried out beyond the wire; by default the
            model of the topology's preset (``transports.sim.COLLECTIVE_MODELS``).
        denoising_step: charge the step's overhead (the pipeline's work outside the
            blocks, once per step, at the rank's share of the sequence:
            :func:`~cocodiff.simulator.backend.step_overhead_s`) before the plan.
        gathers: the output gathers that end the step, after the plan
            (:func:`cocodiff.schedules.gather.output_gather`; ``simulate_run_plan`` passes them).
        cache: what this simulation may share with others of the same machine, placement
            and model (:class:`transports.sim.FlowCache`).
        execution: a rank's execution given its rank and backend, in place of its
            program's (a PipeFusion generation's, which charges each step's overhead).
    """
    wall_start = time.perf_counter()
    placement = placement or Placement.node_major(topology, plan.num_ranks)
    if placement.num_ranks != plan.num_ranks:
        raise ValueError(
            f"plan has {plan.num_ranks} ranks, placement {placement.num_ranks}"
        )
    fold_nodes = _fold_period_nodes(plan, topology, placement)
    if fold is None:
        fold = fold_nodes is not None
    elif fold and fold_nodes is None:
        raise ValueError("this plan and placement are not node-symmetric; cannot fold")
    simulation = Simulation(topology, record_link_intervals=record_spans)
    collective = collective or collective_model_for(topology.spec.name)
    world = SimWorld(simulation, placement, fold_nodes=fold_nodes if fold else None,
                     collective=collective, cache=cache)
    finish_s: dict[int, float] = {}
    backends: dict[int, SimBackend] = {}
    for rank in world.simulated_ranks:
        backend = SimBackend(world.transport(rank), placement.tile_of(rank), record_spans)
        backends[rank] = backend
        steps = (run_program(plan.program(rank), backend) if execution is None
                 else execution(rank, backend))
        simulation.env.process(
            rank_process(simulation, steps, rank, finish_s, backend,
                         plan if denoising_step else None, gathers)
        )
    simulation.run()
    missing = [rank for rank in world.simulated_ranks if rank not in finish_s]
    if missing:
        raise RuntimeError(f"ranks {missing[:8]} never finished: a collective was not matched")
    slowest = max(finish_s, key=lambda rank: finish_s[rank])
    step_time_s = finish_s[slowest]
    compute_s = backends[slowest].compute_s
    if record_spans:
        simulation.record_link_spans()
    return SimResult(
        schedule=plan.schedule,
        num_ranks=plan.num_ranks,
        step_time_s=step_time_s,
        compute_s=compute_s,
        comm_exposed_s=max(0.0, step_time_s - compute_s),
        bytes_by_tier={tier: world.bytes_by_tier[tier] for tier in TIERS},
        busiest_links=busiest_links(simulation, step_time_s),
        simulated_ranks=len(world.simulated_ranks),
        folded=world.folded,
        wall_s=time.perf_counter() - wall_start,
        num_flows=simulation.network.num_flows_started,
        num_events=simulation.env.events_processed,
        # Concurrent exchanges (V-First) count once: the time any exchange is in flight.
        exchange_s=merged_length(backends[slowest].exchange_intervals),
        # Folding simulates one period of node-symmetric ranks: the others start as many.
        exchanges_per_step=[sum(b.exchanges_started for b in backends.values())
                            * plan.num_ranks // len(world.simulated_ranks)],
        simulation=simulation,
    )


def _with_layers(plan: Plan, num_layers: int) -> Plan:
    # Lazy programs stay lazy (cocodiff.plan.lazy): a sequence, not the tuple annotated.
    return replace(plan, programs=with_layers(plan.programs,  # type: ignore[arg-type]
                                              num_layers))


def _repeats_one_layer(plan: Plan) -> bool:
    """Whether every layer of every rank is the same object (schedulers share it); a
    lazy plan's exemplars show every rank's layers (:mod:`cocodiff.plan.lazy`)."""
    return all(all(layer is p.layers[0] for layer in p.layers)
               for p in exemplar_programs(plan.programs))


def simulate_layers(
    plan: Plan,
    topology: Topology,
    placement: Placement | None = None,
    collective: CollectiveModel | None = None,
    num_layers: int | None = None,
    gathers: tuple[GatherStage, ...] = (),
    cache: FlowCache | None = None,
) -> SimResult:
    """:func:`simulate_plan`'s result for a plan whose layers are all the same, from a
    one-layer and a two-layer simulation (``gathers`` and ``cache`` as there; by default
    the simulations share a cache of their own).

    Every layer ends with exchanges that resynchronise the ranks, so everything a step
    accumulates is affine in its number of layers ``L`` after the first:
    ``x(L) = x(1) + (L - 1) * (x(2) - x(1))`` for the step time, the slowest rank's
    compute and exchange time, the bytes on every tier and link, and the exchanges
    started. A long Ring's passes are reduced the same way (:func:`_simulate_passes`).
    ``tests/simulator/test_simulate.py`` checks every field against the full simulation. A plan
    of two layers or fewer, or with layers that differ, is simulated in full, and so is
    every plan on a host whose late peers go first (``[host] late_peer_first``): there a
    pair that fell out of step in one layer exchanges one way after the other, which
    puts it back in step or further out, so the layers alternate instead of repeating.
    An extrapolated result holds no :class:`Simulation` (traces and plots need the full
    one).

    ``num_layers``: the step's layer count when ``plan`` holds only its first layers
    (at least two, all the same; the planner builds such plans, which is faster).
    """
    held = len(plan.program(0).layers)
    num_layers = num_layers or held
    repeats = _repeats_one_layer(plan)
    if num_layers != held and not (repeats and held >= min(num_layers, 2)):
        raise ValueError(f"a plan of {held} layers stands for {num_layers} only when it "
                         "repeats one layer at least twice")

    cache = cache or FlowCache()
    # The one- and two-layer plans hold the same layers: their Ring repeats found once.
    find = IdentityMemo(repeated_passes)

    def run(layers: int) -> _Point:
        return _simulate_passes(_with_layers(plan, layers) if layers != held else plan,
                                topology, placement, collective, gathers, cache, find)

    host = topology.spec.host
    if num_layers <= 2 or not repeats or (host is not None and host.late_peer_first):
        return run(num_layers).final()
    return _Point.affine(run(1), run(2), num_layers - 1).final()


# A Ring whose block repeats at least this often in a layer (cocodiff.plan.passes) is
# simulated with PASS_POINTS repeats instead (each a short simulation) and extrapolated
# along the line through the first two, the third checking it.
MIN_EXTRAPOLATED_PASSES = 8
PASS_POINTS = (1, 2, 3)
# How close the third simulation must come to the line through the first two (relative
# to the value) for the extrapolation to be taken.
PASSES_RTOL = 1e-9


def _simulate_passes(plan: Plan, topology: Topology, placement: Placement | None,
                     collective: CollectiveModel | None,
                     gathers: tuple[GatherStage, ...], cache: FlowCache,
                     find: Finder = repeated_passes) -> _Point:
    """One simulation of ``plan``, or, for a long Ring, its repeated passes extrapolated.

    Every repeat of the Ring's block starts its pass, attends to the block in hand and
    waits for the pass, on every member alike; once the first repeats have set the
    pace, each adds the same time, bytes and exchanges, so ``x(n) = x(1) + (n - 1) *
    (x(2) - x(1))``. That is checked on every plan, not assumed: a simulation of three
    repeats must land on the line (every field of :meth:`_Point.matches`), else the plan
    is simulated in full. ``tests/simulator/test_passes.py`` holds the extrapolation to
    the full simulation across layouts, schedules and machines.
    """
    passes = plan_passes(plan.programs, find)
    if passes is None or passes < MIN_EXTRAPOLATED_PASSES:
        return _Point.of(simulate_plan(plan, topology, placement, collective=collective,
                                       gathers=gathers, cache=cache))
    one, two, three = (
        _Point.of(simulate_plan(replace(plan, programs=with_passes(  # type: ignore[arg-type]
                                    plan.programs, count, find)),
                                topology, placement, collective=collective,
                                gathers=gathers, cache=cache))
        for count in PASS_POINTS)
    if _Point.affine(one, two, 2).matches(three):
        point = _Point.affine(one, two, passes - 1).plus_effort(three)
        point.result.passes_extrapolated = True
        return point
    full = _Point.of(simulate_plan(plan, topology, placement, collective=collective,
                                   gathers=gathers, cache=cache))
    return full.plus_effort(one).plus_effort(two).plus_effort(three)


@dataclass
class _Point:
    """A simulated (or extrapolated) step and the bytes each link carried in it."""

    result: SimResult
    carried: dict
    simulation: Simulation  # the last one run: its links and capacities

    @classmethod
    def of(cls, result: SimResult) -> _Point:
        assert result.simulation is not None  # simulate_plan keeps it
        return cls(result, result.simulation.network.carried_bytes(), result.simulation)

    @classmethod
    def affine(cls, first: _Point, second: _Point, extra: int) -> _Point:
        """``first + extra * (second - first)`` for everything a step accumulates; the
        simulator's effort (wall, flows, events) summed over both."""
        one, two = first.result, second.result

        def line(a: float, b: float) -> float:
            return a + extra * (b - a)

        step_time_s, compute_s = (line(one.step_time_s, two.step_time_s),
                                  line(one.compute_s, two.compute_s))
        result = replace(
            two, step_time_s=step_time_s, compute_s=compute_s,
            comm_exposed_s=max(0.0, step_time_s - compute_s),
            bytes_by_tier={tier: line(one.bytes_by_tier[tier], two.bytes_by_tier[tier])
                           for tier in TIERS},
            exchange_s=line(one.exchange_s, two.exchange_s),
            exchanges_per_step=[one.exchanges_per_step[0]
                                + extra * (two.exchanges_per_step[0]
                                           - one.exchanges_per_step[0])],
            passes_extrapolated=one.passes_extrapolated or two.passes_extrapolated,
            simulation=None)
        # A link idle in the second simulation carries nothing either way (busiest_links
        # skips it).
        carried = {link: line(first.carried.get(link, 0.0), num_bytes)
                   for link, num_bytes in second.carried.items()}
        return cls(result, carried, second.simulation).plus_effort(first)

    def plus_effort(self, other: _Point) -> _Point:
        """This point with ``other``'s simulation effort added to its own."""
        self.result = replace(self.result, wall_s=self.result.wall_s + other.result.wall_s,
                              num_flows=self.result.num_flows + other.result.num_flows,
                              num_events=self.result.num_events + other.result.num_events)
        return self

    def matches(self, other: _Point) -> bool:
        """Whether every accumulated field of ``other`` equals this one's (relatively)."""
        mine, theirs = self.result, other.result
        values = [(mine.step_time_s, theirs.step_time_s), (mine.compute_s, theirs.compute_s),
                  (mine.exchange_s, theirs.exchange_s),
                  (mine.exchanges_per_step[0], theirs.exchanges_per_step[0]),
                  *((mine.bytes_by_tier[t], theirs.bytes_by_tier[t]) for t in TIERS),
                  *((self.carried.get(link, 0.0), num_bytes)
                    for link, num_bytes in other.carried.items())]
        return (self.carried.keys() <= other.carried.keys()
                and all(math.isclose(a, b, rel_tol=PASSES_RTOL, abs_tol=1e-15)
                        for a, b in values))

    def final(self) -> SimResult:
        """The step's result: a simulation's as it is (with its :class:`Simulation`), an
        extrapolation's with its busiest links from the carried bytes."""
        if self.result.simulation is not None:
            return self.result
        return replace(self.result,
                       busiest_links=busiest_links(self.simulation, self.result.step_time_s,
                                                   bytes_carried=self.carried))


def simulate_schedule(
    name: str,
    spec: ModelSpec,
    topology: Topology,
    placement: Placement,
    stream_tokens: Sequence[int],
    num_steps: int,
    *,
    options: PlanOptions = DEFAULT_OPTIONS,
    collective: CollectiveModel | None = None,
    record_spans: bool = False,
    with_bound: bool = True,
    activity: ActivityTrace | None = None,
    parallel: ParallelLayout | None = None,
    known: SimResult | None = None,
) -> SimResult:
    """Simulate a schedule over a whole generation of ``num_steps`` denoising steps: the
    run's plan (:func:`cocodiff.schedules.run_plan.build_run_plan`, as ``cocodiff plan`` and
    ``cocodiff run`` make it) through :func:`simulate_run_plan` (``known`` as there)."""
    from cocodiff.schedules.run_plan import build_run_plan

    grid = RankGrid.from_placement(topology, placement)
    run_plan = build_run_plan(name, spec, grid, stream_tokens, num_steps, options,
                              parallel=parallel, activity=activity)
    return simulate_run_plan(run_plan, topology, placement, collective=collective,
                             record_spans=record_spans, with_bound=with_bound, known=known)


def simulate_run_plan(
    run_plan: RunPlan,
    topology: Topology,
    placement: Placement | None = None,
    *,
    collective: CollectiveModel | None = None,
    record_spans: bool = False,
    with_bound: bool = True,
    known: SimResult | None = None,
    done: Mapping[int, PlanStep] | None = None,
) -> SimResult:
    """Simulate every step of a run's plan.

    Steps that share a plan share one simulation (a schedule that does the same thing
    every step is simulated once; V-Major's, once per distinct cache ratio or recorded
    step); step times are averaged over the steps (``step_times_s`` lists them all).
    Each plan is simulated by :func:`simulate_layers` (one and two layers,
    extrapolated), except the one a trace or plot records (``record_spans``), which
    runs in full. ``known``: the simulated step of the run's one plan of a schedule that
    does the same every step, when the caller already has it (the planner simulated it
    to choose the layout, :class:`cocodiff.simulator.planner.Choice`); then it is not run again.
    ``done``: distinct plans already simulated by :func:`simulate_step_plans` (by index in
    ``run_plan.plans``; ``cocodiff simulate`` spreads V-Major's over its workers).

    Raises:
        PlanFileError: the plan's rank grid is not where ``placement`` puts the ranks on
            ``topology``.
        ScheduleError: more chunks than any message has rows (:func:`check_chunks`:
            empty chunks change nothing but cost simulated collectives).
    """
    from cocodiff.schedules.run_plan import PlanFileError

    wall_start = time.perf_counter()
    placement = placement or Placement.node_major(topology, run_plan.num_ranks)
    if placement.num_ranks != run_plan.num_ranks:
        raise PlanFileError(f"the plan has {run_plan.num_ranks} ranks, the machine "
                            f"{topology.spec.name} with {topology.spec.num_nodes} node(s) "
                            f"{placement.num_ranks}")
    grid = RankGrid.from_placement(topology, placement)
    if grid != run_plan.grid:
        raise PlanFileError(f"the plan's ranks sit as {_shape(run_plan.grid)} (nodes x GPUs "
                            f"x tiles), the machine's as {_shape(grid)}")
    if run_plan.schedule in PIPELINE_SCHEDULES:
        # The steps depend on each other: simulated back to back, not one by one.
        result = simulate_generation(
            run_plan.plans, run_plan.step_plans, topology, placement, collective, record_spans,
            output_gather(run_plan.spec, run_plan.grid, run_plan.stream_tokens,
                          run_plan.plans[0].pipeline, run_plan.options))
        result.memory = run_plan_memory(run_plan)
        result.wall_s = time.perf_counter() - wall_start
        return result
    entry = get_schedule(run_plan.schedule)
    if entry.phased:
        check_chunks(run_plan.plans[0], run_plan.options.chunks)
    steps = dict(done or {})
    distinct = list(dict.fromkeys(run_plan.step_plans))
    if (known is not None and not entry.step_dependent and len(run_plan.plans) == 1
            and not record_spans):
        steps.setdefault(distinct[0], PlanStep(known, None))
    steps.update(simulate_step_plans(run_plan, [i for i in distinct if i not in steps],
                                     topology, placement, collective, with_bound=with_bound,
                                     record_spans=record_spans))
    by_plan = {index: steps[index].result for index in distinct}
    per_step = [by_plan[index] for index in run_plan.step_plans]
    # A schedule that does the same every step reports (and averages) that step once, as
    # it always has.
    if not entry.step_dependent and len(by_plan) == 1:
        per_step = per_step[:1]
    first = per_step[0]
    result = SimResult(
        schedule=run_plan.schedule,
        num_ranks=first.num_ranks,
        step_time_s=_mean(r.step_time_s for r in per_step),
        compute_s=_mean(r.compute_s for r in per_step),
        comm_exposed_s=_mean(r.comm_exposed_s for r in per_step),
        bytes_by_tier={tier: _mean(r.bytes_by_tier[tier] for r in per_step) for tier in TIERS},
        busiest_links=first.busiest_links,
        simulated_ranks=first.simulated_ranks,
        folded=first.folded,
        wall_s=0.0,
        num_flows=sum(r.num_flows for r in by_plan.values()),
        num_events=sum(r.num_events for r in by_plan.values()),
        exchange_s=_mean(r.exchange_s for r in per_step),
        step_times_s=[r.step_time_s for r in per_step],
        exchanges_per_step=[r.exchanges_per_step[0] for r in per_step],
        simulation=first.simulation,
        passes_extrapolated=any(r.passes_extrapolated for r in by_plan.values()),
    )
    if with_bound:
        # The links' lower bound for the flat baseline's exchanges on the same layout.
        flat = plan_for_step(BASELINE, run_plan.spec, grid, run_plan.stream_tokens,
                             run_plan.options, parallel=run_plan.parallel)
        result.bound_s = plan_bound_s(flat, topology, placement)
        model = collective or collective_model_for(topology.spec.name)
        by_index = {index: model_bound_s(run_plan.plans[index], topology, placement, model)
                    if steps[index].model_bound_s is None else steps[index].model_bound_s
                    for index in distinct}
        counted = run_plan.step_plans if entry.step_dependent else run_plan.step_plans[:1]
        result.model_bound_s = _mean(by_index[index] for index in counted)
    result.memory = run_plan_memory(run_plan)
    # Plans simulated elsewhere (``done``) count their simulations' time.
    result.wall_s = time.perf_counter() - wall_start + sum(
        step.result.wall_s for step in (done or {}).values())
    return result


class PlanStep(NamedTuple):
    """One distinct step plan of a run, simulated: its step, and its model bound
    (:func:`~cocodiff.simulator.bounds.model_bound_s`; None when not worked out)."""

    result: SimResult
    model_bound_s: float | None


def simulate_step_plans(
    run_plan: RunPlan,
    indices: Sequence[int],
    topology: Topology,
    placement: Placement,
    collective: CollectiveModel | None = None,
    *,
    with_bound: bool = True,
    record_spans: bool = False,
) -> dict[int, PlanStep]:
    """Some of a run's distinct step plans (``indices`` into ``run_plan.plans``), each
    simulated as :func:`simulate_run_plan` simulates it, by :func:`simulate_layers` (the
    first in full, its timeline kept, with ``record_spans``), with its model bound
    (``with_bound``). They share one flow cache: V-Major's steps send the same gathers,
    passes and most exchanges. :func:`simulate_run_plan` takes the results back
    (``done``), so a caller may spread a run's plans over processes."""
    if not indices:
        return {}
    if get_schedule(run_plan.schedule).phased:
        check_chunks(run_plan.plans[0], run_plan.options.chunks)
    gathers = output_gather(run_plan.spec, run_plan.grid, run_plan.stream_tokens,
                            run_plan.parallel, run_plan.options)
    model = collective or collective_model_for(topology.spec.name)
    cache = FlowCache()
    steps: dict[int, PlanStep] = {}
    for index in indices:
        plan = run_plan.plans[index]
        if record_spans and not steps:  # the trace and the plot show this one
            result = simulate_plan(plan, topology, placement, collective=collective,
                                   record_spans=True, gathers=gathers, cache=cache)
        else:
            result = simulate_layers(plan, topology, placement, collective, gathers=gathers,
                                     cache=cache)
        steps[index] = PlanStep(result, model_bound_s(plan, topology, placement, model)
                                if with_bound else None)
    return steps


def run_plan_memory(run_plan: RunPlan) -> RankMemory:
    """Device memory one rank of ``run_plan`` needs (:mod:`cocodiff.memory`)."""
    options = run_plan.options
    pipeline = run_plan.plans[run_plan.step_plans[-1]].pipeline
    if pipeline is not None:
        return pipeline_memory(run_plan.spec, run_plan.stream_tokens, pipeline,
                               options.dtype_bytes, options.batch)
    entry = get_schedule(run_plan.schedule)
    return sequence_memory(run_plan.spec, run_plan.stream_tokens, run_plan.num_ranks,
                           run_plan.parallel, options.dtype_bytes, options.batch,
                           v_cache=entry.step_dependent and options.vmajor is not None)


# -- PipeFusion: a generation's steps back to back -------------------------------------
# Simulating a PipeFusion generation: its steps run back to back, as one program per rank.
#
# A pipeline stage's step depends on the step before (stage 0 waits for the last stage's
# latents), so steps cannot be simulated one at a time as the other schedules' are (with
# overlapping steps, ``PipelineLayout.overlap``, the pipeline fills and drains once per
# generation; without, as `run` executes it, once per step). Every rank's program is
# the concatenation of its steps' programs
# (:func:`cocodiff.schedules.pipefusion.pipefusion_step_plans`), run by the one executor in
# one simulation. Sends are eager (the simulated backend's "send" side does not wait for
# the receiver, as xDiT never waits for its ``isend``); the bytes leave once the receiver
# has posted its receive, which it does one patch ahead.
#
# Speed. After the first pipelined step the pipeline is in its steady state: every further
# pipelined step adds the same time, bytes and transfers. A generation of ``T`` steps with
# ``W`` warm-up steps and ``T > W + 3`` is simulated for its first ``W + 2`` and ``W + 3``
# steps (each ending as the last step ends: no latents sent back) and extrapolated:
# ``x(T) = x(W + 2) + (T - W - 2) * (x(W + 3) - x(W + 2))``;
# ``tests/simulator/test_pipeline.py`` checks it against the full simulation.


def simulate_generation(plans: Sequence[Plan], step_plans: Sequence[int],
                        topology: Topology, placement: Placement | None = None,
                        collective: CollectiveModel | None = None,
                        record_spans: bool = False,
                        gathers: tuple[GatherStage, ...] = ()) -> SimResult:
    """Simulate a PipeFusion generation; the result is per step (the generation's time,
    compute, bytes and exchanges over its step count), as the other schedules report.

    Args:
        plans: the distinct step plans.
        step_plans: each step's index in ``plans``.
        topology, placement, collective: as :func:`simulate_plan`.
        record_spans: simulate every step in full and keep the timeline.
        gathers: each step's output gather (:func:`~cocodiff.schedules.gather.stage_gather`).
    """
    num_steps = len(step_plans)
    layout = plans[step_plans[-1]].pipeline
    assert layout is not None, "a PipeFusion plan states its pipeline"
    warmup = min(layout.warmup, num_steps)
    if record_spans or num_steps <= warmup + 3:
        total = _run_generation(plans, step_plans, topology, placement, collective,
                                record_spans, gathers)
        return _generation_per_step(total, num_steps)
    cache = FlowCache()  # the two generations post the same transfers and exchanges
    short, longer = (_run_generation(plans, (*step_plans[:k - 1], step_plans[-1]), topology,
                                     placement, collective, False, gathers, cache)
                     for k in (warmup + 2, warmup + 3))
    extra = num_steps - warmup - 2

    def affine(a: float, b: float) -> float:
        return a + extra * (b - a)

    total = SimResult(
        schedule=short.schedule, num_ranks=short.num_ranks,
        step_time_s=affine(short.step_time_s, longer.step_time_s),
        compute_s=affine(short.compute_s, longer.compute_s),
        comm_exposed_s=0.0,
        bytes_by_tier={t: affine(short.bytes_by_tier[t], longer.bytes_by_tier[t])
                       for t in TIERS},
        busiest_links=longer.busiest_links, simulated_ranks=longer.simulated_ranks,
        folded=False, wall_s=short.wall_s + longer.wall_s,
        num_flows=short.num_flows + longer.num_flows,
        num_events=short.num_events + longer.num_events,
        exchange_s=affine(short.exchange_s, longer.exchange_s),
        exchanges_per_step=[round(affine(short.exchanges_per_step[0],
                                         longer.exchanges_per_step[0]))])
    return _generation_per_step(total, num_steps)


def _run_generation(plans: Sequence[Plan], step_plans: Sequence[int], topology: Topology,
         placement: Placement | None, collective: CollectiveModel | None,
         record_spans: bool, gathers: tuple[GatherStage, ...] = (),
         cache: FlowCache | None = None) -> SimResult:
    # The ranks' executions run the steps' programs back to back, each step's overhead
    # charged in them; the first step's plan only names the schedule and the ranks.
    first = replace(plans[step_plans[0]], shift_period=None)
    return simulate_plan(first, topology, placement, fold=False, record_spans=record_spans,
                         collective=collective, denoising_step=False, cache=cache,
                         execution=functools.partial(generation_execution, plans, step_plans,
                                                     gathers=gathers))


def _generation_per_step(total: SimResult, num_steps: int) -> SimResult:
    """The generation's totals as one step's (each step's overhead outside the blocks
    already charged in it, by :func:`~cocodiff.simulator.backend.generation_execution`)."""
    step_s = total.step_time_s / num_steps
    compute_s = total.compute_s / num_steps
    return replace(
        total, step_time_s=step_s, compute_s=compute_s, step_times_s=[step_s],
        comm_exposed_s=max(0.0, step_s - compute_s),
        bytes_by_tier={t: b / num_steps for t, b in total.bytes_by_tier.items()},
        exchange_s=total.exchange_s / num_steps,
        exchanges_per_step=[round(total.exchanges_per_step[0] / num_steps)],
        busiest_links=total.busiest_links)


def _shape(grid: RankGrid) -> str:
    return "x".join(map(str, grid.shape))


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


# Kept under its old name for callers of this module.
_fold_period_nodes = fold_period_nodes
