"""TAPA exchanges on a transport (cocodiff.runtime.tapa), in one process: every rank a
thread over an in-memory transport that matches collectives per group in posting order,
as real collectives do. Every rank must end up with exactly what the flat all-to-all
gives it, for any grid, uneven heads, both directions, pipelined chunks, and several
exchanges in flight at once (V-First)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest
import torch

from cocodiff.models import REGISTRY
from cocodiff.plan.executor import PlanError, drive_blocking, run_steps
from cocodiff.plan.steps import Compute, Exchange, Wait
from cocodiff.runtime.tapa import PhasedExchanges, PhasedHandle, chunk_rows, plan_route
from cocodiff.schedules import PlanOptions, RankGrid, plan_tapa, plan_vfirst
from cocodiff.util.errors import ScheduleError
from transports.base import CompletedHandle, Group, TransportError

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
        with self._mailbox.condition:
            return all(key in self._mailbox.messages for key in self._keys)

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


# Tokens of a row in these tests: (13, 5) streams over 4 to 8 ranks pad to 2 to 5 per rank.
def _named(rows: list[tuple[int, int, int]], tokens: int) -> torch.Tensor:
    """Rows (R, 1, tokens, 3) whose every token names itself: (source position,
    destination position, row * 1000 + token), so that rows cut along their tokens
    (chunks where a block has fewer rows than chunks) are checked token by token."""
    named = torch.tensor(rows, dtype=torch.float64).reshape(-1, 1, 1, 3)
    named = named.expand(-1, 1, tokens, 3).clone()
    named[..., 2] = named[..., 2] * 1000 + torch.arange(tokens, dtype=torch.float64)
    return named


def send_buffer(exchange, position: int, tokens: int = 4) -> torch.Tensor:
    """Rows that name themselves: (source position, destination position, row)."""
    rows = [(position, d, i) for d, count in enumerate(exchange.send_rows) for i in range(count)]
    return _named(rows, sum(exchange.chunk_tokens) or tokens)


def flat_result(exchange, position: int, tokens: int = 4) -> torch.Tensor:
    rows = [(s, position, i) for s, count in enumerate(exchange.recv_rows) for i in range(count)]
    return _named(rows, sum(exchange.chunk_tokens) or tokens)


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
        handles[tensor] = PhasedHandle(transport, groups, route, send, exchange.chunks,
                                       chunk_tokens=exchange.chunk_tokens)
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
@pytest.mark.parametrize("chunks", [1, 2, 3])
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


class _ProgressBackend:
    """Carries a layer's attention steps through the executor, its exchanges as
    PhasedHandles posting at progress points; each compute step sleeps 0-2 ms at random,
    so postings land before different progress points on different ranks."""

    def __init__(self, transport, plan, grid, seed: int) -> None:
        self.transport, self.plan, self.grid = transport, plan, grid
        self.random = random.Random(seed * 100 + transport.rank)
        self.exchanges = PhasedExchanges()
        self.received: dict[str, torch.Tensor] = {}

    def compute(self, step):
        time.sleep(self.random.uniform(0, 0.002))
        return CompletedHandle()

    def progress(self) -> None:
        self.exchanges.progress()

    def start_exchange(self, step, early):
        rank = self.transport.rank
        groups = [self.transport.new_group(phase.group) for phase in step.phases]
        route = plan_route(step, self.grid, self.plan.head_split.heads, rank)
        return PhasedHandle(self.transport, groups, route,
                            send_buffer(step, self.grid.position(rank)), step.chunks,
                            early=early, exchanges=self.exchanges,
                            chunk_tokens=step.chunk_tokens)

    def finish_exchange(self, step, received) -> None:
        self.received[step.tensor] = received


def interleaved(layer) -> tuple:
    """V's exchange, two computes, Q's, two computes, Q waited, a compute, V waited: Q
    has progress points while V has postings left (its later chunks: Q's start opens
    their group)."""
    v, q = (next(s for s in layer.exchanges if s.tensor == t) for t in ("v", "q"))
    work = next(s for s in layer.attention if isinstance(s, Compute))
    return (v, work, work, q, work, work, Wait("q"), work, Wait("v"))


@pytest.mark.parametrize(("shape", "num_heads"), [((2, 2, 1), 4), ((2, 2, 2), 8), ((3, 2, 1), 7)])
@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("order", ["vfirst", "interleaved"])
def test_postings_at_progress_points_keep_every_groups_order(shape, num_heads, chunks, order):
    # Progress points come before each compute step; whatever lands where, every group
    # must see the same calls in the same order on every rank (the transport pairs them
    # by order), so every rank ends with exactly the flat all-to-all's rows. V-First: V
    # started, four computes, Q and K started, waited Q, K, V.
    num_ranks = shape[0] * shape[1] * shape[2]
    grid = RankGrid(shape, tuple(range(num_ranks)))
    plan = plan_vfirst(heads_spec(num_heads), grid, (13, 5), PlanOptions(chunks=chunks))

    def steps(rank: int) -> tuple:
        layer = plan.program(rank).layers[0]
        return layer.attention if order == "vfirst" else interleaved(layer)

    for seed in range(4):
        def body(transport, seed=seed):
            backend = _ProgressBackend(transport, plan, grid, seed)
            drive_blocking(run_steps(steps(transport.rank), backend))
            return backend.received

        for rank, received in enumerate(run_ranks(num_ranks, body)):
            exchanges = [s for s in steps(rank) if isinstance(s, Exchange)]
            for exchange in exchanges:
                torch.testing.assert_close(received[exchange.tensor],
                                           flat_result(exchange, grid.position(rank)),
                                           atol=0, rtol=0)


def test_progress_points_post_the_later_phases_before_the_wait():
    # V's exchange alone: progress points (here in a loop, as compute steps would give
    # them) land its first phase and post the second, so by the wait nothing is left to
    # post; and it still delivers the flat all-to-all's rows.
    grid = RankGrid((2, 2, 1), (0, 1, 2, 3))
    plan = plan_vfirst(heads_spec(4), grid, (13, 5))

    def body(transport):
        v = plan.program(transport.rank).layers[0].exchanges[0]
        exchanges = PhasedExchanges()
        handle = PhasedHandle(transport, [transport.new_group(p.group) for p in v.phases],
                              plan_route(v, grid, plan.head_split.heads, transport.rank),
                              send_buffer(v, grid.position(transport.rank)), v.chunks,
                              early=frozenset({1}), exchanges=exchanges)
        deadline = time.monotonic() + 10
        while not handle.fully_posted and time.monotonic() < deadline:
            exchanges.progress()
            time.sleep(0.001)
        return handle.fully_posted, v, handle.wait()

    for rank, (posted_before_wait, v, received) in enumerate(run_ranks(4, body)):
        assert posted_before_wait
        torch.testing.assert_close(received, flat_result(v, grid.position(rank)),
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


def test_chunks_cut_tokens_where_a_block_has_fewer_rows_than_chunks():
    # One head per rank: every block is one row, so 2 chunks cut every row's tokens and
    # each chunk carries every row (not chunk 0 everything and chunk 1 nothing).
    grid = RankGrid((2, 2, 1), (0, 1, 2, 3))
    plan = plan_tapa(heads_spec(4), grid, (13, 5), PlanOptions(chunks=2))
    exchange = plan.program(0).layers[0].exchanges[0]
    tokens = plan.head_split.local_tokens
    assert exchange.chunk_tokens == (-(-tokens // 2), tokens // 2)
    for phase in exchange.phases:
        assert phase.chunk_send_rows == (phase.send_rows, phase.send_rows)
    # Two heads per rank: blocks of 2 rows, which 2 chunks split as before.
    rows_cut = plan_tapa(heads_spec(8), grid, (13, 5), PlanOptions(chunks=2))
    exchange = rows_cut.program(0).layers[0].exchanges[0]
    assert exchange.chunk_tokens == ()
    assert all(sum(map(sum, phase.chunk_send_rows)) == sum(phase.send_rows)
               and all(any(rows) for rows in phase.chunk_send_rows)
               for phase in exchange.phases)


def test_a_chunk_count_past_a_rows_tokens_is_refused():
    grid = RankGrid((2, 2, 1), (0, 1, 2, 3))
    # 16 tokens over 4 ranks: rows of 4 tokens, one head per rank.
    with pytest.raises(ScheduleError, match="5 chunks: .* would be empty on every rank"):
        plan_tapa(heads_spec(4), grid, (16,), PlanOptions(chunks=5))
    plan_tapa(heads_spec(4), grid, (16,), PlanOptions(chunks=4))
