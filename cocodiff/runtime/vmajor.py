"""V-Major on a real transport: a selective phase sends only the blocks that changed
most since the receiver last got them.

A *message* is what one holder sends one other member of a selective (slow-tier) phase
for one chunk of one exchange: rows ``(R, B, s, D)``, cut into blocks of
``block_tokens(s)`` tokens of one head of one sample (:mod:`cocodiff.plan.vblocks`).
The sender keeps a *mirror* of what the receiver holds for that message and the
receiver keeps the blocks it holds. Both start empty and change only through the
message itself, so they stay equal without acknowledgements:

* no mirror yet (the first step of a generation, or after :meth:`VMajorCache.clear`):
  every block is sent, in order, and both sides store it;
* otherwise the plan's fraction of the blocks (:func:`blocks_sent`, known to both
  sides), those with the largest L1 change against the mirror, with their indices; the
  receiver overwrites those blocks of its copy and passes the whole copy on.

On the wire a message is bytes: the chosen blocks' values, then their int32 indices in
ascending order (none when every block is sent).

Messages are keyed by (tensor, call, layer, chunk, member): ``call`` counts the
transformer's forward calls within one denoising step (Wan runs the conditional and the
unconditional pass as two calls, whose V differ).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from cocodiff.plan.executor import PlanError
from cocodiff.plan.steps import LayerPlan
from cocodiff.plan.vblocks import (
    block_tokens,
    blocks_sent,
    chunk_blocks_per_row,
    message_bytes,
)
from cocodiff.runtime.exchange import all_gather_rows
from cocodiff.schedules.activity import ActivityTrace

MessageKey = tuple[str, int, int, int, int]
"""(tensor, call, layer, chunk, member index in the phase group)."""


@dataclass(frozen=True, slots=True)
class Selection:
    """The blocks one message carried: ``sent`` (ascending) of ``num_blocks``, or None
    for all of them."""

    chunk: int
    member: int
    num_blocks: int
    sent: tuple[int, ...] | None


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """Any tensor -> its bytes (1-D uint8)."""
    return x.contiguous().view(-1).view(torch.uint8)


def from_bytes(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """1-D uint8 -> 1-D ``dtype`` over the same bytes (copied when misaligned)."""
    if payload.storage_offset() % dtype.itemsize:
        payload = payload.clone()
    return payload.view(dtype)


class VMajorCache:
    """One rank's V-Major state (mirrors and held blocks) and what it sent, for one
    generation.

    ``selections[(step, call, layer)]``: the messages this rank sent in selective phases,
    in the order it sent them.
    """

    def __init__(self) -> None:
        self._mirrors: dict[MessageKey, torch.Tensor] = {}
        self._held: dict[MessageKey, torch.Tensor] = {}
        self.selections: dict[tuple[int, int, int], list[Selection]] = {}

    def clear(self) -> None:
        self._mirrors.clear()
        self._held.clear()
        self.selections.clear()

    @property
    def num_bytes(self) -> int:
        """Bytes of mirrors and held blocks together."""
        return sum(t.numel() * t.element_size()
                   for store in (self._mirrors, self._held) for t in store.values())

    def codec(self, tensor: str, step: int, call: int, layer: int, fraction: float,
              blocks_per_row: int, row_tokens: int = 0) -> SelectiveCodec:
        return SelectiveCodec(self, tensor, step, call, layer, fraction, blocks_per_row,
                              row_tokens)


class SelectiveCodec:
    """Encodes and decodes the messages of one selective phase of one exchange."""

    __slots__ = ("_cache", "_tensor", "_step", "_call", "_layer", "_fraction",
                 "_blocks_per_row", "_row_tokens")

    def __init__(self, cache: VMajorCache, tensor: str, step: int, call: int, layer: int,
                 fraction: float, blocks_per_row: int, row_tokens: int = 0) -> None:
        """``blocks_per_row``: the plan's blocks per whole row; ``row_tokens``: a whole
        row's tokens when the exchange's chunks cut tokens (a chunk's part of a row is
        cut into blocks of its own, :func:`cocodiff.plan.vblocks.chunk_blocks_per_row`),
        else 0."""
        self._cache = cache
        self._tensor = tensor
        self._step = step
        self._call = call
        self._layer = layer
        self._fraction = fraction
        self._blocks_per_row = blocks_per_row
        self._row_tokens = row_tokens

    def _key(self, chunk: int, member: int) -> MessageKey:
        return (self._tensor, self._call, self._layer, chunk, member)

    def _num_blocks(self, num_rows: int, row_shape: Sequence[int]) -> int:
        batch, tokens, _ = row_shape
        per_row = batch * (tokens // block_tokens(tokens))
        planned = (chunk_blocks_per_row(self._blocks_per_row, self._row_tokens, tokens)
                   if self._row_tokens else self._blocks_per_row)
        if per_row != planned:
            raise PlanError(f"V-Major exchange of {self._tensor}: the plan cuts a row into "
                            f"{planned} blocks, rows of {tuple(row_shape)} make "
                            f"{per_row}")
        return num_rows * per_row

    def _sent(self, num_blocks: int, has_copy: bool) -> int:
        # Without a copy on the other side, everything must go.
        return blocks_sent(num_blocks, self._fraction) if has_copy else num_blocks

    def message_bytes(self, chunk: int, member: int, num_rows: int,
                      row_shape: Sequence[int], dtype: torch.dtype) -> int:
        """Bytes the receiver gets from ``member`` for ``num_rows`` rows of ``row_shape``."""
        num_blocks = self._num_blocks(num_rows, row_shape)
        if num_blocks == 0:
            return 0
        block_bytes = num_rows * math.prod(row_shape) // num_blocks * dtype.itemsize
        has_copy = self._key(chunk, member) in self._cache._held
        fraction = self._sent(num_blocks, has_copy) / num_blocks
        return message_bytes(num_blocks, block_bytes, fraction)

    def encode(self, chunk: int, member: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``(R, B, s, D)`` for ``member`` -> the message's bytes."""
        num_blocks = self._num_blocks(rows.shape[0], rows.shape[1:])
        if num_blocks == 0:
            return as_bytes(rows)
        key = self._key(chunk, member)
        # (R, B, s, D) -> (R * B * s/bt, bt * D): block n is (row, sample, token block)
        blocks = rows.reshape(num_blocks, -1)
        mirror = self._cache._mirrors.get(key)
        sent = self._sent(num_blocks, mirror is not None)
        record = self._cache.selections.setdefault((self._step, self._call, self._layer), [])
        if sent == num_blocks:
            self._cache._mirrors[key] = blocks.clone()
            record.append(Selection(chunk, member, num_blocks, None))
            return as_bytes(blocks)
        assert mirror is not None
        change = (blocks.float() - mirror.float()).abs().sum(dim=1)  # L1 per block
        chosen = change.topk(sent).indices.sort().values
        values = blocks.index_select(0, chosen)
        mirror[chosen] = values
        record.append(Selection(chunk, member, num_blocks, tuple(chosen.tolist())))
        return torch.cat([as_bytes(values), as_bytes(chosen.to(torch.int32))])

    def decode(self, chunk: int, member: int, payload: torch.Tensor, num_rows: int,
               row_shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A message's bytes -> rows ``(R, B, s, D)``: the receiver's copy, updated.

        The result may be the copy itself: use it before this message comes again."""
        num_blocks = self._num_blocks(num_rows, row_shape)
        if num_blocks == 0:
            return from_bytes(payload, dtype).view(num_rows, *row_shape)
        key = self._key(chunk, member)
        held = self._cache._held.get(key)
        sent = self._sent(num_blocks, held is not None)
        if sent == num_blocks:
            blocks = from_bytes(payload, dtype).view(num_blocks, -1).clone()
            self._cache._held[key] = blocks
            return blocks.view(num_rows, *row_shape)
        assert held is not None
        value_bytes = payload.numel() - sent * torch.int32.itemsize
        values = from_bytes(payload[:value_bytes], dtype).view(sent, held.shape[1])
        chosen = from_bytes(payload[value_bytes:], torch.int32).long()
        held[chosen] = values
        return held.view(num_rows, *row_shape)


def cache_bytes_bound(layers: Sequence[LayerPlan], rank: int, calls: int) -> int:
    """The most a rank's :class:`VMajorCache` holds under a plan: for every selective
    phase of every layer, the rows it sends other members (mirrors) and receives from
    them (held copies), for each of ``calls`` forward calls per step."""
    total = 0
    for layer in layers:
        for step in layer.exchanges:
            for phase in step.phases:
                if not phase.selective:
                    continue
                me = phase.group.index(rank)
                rows = (sum(phase.send_rows) - phase.send_rows[me]
                        + sum(phase.recv_rows) - phase.recv_rows[me])
                total += rows * step.row_bytes
    return total * calls


@dataclass(frozen=True, slots=True)
class VMajorReport:
    """What V-Major did in one generation, over every rank.

    Args:
        blocks_sent: slow-tier V blocks sent, over ranks, steps and layers.
        blocks_total: slow-tier V blocks an exact run sends.
        bytes_by_tier: bytes the attention exchanges and the output gathers sent between
            ranks, by tier.
        cache_bytes: the largest V cache (mirrors + held copies) of one rank.
        cache_bound_bytes: the largest per-rank cache the plan allows
            (:func:`cache_bytes_bound`).
    """

    blocks_sent: int
    blocks_total: int
    bytes_by_tier: dict[str, int]
    cache_bytes: int
    cache_bound_bytes: int

    @property
    def sent_fraction(self) -> float:
        return self.blocks_sent / self.blocks_total if self.blocks_total else 1.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "sent_fraction": self.sent_fraction}

    def summary(self) -> str:
        mib = 1 << 20
        return (f"V-Major sent {self.sent_fraction:.1%} of V's inter-node blocks; "
                f"inter-node bytes {self.bytes_by_tier.get('inter-node', 0) / mib:.2f} MiB; "
                f"V cache {self.cache_bytes / mib:.3f} MiB per rank "
                f"(plan bound {self.cache_bound_bytes / mib:.3f} MiB)")


def local_activity(cache: VMajorCache, num_steps: int, num_layers: int) -> torch.Tensor:
    """This rank's sent blocks as a mask ``(steps, layers, blocks)``: a layer's blocks are
    its selective messages' blocks in (call, chunk, member) order.

    Raises:
        PlanError: layers or steps differ in their number of blocks.
    """
    by_layer: dict[tuple[int, int], list[tuple[int, Selection]]] = {}
    for (step, call, layer), selections in cache.selections.items():
        by_layer.setdefault((step, layer), []).extend((call, s) for s in selections)
    counts = {key: sum(s.num_blocks for _, s in messages) for key, messages in by_layer.items()}
    blocks = max(counts.values(), default=0)
    if blocks and (len(counts) != num_steps * num_layers or len(set(counts.values())) > 1):
        raise PlanError("V-Major's slow-tier blocks differ between steps or layers: "
                        f"{sorted(set(counts.values()))} in {len(counts)} of "
                        f"{num_steps * num_layers}")
    mask = torch.zeros((num_steps, num_layers, blocks), dtype=torch.bool)
    for (step, layer), messages in by_layer.items():
        offset = 0
        for _, selection in sorted(messages, key=lambda m: (m[0], m[1].chunk, m[1].member)):
            end = offset + selection.num_blocks
            if selection.sent is None:
                mask[step, layer, offset:end] = True
            else:
                mask[step, layer, offset + torch.tensor(selection.sent, dtype=torch.long)] = True
            offset = end
    return mask


def gather_activity(runtime: Any) -> tuple[VMajorReport, ActivityTrace | None]:
    """Every rank's V-Major activity and byte counts (a collective: every rank calls it).

    Returns:
        The report, and the activity trace (None when no rank had a slow-tier phase).
    """
    transport = runtime.transport
    rank = transport.rank
    num_steps, num_layers = runtime.step + 1, runtime.spec.num_layers
    mask = local_activity(runtime.vcache, num_steps, num_layers)
    assert runtime.plan is not None
    bound = cache_bytes_bound(runtime.plan.program(rank).layers, rank, runtime.calls_per_step)
    tiers = list(runtime.bytes_by_tier)
    # (P, 3 + tiers): blocks per layer, cache bytes, bound, bytes by tier
    numbers = all_gather_rows(transport, torch.tensor(
        [mask.shape[2], runtime.vcache.num_bytes, bound,
         *(runtime.bytes_by_tier[t] for t in tiers)], dtype=torch.int64))
    blocks = numbers[:, 0].tolist()
    width = max(blocks)
    padded = torch.zeros((num_steps, num_layers, width), dtype=torch.uint8)
    padded[:, :, :mask.shape[2]] = mask
    masks = all_gather_rows(transport, padded)  # (P, steps, layers, width)
    report = VMajorReport(
        blocks_sent=int(masks.sum()),
        blocks_total=sum(blocks) * num_steps * num_layers,
        bytes_by_tier={tier: int(numbers[:, 3 + i].sum()) for i, tier in enumerate(tiers)},
        cache_bytes=int(numbers[:, 1].max()),
        cache_bound_bytes=int(numbers[:, 2].max()),
    )
    if width == 0:
        return report, None

    def sent(step: int, member: int, layer: int) -> tuple[int, ...] | None:
        row = masks[member, step, layer, :blocks[member]]
        return None if bool(row.all()) else tuple(row.nonzero().flatten().tolist())

    trace = ActivityTrace(
        num_ranks=transport.world_size,
        num_layers=num_layers,
        blocks_per_rank=blocks[0] if len(set(blocks)) == 1 else tuple(blocks),
        sent=tuple(tuple(tuple(sent(step, member, layer) for layer in range(num_layers))
                         for member in range(transport.world_size))
                   for step in range(num_steps)),
    )
    return report, trace
