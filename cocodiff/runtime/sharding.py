"""How token streams are split over Ulysses ranks, and put back together.

A *stream* is a run of tokens that a model keeps in one tensor: the image tokens, the
joint-attention text tokens. Each stream is split into equal chunks, one per rank, the
last ones padded with zeros when the length does not divide. A rank's local sequence
is its chunks of the streams concatenated in the order the model concatenates them.

After the Q/K/V exchange a rank holds every rank's local sequence one after another
(the *gathered* order). Attention runs on the real tokens in the model's *original*
order instead: :meth:`TokenStreams.original_positions` picks them out, so the
attention kernel sees exactly what the single-process model gives it, with no padding
and no mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenShard:
    """One stream of ``total`` tokens split over ``num_ranks`` chunks of ``chunk``."""

    total: int
    num_ranks: int

    @property
    def chunk(self) -> int:
        return -(-self.total // self.num_ranks)

    def split(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """This rank's chunk of ``x`` along ``dim``, zero-padded to ``chunk``."""
        start = min(rank * self.chunk, self.total)
        stop = min(start + self.chunk, self.total)
        local = x.narrow(dim, start, stop - start)
        missing = self.chunk - (stop - start)
        if missing:
            pad_shape = list(local.shape)
            pad_shape[dim] = missing
            local = torch.cat([local, local.new_zeros(pad_shape)], dim=dim)
        return local.contiguous()

    def unsplit(self, chunks: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's chunks concatenated along ``dim`` -> the stream without padding."""
        return chunks.narrow(dim, 0, self.total)


@dataclass(frozen=True, slots=True)
class TokenStreams:
    """The streams of one attention call, in the model's concatenation order."""

    streams: tuple[TokenShard, ...]

    @property
    def local_tokens(self) -> int:
        return sum(shard.chunk for shard in self.streams)

    def original_positions(self) -> torch.Tensor:
        """For each real token in original order (stream by stream), its index in the
        gathered sequence (rank by rank, each rank's streams by chunk)."""
        local = self.local_tokens
        positions: list[torch.Tensor] = []
        offset_in_rank = 0
        for shard in self.streams:
            tokens = torch.arange(shard.total)
            rank, within = tokens // shard.chunk, tokens % shard.chunk
            positions.append(rank * local + offset_in_rank + within)
            offset_in_rank += shard.chunk
        return torch.cat(positions)

