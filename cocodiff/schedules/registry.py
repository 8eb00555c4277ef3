"""The schedules by name, each with what it is.

Code outside this module asks an entry what a schedule does (is it phased, does its
plan change per step, is it exact, what the planner ranks it as) instead of comparing
names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cocodiff.models import ModelSpec
from cocodiff.plan.steps import Plan
from cocodiff.schedules.flat import plan_cocodiff, plan_flat, plan_tapa, plan_vfirst
from cocodiff.schedules.grid import RankGrid
from cocodiff.schedules.options import PlanOptions
from cocodiff.util.errors import ScheduleError

Scheduler = Callable[..., Plan]
"""(spec, grid, stream_tokens, options[, cache_ratio]) -> Plan"""


@dataclass(frozen=True, slots=True)
class Schedule:
    """One schedule.

    Args:
        name: its registry name (a plan's ``schedule``).
        scheduler: the pure function that makes its plan.
        phased: carries exchanges as topology-aligned phases (``chunks`` applies).
        step_dependent: its plan changes from one denoising step to the next (V-Major's
            cached fraction follows a ratio schedule); it takes a ``cache_ratio``.
        exact: its output equals single-process inference (V-Major is lossy).
        ranked_as: the exact schedule the planner ranks layouts by for it (V-Major's
            ``cocodiff`` has ``vfirst``'s exchanges before V-Major trims them).
    """

    name: str
    scheduler: Scheduler
    phased: bool
    step_dependent: bool
    exact: bool
    ranked_as: str

    def cache_ratio(self, options: PlanOptions, step: int, num_steps: int) -> float:
        """The V-Major cached fraction of ``step`` (0 for schedules that have none)."""
        if not self.step_dependent or options.vmajor is None:
            return 0.0
        return options.vmajor.planned_ratio(step, num_steps)

    def plan(self, spec: ModelSpec, grid: RankGrid, stream_tokens: Sequence[int],
             options: PlanOptions, cache_ratio: float = 0.0) -> Plan:
        if self.step_dependent:
            return self.scheduler(spec, grid, stream_tokens, options, cache_ratio=cache_ratio)
        return self.scheduler(spec, grid, stream_tokens, options)


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    # Q, K, V all-to-alls over all ranks, one after another.
    Schedule("flat", plan_flat, phased=False, step_dependent=False, exact=True,
             ranked_as="flat"),
    # flat's order, each all-to-all as topology-aligned phases.
    Schedule("tapa", plan_tapa, phased=True, step_dependent=False, exact=True,
             ranked_as="tapa"),
    # TAPA, V's exchange started first and hidden behind Q/K norm and RoPE.
    Schedule("vfirst", plan_vfirst, phased=True, step_dependent=False, exact=True,
             ranked_as="vfirst"),
    # V-First TAPA plus V-Major: only the active V blocks cross the slow tier.
    Schedule("cocodiff", plan_cocodiff, phased=True, step_dependent=True, exact=False,
             ranked_as="vfirst"),
)}

# The baseline every speedup is measured against.
BASELINE = "flat"
# The schedules the planner ranks by default: the exact ones.
EXACT = tuple(name for name, s in SCHEDULES.items() if s.exact)


def get_schedule(name: str) -> Schedule:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ScheduleError(
            f"unknown schedule {name!r}; valid: {', '.join(sorted(SCHEDULES))}"
        ) from None
