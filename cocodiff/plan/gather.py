"""The step's output gather, as a run's plan implies it.

After the last block, every rank holds the transformer's output for its own image tokens
only; the runtime's gather hook (``cocodiff.runtime.hooks``; the batch gather of
``cocodiff.runtime.hybrid``) sends that chunk to every other rank of its sequence group
(and, with batch groups, the whole sample to the other batch shares) through the transport,
so that the pipeline's scheduler sees the whole latent. The plan's layers do not carry it:
the runtime hooks it into the unmodified model. But it is an exchange every step pays, of
bytes the plan determines, so the simulator charges it (the stages a layout implies:
:func:`cocodiff.schedules.gather.output_gather`). It is no small part of a
small model's step: the emulated cluster's 256 px FLUX on 4 x 2 ranks sends 8 KiB from
every rank to each of the 7 others, 6 of them across the slow link, in a step of a few
dozen milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cocodiff.models import ModelSpec


@dataclass(frozen=True, slots=True)
class GatherStage:
    """One all-gather: every rank sends ``bytes_per_member`` to each other member of its
    group in ``groups`` (disjoint, covering every rank; global ranks)."""

    groups: tuple[tuple[int, ...], ...]
    bytes_per_member: int

    def group_of(self, rank: int) -> tuple[int, ...]:
        return next(group for group in self.groups if rank in group)


def image_stream(spec: ModelSpec, stream_tokens: Sequence[int]) -> int:
    """The image stream's tokens among a plan's streams: the only one, or the one left
    when the joint text's stream (``spec.text_tokens``) is taken out. (A prompt shorter
    than the spec's text, which only Qwen-Image's pipeline leaves unpadded, falls back on
    the largest stream.)"""
    streams = sorted((t for t in stream_tokens if t > 0), reverse=True)
    if len(streams) > 1 and spec.text_tokens in streams:
        streams.remove(spec.text_tokens)
    return streams[0]
