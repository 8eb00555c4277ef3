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
(``t(L) = t(1) + (L - 1) * (t(2) - t(1))``). ``tests/test_planner.py`` checks this
against the full simulation. With Ulysses degree 1 (pure Ring) there is no head
exchange, so every schedule is the same plan and is simulated once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import permutations

from cocodiff.bounds import plan_bound_s
from cocodiff.layout import AXES, ParallelLayout
from cocodiff.models import ModelSpec
from cocodiff.plan import Plan, RankProgram
from cocodiff.schedules import (
    DEFAULT_OPTIONS,
    EXACT,
    PlanOptions,
    RankGrid,
    get_schedule,
    plan_hybrid,
)
from cocodiff.simulate import simulate_plan
from topology import Placement, Topology
from transports.sim import CollectiveModel

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
            ``cocodiff.bounds``): no schedule of this layout communicates faster.
    """

    layout: ParallelLayout
    schedule: str
    step_time_s: float
    compute_s: float
    bound_s: float

    def to_json(self) -> dict:
        return {"layout": self.layout.name, "ulysses": self.layout.ulysses,
                "ring": self.layout.ring, "batch": self.layout.batch,
                "order": list(self.layout.order), "schedule": self.schedule,
                "step_time_s": self.step_time_s, "compute_s": self.compute_s,
                "bound_s": self.bound_s}


@dataclass(frozen=True, slots=True)
class PlanResult:
    """Every candidate, fastest first, and how long ranking them took."""

    candidates: tuple[Candidate, ...]
    wall_s: float

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
            for inner in permutations(("ring", "ulysses")):
                layout = ParallelLayout(ulysses, ring, batch, ("batch", *inner))
                layouts.setdefault(layout.name, layout)
    return list(layouts.values())


def _with_layers(plan: Plan, num_layers: int) -> Plan:
    return replace(plan, programs=tuple(RankProgram(p.rank, p.layers[:num_layers])
                                        for p in plan.programs))


def simulate_step(plan: Plan, topology: Topology, placement: Placement,
                  collective: CollectiveModel | None = None) -> tuple[float, float]:
    """(step time, compute of the slowest rank) of ``plan``, by layer extrapolation
    when its layers are all the same (module doc), else by simulating every layer."""
    layers = plan.program(0).layers
    same = all(all(layer is p.layers[0] for layer in p.layers) for p in plan.programs)
    if len(layers) <= 2 or not same:
        result = simulate_plan(plan, topology, placement, collective=collective)
        return result.step_time_s, result.compute_s
    one, two = (simulate_plan(_with_layers(plan, k), topology, placement, collective=collective)
                for k in (1, 2))
    extra = len(layers) - 1
    return (one.step_time_s + extra * (two.step_time_s - one.step_time_s),
            one.compute_s * len(layers))


def rank_layouts(spec: ModelSpec, topology: Topology, stream_tokens: Sequence[int],
                 schedules: Sequence[str] = DEFAULT_SCHEDULES,
                 options: PlanOptions = DEFAULT_OPTIONS,
                 collective: CollectiveModel | None = None,
                 layouts: Sequence[ParallelLayout] | None = None) -> PlanResult:
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
    """
    start = time.perf_counter()
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    if layouts is None:
        layouts = candidate_layouts(placement.num_ranks, spec.num_heads, options.batch)
    candidates = []
    for layout in layouts:
        # Without a Ulysses exchange every schedule makes the same plan.
        names = schedules[:1] if layout.ulysses == 1 else schedules
        for name in names:
            plan = plan_hybrid(name, spec, grid, stream_tokens, layout, options)
            step_s, compute_s = simulate_step(plan, topology, placement, collective)
            candidates.append(Candidate(layout, name, step_s, compute_s,
                                        plan_bound_s(plan, topology, placement)))
    candidates.sort(key=lambda c: (c.step_time_s, c.layout.name, c.schedule))
    return PlanResult(tuple(candidates), time.perf_counter() - start)


def best_layout(spec: ModelSpec, topology: Topology, stream_tokens: Sequence[int],
                schedule: str, options: PlanOptions = DEFAULT_OPTIONS,
                collective: CollectiveModel | None = None) -> ParallelLayout:
    """The planner's layout for one schedule, ranked as its registry entry says (V-Major's
    ``cocodiff`` as its exact twin ``vfirst``: the same exchanges before V-Major trims
    them)."""
    ranked_as = get_schedule(schedule).ranked_as
    return rank_layouts(spec, topology, stream_tokens, (ranked_as,), options,
                        collective).best.layout


__all__ = ["AXES", "Candidate", "PlanResult", "best_layout", "candidate_layouts",
           "rank_layouts", "simulate_step"]
