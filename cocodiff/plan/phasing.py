"""How a phased (TAPA) exchange is carried: one definition for the simulator
(:class:`cocodiff.simulator.backend.SimBackend`) and the runtime
(:class:`cocodiff.runtime.tapa.PhasedHandle`).

An exchange's rows are cut into ``chunks`` (every block's rows split as evenly as
possible, or every row along its tokens where a block has fewer rows than chunks:
:mod:`cocodiff.plan.chunking`), and the chunks flow through
the phases as a pipeline (:class:`ChunkPipeline`): chunk c enters phase p once it has
left phase p-1 and chunk c-1 has left phase p, so the slow tier carries chunk c while a
fast tier carries chunk c-1. The plan states each chunk's rows per member
(:meth:`cocodiff.plan.steps.Phase.chunk_rows`); :func:`chunk_member_bytes` is what they
cost on the wire, rows (whole, or the chunk's tokens of each) or a selective (V-Major)
phase's message.

When postings go out (:func:`early_phases`): an exchange's first posting when it
starts; each later one at the first *progress point* after the postings before it have
landed: before each compute step of the rank's plan while the exchange is in flight,
when the rank begins to wait, and at each landing it waits on. Collectives pair the n-th
call of a group on every rank, so every rank must call each group in the same order
whatever has landed where, and wherever its progress points fall; two rules keep that
order fixed by the plan alone:

* start order: an exchange posts at a progress point only once every exchange started
  before it has posted all of its postings, and waiting for an exchange first posts all
  of theirs;
* no race with a start: a phase whose group an exchange started later (before this one's
  wait) opens with is not posted at progress points. That start calls the group at a
  fixed point of the program, and a posting made as soon as it may could fall before it
  on one rank and after it on another; it goes out when the rank waits.

So V-First carries V's later phases while the rank projects, normalises and rotates Q
and K, instead of after them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from cocodiff.plan.chunking import chunk_rows
from cocodiff.plan.steps import Exchange, Phase, Step, Wait
from cocodiff.plan.vblocks import chunk_blocks_per_row, message_bytes

Posting = tuple[int, int]
"""(chunk, phase index)."""


def member_bytes(phase: Phase, rows: int, row_bytes: int, blocks_per_row: int = 0) -> int:
    """Bytes of ``rows`` rows of ``row_bytes`` sent to another member in ``phase``: the
    rows, or in a selective (V-Major) phase the sent blocks and their indices
    (``blocks_per_row`` blocks a row; default: the phase's, for whole rows)."""
    if not phase.selective:
        return rows * row_bytes
    per_row = blocks_per_row or phase.blocks_per_row
    return message_bytes(rows * per_row, row_bytes // per_row, phase.sent_fraction)


def chunk_member_bytes(step: Exchange, phase: Phase, chunk: int
                       ) -> tuple[list[int], list[int]]:
    """Bytes sent to and received from each member of ``phase`` (of ``step``) in chunk
    ``chunk``: its rows at the chunk's bytes per row (:mod:`cocodiff.plan.chunking`)."""
    send_rows, recv_rows = phase.chunk_rows(chunk, step.chunks)
    row_bytes = step.chunk_row_bytes(chunk)
    per_row = (chunk_blocks_per_row(phase.blocks_per_row, sum(step.chunk_tokens),
                                    step.chunk_tokens[chunk])
               if phase.selective and step.chunk_tokens else 0)
    return ([member_bytes(phase, rows, row_bytes, per_row) for rows in send_rows],
            [member_bytes(phase, rows, row_bytes, per_row) for rows in recv_rows])


class ChunkPipeline:
    """Which (chunk, phase) may be posted, given what has landed.

    Every (chunk, phase) is posted exactly once: (0, 0) first, then each when the later
    of its two predecessors, (chunk, phase - 1) and (chunk - 1, phase), lands. So each
    phase's group sees its chunks posted in chunk order on every rank, as collectives
    require. A driver takes the ready postings (:meth:`take`) and posts them; one that
    blocks on one at a time waits in :meth:`wait_order`, an event-driven one (the
    simulator) as they land.
    """

    __slots__ = ("chunks", "num_phases", "_landed", "_ready", "_taken")

    def __init__(self, chunks: int, num_phases: int) -> None:
        self.chunks = chunks
        self.num_phases = num_phases
        self._landed: set[Posting] = set()
        self._ready: list[Posting] = [(0, 0)]  # may be posted, in the order they became so
        self._taken = 0

    def landed(self, chunk: int, phase: int) -> None:
        """Record that (chunk, phase) has landed, readying the postings it enables."""
        self._landed.add((chunk, phase))
        if phase + 1 < self.num_phases and (chunk == 0 or (chunk - 1, phase + 1) in self._landed):
            self._ready.append((chunk, phase + 1))
        if chunk + 1 < self.chunks and (phase == 0 or (chunk + 1, phase - 1) in self._landed):
            self._ready.append((chunk + 1, phase))

    def take(self, phases: frozenset[int] | None = None) -> list[Posting]:
        """The ready postings (of ``phases`` only, when given), now the driver's to post:
        each phase's chunks in chunk order."""
        taken = [p for p in self._ready if phases is None or p[1] in phases]
        if taken:
            self._ready = [p for p in self._ready if phases is not None and p[1] not in phases]
            self._taken += len(taken)
        return taken

    @property
    def has_ready(self) -> bool:
        return bool(self._ready)

    @property
    def fully_posted(self) -> bool:
        return self._taken == self.chunks * self.num_phases

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


def early_phases(steps: Sequence[Step], index: int) -> frozenset[int]:
    """The phases of the exchange ``steps[index]`` whose postings may go out at progress
    points: those whose group no exchange started after it, and before its wait, opens
    with. A group's members start the same collectives, so they agree on this set."""
    exchange = steps[index]
    if not isinstance(exchange, Exchange):
        raise TypeError(f"step {index} is not an exchange: {exchange!r}")
    opened: set[tuple[int, ...]] = set()
    for step in steps[index + 1:]:
        if isinstance(step, Wait) and step.tensor == exchange.tensor:
            break
        if isinstance(step, Exchange):
            opened.add(step.phases[0].group if step.phases else step.group)
    return frozenset(p for p, phase in enumerate(exchange.phases) if phase.group not in opened)


__all__ = ["ChunkPipeline", "Posting", "chunk_member_bytes", "chunk_rows", "early_phases",
           "member_bytes"]
