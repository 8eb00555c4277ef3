"""TAPA: the flat all-to-all as topology-aligned phases.

A flat all-to-all sends every block (source, destination) directly: P-1 messages per
rank, most of them small, across every tier at once. TAPA moves blocks one coordinate
at a time instead: first across nodes (each rank exchanges with the ranks that share
its GPU and tile index on the other nodes, sending everything bound for each node in
one message), then across the GPUs of a node, then between the tiles of a GPU. Every
block crosses each tier at most once, and each tier carries only what it must plus the
blocks forwarded on its way; a rank sends (N-1) + (G-1) + (T-1) messages instead of
N*G*T - 1. The payload is cut into chunks pipelined through the phases, so the slow
inter-node phase of one chunk overlaps the fast phases of the previous one.

Rows of a block. Ulysses blocks factor as rows(s, d) = a[s] * b[d]: for Q/K/V every
source sends destination d its heads' rows (a = 1, b = heads); for the output, source
s sends its own heads' rows (a = heads, b = 1). That makes every phase's row counts
box sums over the rank grid, computed for all ranks at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cocodiff.plan.chunking import check_chunk_count, chunk_rows, chunk_tokens, cuts_tokens
from cocodiff.plan.lazy import exemplar_programs
from cocodiff.plan.steps import Exchange, Phase, Plan
from cocodiff.schedules.grid import LEVELS, RankGrid
from cocodiff.util.errors import ScheduleError

# One chunk when none is asked for; the planner chooses a count per layout (`--chunks
# auto`): with per-transfer set-up costs (transports.sim.CollectiveModel) more chunks
# mean more, smaller transfers.
DEFAULT_CHUNKS = 1


def tapa_levels(grid: RankGrid) -> tuple[str, ...]:
    """The levels with more than one member, slowest first."""
    return tuple(level for level, size in zip(LEVELS, grid.shape, strict=True) if size > 1)


@dataclass(frozen=True, slots=True)
class _PhaseTable:
    """For one phase: rows(holder -> member) = source[holder] * destination[member]
    (both indexed by grid position)."""

    level: str
    source: np.ndarray
    destination: np.ndarray


class TapaRows:
    """The phase row counts of one logical exchange pattern, for every rank.

    Args:
        grid: where the ranks sit; group index i of the logical exchange is the rank at
            grid position i.
        heads: heads of each group member.
        direction: "scatter_heads" (Q/K/V) or "gather_heads" (output).
    """

    def __init__(self, grid: RankGrid, heads: tuple[int, ...], direction: str) -> None:
        self.grid = grid
        self.heads = heads
        self.direction = direction
        self._chunked: dict[tuple[int, int], TapaRows] = {}
        per_member = np.array(heads, dtype=np.int64).reshape(grid.shape)
        ones = np.ones(grid.shape, dtype=np.int64)
        a, b = (ones, per_member) if direction == "scatter_heads" else (per_member, ones)
        self.tables: list[_PhaseTable] = []
        done: list[int] = []
        for level in tapa_levels(grid):
            axis = LEVELS.index(level)
            later = tuple(x for x in range(3) if x not in done and x != axis)
            # A holder holds blocks from the sources that differ from it along the done
            # axes; it sends a member the blocks whose destination agrees with the holder
            # along the done axes and with the member along this axis.
            source = np.broadcast_to(a.sum(axis=tuple(done), keepdims=True), grid.shape)
            destination = np.broadcast_to(b.sum(axis=later, keepdims=True), grid.shape)
            self.tables.append(_PhaseTable(level, source.ravel(), destination.ravel()))
            done.append(axis)

    def exchange(self, flat: Exchange, rank: int, chunks: int,
                 sent_fraction: dict[str, float] | None = None,
                 blocks_per_row: int = 0, row_tokens: int = 0) -> Exchange:
        """``rank``'s logical exchange ``flat`` carried as phases.

        Args:
            chunks: pipeline chunks; they cut each block's rows, or every row's
                ``row_tokens`` tokens where a block has fewer rows than chunks
                (:mod:`cocodiff.plan.chunking`).
            sent_fraction: per level, the share of V-Major blocks actually sent; the
                phases of these levels are selective (V-Major), even at 1.0.
            blocks_per_row: V-Major blocks per row (for selective phases).
            row_tokens: tokens of one row (the group's local tokens).

        Raises:
            ScheduleError: some chunk would be empty on every rank
                (:func:`cocodiff.plan.chunking.check_chunk_count`).
        """
        selective = set(sent_fraction or ()) & {table.level for table in self.tables}
        if len(self.tables) <= 1 and not selective:
            # One tier: the flat exchange is already aligned. (A V-Major tier stays a
            # phase of its own: only phases send a share of their blocks.)
            return flat
        grid = self.grid
        check_chunk_count(chunks, self.heads, row_tokens)
        by_tokens = cuts_tokens(self.heads, chunks)
        if chunks == 1:
            per_chunk = None
        elif by_tokens:  # every chunk carries every row, a share of its tokens
            per_chunk = [self.rows(rank)] * chunks
        else:
            per_chunk = [self._for_chunk(c, chunks).rows(rank) for c in range(chunks)]
        phases = []
        for index, ((send, recv), table) in enumerate(zip(self.rows(rank), self.tables,
                                                          strict=True)):
            selective = table.level in (sent_fraction or {})
            fraction = sent_fraction[table.level] if selective else 1.0
            chunk_send, chunk_recv = (
                (tuple(c[index][0] for c in per_chunk), tuple(c[index][1] for c in per_chunk))
                if per_chunk else ((), ()))
            phases.append(Phase(table.level, grid.peers(rank, table.level), send, recv,
                                fraction, blocks_per_row if selective else 0, chunk_send,
                                chunk_recv))
        return Exchange(flat.tensor, flat.group, flat.send_rows, flat.recv_rows,
                        flat.row_bytes, flat.direction, tuple(phases), chunks,
                        chunk_tokens(row_tokens, chunks) if by_tokens else ())

    def rows(self, rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per phase, the rows ``rank`` sends to and receives from each member."""
        grid = self.grid
        me = grid.position(rank)
        out = []
        for table in self.tables:
            positions = [grid.position(member) for member in grid.peers(rank, table.level)]
            out.append((tuple(int(table.source[me] * table.destination[p]) for p in positions),
                        tuple(int(table.source[p] * table.destination[me]) for p in positions)))
        return out

    def _for_chunk(self, chunk: int, chunks: int) -> TapaRows:
        """The row counts of chunk ``chunk``: every block's rows are cut separately, and a
        block's rows are its source's or destination's head count (the other factor is
        1), so the chunk's counts are those of the heads cut the same way."""
        key = (chunk, chunks)
        if key not in self._chunked:
            heads = tuple(chunk_rows(h, chunk, chunks) for h in self.heads)
            self._chunked[key] = TapaRows(self.grid, heads, self.direction)
        return self._chunked[key]


def check_chunks(plan: Plan, chunks: int) -> None:
    """Refuse a chunk count that pipelines nothing: past one chunk, the plan must have a
    phased exchange to cut (some chunk empty on every rank is refused when the plan is
    made, :func:`cocodiff.plan.chunking.check_chunk_count`).

    Raises:
        ScheduleError: ``chunks`` > 1 and no exchange of ``plan`` has phases (one tier).
    """
    if chunks == 1:
        return
    # A lazy plan's exemplars hold every layer up to relabelling (cocodiff.plan.lazy).
    layers = {id(layer): layer for program in exemplar_programs(plan.programs)
              for layer in program.layers}
    if not any(step.phases for layer in layers.values() for step in layer.exchanges):
        raise ScheduleError(
            f"{chunks} chunks: {plan.schedule}'s exchanges here have one phase (the ranks "
            "share one tier), so there is nothing to pipeline; use --chunks 1")


__all__ = ["DEFAULT_CHUNKS", "TapaRows", "check_chunks", "chunk_rows", "tapa_levels"]
