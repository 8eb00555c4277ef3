"""TAPA exchanges on a transport (cocodiff.runtime.tapa), in one process: every rank a
thread over an in-memory transport that matches collectives per group in posting order,
as real collectives do. Every rank must end up with exactly what the flat all-to-all
gives it, for any grid, uneven heads, both directions, pipelined chunks, and several
exchanges in flight at once (V-First)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest
import torch

from cocodiff.models import REGISTRY
from cocodiff.plan.executor import PlanError
from cocodiff.runtime.tapa import PhasedHandle, chunk_rows, plan_route
from cocodiff.schedules import PlanOptions, RankGrid, plan_tapa
from transports.base import Group, TransportError

FLUX = REGISTRY["flux1-dev"]
TENSORS = ("q", "k", "v", "out")


class _Mailbox:
    """What the ranks of one job have posted: (group, sequence, src, dst) -> rows."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.messages: dict[tuple, torch.Tensor] = {}


class _ThreadHandle:
    def __init__(self, mailbox: _Mailbox, keys: list[tuple], recv_rows: list[int]) -> None:
        self._mailbox, self._keys, self._recv_rows = mailbox, keys, recv_rows

    def is_completed(self) -> bool:
        return False

    def wait(self) -> torch.Tensor:
        with self._mailbox.condition:
            arrived = self._mailbox.condition.wait_for(
                lambda: all(key in self._mailbox.messages for key in self._keys), timeout=20
            )
            if not arrived:
                raise TransportError(f"timed out waiting for {self._keys}")
            blocks = [self._mailbox.messages.pop(key) for key in self._keys]
        assert [len(b) for b in blocks] == self._recv_rows, (self._keys, self._recv_rows)
        return torch.cat(blocks)


class ThreadTransport:
    """Just enough of a transport for all-to-alls between threads."""

    name = "threads"

    def __init__(self, rank: int, world_size: int, mailbox: _Mailbox) -> None:
        self.rank, self.world_size, self._mailbox = rank, world_size, mailbox
        self.world = Group(tuple(range(world_size)))
        self._sequence: dict[tuple[int, ...], int] = {}

    def new_group(self, ranks: Sequence[int]) -> Group:
        return Group(tuple(ranks))

    def all_to_all(self, send, send_splits, recv_splits, group=None) -> _ThreadHandle:
        group = group or self.world
        assert self.rank in group.ranks and sum(send_splits) == len(send)
        sequence = self._sequence.get(group.ranks, 0)
        self._sequence[group.ranks] = sequence + 1
        with self._mailbox.condition:
            for member, block in zip(group.ranks, torch.split(send, list(send_splits)),
                                     strict=True):
                self._mailbox.messages[(group.ranks, sequence, self.rank, member)] = block.clone()
            self._mailbox.condition.notify_all()
        keys = [(group.ranks, sequence, source, self.rank) for source in group.ranks]
        return _ThreadHandle(self._mailbox, keys, list(recv_splits))


def run_ranks(num_ranks: int, body: Callable[[ThreadTransport], object]) -> list:
    """Run ``body`` on every rank in its own thread; return each rank's result."""
    mailbox = _Mailbox()
    results: list = [None] * num_ranks
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = body(ThreadTransport(rank, num_ranks, mailbox))
        except BaseException as error:  # re-raised in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(num_ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def heads_spec(num_heads: int):
    return replace(FLUX, num_heads=num_heads)


def send_buffer(exchange, position: int) -> torch.Tensor:
    """Rows that name themselves: (source position, destination position, row)."""
    rows = [(position, d, i) for d, count in enumerate(exchange.send_rows) for i in range(count)]
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)


def flat_result(exchange, position: int) -> torch.Tensor:
    rows = [(s, position, i) for s, count in enumerate(exchange.recv_rows) for i in range(count)]
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)


def phased(transport, plan, grid, tensors: Sequence[str]) -> dict[str, torch.Tensor]:
    """Start the exchanges of ``tensors`` together, then wait for them in order."""
    rank = transport.rank
    layer = plan.program(rank).layers[0]
    handles = {}
    for tensor in tensors:
        exchange = layer.exchanges[TENSORS.index(tensor)]
        assert exchange.tensor == tensor and exchange.phases
        groups = [transport.new_group(phase.group) for phase in exchange.phases]
        route = plan_route(exchange, grid, plan.head_split.heads, rank)
        send = send_buffer(exchange, grid.position(rank))
        handles[tensor] = PhasedHandle(transport, groups, route, send, exchange.chunks)
    return {tensor: handles[tensor].wait() for tensor in tensors}


@pytest.mark.parametrize(
    ("shape", "ranks", "num_heads"),
    [
        ((2, 2, 1), None, 4),
        ((2, 2, 2), None, 8),
        ((2, 2, 2), None, 11),  # uneven heads
        ((3, 2, 1), None, 7),
        ((2, 1, 3), None, 6),
        ((2, 2, 1), (2, 0, 3, 1), 5),  # ranks not in grid order
    ],
)
@pytest.mark.parametrize("chunks", [1, 3])
def test_phases_deliver_the_flat_all_to_all(shape, ranks, num_heads, chunks):
    num_ranks = shape[0] * shape[1] * shape[2]
    grid = RankGrid(shape, ranks or tuple(range(num_ranks)))
    plan = plan_tapa(heads_spec(num_heads), grid, (13, 5), PlanOptions(chunks=chunks))
    # q and k in flight together, then v, then the output (gather_heads).
    results = run_ranks(num_ranks, lambda t: phased(t, plan, grid, ("q", "k"))
                        | phased(t, plan, grid, ("v", "out")))
    for rank, received in enumerate(results):
        for tensor in TENSORS:
            exchange = plan.program(rank).layers[0].exchanges[TENSORS.index(tensor)]
            torch.testing.assert_close(received[tensor],
                                       flat_result(exchange, grid.position(rank)),
                                       atol=0, rtol=0)


def test_a_plan_whose_phase_rows_disagree_with_the_grid_is_refused():
    grid = RankGrid((2, 2, 1), (0, 1, 2, 3))
    plan = plan_tapa(heads_spec(4), grid, (16,))
    exchange = plan.program(0).layers[0].exchanges[0]
    phase = exchange.phases[0]
    wrong = replace(phase, send_rows=(phase.send_rows[0] + 1, *phase.send_rows[1:]))
    bad = replace(exchange, phases=(wrong, *exchange.phases[1:]))
    with pytest.raises(PlanError, match=r"phase 0 \(node\): the plan sends"):
        plan_route(bad, grid, plan.head_split.heads, 0)


def test_a_plan_missing_a_phase_is_refused():
    grid = RankGrid((2, 2, 1), (0, 1, 2, 3))
    plan = plan_tapa(heads_spec(4), grid, (16,))
    exchange = plan.program(0).layers[0].exchanges[0]
    with pytest.raises(PlanError, match="holds 4 blocks, 2 of them bound for other ranks"):
        plan_route(replace(exchange, phases=exchange.phases[:1]), grid, plan.head_split.heads, 0)


def test_chunks_split_rows_as_evenly_as_possible():
    assert [chunk_rows(7, c, 3) for c in range(3)] == [3, 2, 2]
    assert [chunk_rows(1, c, 3) for c in range(3)] == [1, 0, 0]
