"""A step's exchanges timed as the schedules issue them: ``flat``'s world all-to-all and
TAPA's cross-node phase (every column at once, then a one-row sync over the node), every
rank at once, at the size of one of the model's exchanges and four times it (a rate must
hold at both: see :mod:`cocodiff.simulator.collective_fit`).

Why beside the pair sweep: the links are fitted on one pair exchange alone, and a step
never sends one alone. On a shaped TCP link, TAPA's cross-node phase of 2 x 2 ranks took
1.3-1.6x the world all-to-all of the same bytes, where a fluid link prices both alike
(docs/changelog.md, "Why TAPA alone loses on 2 x 2 slow links"). calibrate sets each
beside the simulator's time for it; with ``--fit-patterns`` the collective fit
(:mod:`cocodiff.simulator.collective_fit`) also prices both from these times. Measured
as ``bench/phase_coupling.py`` measures them: the patterns interleaved in rounds, each
timed over back-to-back calls between barriers, the slowest rank's time per call, the
median over rounds.
"""

from __future__ import annotations

import statistics
import time

from cocodiff.calibration.collect import gather_floats
from cocodiff.calibration.options import ROW_BYTES
from cocodiff.simulator.collective import PATTERN_CALLS, pattern_groups

# The patterns timed (``world`` is the flat all-to-all; ``column+sync`` needs several ranks
# per node, or it is the world again).
TIMED = ("world", "column+sync")


def patterns_to_time(num_nodes: int, per_node: int) -> tuple[str, ...]:
    """The patterns a ``num_nodes x per_node`` world times: none on one node (nothing
    crosses a node boundary), the world only with one rank per node."""
    if num_nodes < 2:
        return ()
    return TIMED if per_node > 1 else ("world",)


# The sizes timed, as multiples of a step's exchange.
SIZE_FACTORS = (1, 4)


def pattern_sizes(exchange_bytes: int, world: int, max_kib: int) -> list[int]:
    """Bytes per rank to time the patterns at: a step's exchange (``exchange_bytes`` per
    rank) and :data:`SIZE_FACTORS` times it, the block to one member at most ``max_kib``."""
    block = exchange_bytes // world
    return sorted({min(factor * block, max_kib * 1024) * world for factor in SIZE_FACTORS})


def measure_patterns(transport, num_nodes: int, per_node: int, sizes: list[int],
                     rounds: int, repeats: int) -> list[dict]:
    """``[{"pattern", "bytes_per_rank", "measured_s", "rounds_s"}]`` for every pattern of
    :func:`patterns_to_time` at each of ``sizes`` (bytes per rank; collective: every rank
    calls this; each round's time is the slowest rank's seconds per call)."""
    names = patterns_to_time(num_nodes, per_node)
    if not names:
        return []
    world = num_nodes * per_node
    # Every rank makes every group, in one order (making a group is collective).
    made = {members: transport.new_group(list(members)) for members in sorted(
        {pattern_groups(num_nodes, per_node, rank)[name] for rank in range(world)
         for name in ("node", "column")})}
    made[tuple(range(world))] = transport.world
    mine = {name: made[members]
            for name, members in pattern_groups(num_nodes, per_node, transport.rank).items()}
    return [row for size in sizes
            for row in _measure_size(transport, mine, names, size, rounds, repeats)]


def _measure_size(transport, mine: dict, names: tuple[str, ...], bytes_per_rank: int,
                  rounds: int, repeats: int) -> list[dict]:
    """The rows of :func:`measure_patterns` at one size, over this rank's groups."""
    import torch

    rows = max(1, bytes_per_rank // ROW_BYTES)
    splits = {(name, one_row): [1 if one_row else max(1, rows // mine[name].size)]
              * mine[name].size for pattern in names for name, one_row in PATTERN_CALLS[pattern]}
    sends = {call: torch.zeros((sum(split), ROW_BYTES), dtype=torch.uint8)
             for call, split in splits.items()}

    def run(pattern: str) -> None:
        for call in PATTERN_CALLS[pattern]:
            transport.all_to_all(sends[call], splits[call], splits[call], mine[call[0]]).wait()

    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            run(name)  # warm-up: connections made, buffers touched
            transport.barrier()
            began = time.perf_counter()
            for _ in range(repeats):
                run(name)
            elapsed = (time.perf_counter() - began) / repeats
            transport.barrier()
            times[name].append(max(row[0] for row in gather_floats(transport, [elapsed])))
    return [{"pattern": name, "bytes_per_rank": rows * ROW_BYTES,
             "measured_s": statistics.median(times[name]), "rounds_s": times[name]}
            for name in names]
