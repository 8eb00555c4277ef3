"""TAPA exchanges on a real transport: a plan's phased :class:`~cocodiff.plan.steps.Exchange`
carried as all-to-alls on the phases' sub-groups.

The logical (flat) all-to-all moves *blocks*: block ``(s, d)`` holds the rows group
member ``s`` sends member ``d`` (positions in the rank grid, which is also the logical
group's order). Rows factor as ``rows(s, d) = a[s] * b[d]`` (``cocodiff.schedules.tapa``):
for Q/K/V a source sends ``d`` its heads' rows, for the output a source sends its own
heads' rows.

In the phase of level L, a holder sends every block it holds to the member of its L
group whose L coordinate is the block destination's. Before a phase, the holder ``h``
holds exactly the blocks whose source agrees with ``h`` on the levels not done yet and
whose destination agrees with ``h`` on the levels done, so both sides of every message
know from the grid alone which blocks it carries. Blocks travel in canonical order
(sorted by (source, destination) position) and no index is sent.

The rows may be cut into ``chunks`` (each block's rows split as evenly as possible, or,
where a block has fewer rows than chunks, every row along its tokens:
:mod:`cocodiff.plan.chunking`, the one definition the schedulers and the simulator use)
pipelined through the phases as :mod:`cocodiff.plan.phasing` orders them, for the simulator
and here alike: chunk c enters phase p once it has left phase p-1 and chunk c-1 has
left phase p, so the slow tier carries chunk c while a fast tier carries chunk c-1.
After the last phase every block destined to this rank is here; they are
assembled in source order, which is exactly the layout the flat all-to-all returns.

A selective (V-Major) phase sends other members bytes chosen by a codec
(:mod:`cocodiff.runtime.vmajor`) instead of the rows; what it delivers has the same
layout, with the blocks not sent taken from the receiver's copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import product
from typing import Protocol

import torch

from cocodiff.plan.chunking import block_rows, chunk_rows
from cocodiff.plan.executor import PlanError
from cocodiff.plan.phasing import ChunkPipeline
from cocodiff.plan.steps import Exchange
from cocodiff.runtime.vmajor import as_bytes, from_bytes
from cocodiff.schedules.grid import LEVELS, RankGrid
from transports.base import Group, Handle, Transport, TransportError

Block = tuple[int, int]
"""(source position, destination position) in the rank grid."""


@dataclass(frozen=True, slots=True)
class PhaseRoute:
    """One phase as this rank runs it.

    Args:
        group: the phase's members (global ranks, group order).
        send: per member, the blocks sent to it, in canonical order.
        recv: per member, the blocks received from it, in canonical order.
    """

    group: tuple[int, ...]
    send: tuple[tuple[Block, ...], ...]
    recv: tuple[tuple[Block, ...], ...]


@dataclass(frozen=True, slots=True)
class Route:
    """How one rank carries one phased exchange.

    Args:
        source_rows: ``a``, by position: rows(s, d) = a[s] * b[d].
        destination_rows: ``b``, by position.
        sent: the blocks of the flat send buffer, in its order (destinations in
            position order).
        phases: the phases in order.
        delivered: the blocks destined to this rank, in source order: the flat
            all-to-all's receive layout.
    """

    source_rows: tuple[int, ...]
    destination_rows: tuple[int, ...]
    sent: tuple[Block, ...]
    phases: tuple[PhaseRoute, ...]
    delivered: tuple[Block, ...]

    def rows(self, block: Block) -> int:
        return self.source_rows[block[0]] * self.destination_rows[block[1]]


def plan_route(step: Exchange, grid: RankGrid, heads: Sequence[int], rank: int) -> Route:
    """Work out which blocks ``rank`` sends and receives in each phase of ``step``, and
    check them against the plan.

    Args:
        step: a phased exchange of ``rank``'s program.
        grid: where the ranks sit; ``step.group`` must be its ranks in grid order.
        heads: heads of each group member (the plan layout's ``heads``).
        rank: this global rank.

    Raises:
        PlanError: the plan's phases do not move the blocks the grid says they must
            (row counts, groups), or do not deliver every block.
    """
    num_ranks = grid.num_ranks
    if step.group != grid.ranks:
        raise PlanError(f"exchange of {step.tensor} over ranks {step.group}: a phased "
                        f"exchange must span the grid's ranks {grid.ranks} in grid order")
    ones = (1,) * num_ranks
    heads = tuple(heads)
    source_rows, destination_rows = (
        (ones, heads) if step.direction == "scatter_heads" else (heads, ones)
    )
    me = grid.position(rank)

    def rows(block: Block) -> int:
        return source_rows[block[0]] * destination_rows[block[1]]

    sent = tuple((me, d) for d in range(num_ranks))
    delivered = tuple((s, me) for s in range(num_ranks))
    if (tuple(map(rows, sent)) != step.send_rows
            or tuple(map(rows, delivered)) != step.recv_rows):
        raise PlanError(f"exchange of {step.tensor}: the plan sends {step.send_rows} and "
                        f"receives {step.recv_rows} rows, the heads {heads} make "
                        f"{tuple(map(rows, sent))} and {tuple(map(rows, delivered))}")
    coords = [grid.coords(r) for r in grid.ranks]  # by position
    done: list[int] = []
    held = sent
    phases = []
    for index, phase in enumerate(step.phases):
        where = f"exchange of {step.tensor}, phase {index} ({phase.level})"
        axis = LEVELS.index(phase.level)
        if axis in done or phase.group != grid.peers(rank, phase.level):
            raise PlanError(f"{where}: group {phase.group} is not this rank's "
                            f"{phase.level} group {grid.peers(rank, phase.level)}, or the "
                            "level comes twice")
        # Group member j is the one whose `axis` coordinate is j (peers() order).
        send = tuple(tuple(b for b in held if coords[b[1]][axis] == j)
                     for j in range(len(phase.group)))
        recv = tuple(
            tuple(b for b in _held(grid, coords, grid.position(member), done)
                  if coords[b[1]][axis] == coords[me][axis])
            for member in phase.group
        )
        for label, blocks, planned in (("sends", send, phase.send_rows),
                                       ("receives", recv, phase.recv_rows)):
            moved = tuple(sum(map(rows, per_member)) for per_member in blocks)
            if moved != planned:
                raise PlanError(f"{where}: the plan {label} {planned} rows per member, the "
                                f"blocks this rank holds make {moved}")
        for chunk in range(step.chunks):
            # Every block's rows are cut into chunks: the plan states each chunk's.
            try:
                planned_chunk = phase.chunk_rows(chunk, step.chunks)
            except ValueError as err:
                raise PlanError(f"{where}: {err}") from None
            moved_chunk = tuple(tuple(sum(step.block_rows(rows(b), chunk) for b in m)
                                      for m in blocks) for blocks in (send, recv))
            if moved_chunk != planned_chunk:
                raise PlanError(f"{where}, chunk {chunk}: the plan moves {planned_chunk} rows "
                                f"per member (sent, received), the blocks make {moved_chunk}")
        phases.append(PhaseRoute(phase.group, send, recv))
        held = tuple(sorted(b for per_member in recv for b in per_member))
        done.append(axis)
    if held != delivered:
        elsewhere = sum(1 for block in held if block[1] != me)
        raise PlanError(f"exchange of {step.tensor}: after the phases "
                        f"{[p.level for p in step.phases]} this rank holds {len(held)} blocks, "
                        f"{elsewhere} of them bound for other ranks, not the {num_ranks} "
                        "destined to it")
    return Route(source_rows, destination_rows, sent, tuple(phases), delivered)


def _held(grid: RankGrid, coords: list[tuple[int, int, int]], holder: int,
          done: list[int]) -> Iterator[Block]:
    """The blocks ``holder`` (a position) holds once the levels on ``done`` axes are
    done, in canonical order: sources agree with it on the other axes, destinations on
    the done ones."""
    mine = coords[holder]
    _, gpus, tiles = grid.shape

    def positions(free: set[int]) -> list[int]:
        # Positions are (node, gpu, tile) row-major, so product() yields them sorted.
        n, g, t = (range(size) if axis in free else (mine[axis],)
                   for axis, size in enumerate(grid.shape))
        return [(node * gpus + gpu) * tiles + tile for node, gpu, tile in product(n, g, t)]

    sources = positions(set(done))
    destinations = positions({0, 1, 2} - set(done))
    return ((s, d) for s in sources for d in destinations)


class PhaseCodec(Protocol):
    """How a selective (V-Major) phase turns one chunk's rows for one member into bytes
    and back (:class:`cocodiff.runtime.vmajor.SelectiveCodec`)."""

    def message_bytes(self, chunk: int, member: int, num_rows: int,
                      row_shape: Sequence[int], dtype: torch.dtype) -> int: ...
    def encode(self, chunk: int, member: int, rows: torch.Tensor) -> torch.Tensor: ...
    def decode(self, chunk: int, member: int, payload: torch.Tensor, num_rows: int,
               row_shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class _Posted:
    """One chunk's phase in flight: its handle, and the rows and splits (rows, or a
    selective phase's bytes) expected from each member."""

    handle: Handle
    recv_rows: list[int]
    recv_splits: list[int]


class PhasedExchanges:
    """The phased exchanges one attention call has in flight, in start order, and the
    order their postings go out in (:mod:`cocodiff.plan.phasing`): at a progress point
    (before each compute step, and at each landing the rank waits on) each posts what it
    may, an exchange only once all started before it have posted all of theirs; waiting
    for one first posts all of theirs."""

    __slots__ = ("_handles",)

    def __init__(self) -> None:
        self._handles: list[PhasedHandle] = []

    def started(self, handle: PhasedHandle) -> None:
        self._handles.append(handle)

    def progress(self) -> None:
        """A progress point: never blocks."""
        may_post = True
        for handle in self._handles:
            handle.progress(may_post)
            may_post = may_post and handle.fully_posted

    def before_wait(self, handle: PhasedHandle) -> None:
        """Post every posting of the exchanges started before ``handle`` (blocking on the
        landings that enable them)."""
        for earlier in self._handles:
            if earlier is handle:
                return
            earlier.post_all()

    def finished(self, handle: PhasedHandle) -> None:
        self._handles.remove(handle)


class PhasedHandle:
    """A phased exchange in flight. Created with the first chunk's first phase posted;
    each later posting goes out once the postings before it have landed: at a progress
    point (:meth:`PhasedExchanges.progress`) for the ``early`` phases, else in ``wait()``,
    which runs the rest and returns the rows destined to this rank, grouped by source in
    group order, as the flat all-to-all does. The postings of several exchanges go out in
    one order on every rank, whatever lands when (:mod:`cocodiff.plan.phasing`).

    Args:
        transport: the transport.
        groups: the phases' groups (from ``transport.new_group``), in phase order.
        route: this rank's route (:func:`plan_route`).
        send: the flat send buffer: rows grouped by destination in group order.
        chunks: pieces each block's rows are cut into, pipelined through the phases.
        chunk_tokens: when the chunks cut every row along its tokens instead
            (:attr:`cocodiff.plan.steps.Exchange.chunk_tokens`), each chunk's tokens;
            empty when they cut rows.
        codecs: phase index -> codec, for the selective (V-Major) phases; their
            messages to other members go as the codec's bytes.
        on_sent: called with (phase index, bytes sent to other members) per posting.
        early: the phases whose postings may go out at progress points
            (:func:`cocodiff.plan.phasing.early_phases`).
        exchanges: the other phased exchanges of the attention call, for the order of
            postings; None for an exchange on its own.
    """

    __slots__ = ("_transport", "_groups", "_route", "_chunks", "_tokens", "_pieces",
                 "_posted", "_pipeline", "_empty", "_waited", "_codecs", "_on_sent", "_early",
                 "_exchanges")

    def __init__(self, transport: Transport, groups: Sequence[Group], route: Route,
                 send: torch.Tensor, chunks: int, codecs: Mapping[int, PhaseCodec] | None = None,
                 on_sent: Callable[[int, int], None] | None = None,
                 early: frozenset[int] = frozenset(),
                 exchanges: PhasedExchanges | None = None,
                 chunk_tokens: Sequence[int] = ()) -> None:
        if chunks < 1:
            raise PlanError(f"an exchange needs at least one chunk, got {chunks}")
        if chunk_tokens and (len(chunk_tokens) != chunks or sum(chunk_tokens) != send.shape[2]):
            raise PlanError(f"the plan cuts rows of {sum(chunk_tokens)} tokens into "
                            f"{len(chunk_tokens)} chunks {tuple(chunk_tokens)}; the exchange "
                            f"has {chunks} chunks of rows of {send.shape[2]} tokens")
        self._transport = transport
        self._groups = tuple(groups)
        self._route = route
        self._chunks = chunks
        self._tokens = tuple(chunk_tokens)
        self._codecs = dict(codecs or {})
        self._on_sent = on_sent
        self._early = early
        # Per chunk, no rows of the chunk's row shape (B, s or the chunk's tokens, D).
        self._empty = [send.new_empty((0, send.shape[1], tokens, *send.shape[3:]))
                       for tokens in self._tokens] or [send.new_empty((0, *send.shape[1:]))]
        # What this rank holds: (block, chunk) -> rows (B, s, D) each.
        self._pieces: dict[tuple[Block, int], torch.Tensor] = {}
        blocks = torch.split(send, [route.rows(b) for b in route.sent])
        for block, rows in zip(route.sent, blocks, strict=True):
            self._split_block(block, rows)
        self._posted: dict[tuple[int, int], _Posted] = {}  # posted, not landed
        self._pipeline = ChunkPipeline(chunks, len(route.phases))
        self._waited = False
        self._exchanges = exchanges if exchanges is not None else PhasedExchanges()
        self._exchanges.started(self)
        self._post_ready()

    def _split_block(self, block: Block, rows: torch.Tensor) -> None:
        if self._tokens:
            # (R, B, s, D) -> per chunk (R, B, s_c, D): every row, the chunk's tokens
            pieces = torch.split(rows, list(self._tokens), dim=2)
        else:
            pieces = torch.split(rows, [chunk_rows(rows.shape[0], c, self._chunks)
                                        for c in range(self._chunks)])
        for chunk, piece in enumerate(pieces):
            self._pieces[(block, chunk)] = piece

    def _rows(self, blocks: tuple[Block, ...], chunk: int) -> list[int]:
        return [block_rows(self._route.rows(b), chunk, self._chunks, bool(self._tokens))
                for b in blocks]

    def _empty_for(self, chunk: int) -> torch.Tensor:
        return self._empty[chunk] if self._tokens else self._empty[0]

    def _post(self, chunk: int, phase: int) -> None:
        route = self._route.phases[phase]
        me = route.group.index(self._transport.rank)
        # per member: (rows of every block sent to it, B, s, D)
        empty = self._empty_for(chunk)
        messages = [torch.cat([self._pieces.pop((b, chunk)) for b in blocks]) if blocks
                    else empty for blocks in route.send]
        recv_rows = [sum(self._rows(blocks, chunk)) for blocks in route.recv]
        codec = self._codecs.get(phase)
        if codec is None:
            send = torch.cat(messages)
            send_splits = [m.shape[0] for m in messages]
            recv_splits = recv_rows
            row_bytes = math.prod(empty.shape[1:]) * empty.element_size()
            sent_bytes = (send.shape[0] - send_splits[me]) * row_bytes
        else:
            # Bytes: to other members the codec's message, to itself the rows as they are.
            row_shape, dtype = empty.shape[1:], empty.dtype
            payloads = [as_bytes(m) if j == me else codec.encode(chunk, j, m)
                        for j, m in enumerate(messages)]
            send = torch.cat(payloads)
            send_splits = [p.numel() for p in payloads]
            recv_splits = [rows * math.prod(row_shape) * dtype.itemsize if j == me
                           else codec.message_bytes(chunk, j, rows, row_shape, dtype)
                           for j, rows in enumerate(recv_rows)]
            sent_bytes = send.numel() - send_splits[me]
        if self._on_sent is not None:
            self._on_sent(phase, sent_bytes)
        handle = self._transport.all_to_all(send, send_splits, recv_splits, self._groups[phase])
        self._posted[(chunk, phase)] = _Posted(handle, recv_rows, recv_splits)

    def _post_ready(self, phases: frozenset[int] | None = None) -> None:
        """Post the ready postings (of ``phases`` only, when given)."""
        for posting in self._pipeline.take(phases):
            self._post(*posting)

    def _land_next(self, chunk: int, phase: int) -> None:
        self._land(chunk, phase, self._posted.pop((chunk, phase)))
        self._pipeline.landed(chunk, phase)

    def _land(self, chunk: int, phase: int, posted: _Posted) -> None:
        route = self._route.phases[phase]
        codec = self._codecs.get(phase)
        received = posted.handle.wait()
        if codec is not None:
            # bytes grouped by source member -> rows grouped by source member
            me = route.group.index(self._transport.rank)
            empty = self._empty_for(chunk)
            row_shape, dtype = empty.shape[1:], empty.dtype
            received = torch.cat([
                from_bytes(payload, dtype).view(n, *row_shape) if j == me
                else codec.decode(chunk, j, payload, n, row_shape, dtype)
                for j, (payload, n) in enumerate(zip(received.split(posted.recv_splits),
                                                     posted.recv_rows, strict=True))
            ])
        blocks = [b for per_member in route.recv for b in per_member]
        # rows grouped by source member -> one piece per block
        for block, piece in zip(blocks, torch.split(received, self._rows(tuple(blocks), chunk)),
                                strict=True):
            self._pieces[(block, chunk)] = piece

    @property
    def fully_posted(self) -> bool:
        return self._pipeline.fully_posted

    def progress(self, may_post: bool) -> None:
        """Land what has arrived; post the early phases' ready postings if ``may_post``.
        Never blocks."""
        for posting in [key for key, posted in self._posted.items()
                        if posted.handle.is_completed()]:
            self._land_next(*posting)
        if may_post:
            self._post_ready(self._early)

    def _run(self, until_posted: bool) -> None:
        """Land in the pipeline's order (cocodiff.plan.phasing), one at a time, until all
        is posted or (else) landed. Each landing is a progress point for every exchange
        in flight, this one first posting all it may."""
        for posting in self._pipeline.wait_order():
            self._exchanges.progress()
            self._post_ready()
            if until_posted and self.fully_posted:
                return
            if posting in self._posted:  # else landed at a progress point
                self._land_next(*posting)
        self._exchanges.progress()

    def post_all(self) -> None:
        """Post every posting, blocking on the landings that enable them."""
        self._run(until_posted=True)

    def is_completed(self) -> bool:
        return self._waited

    def wait(self) -> torch.Tensor:
        if self._waited:
            raise TransportError("wait() called twice on the same handle")
        self._waited = True
        self._exchanges.before_wait(self)
        self._run(until_posted=False)
        self._exchanges.finished(self)
        # (rows from every source, B, s, D), grouped by source in group order
        if self._tokens:  # a block's chunks are its rows' token ranges, in order
            pieces = [torch.cat([self._pieces.pop((b, c)) for c in range(self._chunks)], dim=2)
                      for b in self._route.delivered]
            return torch.cat(pieces) if pieces else self._empty[0].new_empty(
                (0, self._empty[0].shape[1], sum(self._tokens), *self._empty[0].shape[3:]))
        pieces = [self._pieces.pop((b, c)) for b in self._route.delivered
                  for c in range(self._chunks)]
        return torch.cat(pieces) if pieces else self._empty[0]

