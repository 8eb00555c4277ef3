"""TAPA's routing CPU (``[host] phase_cpu_us``): what calibrate times, on one process."""

from __future__ import annotations

import pytest

from cocodiff.calibration import routing
from cocodiff.calibration.routing import _layer_exchanges, measure_phase_cpu_s


class _Alone:
    """One rank that is the whole world (a barrier waits for no one)."""

    rank = 0
    world_size = 1

    def barrier(self) -> None:
        pass


@pytest.fixture
def alone(monkeypatch):
    monkeypatch.setattr(routing, "gather_floats", lambda transport, values: [values])
    return _Alone()


def test_the_timed_exchanges_are_a_tapa_layers_phased_ones() -> None:
    # tiny-flux on 2 nodes of 2: Q, K, V in and the output back, each in two phases (the
    # rank's node, then its column), as a tapa step's first layer makes them.
    found = _layer_exchanges(0, "tiny-flux", None, None, "float32", 2, 2)
    assert [step.tensor for step, _, _ in found] == ["q", "k", "v", "out"]
    assert all(len(step.phases) == 2 for step, _, _ in found)
    # Every run carries the exchange's rows: the phased one delivers what the flat one does.
    for step, phased, flat in found:
        assert phased().shape == flat().shape and phased().shape[0] == sum(step.recv_rows)


def test_routing_costs_cpu_where_tapa_has_phases(alone) -> None:
    assert 0 < measure_phase_cpu_s(alone, "tiny-flux", None, None, "float32", 2, 2) < 0.01


@pytest.mark.parametrize("shape", [(1, 4), (4, 1)])
def test_one_level_has_no_phases_to_route(alone, shape) -> None:
    assert measure_phase_cpu_s(alone, "tiny-flux", None, None, "float32", *shape) == 0.0
