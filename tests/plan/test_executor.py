"""The shared executor: step order, handle lifecycle, malformed plans."""

import pytest

from cocodiff.cost import Cost
from cocodiff.plan.executor import PlanError, drive_blocking, run_steps
from cocodiff.plan.steps import Compute, Exchange, Wait
from transports.base import CompletedHandle

EXCHANGE = Exchange("v", (0, 1), (1, 1), (1, 1), 8, "scatter_heads")


class RecordingBackend:
    def __init__(self):
        self.events = []

    def compute(self, step):
        self.events.append(("compute", step.op))
        return CompletedHandle()

    def start_exchange(self, step, early):
        self.events.append(("start", step.tensor))
        return CompletedHandle(f"received {step.tensor}")

    def progress(self):
        self.events.append(("progress",))

    def finish_exchange(self, step, received):
        self.events.append(("finish", received))


def test_steps_run_in_plan_order_and_exchanges_overlap_compute():
    backend = RecordingBackend()
    steps = [EXCHANGE, Compute("proj_q", Cost(1, 1)), Wait("v")]
    drive_blocking(run_steps(steps, backend))
    assert backend.events == [("start", "v"), ("progress",), ("compute", "proj_q"),
                              ("finish", "received v")]


def test_execution_yields_each_handle_it_waits_on():
    handles = list(run_steps([EXCHANGE, Wait("v"), Compute("mlp", Cost(1, 1))], RecordingBackend()))
    assert len(handles) == 2


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([Wait("v")], "wait for v with no exchange in flight"),
        ([EXCHANGE, EXCHANGE], "started twice"),
        ([EXCHANGE], "never waited for"),
    ],
)
def test_malformed_plans_raise(steps, message):
    with pytest.raises(PlanError, match=message):
        drive_blocking(run_steps(steps, RecordingBackend()))
