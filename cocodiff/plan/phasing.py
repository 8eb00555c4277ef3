"""How a phased (TAPA) exchange is carried: one definition for the simulator
(:class:`cocodiff.simulator.backend.SimBackend`) and the runtime
(:class:`cocodiff.runtime.tapa.PhasedHandle`).

An exchange's rows are cut into ``chunks`` (every block's rows split as evenly as
possible, the first chunks one larger: :func:`chunk_rows`), and the chunks flow through
the phases as a pipeline (:class:`ChunkPipeline`): chunk c enters phase p once it has
left phase p-1 and chunk c-1 has left phase p, so the slow tier carries chunk c while a
fast tier carries chunk c-1. The plan states each chunk's rows per member
(:meth:`cocodiff.plan.steps.Phase.chunk_rows`); :func:`member_bytes` is what they cost on the
wire, whole rows or a selective (V-Major) phase's message.
"""

from __future__ import annotations

from collections.abc import Iterator

from cocodiff.plan.steps import Phase
from cocodiff.schedules.tapa import chunk_rows
from cocodiff.schedules.vmajor import message_bytes

Posting = tuple[int, int]
"""(chunk, phase index)."""


def member_bytes(phase: Phase, rows: int, row_bytes: int) -> int:
    """Bytes of ``rows`` rows sent to another member in ``phase``: the rows, or in a
    selective (V-Major) phase the sent blocks and their indices."""
    if not phase.selective:
        return rows * row_bytes
    per_row = phase.blocks_per_row
    return message_bytes(rows * per_row, row_bytes // per_row, phase.sent_fraction)


class ChunkPipeline:
    """Which (chunk, phase) may be posted once another has landed.

    Every (chunk, phase) is posted exactly once: (0, 0) first, then each when the later
    of its two predecessors, (chunk, phase - 1) and (chunk - 1, phase), lands. So each
    phase's group sees its chunks posted in chunk order on every rank, as collectives
    require. A driver that blocks on one at a time waits in :meth:`wait_order`; an
    event-driven one (the simulator) as they land.
    """

    __slots__ = ("chunks", "num_phases", "_landed")

    def __init__(self, chunks: int, num_phases: int) -> None:
        self.chunks = chunks
        self.num_phases = num_phases
        self._landed: set[Posting] = set()

    def first(self) -> list[Posting]:
        return [(0, 0)]

    def landed(self, chunk: int, phase: int) -> list[Posting]:
        """Record that (chunk, phase) has landed; return the postings it enables."""
        self._landed.add((chunk, phase))
        ready = []
        if phase + 1 < self.num_phases and (chunk == 0 or (chunk - 1, phase + 1) in self._landed):
            ready.append((chunk, phase + 1))
        if chunk + 1 < self.chunks and (phase == 0 or (chunk + 1, phase - 1) in self._landed):
            ready.append((chunk + 1, phase))
        return ready

    @property
    def finished(self) -> bool:
        return len(self._landed) == self.chunks * self.num_phases

    def wait_order(self) -> Iterator[Posting]:
        """Diagonal order (chunk + phase): whatever comes next was posted by every rank,
        since its predecessors lie on earlier diagonals."""
        for diagonal in range(self.chunks + self.num_phases - 1):
            for chunk in range(max(0, diagonal - self.num_phases + 1),
                               min(self.chunks - 1, diagonal) + 1):
                yield chunk, diagonal - chunk


__all__ = ["ChunkPipeline", "Posting", "chunk_rows", "member_bytes"]
