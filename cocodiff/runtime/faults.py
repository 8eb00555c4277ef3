"""Fault injection for the reliability tests: one rank misbehaves at one point of a run.

Off unless ``COCODIFF_FAULT`` is set; it is read once, when ``cocodiff run`` starts::

    COCODIFF_FAULT="rank:1,point:exchange,count:3,action:kill"

Keys (comma-separated ``key:value`` pairs):

* ``rank``: the global rank that misbehaves (required).
* ``point``: ``exchange``, the ``count``-th all-to-all this rank starts (counting every
  all-to-all of the run from 1, the start-up argument check included), which is in flight
  on the peers when the fault strikes; or ``step``, right after the ``count``-th denoising
  step, between steps.
* ``count``: which exchange or step (default 1).
* ``action``: ``kill`` (SIGKILL: no cleanup at all), ``exit`` (``os._exit(3)``: no Python
  cleanup), ``raise`` (an :class:`InjectedFault` exception), ``hang`` (alive but silent
  until the launcher ends it), ``mark`` (only announce it: tests use it to know the job is
  mid-run), or ``nan`` (``exchange`` only: send a NaN in that all-to-all).

Every fault announces itself first with one line on stderr,
``cocodiff fault: rank 1: kill at exchange 3 (t=1712345678.123456)``, whose wall-clock
time lets a test measure how long the other ranks took to stop.

When the variable is unset nothing is installed: the transport is not wrapped and the step
callback makes one ``is None`` test.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cocodiff.util.errors import CocodiffError
from transports.base import Group, Handle, Transport

ENV_VAR = "COCODIFF_FAULT"
POINTS = ("exchange", "step")
ACTIONS = ("kill", "exit", "raise", "hang", "mark", "nan")
# os._exit status of the "exit" action: distinct from the CLI's 1 (failure) and 2 (usage).
EXIT_STATUS = 3


class InjectedFault(RuntimeError):
    """The exception the ``raise`` action throws."""


@dataclass(frozen=True, slots=True)
class Fault:
    """Where and how one rank misbehaves; see the module docstring."""

    rank: int
    point: str
    count: int
    action: str

    @classmethod
    def parse(cls, text: str) -> Fault:
        """Parse ``"rank:1,point:exchange,count:3,action:kill"``.

        Raises:
            CocodiffError: a malformed spec, naming the offending part.
        """
        fields: dict[str, str] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition(":")
            if not sep or key not in ("rank", "point", "count", "action"):
                raise CocodiffError(
                    f"bad {ENV_VAR} part {part.strip()!r}: expected rank:R, point:P, count:N "
                    f"or action:A"
                )
            fields[key] = value.strip()
        if "rank" not in fields or "point" not in fields or "action" not in fields:
            raise CocodiffError(f"{ENV_VAR}={text!r} needs rank, point and action")
        rank = _non_negative_int(fields["rank"], "rank")
        count = _non_negative_int(fields.get("count", "1"), "count")
        if count < 1:
            raise CocodiffError(f"{ENV_VAR} count must be at least 1, got {count}")
        point, action = fields["point"], fields["action"]
        if point not in POINTS:
            raise CocodiffError(f"{ENV_VAR} point {point!r} unknown; valid: {', '.join(POINTS)}")
        if action not in ACTIONS:
            raise CocodiffError(
                f"{ENV_VAR} action {action!r} unknown; valid: {', '.join(ACTIONS)}"
            )
        if action == "nan" and point != "exchange":
            raise CocodiffError(f"{ENV_VAR} action nan needs point:exchange, got {point}")
        return cls(rank, point, count, action)

    def strike(self, rank: int) -> None:
        """Announce the fault on stderr, then do it."""
        print(f"cocodiff fault: rank {rank}: {self.action} at {self.point} {self.count} "
              f"(t={time.time():.6f})", file=sys.stderr, flush=True)
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "exit":
            os._exit(EXIT_STATUS)
        elif self.action == "raise":
            raise InjectedFault(f"injected fault at {self.point} {self.count} on rank {rank}")
        elif self.action == "hang":
            while True:  # signals still end it: time.sleep returns to run their handlers
                time.sleep(1.0)


def fault_from_env(environ: Mapping[str, str] | None = None) -> Fault | None:
    """The fault ``COCODIFF_FAULT`` asks for, or None when it is unset or empty."""
    text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    return Fault.parse(text) if text else None


class StepFaults:
    """The ``step`` point: call :meth:`after_step` after each denoising step."""

    __slots__ = ("_fault", "_rank")

    def __init__(self, fault: Fault, rank: int) -> None:
        self._fault = fault
        self._rank = rank

    def after_step(self, steps_done: int) -> None:
        if steps_done == self._fault.count:
            self._fault.strike(self._rank)


class FaultyTransport:
    """A transport that strikes its fault at the ``count``-th all-to-all it starts.

    Everything else is passed through to the wrapped transport.
    """

    def __init__(self, inner: Transport, fault: Fault) -> None:
        self._inner = inner
        self._fault = fault
        self._started = 0

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def rank(self) -> int:
        return self._inner.rank

    @property
    def world_size(self) -> int:
        return self._inner.world_size

    @property
    def world(self) -> Group:
        return self._inner.world

    def new_group(self, ranks: Sequence[int]) -> Group:
        return self._inner.new_group(ranks)

    def all_to_all(self, send: Any, send_splits: Sequence[int], recv_splits: Sequence[int],
                   group: Group | None = None) -> Handle:
        self._started += 1
        if self._started != self._fault.count:
            return self._inner.all_to_all(send, send_splits, recv_splits, group)
        if self._fault.action == "nan":
            if not send.is_floating_point():
                raise CocodiffError(
                    f"{ENV_VAR}: exchange {self._started} moves {send.dtype}, not floats: "
                    "pick a later count for action nan"
                )
            self._fault.strike(self.rank)
            send = send.clone()
            send.view(-1)[0] = float("nan")
            return self._inner.all_to_all(send, send_splits, recv_splits, group)
        # Start it first, so that the peers' side of the exchange is in flight.
        handle = self._inner.all_to_all(send, send_splits, recv_splits, group)
        self._fault.strike(self.rank)
        return handle

    def barrier(self) -> None:
        self._inner.barrier()

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:  # backend extras (device, backend, ...)
        return getattr(self._inner, name)


def install_faults(fault: Fault | None, transport: Transport | None, rank: int
                   ) -> tuple[Transport | None, StepFaults | None]:
    """Wrap the transport or make the step hook for ``fault`` when it targets ``rank``.

    Returns:
        The transport to use (wrapped for an ``exchange`` fault on this rank) and the step
        hook (for a ``step`` fault on this rank), else the transport as given and None.
    """
    if fault is None or fault.rank != rank:
        return transport, None
    if fault.point == "step":
        return transport, StepFaults(fault, rank)
    if transport is None:
        raise CocodiffError(f"{ENV_VAR} point exchange needs a launch of several ranks")
    return FaultyTransport(transport, fault), None


def _non_negative_int(text: str, key: str) -> int:
    if not (text.isascii() and text.isdigit()):  # int() would take ' 1', '١' or '1_0'
        raise CocodiffError(f"{ENV_VAR} {key} must be a non-negative integer, got {text!r}")
    return int(text)
