"""TAPA's routing on this machine: the CPU a rank spends per phase of a phased exchange
beyond the call itself (the host's ``phase_cpu_us``).

A flat exchange hands its packed buffer to one call. A phased one
(:class:`cocodiff.runtime.tapa.PhasedHandle`) cuts the buffer into blocks, concatenates each
member's blocks into a message per phase, splits what arrives back into blocks, and
concatenates the blocks delivered to the rank at the end: a few dozen small tensor
operations that cost about the same whatever the rows' size. On this 2-core machine, one
rank alone, a two-phase exchange of the small emulated model took 76 us (2 x 2) and 109 us
(4 x 2) more than the flat one, the enlarged model's 119 and 128 us. calibrate's loops call
the transport directly, so they never see it; a real step pays it in every TAPA-family
exchange (on 4 x 2, 8 ranks on 2 cores, ``bench/step_cpu.py`` measured ``tapa``'s step
0.8 ms of CPU per rank dearer than ``flat``'s where the loops' prices said 1 ms cheaper).

Measured on every rank at once, as calibrate measures compute (process CPU time), through a
transport whose calls move nothing and hand back a fresh buffer of the rows expected (so
the routing and the buffers are timed; the same exchange made flat through it is timed
beside it and taken off): the model's exchanges of one layer of a ``tapa`` step on the
calibrated grid, as the rank's own route carries them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from cocodiff.calibration.collect import gather_floats
from transports.base import CompletedHandle, Group

# Layers of exchanges per round, and rounds (the median round is kept).
ROUTING_LAYERS = 25
ROUTING_ROUNDS = 3


def measure_phase_cpu_s(transport, model: str, tokens: int | None, resolution: str | None,
                        dtype: str, num_nodes: int, ranks_per_node: int) -> float:
    """CPU seconds of routing per phase posting, the median over ranks of each rank's
    median round (collective); 0.0 where a ``tapa`` step has no phases (one level)."""
    exchanges = _layer_exchanges(transport.rank, model, tokens, resolution, dtype,
                                 num_nodes, ranks_per_node)
    postings = sum(len(step.phases) * step.chunks for step, _, _ in exchanges)
    phased = [run for _, run, _ in exchanges]
    flat = [run for _, _, run in exchanges]
    rounds = []
    for _ in range(ROUTING_ROUNDS):
        transport.barrier()  # every rank, phases or none (the rounds start together)
        if exchanges:
            rounds.append(max(0.0, _cpu_s(phased) - _cpu_s(flat)) / postings)
    mine = statistics.median(rounds) if rounds else 0.0
    return statistics.median(row[0] for row in gather_floats(transport, [mine]))


def _cpu_s(runs: list[Callable[[], object]]) -> float:
    """Process CPU seconds of ``ROUTING_LAYERS`` layers of ``runs``, per layer."""
    began = time.process_time()
    for _ in range(ROUTING_LAYERS):
        for run in runs:
            run()
    return (time.process_time() - began) / ROUTING_LAYERS


class _NoWire:
    """Rank ``rank``'s calls, answered at once with zeros in the rows expected."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def all_to_all(self, send, send_splits, recv_splits, group: Group | None = None
                   ) -> CompletedHandle:
        return CompletedHandle(send.new_zeros((sum(recv_splits), *send.shape[1:])))


def _layer_exchanges(rank: int, model: str, tokens: int | None, resolution: str | None,
                     dtype: str, num_nodes: int, ranks_per_node: int) -> list:
    """``(exchange, phased run, flat run)`` for each phased exchange of the first layer of
    ``rank``'s ``tapa`` program, each run carrying a buffer of the exchange's rows through
    a transport that moves nothing (warmed once)."""
    import torch

    from cocodiff.calibration.model_shapes import model_tokens
    from cocodiff.runtime.tapa import PhasedHandle, plan_route
    from cocodiff.schedules import plan_for_step
    from cocodiff.schedules.grid import RankGrid
    from cocodiff.schedules.options import PlanOptions

    world = num_nodes * ranks_per_node
    spec, total, image = model_tokens(model, tokens, resolution)
    grid = RankGrid((num_nodes, ranks_per_node, 1), tuple(range(world)))
    plan = plan_for_step("tapa", spec, grid, (image, total - image), PlanOptions(dtype=dtype))
    transport = _NoWire(rank)
    torch_dtype = getattr(torch, dtype)
    found = []
    for step in plan.programs[rank].layers[0].exchanges:
        if not step.phases:
            continue
        elements = step.row_bytes // torch_dtype.itemsize
        send = torch.zeros(sum(step.send_rows), 1, 1, elements, dtype=torch_dtype)
        route = plan_route(step, grid, plan.head_split.heads, rank)
        groups = [Group(phase.group) for phase in step.phases]

        def phased(step=step, send=send, route=route, groups=groups) -> object:
            return PhasedHandle(transport, groups, route, send, step.chunks).wait()

        def flat(step=step, send=send) -> object:
            return transport.all_to_all(send, step.send_rows, step.recv_rows).wait()

        phased(), flat()
        found.append((step, phased, flat))
    return found
