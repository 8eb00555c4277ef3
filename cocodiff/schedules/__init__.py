"""Schedulers: pure functions from (model, rank layout, options) to a :class:`~cocodiff.plan.Plan`.

Each is registered by name in :data:`SCHEDULES`; :func:`get_schedule` resolves a name
and lists the valid ones when it is unknown.
"""

from __future__ import annotations

from collections.abc import Callable

from cocodiff.errors import ScheduleError
from cocodiff.plan import Plan
from cocodiff.schedules.flat import plan_flat

Scheduler = Callable[..., Plan]

SCHEDULES: dict[str, Scheduler] = {
    "flat": plan_flat,
}


def get_schedule(name: str) -> Scheduler:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ScheduleError(
            f"unknown schedule {name!r}; valid: {', '.join(sorted(SCHEDULES))}"
        ) from None


__all__ = ["SCHEDULES", "ScheduleError", "Scheduler", "get_schedule", "plan_flat"]
