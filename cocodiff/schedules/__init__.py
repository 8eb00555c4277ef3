"""Schedulers: pure functions from (model, rank layout, options) to a :class:`~cocodiff.plan.Plan`.

Each is registered by name in :data:`SCHEDULES`; :func:`get_schedule` resolves a name
and lists the valid ones when it is unknown.
"""

from __future__ import annotations

from collections.abc import Callable

from cocodiff.errors import ScheduleError
from cocodiff.plan import Plan
from cocodiff.schedules.flat import plan_flat, plan_tapa, plan_vfirst
from cocodiff.schedules.grid import RankGrid
from cocodiff.schedules.vmajor import VMajorOptions, plan_cocodiff

Scheduler = Callable[..., Plan]
"""(spec, grid, stream_tokens, dtype_bytes=2, batch=1, ...) -> Plan"""

SCHEDULES: dict[str, Scheduler] = {
    "flat": plan_flat,
    "tapa": plan_tapa,
    "vfirst": plan_vfirst,
    "cocodiff": plan_cocodiff,
}

# Schedules whose plan changes from one denoising step to the next.
STEP_DEPENDENT = frozenset({"cocodiff"})


def get_schedule(name: str) -> Scheduler:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ScheduleError(
            f"unknown schedule {name!r}; valid: {', '.join(sorted(SCHEDULES))}"
        ) from None


def plan_for_step(name: str, spec, grid: RankGrid, stream_tokens, step: int, num_steps: int,
                  vmajor: VMajorOptions | None = None, **kwargs) -> Plan:
    """The plan of schedule ``name`` at denoising step ``step`` of ``num_steps``."""
    scheduler = get_schedule(name)
    if name in STEP_DEPENDENT:
        options = vmajor or VMajorOptions()
        kwargs |= {"cache_ratio": options.cache_ratio(step, num_steps),
                   "slow_levels": options.slow_levels}
    return scheduler(spec, grid, stream_tokens, **kwargs)


__all__ = [
    "SCHEDULES", "STEP_DEPENDENT", "RankGrid", "ScheduleError", "Scheduler", "VMajorOptions",
    "get_schedule", "plan_cocodiff", "plan_flat", "plan_for_step", "plan_tapa", "plan_vfirst",
]
