"""Errors a user can cause. The CLI prints their message as one line and exits 2."""


class CocodiffError(Exception):
    """Bad input to cocodiff: the message names the offending value."""


class ScheduleError(CocodiffError, ValueError):
    """An unknown schedule name, or a layout a schedule cannot honour."""
