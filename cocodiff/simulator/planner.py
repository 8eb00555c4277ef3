"""The planner: every valid parallel layout and schedule, ranked by simulated step time.

A layout is valid when ``ulysses x ring x batch`` is the rank count, the Ulysses degree
is at most the head count, and the batch degree divides the step's samples
(:meth:`cocodiff.layout.ParallelLayout.check`). For each, both placements of the
communicating axes are tried (Ulysses innermost, on the fast tiers, and Ring
innermost); batch, which never communicates inside the transformer, stays outermost,
since anywhere else it only pushes the others onto slower tiers.

Speed. All layers of a plan are the same, and every layer ends with exchanges that
resynchronise the ranks, so a step's time is affine in its number of layers after the
first: the planner simulates each plan with one and with two layers and extrapolates
(``t(L) = t(1) + (L - 1) * (t(2) - t(1))``). ``tests/simulator/test_planner.py`` checks this
against the full simulation. With Ulysses degree 1 (pure Ring) there is no head
exchange, so every schedule is the same plan and is simulated once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import permutations
from typing import Any

from cocodiff.layout import AXES, ParallelLayout, PipelineLayout
from cocodiff.memory import RankMemory
from cocodiff.models import ModelSpec
from cocodiff.plan.gather import GatherStage
from cocodiff.plan.steps import Plan
from cocodiff.schedules import (
    DEFAULT_OPTIONS,
    EXACT,
    PlanOptions,
    RankGrid,
    get_schedule,
    plan_for_step,
    plan_hybrid,
)
from cocodiff.schedules.gather import output_gather
from cocodiff.simulator.bounds import plan_bound_s, step_floor_s
from cocodiff.simulator.fanout import map_local
from cocodiff.simulator.results import SimResult
from cocodiff.simulator.simulate import simulate_layers
from topology import Placement, Topology
from transports.sim import CollectiveModel, collective_model_for

# Schedules the planner ranks by default: the exact ones (V-Major is lossy).
DEFAULT_SCHEDULES = EXACT


@dataclass(frozen=True, slots=True)
class Candidate:
    """One layout and schedule with its simulated step.

    Args:
        layout: the parallel layout.
        schedule: the Ulysses schedule inside each Ulysses group.
        step_time_s: simulated time of one denoising step.
        compute_s: compute of the slowest rank in that step.
        bound_s: the topology's lower bound for the step's exchanges (links only,
            ``cocodiff.simulator.bounds``): no schedule of this layout communicates faster; None
            when the ranking was asked for none.
        memory: device memory one rank needs (``cocodiff.memory``), where it was computed.
    """

    layout: ParallelLayout | PipelineLayout
    schedule: str
    step_time_s: float
    compute_s: float
    bound_s: float | None
    memory: RankMemory | None = None

    def to_json(self) -> dict:
        layout = self.layout
        degrees: dict[str, Any]
        if isinstance(layout, PipelineLayout):
            degrees = {"pipeline": layout.stages, "ulysses": layout.ulysses,
                       "patches": layout.patches, "warmup": layout.warmup,
                       "overlap": layout.overlap}
        else:
            degrees = {"ulysses": layout.ulysses, "ring": layout.ring,
                       "batch": layout.batch, "order": list(layout.order)}
        return {"layout": layout.name, **degrees, "schedule": self.schedule,
                "step_time_s": self.step_time_s, "compute_s": self.compute_s,
                "bound_s": self.bound_s,
                **({} if self.memory is None else {"memory_per_rank": self.memory.to_json()})}


@dataclass(frozen=True, slots=True)
class PlanResult:
    """Every candidate, fastest first, how long ranking them took, and one line for each
    layout refused because its ranks would not fit the device's memory."""

    candidates: tuple[Candidate, ...]
    wall_s: float
    refused: tuple[str, ...] = ()

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(num_ranks: int, num_heads: int, batch_size: int = 1
                      ) -> list[ParallelLayout]:
    """Every valid layout of ``num_ranks`` ranks, each communicating placement once."""
    layouts: dict[str, ParallelLayout] = {}
    for ulysses in divisors(num_ranks):
        if ulysses > num_heads:
            break
        for batch in divisors(num_ranks // ulysses):
            if batch_size % batch:
                continue
            ring = num_ranks // (ulysses * batch)
            for first, second in permutations(("ring", "ulysses")):
                layout = ParallelLayout(ulysses, ring, batch, ("batch", first, second))
                layouts.setdefault(layout.name, layout)
    return list(layouts.values())


def simulate_step(plan: Plan, topology: Topology, placement: Placement,
                  collective: CollectiveModel | None = None,
                  num_layers: int | None = None,
                  gathers: tuple[GatherStage, ...] = ()) -> tuple[float, float]:
    """(step time, compute of the slowest rank) of ``plan``, by layer extrapolation
    (:func:`cocodiff.simulator.simulate.simulate_layers`; ``num_layers`` and ``gathers``
    as there)."""
    result = simulate_layers(plan, topology, placement, collective, num_layers, gathers)
    return result.step_time_s, result.compute_s


def rank_layouts(spec: ModelSpec, topology: Topology, stream_tokens: Sequence[int],
                 schedules: Sequence[str] = DEFAULT_SCHEDULES,
                 options: PlanOptions = DEFAULT_OPTIONS,
                 collective: CollectiveModel | None = None,
                 layouts: Sequence[ParallelLayout] | None = None, *,
                 with_bounds: bool = True, workers: int = 1) -> PlanResult:
    """Simulate every valid layout under every schedule on all of ``topology``'s tiles
    and rank them by step time.

    Args:
        spec: the model.
        topology: the machine (one rank per tile, node-major).
        stream_tokens: tokens of each stream of one sample.
        schedules: Ulysses schedules to try inside the Ulysses groups (each is ranked as
            its registry entry's ``ranked_as``, at its first step).
        options: dtype, samples per step (``batch``: 2 for a classifier-free-guidance
            batch), chunks of phased exchanges.
        collective: the collective model (default: the topology preset's).
        layouts: the layouts to rank (default: :func:`candidate_layouts`).
        with_bounds: compute each candidate's link bound (else ``bound_s`` is None):
            only for showing, it plays no part in the ranking.
        workers: local processes to simulate the candidates on
            (:func:`cocodiff.simulator.fanout.map_local`); the ranking is the same for any number.
    """
    start = time.perf_counter()
    placement = Placement.node_major(topology)
    if layouts is None:
        layouts = candidate_layouts(placement.num_ranks, spec.num_heads, options.batch)
    # Without a Ulysses exchange every schedule makes the same plan.
    pairs = [(layout, name) for layout in layouts
             for name in (schedules[:1] if layout.ulysses == 1 else schedules)]
    context = _Context(spec, topology, placement, RankGrid.from_placement(topology, placement),
                       tuple(stream_tokens), options, collective, with_bounds)
    candidates = map_local(_evaluate, context, pairs, workers)
    candidates.sort(key=lambda c: (step_key(c.step_time_s), c.layout.name, c.schedule))
    return PlanResult(tuple(candidates), time.perf_counter() - start)


@dataclass(frozen=True, slots=True)
class _Context:
    """What every candidate of one ranking shares."""

    spec: ModelSpec
    topology: Topology
    placement: Placement
    grid: RankGrid
    stream_tokens: tuple[int, ...]
    options: PlanOptions
    collective: CollectiveModel | None
    with_bounds: bool

    def gathers(self, layout: ParallelLayout) -> tuple[GatherStage, ...]:
        """The output gathers of a step split as ``layout``."""
        return output_gather(self.spec, self.grid, self.stream_tokens, layout, self.options)


def _evaluate(context: _Context, pair: tuple[ParallelLayout, str]) -> Candidate:
    layout, name = pair
    plan = plan_hybrid(name, context.spec, context.grid, context.stream_tokens, layout,
                       context.options)
    step_s, compute_s = simulate_step(plan, context.topology, context.placement,
                                      context.collective, gathers=context.gathers(layout))
    bound_s = (plan_bound_s(plan, context.topology, context.placement)
               if context.with_bounds else None)
    return Candidate(layout, name, step_s, compute_s, bound_s)


@dataclass(frozen=True, slots=True)
class Choice:
    """The planner's layout for one schedule, and the step it simulated to choose it
    (None for a schedule ranked as another: ``cocodiff`` as ``vfirst``). The step is the
    one :func:`cocodiff.simulator.simulate.simulate_schedule` gives for that layout with the same
    options, so callers may reuse it instead of simulating it again (its ``known``)."""

    layout: ParallelLayout
    result: SimResult | None


def best_layouts(spec: ModelSpec, topology: Topology, stream_tokens: Sequence[int],
                 schedules: Sequence[str], options: PlanOptions = DEFAULT_OPTIONS,
                 collective: CollectiveModel | None = None, *,
                 workers: int = 1) -> dict[str, ParallelLayout]:
    """The planner's best layout for each schedule (:func:`choose_layouts`)."""
    choices = choose_layouts(spec, topology, stream_tokens, schedules, options, collective,
                             workers=workers)
    return {name: choice.layout for name, choice in choices.items()}


# A ranked schedule's candidates by step floor, lowest first: (floor_s, layout name,
# index into candidate_layouts), the order choose_layouts simulates them in.
Floors = tuple[tuple[float, str, int], ...]


def layout_floors(spec: ModelSpec, topology: Topology, stream_tokens: Sequence[int],
                  schedules: Sequence[str], options: PlanOptions = DEFAULT_OPTIONS,
                  collective: CollectiveModel | None = None, *,
                  workers: int = 1) -> dict[str, Floors]:
    """Each ranked schedule's candidate layouts (:func:`candidate_layouts`) with their
    step floors (:func:`cocodiff.simulator.bounds.step_floor_s`: one node's ranks walked,
    no simulation), lowest first: what :func:`choose_layouts` walks, worked out apart so
    that the resource guard can count what the planner will surely simulate
    (``cocodiff.simulator.budget.estimate_planned``) before it does."""
    context = _context(spec, topology, stream_tokens, options, collective)
    ranked = _ranked(schedules)
    return dict(zip(ranked, map_local(_floors, context, ranked, workers), strict=True))


def choose_layouts(spec: ModelSpec, topology: Topology, stream_tokens: Sequence[int],
                   schedules: Sequence[str], options: PlanOptions = DEFAULT_OPTIONS,
                   collective: CollectiveModel | None = None, *,
                   workers: int = 1, floors: dict[str, Floors] | None = None
                   ) -> dict[str, Choice]:
    """The planner's best layout for each schedule, ranked as its registry entry says
    (V-Major's ``cocodiff`` as its exact twin ``vfirst``: the same exchanges before
    V-Major trims them).

    The same choice as the best of :func:`rank_layouts` for that schedule alone, without
    simulating every candidate: candidates are simulated in the order of their step
    floor (:func:`layout_floors`, a lower bound that needs no simulation; ``floors``:
    the same arguments' floors, already worked out), and once a floor exceeds the best
    step time simulated so far no later candidate can win. Ties (equal to
    :data:`_TIE_DIGITS` significant digits, :func:`step_key`) go to the layout name first,
    as in :func:`rank_layouts`, so a candidate whose floor already ties the best and whose
    name comes later is not simulated either.
    ``workers`` local processes search for different schedules at once.
    """
    context = _context(spec, topology, stream_tokens, options, collective)
    ranked = _ranked(schedules)
    jobs = [(name, None if floors is None else floors[name]) for name in ranked]
    best = dict(zip(ranked, map_local(_best_for, context, jobs, workers), strict=True))
    return {name: best[name] if get_schedule(name).ranked_as == name
            else Choice(best[get_schedule(name).ranked_as].layout, None) for name in schedules}


def _context(spec: ModelSpec, topology: Topology, stream_tokens: Sequence[int],
             options: PlanOptions, collective: CollectiveModel | None) -> _Context:
    from cocodiff.schedules.run_plan import canonical_streams

    placement = Placement.node_major(topology)
    # The streams as a run's plan holds them, so that a winner's step is that plan's.
    return _Context(spec, topology, placement, RankGrid.from_placement(topology, placement),
                    canonical_streams(stream_tokens), options, collective, False)


def _ranked(schedules: Sequence[str]) -> list[str]:
    """The schedules the layouts are ranked by, once each (``cocodiff`` as ``vfirst``)."""
    return list(dict.fromkeys(get_schedule(name).ranked_as for name in schedules))


def _short_plan(context: _Context, name: str, layout: ParallelLayout) -> Plan:
    # Every layer of a plan is the same: plans of two layers stand for the whole step, for
    # the floor (a sum over layers) and for the simulation (two layers, extrapolated).
    short = replace(context.spec, num_layers=min(context.spec.num_layers, 2))
    return plan_hybrid(name, short, context.grid, context.stream_tokens, layout,
                       context.options)


def _floors(context: _Context, name: str) -> Floors:
    """:func:`layout_floors` for one schedule."""
    topology, placement = context.topology, context.placement
    model = context.collective or collective_model_for(topology.spec.name)
    layouts = candidate_layouts(placement.num_ranks, context.spec.num_heads,
                                context.options.batch)
    # One plan alive at a time: at scale a plan of every rank is large, and most
    # candidates are pruned by their floor, so those that are simulated are built again.
    return tuple(sorted((step_floor_s(_short_plan(context, name, layout), topology,
                                      placement, model, context.gathers(layout),
                                      context.spec.num_layers),
                         layout.name, index)
                        for index, layout in enumerate(layouts)))


def _best_for(context: _Context, job: tuple[str, Floors | None]) -> Choice:
    """:func:`choose_layouts` for one schedule (and its floors, if worked out)."""
    name, floors = job
    if floors is None:
        floors = _floors(context, name)
    layouts = candidate_layouts(context.placement.num_ranks, context.spec.num_heads,
                                context.options.batch)
    winner: tuple[float, str, int, SimResult] | None = None
    for floor_s, layout_name, index in floors:
        if winner is not None:
            # The least step this candidate can have (its floor, less float rounding):
            # past the winner's it cannot win; equal to it, it ties at best, and a tie
            # goes to the name (a Ring-innermost twin of the winner at 1,024 nodes ties
            # it to 5e-14 and took 7 CPU-minutes to simulate).
            least = (step_key(floor_s / (1 + _FLOOR_SLACK)), layout_name)
            if least[0] > step_key(winner[0]):
                break
            if least > (step_key(winner[0]), winner[1]):
                continue
        result = simulate_layers(_short_plan(context, name, layouts[index]), context.topology,
                                 context.placement, context.collective,
                                 context.spec.num_layers, context.gathers(layouts[index]))
        if winner is None or ((step_key(result.step_time_s), layout_name)
                              < (step_key(winner[0]), winner[1])):
            winner = (result.step_time_s, layout_name, index, result)
    assert winner is not None, "candidate_layouts always holds pure Ulysses or pure Ring"
    result = winner[3]
    result.simulation = None  # a worker's result must pickle
    return Choice(layouts[winner[2]], result)


# Relative float rounding a step floor may carry above the simulated time it bounds.
_FLOOR_SLACK = 1e-9
# Step times equal to this many significant digits are one time: the layout's name then
# decides, so that a pick never rests on the last bits of sums taken in different orders
# (two placements that mirror each other simulate equal to ~1e-13).
_TIE_DIGITS = 7


def step_key(step_s: float) -> float:
    """``step_s`` as rankings compare it (:data:`_TIE_DIGITS` significant digits)."""
    return float(f"{step_s:.{_TIE_DIGITS}g}")

# Chunk counts the planner tries for a phased schedule (`--chunks auto`). Every chunk is
# one more collective per phase, each paying its transfers' set-up
# (transports.sim.CollectiveModel), so past a few chunks the set-up outweighs the overlap.
CHUNK_CANDIDATES = (1, 2, 3, 4, 6, 8)


@dataclass(frozen=True, slots=True)
class ChunkChoice:
    """The planner's chunk count for one schedule on one layout.

    Args:
        chunks: the fastest count (the fewest among equals).
        step_times_s: simulated step time of each count tried (those that split the
            exchanges: a count refused by :mod:`cocodiff.plan.chunking` is not tried).
        result: the step at ``chunks`` (as :class:`Choice`'s; None for a schedule ranked
            as another, or one without phased exchanges).
    """

    chunks: int
    step_times_s: dict[int, float]
    result: SimResult | None

    def describe(self) -> str:
        """The count and, when the planner chose it, the step time of each count tried."""
        if not self.step_times_s:
            return f"{self.chunks} (given)"
        counts = ", ".join(map(str, self.step_times_s))
        times_ms = ", ".join(f"{t * 1e3:.2f}" for t in self.step_times_s.values())
        return f"{self.chunks} (auto; step time at {counts} chunks: {times_ms} ms)"


def choose_chunks(name: str, spec: ModelSpec, topology: Topology, stream_tokens: Sequence[int],
                  layout: ParallelLayout | None, options: PlanOptions = DEFAULT_OPTIONS,
                  collective: CollectiveModel | None = None,
                  candidates: Sequence[int] = CHUNK_CANDIDATES,
                  known: SimResult | None = None) -> ChunkChoice:
    """The chunk count that gives schedule ``name`` (ranked as its registry entry says, at
    its first step) the shortest simulated step on ``layout`` (None: pure Ulysses).

    One chunk for a schedule that is not phased, or whose exchanges have one phase (one
    tier: nothing to pipeline). Counts are simulated as the planner simulates layouts
    (two layers, extrapolated; :func:`cocodiff.simulator.simulate.simulate_layers`), in
    increasing order until two in a row are slower than the best so far: past its best
    count, each chunk adds a set-up per transfer and less left to overlap.

    ``known``: the step :func:`choose_layouts` simulated for this schedule on ``layout``
    at ``options.chunks`` (its :class:`Choice`'s ``result``): that count is not simulated
    again (the same plan, the same simulation).
    """
    from cocodiff.schedules.run_plan import canonical_streams
    from cocodiff.schedules.tapa import check_chunks
    from cocodiff.util.errors import ScheduleError

    entry = get_schedule(name)
    if not entry.phased:
        return ChunkChoice(1, {}, None)
    ranked = entry.ranked_as
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    streams = canonical_streams(stream_tokens)
    num_layers = spec.num_layers
    short = replace(spec, num_layers=min(num_layers, 2))
    gathers = output_gather(spec, grid, streams, layout, options)
    times: dict[int, float] = {}
    results: dict[int, SimResult] = {}
    for chunks in candidates:
        try:
            plan = plan_for_step(ranked, short, grid, streams, replace(options, chunks=chunks),
                                 parallel=layout)
            check_chunks(plan, chunks)
        except ScheduleError:  # some chunk empty everywhere, or nothing to pipeline
            continue
        if known is not None and chunks == options.chunks:
            result = known
        else:
            result = simulate_layers(plan, topology, placement, collective, num_layers,
                                     gathers)
            result.simulation = None  # a worker's result must pickle
        times[chunks], results[chunks] = result.step_time_s, result
        best = min(times, key=lambda c: (times[c], c))
        last_two = sorted(times)[-2:]
        if len(times) >= 3 and all(times[c] > times[best] for c in last_two):
            break
    best = min(times, key=lambda c: (times[c], c))
    return ChunkChoice(best, times, results[best] if ranked == name else None)


__all__ = ["AXES", "CHUNK_CANDIDATES", "Candidate", "ChunkChoice", "Choice", "PlanResult",
           "Floors", "best_layouts", "candidate_layouts", "choose_chunks", "choose_layouts",
           "layout_floors", "rank_layouts", "simulate_step"]
