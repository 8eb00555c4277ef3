"""TAPA's phases on the host (``[host] phase_cpu_us``): what calibrate times, on one process
through a transport that answers at once, and across 4 ranks through the real one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import WORKERS, launcher_prefix, needs_torchrun, run_job

from cocodiff.calibration import routing
from cocodiff.calibration.routing import _layer_exchanges, measure_phase_cpu_s, priced_cpu_s
from topology import HostSpec
from transports.base import CompletedHandle, Group


class _Instant:
    """Rank 0 of a world of ``size``, whose calls are answered at once with zeros in the
    rows expected (so only the routing and the buffers cost CPU); a barrier waits for no
    one."""

    rank = 0

    def __init__(self, size: int) -> None:
        self.world_size = size
        self.world = Group(tuple(range(size)))
        self.made: list[tuple[int, ...]] = []

    def new_group(self, ranks) -> Group:
        self.made.append(tuple(ranks))
        return Group(tuple(ranks))

    def all_to_all(self, send, send_splits, recv_splits, group=None) -> CompletedHandle:
        return CompletedHandle(send.new_zeros((sum(recv_splits), *send.shape[1:])))

    def barrier(self) -> None:
        pass


@pytest.fixture
def alone(monkeypatch):
    monkeypatch.setattr(routing, "gather_floats", lambda transport, values: [values])


def test_the_timed_exchanges_are_a_tapa_layers_phased_ones() -> None:
    # tiny-flux on 2 nodes of 2: Q, K, V in and the output back, each in two phases (the
    # rank's node, then its column), as a tapa step's first layer makes them.
    transport = _Instant(4)
    found = _layer_exchanges(transport, "tiny-flux", None, None, "float32", 2, 2)
    assert [step.tensor for step, _, _ in found] == ["q", "k", "v", "out"]
    assert all(len(step.phases) == 2 for step, _, _ in found)
    # Every group of every rank's layer is made, once, in one order (collective); the
    # world is the transport's own.
    assert transport.made == sorted(set(transport.made))
    assert {(0, 1), (2, 3), (0, 2), (1, 3)} <= set(transport.made)
    # Every run carries the exchange's rows: the phased one delivers what the flat one does.
    for step, phased, flat in found:
        assert phased().shape == flat().shape and phased().shape[0] == sum(step.recv_rows)


def test_routing_costs_cpu_where_tapa_has_phases(alone) -> None:
    assert 0 < measure_phase_cpu_s(_Instant(4), "tiny-flux", None, None, "float32", 2, 2) < 0.01


def test_what_the_prices_charge_is_taken_off(alone) -> None:
    # Prices far above what routing costs take all of it: never below zero.
    dear = HostSpec(cores=2, call_cpu_us=50_000.0)
    assert measure_phase_cpu_s(_Instant(4), "tiny-flux", None, None, "float32", 2, 2,
                               dear) == 0.0


@pytest.mark.parametrize("shape", [(1, 4), (4, 1)])
def test_one_level_has_no_phases_to_route(alone, shape) -> None:
    transport = _Instant(4)
    assert measure_phase_cpu_s(transport, "tiny-flux", None, None, "float32", *shape) == 0.0
    assert transport.made == []  # no group made where none routes


def test_the_prices_count_a_phased_exchanges_calls_and_messages() -> None:
    # 2 x 2, one chunk: rank 0 sends 3 messages flat (to 1, 2, 3) and receives 3; phased, 1
    # and 1 in its node's phase, 1 and 1 in its column's: 2 calls, 4 messages. Bytes: every
    # message a quarter of the rows flat; the phases carry two quarters each to one member.
    (step, _, _), *_ = _layer_exchanges(_Instant(4), "tiny-flux", None, None, "float32", 2, 2)
    calls = HostSpec(cores=2, call_cpu_us=100.0)
    assert priced_cpu_s(calls, step, 0, phased=False) == pytest.approx(100e-6)
    assert priced_cpu_s(calls, step, 0, phased=True) == pytest.approx(2 * 100e-6 * step.chunks)
    messages = HostSpec(cores=2, message_cpu_us=10.0)
    assert priced_cpu_s(messages, step, 0, phased=False) == pytest.approx(6 * 10e-6)
    assert priced_cpu_s(messages, step, 0, phased=True) == pytest.approx(4 * 10e-6)
    copies = HostSpec(cores=2, copy_gbps=1.0)
    flat_bytes = sum(step.send_rows[1:] + step.recv_rows[1:]) * step.row_bytes
    assert priced_cpu_s(copies, step, 0, phased=False) == pytest.approx(flat_bytes / 1e9)
    assert priced_cpu_s(copies, step, 0, phased=True) == pytest.approx(flat_bytes / 1e9 * 4 / 3)
    assert priced_cpu_s(None, step, 0, phased=True) == 0.0


@pytest.mark.multiprocess
@needs_torchrun
def test_every_rank_measures_the_same_value_through_the_real_transport(tmp_path) -> None:
    out = tmp_path / "phase_cpu"
    job = run_job([*launcher_prefix("torchrun", 4), str(WORKERS / "phase_cpu.py"), str(out)],
                  tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    values = [json.loads(Path(f"{out}.{rank}").read_text())["phase_cpu_s"] for rank in range(4)]
    assert len(set(values)) == 1, values  # one median, shared
    assert 0 <= values[0] < 0.05, values
