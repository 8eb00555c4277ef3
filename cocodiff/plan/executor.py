"""The one executor of a plan, shared by the simulator and the runtime.

A rank's program is run as a generator that yields a handle whenever the rank must
wait. The caller decides what waiting means:

* the runtime drives it with :func:`drive_blocking` (nothing to do: ``handle.wait()``
  inside the executor blocks on real communication);
* the simulator drives it inside a SimPy process (``cocodiff.simulator.simulate``), yielding
  the handle's SimPy event so that simulated time passes first.

The executor itself knows nothing of tensors or time: a *backend* binds compute steps
to real modules or to cost-model durations, and exchanges to buffers. It also calls the
backend's progress point before each compute step while an exchange is in flight, where
a phased exchange may post its later phases (:mod:`cocodiff.plan.phasing`), so the
runtime and the simulator carry it alike.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, Protocol

from cocodiff.plan.phasing import early_phases
from cocodiff.plan.steps import Compute, Exchange, LayerPlan, RankProgram, Step, Tensor, Wait
from transports.base import Handle

Execution = Generator[Handle, None, None]


class PlanError(RuntimeError):
    """A plan that cannot be executed (a wait with no exchange in flight, ...)."""


class Backend(Protocol):
    """Binds plan steps to something that runs them."""

    def compute(self, step: Compute) -> Handle:
        """Run (or start) a compute step."""
        ...

    def start_exchange(self, step: Exchange, early: frozenset[int]) -> Handle:
        """Start an exchange through the transport; ``early``: the phases whose
        postings may go out at progress points (:func:`~cocodiff.plan.phasing.early_phases`)."""
        ...

    def progress(self) -> Handle | None:
        """A progress point: post what the phased exchanges in flight may post now. A
        handle when that takes the rank's time, else None."""
        ...

    def finish_exchange(self, step: Exchange, received: Any) -> None:
        """Take delivery of an exchange's received buffer."""
        ...


InFlight = dict[Tensor, tuple[Exchange, Handle]]


def run_steps(steps: Sequence[Step], backend: Backend,
              in_flight: InFlight | None = None) -> Execution:
    """Execute steps in order; yield each handle the rank must wait on.

    ``in_flight``: exchanges started by earlier steps and not yet waited for, which these
    steps may wait for (a pipeline stage's point-to-point transfers span its layers); it
    is left holding what these steps start and do not wait for. Without it, every
    exchange must be waited for within ``steps``.
    """
    own = in_flight is None
    in_flight = {} if in_flight is None else in_flight
    for index, step in enumerate(steps):
        if isinstance(step, Compute):
            if in_flight:
                progressed = backend.progress()
                if progressed is not None:
                    yield progressed
                    progressed.wait()
            handle = backend.compute(step)
            yield handle
            handle.wait()
        elif isinstance(step, Exchange):
            if step.tensor in in_flight:
                raise PlanError(f"exchange of {step.tensor} started twice without a wait")
            early = early_phases(steps, index) if step.phases else frozenset()
            in_flight[step.tensor] = (step, backend.start_exchange(step, early))
        elif isinstance(step, Wait):
            if step.tensor not in in_flight:
                raise PlanError(f"wait for {step.tensor} with no exchange in flight")
            exchange, handle = in_flight.pop(step.tensor)
            yield handle
            backend.finish_exchange(exchange, handle.wait())
        else:
            raise PlanError(f"unknown plan step {step!r}")
    if own and in_flight:
        raise PlanError(f"exchanges never waited for: {sorted(in_flight)}")


def run_layer(layer: LayerPlan, backend: Backend,
              in_flight: InFlight | None = None) -> Execution:
    yield from run_steps(layer.steps, backend, in_flight)


def run_program(program: RankProgram, backend: Backend) -> Execution:
    """Execute a rank's layers in order. An exchange may stay in flight from one layer to
    a later one (PipeFusion's transfers between stages); all are waited for by the end."""
    in_flight: InFlight = {}
    for layer in program.layers:
        yield from run_layer(layer, backend, in_flight)
    if in_flight:
        raise PlanError(f"exchanges never waited for: {sorted(in_flight)}")


def drive_blocking(execution: Execution) -> None:
    """Run an execution whose handles block in ``wait()`` (real transports)."""
    for _handle in execution:
        pass
