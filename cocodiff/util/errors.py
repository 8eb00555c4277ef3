"""Errors a user can cause. The CLI prints their message as one line and exits 2."""


class CocodiffError(Exception):
    """Bad input to cocodiff: the message names the offending value."""


class ScheduleError(CocodiffError, ValueError):
    """An unknown schedule name, or a layout a schedule cannot honour."""


def one_line(message: str) -> str:
    """``message`` with the characters that would break or garble its line escaped.

    Messages quote user input (paths, TOML keys, argument values), which may hold newlines,
    terminal escapes or the undecodable bytes of a path.
    """
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in message)
