"""Exchanges timed on the real transport, and what the fitted links predict for an
all-to-all."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from cocodiff.calibration.fits import LinkFit
from cocodiff.calibration.options import ROW_BYTES

SMALL_BYTES = 64 * 1024
SMALL_REPEATS_FACTOR = 3


def timed_exchange(transport, group, num_bytes: int, torch) -> tuple[float, float]:
    """One all-to-all over ``group`` sending ``num_bytes`` to every other member: (wall
    seconds, this process's CPU seconds, every thread included)."""
    rows = num_bytes // ROW_BYTES
    me = group.group_rank(transport.rank)
    splits = [0 if member == me else rows for member in range(group.size)]
    send = torch.empty((sum(splits), ROW_BYTES), dtype=torch.uint8)
    cpu_began = time.process_time()
    began = time.perf_counter()
    transport.all_to_all(send, splits, splits, group).wait()
    return time.perf_counter() - began, time.process_time() - cpu_began


def measure_exchanges_cpu(transport, group, sizes_bytes: Sequence[int], repeats: int,
                          wall_quantile: float = 0.5) -> list[tuple[int, float, float]]:
    """``(bytes, wall s, median CPU s)`` of an all-to-all over ``group`` per size (every
    member must call this); the wall time is the ``wall_quantile`` of the repeats (0.5:
    the median).

    Each timed exchange follows a 1-row exchange that lines the members up, so one member's
    late start is not counted as transfer time. Medians over ``repeats``: one exchange
    that a neighbour's burst of work delayed moves neither figure.
    """
    import torch

    points = []
    for num_bytes in sizes_bytes:
        timed_exchange(transport, group, num_bytes, torch)  # warm-up (connections, buffers)
        walls, cpus = [], []
        # Small sizes set the start-up terms and cost little: three times the repeats
        # (their medians moved most between two calibrations on a loaded machine).
        for _ in range(repeats * (SMALL_REPEATS_FACTOR if num_bytes <= SMALL_BYTES else 1)):
            timed_exchange(transport, group, ROW_BYTES, torch)
            wall_s, cpu_s = timed_exchange(transport, group, num_bytes, torch)
            walls.append(wall_s)
            cpus.append(cpu_s)
        walls.sort()
        points.append((num_bytes, walls[round(wall_quantile * (len(walls) - 1))],
                       statistics.median(cpus)))
    return points


def measure_wait_spin(transport, group, delay_s: float = 0.02, repeats: int = 3) -> float:
    """The share of a core the first member of ``group`` burns while it waits for a late
    peer (every member must call this; the others return 0).

    The others join each exchange ``delay_s`` late (they sleep first), so the first
    member's CPU over that wait is its waiting cost alone: about 0 when the transport's
    waits sleep (gloo), about 1 when they spin (MPI progress engines). Measured as its own
    case, not read off ordinary exchanges: there, CPU over wall mixes the transfer's own
    work with the waiting and sat near any threshold (76-83% under gloo on this machine),
    so the verdict flipped between two calibrations.
    """
    import torch

    me = group.group_rank(transport.rank)
    fractions = []
    for _ in range(repeats):
        timed_exchange(transport, group, ROW_BYTES, torch)  # line the members up
        if me == 0:
            wall_s, cpu_s = timed_exchange(transport, group, ROW_BYTES, torch)
            fractions.append(cpu_s / wall_s if wall_s > 0 else 0.0)
        else:
            time.sleep(delay_s)
            timed_exchange(transport, group, ROW_BYTES, torch)
    return statistics.median(fractions) if me == 0 else 0.0


def measure_exchanges(transport, group, sizes_bytes: Sequence[int], repeats: int
                      ) -> list[tuple[int, float]]:
    """Median wall time of an all-to-all over ``group`` per size (see
    :func:`measure_exchanges_cpu`)."""
    return [(n, wall_s) for n, wall_s, _ in
            measure_exchanges_cpu(transport, group, sizes_bytes, repeats)]


def predict_all_to_all(num_bytes: int, num_nodes: int, ranks_per_node: int,
                       intra: LinkFit, inter: LinkFit) -> float:
    """A flat all-to-all sending ``num_bytes`` to every other rank, on the fitted links:
    the busiest rank port (``R - 1`` messages inside the node) or node NIC
    (``R * (P - R)`` messages out of the node), whichever takes longer."""
    world = num_nodes * ranks_per_node
    times = []
    if ranks_per_node > 1:
        times.append(intra.seconds((ranks_per_node - 1) * num_bytes))
    if num_nodes > 1:
        times.append(inter.seconds(ranks_per_node * (world - ranks_per_node) * num_bytes))
    return max(times) if times else 0.0
