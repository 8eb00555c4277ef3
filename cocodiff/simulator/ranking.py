"""``cocodiff plan``'s ranking: sequence and PipeFusion candidates together, pruned with
lower bounds so that only those that can reach the top are simulated.

Every candidate gets a floor first, a lower bound on its simulated step that needs no
simulation (:func:`cocodiff.simulator.bounds.step_floor_s` for a Ulysses x Ring x batch
layout and schedule, :func:`cocodiff.simulator.bounds.generation_floor_s` for a PipeFusion
layout) and its memory check (:func:`cocodiff.simulator.pipelines.keep_fitting`). The
candidates that fit are simulated in the order of their floors; once the next floor is
above the ``top``-th best step time simulated so far, no candidate left can enter the
top ``top``, and they are reported as pruned, with their floor and no step time. The
top ``top`` are therefore exactly those of simulating every candidate (the same
simulations, the same times). Which candidates are listed as simulated does not depend
on the number of workers: those whose floor is at most the final ``top``-th best time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cocodiff.layout import ParallelLayout, PipelineLayout
from cocodiff.memory import RankMemory
from cocodiff.models import ModelSpec
from cocodiff.schedules import DEFAULT_OPTIONS, PlanOptions, RankGrid, plan_hybrid
from cocodiff.schedules.gather import output_gather
from cocodiff.schedules.pipefusion import pipefusion_step_plans
from cocodiff.schedules.run_plan import canonical_streams
from cocodiff.simulator.bounds import generation_floor_s, plan_bound_s, step_floor_s
from cocodiff.simulator.fanout import map_local
from cocodiff.simulator.pipelines import keep_fitting
from cocodiff.simulator.planner import Candidate, step_key
from cocodiff.simulator.simulate import simulate_generation, simulate_layers
from topology import Placement, Topology
from transports.sim import CollectiveModel, collective_model_for

# Relative float rounding a floor may carry above the simulated time it bounds.
FLOOR_SLACK = 1e-9


@dataclass(frozen=True, slots=True)
class PrunedCandidate:
    """A candidate not simulated: its floor is above the ``top``-th best step time.

    Args:
        layout: the layout.
        schedule: the schedule.
        floor_s: the lower bound on its step time.
        memory: device memory one rank needs.
    """

    layout: ParallelLayout | PipelineLayout
    schedule: str
    floor_s: float
    memory: RankMemory | None = None

    def to_json(self) -> dict:
        return {"layout": self.layout.name, "schedule": self.schedule, "pruned": True,
                "floor_s": self.floor_s,
                **({} if self.memory is None else {"memory_per_rank": self.memory.to_json()})}


@dataclass(frozen=True, slots=True)
class Ranking:
    """Simulated candidates fastest first, the pruned ones by floor, one line per layout
    refused for memory, and how long it took."""

    candidates: tuple[Candidate, ...]
    pruned: tuple[PrunedCandidate, ...]
    refused: tuple[str, ...]
    wall_s: float

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


@dataclass(frozen=True, slots=True)
class _Context:
    spec: ModelSpec
    short: ModelSpec  # two layers stand for the step (cocodiff.simulator.planner)
    topology: Topology
    placement: Placement
    grid: RankGrid
    stream_tokens: tuple[int, ...]
    num_steps: int
    options: PlanOptions
    collective: CollectiveModel | None


def rank_with_floors(spec: ModelSpec, topology: Topology, stream_tokens: Sequence[int],
                     schedules: Sequence[str], layouts: Sequence[ParallelLayout],
                     pipelines: Sequence[PipelineLayout], num_steps: int,
                     options: PlanOptions = DEFAULT_OPTIONS,
                     collective: CollectiveModel | None = None, *, top: int = 5,
                     workers: int = 1) -> Ranking:
    """Rank ``layouts`` under ``schedules`` (each as :func:`cocodiff.simulator.planner.
    rank_layouts` simulates it) and the PipeFusion ``pipelines`` over a generation of
    ``num_steps`` steps (as :func:`cocodiff.simulator.pipelines.rank_pipelines`), the top
    ``top`` settled exactly and the rest pruned by their floors (module docstring).
    ``workers`` local processes simulate candidates of neighbouring floors at once."""
    start = time.perf_counter()
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    short = replace(spec, num_layers=min(spec.num_layers, 2))
    context = _Context(spec, short, topology, placement, grid, tuple(stream_tokens),
                       num_steps, options, collective)
    model = collective or collective_model_for(topology.spec.name)
    pairs = [Candidate(layout, name, 0.0, 0.0, None) for layout in layouts
             for name in (schedules[:1] if layout.ulysses == 1 else schedules)]
    pairs += [Candidate(layout, "pipefusion", 0.0, 0.0, None) for layout in pipelines]
    fitting, refused = keep_fitting(pairs, spec, stream_tokens, topology, options)
    floors = sorted(((_floor_s(context, model, c), c.layout.name, c.schedule, index)
                     for index, c in enumerate(fitting)))
    simulated: dict[int, tuple[float, float]] = {}
    done = 0
    top = max(1, top)
    while done < len(floors):
        times = sorted(t for t, _ in simulated.values())
        if len(times) >= top and floors[done][0] > times[top - 1] * (1 + FLOOR_SLACK):
            break
        batch = [floors[k][3] for k in range(done, min(done + max(1, workers), len(floors)))]
        for index, result in zip(batch, map_local(_simulate, context,
                                                  [fitting[k] for k in batch], workers),
                                 strict=True):
            simulated[index] = result
        done += len(batch)
    times = sorted(t for t, _ in simulated.values())
    threshold = times[min(top, len(times)) - 1] * (1 + FLOOR_SLACK) if times else 0.0
    candidates, pruned = [], []
    for floor_s, _, _, index in floors:
        candidate = fitting[index]
        if index in simulated and (floor_s <= threshold or len(times) < top):
            step_s, compute_s = simulated[index]
            candidates.append(replace(candidate, step_time_s=step_s, compute_s=compute_s,
                                      bound_s=_bound_s(context, candidate)))
        else:
            pruned.append(PrunedCandidate(candidate.layout, candidate.schedule, floor_s,
                                          candidate.memory))
    candidates.sort(key=lambda c: (step_key(c.step_time_s), c.layout.name, c.schedule))
    return Ranking(tuple(candidates), tuple(pruned), tuple(refused),
                   time.perf_counter() - start)


def _sequence_plan(context: _Context, candidate: Candidate):
    assert isinstance(candidate.layout, ParallelLayout)
    return plan_hybrid(candidate.schedule, context.short, context.grid, context.stream_tokens,
                       candidate.layout, context.options)


def _pipeline_plans(context: _Context, layout: PipelineLayout):
    # The streams as a run's plan holds them (build_run_plan), as rank_pipelines simulates.
    return pipefusion_step_plans(context.spec, context.grid,
                                 canonical_streams(context.stream_tokens), layout,
                                 context.num_steps, context.options)


def _floor_s(context: _Context, model: CollectiveModel, candidate: Candidate) -> float:
    layout = candidate.layout
    if isinstance(layout, PipelineLayout):
        plans, steps = _pipeline_plans(context, layout)
        return generation_floor_s(plans, steps, context.topology, context.placement, model)
    plan = _sequence_plan(context, candidate)
    return (step_floor_s(plan, context.topology, context.placement, model)
            * context.spec.num_layers / context.short.num_layers)


def _simulate(context: _Context, candidate: Candidate) -> tuple[float, float]:
    """(step time, compute of the slowest rank), as the full ranking simulates them."""
    layout = candidate.layout
    if isinstance(layout, PipelineLayout):
        plans, steps = _pipeline_plans(context, layout)
        result = simulate_generation(plans, steps, context.topology, context.placement,
                                     context.collective,
                                     gathers=output_gather(context.spec, context.grid,
                                                           context.stream_tokens, layout,
                                                           context.options))
    else:
        result = simulate_layers(_sequence_plan(context, candidate), context.topology,
                                 context.placement, context.collective,
                                 context.spec.num_layers,
                                 output_gather(context.spec, context.grid,
                                               context.stream_tokens, layout, context.options))
    return result.step_time_s, result.compute_s


def _bound_s(context: _Context, candidate: Candidate) -> float | None:
    """The links' bound of a sequence candidate's exchanges (None for a pipeline, as
    :func:`cocodiff.simulator.pipelines.rank_pipelines` gives none)."""
    if isinstance(candidate.layout, PipelineLayout):
        return None
    plan = _sequence_plan(context, candidate)
    return (plan_bound_s(plan, context.topology, context.placement)
            / context.short.num_layers * context.spec.num_layers)
