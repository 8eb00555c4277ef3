"""The one transport interface every backend implements.

A transport moves buffers between the ranks of one job. The executor
(``cocodiff.plan.executor``) is written against this interface only, so the same rank
program runs over torch.distributed, mpi4py or the simulator.

Conventions:
    * Ranks are *global* ranks unless a name says ``group_rank``.
    * Split sizes count rows of dimension 0 of the buffer (as
      ``torch.distributed.all_to_all_single`` does). The simulated backend's buffers are
      :class:`VirtualBuffer` objects that know their row size in bytes but hold no data.
    * A collective call returns a :class:`Handle` at once; ``wait()`` blocks until this
      rank's part is done and returns the received buffer. Waiting twice is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


class TransportError(RuntimeError):
    """A transport failed: a peer died, a timeout expired, or a call was misused."""


@dataclass(frozen=True, slots=True)
class Group:
    """A set of global ranks that take part in a collective together.

    Args:
        ranks: the members' global ranks, in group-rank order.
        handle: the backend's own object for the group (a torch ProcessGroup, an MPI
            communicator), or None for the world group and for the simulator.
    """

    ranks: tuple[int, ...]
    handle: Any = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def group_rank(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


@dataclass(frozen=True, slots=True)
class VirtualBuffer:
    """A buffer with a size but no contents: what the simulated transport moves.

    Args:
        num_rows: length of dimension 0.
        row_bytes: bytes in one row.
    """

    num_rows: int
    row_bytes: int

    @property
    def num_bytes(self) -> int:
        return self.num_rows * self.row_bytes


@runtime_checkable
class Handle(Protocol):
    """An operation in flight. ``wait()`` returns its result once, then raises."""

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


@runtime_checkable
class Transport(Protocol):
    """What the executor needs from a communication backend."""

    @property
    def name(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def world(self) -> Group: ...

    def new_group(self, ranks: Sequence[int]) -> Group:
        """Create a sub-group. Collective: every rank of the world calls it with the
        same ``ranks`` in the same order (as torch.distributed.new_group requires)."""
        ...

    def all_to_all(
        self,
        send: Any,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        group: Group | None = None,
    ) -> Handle:
        """Start an all-to-all with uneven splits over ``group`` (the world if None).

        Args:
            send: rows to send, grouped by destination in group-rank order.
            send_splits: rows for each group member (``sum == len(send)``).
            recv_splits: rows expected from each group member.
            group: the group, from :meth:`new_group`.

        Returns:
            A handle whose ``wait()`` returns the received rows, grouped by source.
        """
        ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class CompletedHandle:
    """A handle for work that finished synchronously (e.g. real compute)."""

    __slots__ = ("_result", "_waited")

    def __init__(self, result: Any = None) -> None:
        self._result = result
        self._waited = False

    def is_completed(self) -> bool:
        return True

    def wait(self) -> Any:
        if self._waited:
            raise TransportError("wait() called twice on the same handle")
        self._waited = True
        return self._result


def check_group_ranks(ranks: tuple[int, ...], world_size: int) -> None:
    """Raise ValueError unless ``ranks`` is a non-empty set of distinct world ranks."""
    if not ranks:
        raise ValueError("a group needs at least one rank")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"duplicate ranks in group {ranks}")
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"ranks {bad} outside world of {world_size}")


def check_all_to_all(
    rank: int,
    group: Group,
    send_shape: Sequence[int],
    send_rows: Sequence[int],
    recv_rows: Sequence[int],
) -> None:
    """Raise ValueError unless the arguments describe a valid all-to-all for ``rank``
    (the same message from every backend)."""
    if rank not in group.ranks:
        raise ValueError(f"rank {rank} is not in group {group.ranks}")
    if len(send_shape) == 0:
        raise ValueError("send buffer must have at least one dimension (rows)")
    for label, rows in (("send_splits", send_rows), ("recv_splits", recv_rows)):
        if len(rows) != group.size:
            raise ValueError(f"{label} has {len(rows)} entries for a group of {group.size}")
        if any(n < 0 for n in rows):
            raise ValueError(f"negative entry in {label} {list(rows)}")
    if sum(send_rows) != send_shape[0]:
        raise ValueError(
            f"send_splits {list(send_rows)} sum to {sum(send_rows)}, not {send_shape[0]}"
        )
