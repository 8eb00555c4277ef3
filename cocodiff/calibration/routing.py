"""TAPA's phases on this machine: the CPU a rank spends per phase posting of a phased
exchange beyond what the host's per-call and per-message prices charge it (the host's
``phase_cpu_us``).

A flat exchange hands its packed buffer to one call. A phased one
(:class:`cocodiff.runtime.tapa.PhasedHandle`) cuts the buffer into blocks, concatenates each
member's blocks into a message per phase, splits what arrives back into blocks, and
concatenates the blocks delivered to the rank at the end: a few dozen small tensor
operations (on this 2-core machine, one rank alone, 76-128 us per exchange). And its calls
cost the transport more than their count and messages say: exchanges alone across the
emulated 4 x 2 cluster at 0.2 Gbit/s, the enlarged model's size (``bench/phase_coupling.py``),
TAPA's two phases took 2.66 ms of process CPU per rank and call where the world all-to-all
of the same bytes took 1.13, and a real step of ``tapa`` took 41 ms more CPU per rank than
``flat``'s (``bench/step_cpu.py``, since retired: 132 against 91 ms, 40 of them in the
exchanges' waits), where the host's prices and the routing alone said 5 ms
(docs/changelog.md, 2026-11-27, "Morning").

Measured as a step pays it: the model's exchanges of one layer of a ``tapa`` step on the
calibrated grid, through the transport, every rank at once, process CPU time (every
thread: the transport's own included), interleaved layer by layer with the same exchanges
made flat. The flat ones are taken off, and so is what the host's prices already charge the
phased ones beyond the flat ones (their calls, messages and bytes, :func:`priced_cpu_s`):
what is left, per posting, is ``phase_cpu_us`` (none below zero).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from cocodiff.calibration.collect import gather_floats

# Layers of exchanges per round, and rounds (the median round is kept).
ROUTING_LAYERS = 10
ROUTING_ROUNDS = 3


def measure_phase_cpu_s(transport, model: str, tokens: int | None, resolution: str | None,
                        dtype: str, num_nodes: int, ranks_per_node: int,
                        host=None) -> float:
    """CPU seconds per phase posting beyond ``host``'s prices (a ``topology.HostSpec``;
    None: prices nothing), the median over ranks of each rank's median round, at least 0
    (collective: every rank calls it); 0.0 where a ``tapa`` step has no phases (one
    level)."""
    exchanges = _layer_exchanges(transport, model, tokens, resolution, dtype, num_nodes,
                                 ranks_per_node)
    postings = sum(len(step.phases) * step.chunks for step, _, _ in exchanges)
    priced = sum(priced_cpu_s(host, step, transport.rank, phased=True)
                 - priced_cpu_s(host, step, transport.rank, phased=False)
                 for step, _, _ in exchanges)
    rounds = []
    for _ in range(ROUTING_ROUNDS):
        transport.barrier()  # every rank, phases or none (the rounds start together)
        if exchanges:
            phased_s, flat_s = _cpu_s([run for _, run, _ in exchanges],
                                      [run for _, _, run in exchanges])
            rounds.append((phased_s - flat_s - priced) / postings)
    mine = statistics.median(rounds) if rounds else 0.0
    return max(0.0, statistics.median(row[0] for row in gather_floats(transport, [mine])))


def priced_cpu_s(host, step, rank: int, phased: bool) -> float:
    """CPU seconds ``host``'s call, message and byte prices charge ``rank`` for ``step``
    (an :class:`~cocodiff.plan.steps.Exchange` with phases), made in its phases (each
    chunk a call) or flat, as the simulator charges them; 0 without a host."""
    from cocodiff.plan.phasing import chunk_member_bytes

    if host is None:
        return 0.0

    def call_s(group: Sequence[int], send: Sequence[int], recv: Sequence[int]) -> float:
        me = group.index(rank)  # a rank's own part is not a message
        moved = [b for part in (send, recv) for member, b in enumerate(part)
                 if member != me and b]
        return host.exchange_cpu_s(len(moved), sum(moved), calls=1)

    if not phased:
        return call_s(step.group, [r * step.row_bytes for r in step.send_rows],
                      [r * step.row_bytes for r in step.recv_rows])
    total = 0.0
    for phase in step.phases:
        for chunk in range(step.chunks):
            total += call_s(phase.group, *chunk_member_bytes(step, phase, chunk))
    return total


def _cpu_s(phased: list[Callable[[], object]], flat: list[Callable[[], object]]
           ) -> tuple[float, float]:
    """Process CPU seconds per layer of ``phased`` and of ``flat``, over
    ``ROUTING_LAYERS`` layers, each layer's phased exchanges then its flat ones (so both
    see the same moments of the machine)."""
    phased_s = flat_s = 0.0
    for _ in range(ROUTING_LAYERS):
        began = time.process_time()
        for run in phased:
            run()
        middle = time.process_time()
        for run in flat:
            run()
        phased_s += middle - began
        flat_s += time.process_time() - middle
    return phased_s / ROUTING_LAYERS, flat_s / ROUTING_LAYERS


def _layer_exchanges(transport, model: str, tokens: int | None, resolution: str | None,
                     dtype: str, num_nodes: int, ranks_per_node: int) -> list:
    """``(exchange, phased run, flat run)`` for each phased exchange of the first layer of
    the rank's ``tapa`` program, each run carrying a buffer of the exchange's rows through
    ``transport`` (collective: every rank makes every group the layer uses, in one order;
    each run is warmed once, by every rank at once)."""
    import torch

    from cocodiff.calibration.model_shapes import model_tokens
    from cocodiff.runtime.tapa import PhasedHandle, plan_route
    from cocodiff.schedules import plan_for_step
    from cocodiff.schedules.grid import RankGrid
    from cocodiff.schedules.options import PlanOptions

    world = num_nodes * ranks_per_node
    rank = transport.rank
    spec, total, image = model_tokens(model, tokens, resolution)
    grid = RankGrid((num_nodes, ranks_per_node, 1), tuple(range(world)))
    plan = plan_for_step("tapa", spec, grid, (image, total - image), PlanOptions(dtype=dtype))
    layers = [plan.programs[r].layers[0].exchanges for r in range(world)]
    if not all(any(step.phases for step in layer) for layer in layers):
        return []  # one level: no rank routes (every rank agrees, so none makes a group)
    members = sorted({group for layer in layers for step in layer
                      for group in (step.group, *(phase.group for phase in step.phases))})
    made = {group: transport.world if group == tuple(range(world))
            else transport.new_group(list(group)) for group in members}
    torch_dtype = getattr(torch, dtype)
    found = []
    for step in layers[rank]:
        if not step.phases:
            continue
        elements = step.row_bytes // torch_dtype.itemsize
        send = torch.zeros(sum(step.send_rows), 1, 1, elements, dtype=torch_dtype)
        route = plan_route(step, grid, plan.head_split.heads, rank)
        groups = [made[phase.group] for phase in step.phases]

        def phased(step=step, send=send, route=route, groups=groups) -> object:
            return PhasedHandle(transport, groups, route, send, step.chunks).wait()

        def flat(step=step, send=send) -> object:
            return transport.all_to_all(send, step.send_rows, step.recv_rows,
                                        made[step.group]).wait()

        phased(), flat()
        found.append((step, phased, flat))
    return found
