"""How a rank fails without hanging the others.

* SIGINT and SIGTERM raise :class:`Interrupted` in the main thread, so ``finally`` blocks
  run (a half-written output's temporary file is removed); a second signal ends the
  process at once;
* under mpiexec a failing rank ends the whole job (``MPI_Abort``), since mpiexec would
  leave a silent peer running and MPI_Finalize may wait for a dead one.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from cocodiff.util.errors import CocodiffError

EXIT_FAILURE = 1
ABORT_GRACE_S = 0.5


class RankFailure(CocodiffError):
    """Something that stops the job on every rank."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; raised in the main thread so that cleanups run."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


class _SignalsRaise:
    """SIGINT and SIGTERM raise :class:`Interrupted` until :meth:`disarm`; after that the
    first one is ignored. Either way a second signal ends the process at once (the default
    action), without waiting for the cleanups the first one started."""

    WATCHED = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.armed = True

    def handler(self, signum: int, frame: Any) -> None:
        for sig in self.WATCHED:
            signal.signal(sig, signal.SIG_DFL)
        if self.armed:
            raise Interrupted(signum)

    def disarm(self) -> None:
        self.armed = False


@contextmanager
def raise_on_signals() -> Iterator[_SignalsRaise]:
    """Turn SIGINT and SIGTERM into :class:`Interrupted` for the duration (or until the
    yielded object's ``disarm()``), so that ``finally`` blocks and temporary-file cleanups
    run; the previous handlers are restored after."""
    signals = _SignalsRaise()
    try:
        previous = {sig: signal.signal(sig, signals.handler) for sig in signals.WATCHED}
    except ValueError:  # not the main thread: signals go to the main thread anyway
        yield signals
        return
    try:
        yield signals
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def end_job_after_failure(launch) -> None:
    """Under mpiexec, end every rank now: mpiexec leaves a silent peer running, and
    MPI_Finalize at exit may wait forever for a dead one."""
    from transports.launch import MPIEXEC

    mpi = sys.modules.get("mpi4py.MPI")
    if launch.launcher != MPIEXEC or mpi is None:
        return
    if mpi.Is_initialized() and not mpi.Is_finalized():
        sys.stdout.flush()
        sys.stderr.flush()
        # mpiexec forwards output asynchronously and drops what it has not forwarded when
        # the abort reaches it: give the line just printed time to get out.
        time.sleep(ABORT_GRACE_S)
        mpi.COMM_WORLD.Abort(EXIT_FAILURE)
