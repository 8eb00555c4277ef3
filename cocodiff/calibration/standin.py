"""A transport that moves nothing: one rank's view of a world of P ranks whose exchanges hand
the rank's own rows back.

With it the runtime runs a forward on one rank as a step runs it (the sharding hooks, the
attention processors packing and unpacking each exchange, attention at the Ulysses shape,
the output's gather), less the communication itself, which calibrate prices on its own
(the pair sweep, the loaded loops). The values received are wrong, their shapes right:
enough to time the work, not to check it. ``on_exchange``, when set, runs at each
exchange: the loaded loops (:mod:`cocodiff.calibration.loaded`) make their real calls
there, so the calls meet the cores where a step meets them, between the real blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transports.base import CompletedHandle, Group, check_all_to_all, check_group_ranks


class StandInTransport:
    """Rank ``rank`` of ``world_size`` ranks, alone in this process (see the module)."""

    name = "stand-in"

    def __init__(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.rank, self.world_size = rank, world_size
        self.world = Group(tuple(range(world_size)))
        self.on_exchange: Callable[[], None] | None = None
        # The runtime parallelised over this stand-in, when one is (``standin_forward``):
        # its plan says which of the forward's exchanges follow one another with no
        # compute between (``cocodiff.calibration.loaded.calls_after_compute``).
        self.runtime: Any = None

    def new_group(self, ranks: Sequence[int]) -> Group:
        check_group_ranks(tuple(ranks), self.world_size)
        return Group(tuple(ranks))

    def all_to_all(self, send: Any, send_splits: Sequence[int], recv_splits: Sequence[int],
                   group: Group | None = None) -> CompletedHandle:
        import torch

        group = group or self.world
        check_all_to_all(self.rank, group, tuple(send.shape), send_splits, recv_splits)
        if self.on_exchange is not None:
            self.on_exchange()
        rows = sum(recv_splits)
        # The rows sent, cut or repeated to the rows expected: no copy when they match (a
        # Ulysses exchange sends as many rows as it receives), as a transport that
        # receives into a fresh buffer does not copy twice.
        repeats = -(-rows // max(1, send.shape[0]))
        received = send if repeats <= 1 else torch.cat([send] * repeats)
        return CompletedHandle(received[:rows])

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass
