"""Schedulers: pure functions from (model, rank layout, options) to a
:class:`~cocodiff.plan.steps.Plan`.

Each is registered by name with what it is in :data:`SCHEDULES`
(:mod:`cocodiff.schedules.registry`); :func:`get_schedule` resolves a name and lists the
valid ones when it is unknown. :func:`plan_for_step` is the one way a step's plan is
made, in the simulator, the planner and the runtime alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from cocodiff.layout import ParallelLayout
from cocodiff.models import ModelSpec
from cocodiff.plan.steps import Plan
from cocodiff.schedules.flat import plan_cocodiff, plan_flat, plan_tapa, plan_vfirst
from cocodiff.schedules.grid import RankGrid
from cocodiff.schedules.hybrid import plan_hybrid
from cocodiff.schedules.options import DEFAULT_OPTIONS, DTYPE_BYTES, PlanOptions
from cocodiff.schedules.registry import (
    BASELINE,
    EXACT,
    SCHEDULES,
    Schedule,
    ScheduleError,
    Scheduler,
    get_schedule,
)
from cocodiff.schedules.tapa import DEFAULT_CHUNKS
from cocodiff.schedules.vmajor import VMajorOptions


def plan_for_step(name: str, spec: ModelSpec, grid: RankGrid, stream_tokens: Sequence[int],
                  options: PlanOptions = DEFAULT_OPTIONS, step: int = 0, num_steps: int = 1,
                  parallel: ParallelLayout | None = None) -> Plan:
    """The plan of schedule ``name`` at denoising step ``step`` of ``num_steps``: on
    ``parallel`` (a Ulysses x Ring x batch layout) when given, else pure Ulysses."""
    schedule = get_schedule(name)
    ratio = schedule.cache_ratio(options, step, num_steps)
    if parallel is not None:
        return plan_hybrid(name, spec, grid, stream_tokens, parallel, options, ratio)
    return schedule.plan(spec, grid, stream_tokens, options, ratio)


__all__ = [
    "BASELINE", "DEFAULT_CHUNKS", "DEFAULT_OPTIONS", "DTYPE_BYTES", "EXACT", "SCHEDULES",
    "PlanOptions", "RankGrid", "Schedule", "ScheduleError", "Scheduler", "VMajorOptions",
    "get_schedule", "plan_cocodiff", "plan_flat", "plan_for_step", "plan_hybrid", "plan_tapa",
    "plan_vfirst",
]
