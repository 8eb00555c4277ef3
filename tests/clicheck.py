"""Driving ``cocodiff.commands.cli.main`` in-process the way a real process sees it, and checking
the promise every command makes: it works (exit 0), or it prints exactly one line on
stderr and exits 2; never a traceback, never a hang."""

from __future__ import annotations

import io
import signal
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass

from cocodiff.commands.cli import main


class Hang(Exception):
    """A command ran past its time limit."""


# A wall-clock bound as well, this many times the CPU bound: for a command that waits
# instead of computing.
WALL_FACTOR = 10


@contextmanager
def time_limit(seconds: float):
    """Raise :class:`Hang` after ``seconds`` of this process's CPU time, or ten times as
    long on the wall clock.

    CPU time, because a machine shared with other jobs may give a test a fifth of a core:
    a wall-clock alarm then fires on commands that are merely starved. A livelock still
    burns CPU time; a command stuck waiting hits the wall-clock bound.
    """
    def on_alarm(signum, frame):
        kind = "CPU" if signum == signal.SIGPROF else "wall-clock"
        raise Hang(f"no answer after {seconds} s of {kind} time")

    previous = {sig: signal.signal(sig, on_alarm) for sig in (signal.SIGALRM, signal.SIGPROF)}
    signal.setitimer(signal.ITIMER_PROF, seconds)
    signal.setitimer(signal.ITIMER_REAL, seconds * WALL_FACTOR)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def check_one_line_error(err: str) -> None:
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    line = err[:-1]
    assert line.strip(), "empty error line"
    assert "\r" not in line, f"carriage return in {line!r}"


def strict_stream(errors: str) -> io.TextIOWrapper:
    """A UTF-8 text stream as a real process has: ``errors="strict"`` for stdout under a
    desktop locale, ``"backslashreplace"`` for stderr."""
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors=errors, write_through=True)


@dataclass(frozen=True, slots=True)
class Outcome:
    code: int
    out: str
    err: str


def call(argv: list[str], limit_s: float) -> Outcome:
    """``main(argv)`` under an alarm, with a strict UTF-8 stdout; raises :class:`Hang`."""
    stdout, stderr = strict_stream("strict"), strict_stream("backslashreplace")
    with time_limit(limit_s), redirect_stdout(stdout), redirect_stderr(stderr):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse: usage errors and --help
            code = exit_.code if isinstance(exit_.code, int) else 2
    return Outcome(code, stdout.buffer.getvalue().decode("utf-8", "backslashreplace"),
                   stderr.buffer.getvalue().decode("utf-8", "backslashreplace"))


def check_outcome(outcome: Outcome, argv: list[str]) -> None:
    """Exit 0 without a traceback, or exit 2 with one line."""
    if outcome.code == 0:
        assert "Traceback" not in outcome.err, outcome.err
    else:
        assert outcome.code == 2, f"exit {outcome.code} for {argv!r}: {outcome.err[-2000:]}"
        check_one_line_error(outcome.err)
