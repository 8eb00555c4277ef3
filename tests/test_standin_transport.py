"""The stand-in transport calibrate times the runtime's forward over: one rank of a world,
nothing moved, every shape right."""

import pytest
import torch

from cocodiff.calibration.standin import StandInTransport
from cocodiff.runtime.exchange import all_gather_rows


def test_an_exchange_hands_back_as_many_rows_as_expected_and_moves_nothing():
    transport = StandInTransport(2, 4)
    assert (transport.rank, transport.world_size, transport.world.ranks) == (2, 4, (0, 1, 2, 3))
    send = torch.arange(8.0).reshape(8, 1)
    same = transport.all_to_all(send, [2] * 4, [2] * 4).wait()
    assert same.data_ptr() == send.data_ptr() and same.shape == send.shape
    more = transport.all_to_all(send, [2] * 4, [5] * 4).wait()
    assert more.shape == (20, 1)
    pair = transport.new_group([2, 3])
    assert transport.all_to_all(send, [4, 4], [1, 1], pair).wait().shape == (2, 1)
    # The runtime's output gather: every member's rows stacked.
    assert all_gather_rows(transport, torch.ones(3, 2)).shape == (4, 3, 2)


def test_misuse_is_refused_as_a_real_transport_refuses_it():
    transport = StandInTransport(0, 2)
    with pytest.raises(ValueError, match="sum to"):
        transport.all_to_all(torch.zeros(3, 1), [1, 1], [1, 1])
    with pytest.raises(ValueError, match="not in group"):
        transport.all_to_all(torch.zeros(2, 1), [1, 1], [1, 1], transport.new_group([1]))
    with pytest.raises(ValueError, match="not in a world"):
        StandInTransport(2, 2)


def test_on_exchange_runs_once_at_every_exchange_before_it_completes():
    # The loaded loops make their real calls there: once per exchange, in order.
    transport = StandInTransport(1, 2)
    seen = []
    transport.on_exchange = lambda: seen.append(len(seen))
    for _ in range(3):
        transport.all_to_all(torch.zeros(2, 1), [1, 1], [1, 1]).wait()
    assert seen == [0, 1, 2]
    transport.on_exchange = None
    transport.all_to_all(torch.zeros(2, 1), [1, 1], [1, 1])
    assert seen == [0, 1, 2]
