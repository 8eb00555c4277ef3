"""Plans are data: what one rank does, in what order, for one transformer layer.

A scheduler (``cocodiff.schedules``) turns a model, a rank layout and options into a
:class:`Plan`. The same plan is executed by the simulator (compute steps take the cost
model's time, exchanges become flows) and by the runtime (compute steps are the
model's modules, exchanges go through a real transport) with one executor,
:mod:`cocodiff.plan.executor`.

Ulysses exchanges move *head rows*: a rank's Q (or K, V, attention output) is laid out
as rows of ``tokens x head_dim`` values, one row per (head, token block); an exchange
sends ``send_rows[j]`` rows to group member j. ``row_bytes`` is one row's size.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

from cocodiff.cost import Cost
from cocodiff.layout import ParallelLayout, PipelineLayout
from cocodiff.plan.chunking import block_rows

# "kv": a Ring pass of one K/V block to the next Ring member (hybrid layouts).
# "send", "recv": a point-to-point transfer between pipeline stages (PipeFusion), the
# side this rank is on.
Tensor = Literal["q", "k", "v", "out", "kv", "send", "recv"]


@dataclass(frozen=True, slots=True)
class Compute:
    """Run one operation (a name from ``cocodiff.cost.OPS``) costing ``cost`` on this rank."""

    op: str
    cost: Cost


Level = Literal["tile", "gpu", "node"]


@dataclass(frozen=True, slots=True)
class Phase:
    """One all-to-all of a topology-aligned (TAPA) exchange.

    The members of ``group`` differ only in their ``level`` coordinate (their tile
    within one GPU, their GPU within one node, or their node). A block held by a
    member moves to the member whose ``level`` coordinate is its destination's, so
    after one phase per level every block has reached its destination rank.

    Args:
        level: the coordinate the members differ in.
        group: global ranks, group order.
        send_rows: rows sent to each member (forwarded blocks included).
        recv_rows: rows received from each member.
        sent_fraction: the share of the V-Major blocks actually sent; V-Major sends only
            the active V blocks over slow tiers (the rest come from the receiver's cache).
        blocks_per_row: V-Major blocks a row is cut into when the phase is selective
            (V-Major: messages carry the chosen blocks and their indices,
            :func:`cocodiff.plan.vblocks.message_bytes`); 0: whole rows.
        chunk_send_rows: with the exchange cut into chunks, the rows each chunk sends to
            each member (:mod:`cocodiff.plan.chunking`: every block's rows are cut, so a
            chunk's message is not simply its share of ``send_rows``; or, when the
            exchange's chunks cut tokens, every row, each carrying the chunk's tokens);
            empty for one chunk.
        chunk_recv_rows: the same for the rows received.
    """

    level: Level
    group: tuple[int, ...]
    send_rows: tuple[int, ...]
    recv_rows: tuple[int, ...]
    sent_fraction: float = 1.0
    blocks_per_row: int = 0
    chunk_send_rows: tuple[tuple[int, ...], ...] = ()
    chunk_recv_rows: tuple[tuple[int, ...], ...] = ()

    @property
    def selective(self) -> bool:
        return self.blocks_per_row > 0

    def chunk_rows(self, chunk: int, chunks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(rows sent to, rows received from) each member in chunk ``chunk`` of ``chunks``.

        Raises:
            ValueError: the phase states no rows for that many chunks.
        """
        if chunks == 1 and not self.chunk_send_rows:
            return self.send_rows, self.recv_rows
        if len(self.chunk_send_rows) != chunks or len(self.chunk_recv_rows) != chunks:
            raise ValueError(f"a {self.level} phase states rows for "
                             f"{len(self.chunk_send_rows) or 1} chunk(s), its exchange has "
                             f"{chunks}")
        return self.chunk_send_rows[chunk], self.chunk_recv_rows[chunk]


@dataclass(frozen=True, slots=True)
class Exchange:
    """Start an all-to-all of ``tensor`` over ``group`` (global ranks, group order).

    ``scatter_heads``: tokens are split and heads whole before, the opposite after
    (Q, K, V). ``gather_heads``: the reverse (the attention output). ``ring``: a Ring
    pass (tensor "kv"): one row, the K/V block in hand, to the next member of the Ring,
    one row from the previous; every other entry is 0 (``cocodiff.schedules.hybrid``).
    ``p2p``: a point-to-point transfer (:func:`transfer`): one row of ``row_bytes`` from
    ``group[0]`` to ``group[1]``; the sender's step has tensor "send", the receiver's
    "recv", and transports match the two by the group and the direction.

    ``send_rows``/``recv_rows`` describe the logical exchange: what each member ends
    up with. With ``phases`` empty it runs as one flat all-to-all; otherwise as the
    phases in order, the rows split into ``chunks`` that are pipelined through them
    (chunk c's phase p runs while chunk c+1 is in phase p-1), so every tier is busy.
    ``chunk_tokens``: when the chunks cut every row along its tokens rather than each
    block's rows (:mod:`cocodiff.plan.chunking`), the tokens of each row each chunk
    carries (they sum to a row's tokens); empty when chunks cut rows.
    """

    tensor: Tensor
    group: tuple[int, ...]
    send_rows: tuple[int, ...]
    recv_rows: tuple[int, ...]
    row_bytes: int
    direction: Literal["scatter_heads", "gather_heads", "ring", "p2p"]
    phases: tuple[Phase, ...] = ()
    chunks: int = 1
    chunk_tokens: tuple[int, ...] = ()

    @property
    def send_bytes(self) -> int:
        return sum(self.send_rows) * self.row_bytes

    def block_rows(self, rows: int, chunk: int) -> int:
        """Rows of a block of ``rows`` rows that chunk ``chunk`` carries (all of them,
        each in part, when chunks cut tokens)."""
        return block_rows(rows, chunk, self.chunks, bool(self.chunk_tokens))

    def chunk_row_bytes(self, chunk: int) -> int:
        """Bytes of one row's part in chunk ``chunk``: a row's values are
        ``batch x tokens x head_dim``, so its bytes divide by its tokens."""
        if not self.chunk_tokens:
            return self.row_bytes
        return self.row_bytes // sum(self.chunk_tokens) * self.chunk_tokens[chunk]


@dataclass(frozen=True, slots=True)
class Wait:
    """Block until the exchange of ``tensor`` has arrived."""

    tensor: Tensor


Step = Compute | Exchange | Wait


def transfer(src_rank: int, dst_rank: int, num_bytes: int, me: int) -> Exchange:
    """A point-to-point transfer of ``num_bytes`` from ``src_rank`` to ``dst_rank`` (global
    ranks), as rank ``me`` (one of them) starts it: an exchange over the pair whose only
    non-zero entry is the one row sent, so every executor and transport carries it as it
    carries any exchange (the simulator charges one message on the route, its bytes to
    the route's tier). Wait for it with ``Wait("send")`` or ``Wait("recv")``."""
    if me == src_rank:
        return Exchange("send", (src_rank, dst_rank), (0, 1), (0, 0), num_bytes, "p2p")
    return Exchange("recv", (src_rank, dst_rank), (0, 0), (1, 0), num_bytes, "p2p")


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """One transformer layer on one rank.

    ``attention`` is what the runtime's attention processor executes; ``before`` and
    ``after`` (norms, MLP, cross-attention) run in the model's own block code, so only
    the simulator executes them.
    """

    before: tuple[Compute, ...]
    attention: tuple[Step, ...]
    after: tuple[Compute, ...]

    @property
    def steps(self) -> tuple[Step, ...]:
        return self.before + self.attention + self.after

    @property
    def exchanges(self) -> tuple[Exchange, ...]:
        return tuple(step for step in self.attention if isinstance(step, Exchange))


@dataclass(frozen=True, slots=True)
class RankProgram:
    """All layers of one denoising step on one rank (identical layers share one object)."""

    rank: int
    layers: tuple[LayerPlan, ...]


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """How a Ulysses group splits the sequence's tokens (before the exchange) and the
    heads (after it).

    Args:
        sequence_tokens: real tokens (image + joint text).
        padded_tokens: all ranks' local tokens together (each token stream padded to a
            multiple of the rank count).
        heads: heads each rank attends over after the exchange (uneven when the head
            count does not divide).
        head_dim: values per head and token.
        batch: samples per step (2 when classifier-free guidance batches them).
    """

    sequence_tokens: int
    padded_tokens: int
    heads: tuple[int, ...]
    head_dim: int
    batch: int = 1

    @property
    def num_ranks(self) -> int:
        return len(self.heads)

    @property
    def local_tokens(self) -> int:
        return self.padded_tokens // self.num_ranks


@dataclass(frozen=True, slots=True)
class Plan:
    """One denoising step for every rank of a run.

    Args:
        schedule: the scheduler's registry name.
        model: the model spec's name.
        head_split: the Ulysses group's split of tokens and heads.
        programs: one program per rank, indexed by global rank.
        shift_period: the plan is unchanged when every rank is shifted by this many
            ranks (mod the rank count), or None. The simulator folds node-symmetric
            traffic onto one node when the ranks per node is a multiple of it.
        parallel: the Ulysses x Ring x batch layout (``cocodiff.layout``); None for pure
            Ulysses over every rank, when ``head_split`` is the whole story.
        pipeline: a PipeFusion step's layout (``cocodiff.schedules.pipefusion``), its
            ``patches`` those this step streams (1: a synchronous warm-up step); None for
            every other schedule.
    """

    schedule: str
    model: str
    head_split: HeadSplit
    programs: tuple[RankProgram, ...] = field(repr=False)
    shift_period: int | None
    parallel: ParallelLayout | None = None
    pipeline: PipelineLayout | None = None

    @property
    def num_ranks(self) -> int:
        return len(self.programs)

    def program(self, rank: int) -> RankProgram:
        return self.programs[rank]

    def to_json(self, ranks: tuple[int, ...] | None = None) -> str:
        """JSON of the plan (all ranks, or the given ones). Shared layers are repeated."""
        chosen = range(self.num_ranks) if ranks is None else ranks
        return json.dumps(
            {
                "schedule": self.schedule,
                "model": self.model,
                "head_split": asdict(self.head_split),
                "shift_period": self.shift_period,
                "parallel": None if self.parallel is None else asdict(self.parallel),
                **({} if self.pipeline is None else {"pipeline": asdict(self.pipeline)}),
                "programs": [_program_json(self.programs[r]) for r in chosen],
            }
        )


def _program_json(program: RankProgram) -> dict:
    def step_json(step: Step) -> dict:
        return {"kind": type(step).__name__.lower(), **asdict(step)}

    return {
        "rank": program.rank,
        "layers": [
            {part: [step_json(s) for s in getattr(layer, part)]
             for part in ("before", "attention", "after")}
            for layer in program.layers
        ],
    }
