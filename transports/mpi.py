"""The MPI backend over mpi4py (MPICH, Intel MPI, Cray MPICH, Open MPI).

Buffers are host arrays: torch CPU tensors (exchanged through their numpy view) or numpy
arrays. The all-to-all is one ``Ialltoallv`` over ``MPI.BYTE`` with counts and displacements
in bytes (rows x row bytes), so every dtype works, bfloat16 included.

Device tensors (CUDA, XPU) are staged through host memory unless the transport is built with
``gpu_aware=True``; then the device buffer is handed to MPI directly (through DLPack / CUDA
array interface), which only a GPU-aware MPI may be given.

MPI has no collective timeout, so this transport makes its own: every wait (an all-to-all's
``wait()``, ``barrier()``, the collective set-up of communicators) polls ``MPI_Test`` until
the request completes or ``timeout_s`` has passed since it started, then raises
:class:`~transports.base.TransportError` naming what timed out and the peers it waited for.
A peer that is killed ends the job through the launcher (mpiexec kills the other ranks); a
peer that is alive but silent, or one that exits without telling MPI, is caught by the
deadline. After such an error the job cannot continue: the caller should end it with
``MPI.COMM_WORLD.Abort`` (``cocodiff run`` does), since MPI_Finalize may wait for the dead
peer. MPI errors the library reports are raised as :class:`~transports.base.TransportError`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import numpy as np
from mpi4py import MPI

from transports.base import Group, TransportError, check_all_to_all, check_group_ranks


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


# Polling a request: spin (yielding the CPU each time round) for this long, as MPI_Wait
# would, so that a multi-round collective gets progress calls promptly; then sleep between
# polls, so that a long wait (a peer still computing) leaves the CPU to the processes that
# need it.
_SPIN_S = 0.02
_POLL_SLEEP_S = 0.001

# Buffers of all-to-alls dropped before they completed: a wait that timed out or was
# interrupted, an exception between start and wait. MPI may still write into them (a
# collective cannot be cancelled), even during MPI_Finalize, so they must outlive every
# Python object that held them: they are kept until the process ends.
_ABANDONED: list[tuple[Any, ...]] = []


def _wait_until(request: MPI.Request, deadline: float, timeout_s: float, what: str,
                peers: tuple[int, ...]) -> None:
    """Complete ``request`` by ``deadline`` (``time.monotonic()``), or raise.

    Raises:
        TransportError: MPI reported an error, or the deadline passed (the message names
            the peers that were waited for).
    """
    try:
        if request.Test():
            return
        spin_until = time.monotonic() + _SPIN_S
        while not request.Test():
            now = time.monotonic()
            if now > deadline:
                raise TransportError(
                    f"{what} timed out after {timeout_s:g} s waiting for {_ranks_text(peers)}: "
                    "a peer died or stopped responding"
                )
            if now < spin_until:
                os.sched_yield()
            else:
                time.sleep(_POLL_SLEEP_S)
    except MPI.Exception as exc:
        raise TransportError(f"{what} failed: {_one_line(exc)}") from exc


def _ranks_text(peers: tuple[int, ...]) -> str:
    if len(peers) == 1:
        return f"rank {peers[0]}"
    return f"one of ranks {', '.join(map(str, peers))}"


class _MpiHandle:
    """One ``Ialltoallv`` in flight. ``wait()`` returns the received buffer once, or raises
    :class:`~transports.base.TransportError` when it is not done ``timeout_s`` after it
    started."""

    __slots__ = ("_request", "_keep", "_finish", "_what", "_waited", "_deadline", "_timeout_s",
                 "_peers")

    def __init__(
        self,
        request: MPI.Request,
        keep: tuple[Any, ...],
        finish: Callable[[], Any],
        what: str,
        timeout_s: float,
        peers: tuple[int, ...],
    ) -> None:
        self._request = request
        # The send/recv buffers must outlive the request, also when a wait timed out
        # (MPI may still write into them): they are dropped only once it completed.
        self._keep = keep
        self._finish = finish
        self._what = what
        self._waited = False
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._peers = peers

    def __del__(self) -> None:
        if self._keep:  # never completed through wait(): MPI may still own the buffers
            _ABANDONED.append((self._request, self._keep))

    def is_completed(self) -> bool:
        if self._waited:
            return True
        try:
            return bool(self._request.Test())
        except MPI.Exception as exc:
            raise TransportError(f"{self._what} failed: {_one_line(exc)}") from exc

    def wait(self) -> Any:
        """Block until the exchange is done; return the received rows, grouped by source."""
        if self._waited:
            raise TransportError("wait() called twice on the same handle")
        self._waited = True
        _wait_until(self._request, self._deadline, self._timeout_s, self._what, self._peers)
        self._keep = ()
        return self._finish()


class MpiTransport:
    """A :class:`~transports.base.Transport` over mpi4py.

    Args:
        comm: the communicator whose ranks form the world; ``MPI.COMM_WORLD`` if None. It is
            duplicated, so this transport's messages never match anyone else's.
        gpu_aware: pass device tensors to MPI directly instead of staging them through host
            memory. Only for an MPI built GPU-aware (e.g. Cray MPICH with
            ``MPIR_CVAR_ENABLE_GPU=1``, Intel MPI with ``I_MPI_OFFLOAD=1``).
        timeout_s: how long any collective may wait for a peer before it fails with
            :class:`TransportError` instead of hanging (see the module docstring).
    """

    def __init__(
        self, *, comm: MPI.Comm | None = None, gpu_aware: bool = False, timeout_s: float = 60.0
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._timeout_s = timeout_s
        base = MPI.COMM_WORLD if comm is None else comm
        base_rank = base.Get_rank()
        try:
            self._comm, request = base.Idup()
        except MPI.Exception as exc:
            raise TransportError(f"MPI communicator setup failed: {_one_line(exc)}") from exc
        peers = tuple(r for r in range(base.Get_size()) if r != base_rank)
        self._wait(request, f"MPI communicator setup on rank {base_rank}", peers)
        self._comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._gpu_aware = gpu_aware
        self._rank = self._comm.Get_rank()
        self._world_size = self._comm.Get_size()
        self._world = Group(tuple(range(self._world_size)))
        self._groups: dict[tuple[int, ...], Group] = {self._world.ranks: self._world}
        self._closed = False

    def _wait(self, request: MPI.Request, what: str, peers: tuple[int, ...]) -> None:
        _wait_until(request, time.monotonic() + self._timeout_s, self._timeout_s, what, peers)

    def _peers(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(r for r in ranks if r != self._rank)

    @property
    def name(self) -> str:
        return "mpi"

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def world(self) -> Group:
        return self._world

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")

    def new_group(self, ranks: Sequence[int]) -> Group:
        """Create (or return the cached) sub-group. Collective over the whole world.

        The group's communicator ranks its members in the order given; ranks outside the
        group get a Group whose handle is ``MPI.COMM_NULL``.
        """
        self._check_open()
        key = tuple(int(r) for r in ranks)
        if key in self._groups:
            return self._groups[key]
        check_group_ranks(key, self._world_size)
        # MPI_Comm_create blocks and has no nonblocking form: meet in a bounded barrier
        # first, so that a dead peer is caught here rather than inside Create.
        self._barrier(f"MPI new_group({list(key)}) on rank {self._rank}")
        world_group = self._comm.Get_group()
        sub_group = world_group.Incl(list(key))
        try:
            comm = self._comm.Create(sub_group)  # collective over the world, keeps the order
        except MPI.Exception as exc:
            raise TransportError(f"MPI new_group({list(key)}) failed: {_one_line(exc)}") from exc
        finally:
            sub_group.Free()
            world_group.Free()
        if comm != MPI.COMM_NULL:
            comm.Set_errhandler(MPI.ERRORS_RETURN)
        group = Group(key, handle=comm)
        self._groups[key] = group
        return group

    def all_to_all(
        self,
        send: Any,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        group: Group | None = None,
    ) -> _MpiHandle:
        """Start an all-to-all of rows of ``send`` (a torch tensor or a numpy array);
        see :meth:`transports.base.Transport.all_to_all`."""
        self._check_open()
        group = self._world if group is None else group
        send_rows = [int(n) for n in send_splits]
        recv_rows = [int(n) for n in recv_splits]
        check_all_to_all(self._rank, group, tuple(send.shape), send_rows, recv_rows)
        comm = self._comm if group.handle is None else group.handle

        if isinstance(send, np.ndarray):
            send_buf, recv_buf, row_bytes, finish = _numpy_buffers(send, sum(recv_rows))
        else:
            send_buf, recv_buf, row_bytes, finish = _torch_buffers(
                send, sum(recv_rows), self._gpu_aware
            )
        send_counts = [n * row_bytes for n in send_rows]
        recv_counts = [n * row_bytes for n in recv_rows]
        what = f"MPI all_to_all on rank {self._rank} over group {group.ranks}"
        try:
            request = comm.Ialltoallv(
                [send_buf, (send_counts, _displacements(send_counts)), MPI.BYTE],
                [recv_buf, (recv_counts, _displacements(recv_counts)), MPI.BYTE],
            )
        except MPI.Exception as exc:
            raise TransportError(f"{what} failed: {_one_line(exc)}") from exc
        return _MpiHandle(request, (send_buf, recv_buf), finish, what, self._timeout_s,
                          self._peers(group.ranks))

    def barrier(self) -> None:
        self._check_open()
        self._barrier(f"MPI barrier on rank {self._rank}")

    def _barrier(self, what: str) -> None:
        try:
            request = self._comm.Ibarrier()
        except MPI.Exception as exc:
            raise TransportError(f"{what} failed: {_one_line(exc)}") from exc
        self._wait(request, what, self._peers(self._world.ranks))

    def close(self) -> None:
        """Free the communicators made here. Idempotent; MPI itself is finalised by mpi4py
        at exit, since other code in the process may still use it."""
        if self._closed:
            return
        self._closed = True
        for group in self._groups.values():
            if group.handle is not None and group.handle != MPI.COMM_NULL:
                group.handle.Free()
        self._groups.clear()
        self._comm.Free()


def _displacements(counts: list[int]) -> list[int]:
    return [0, *accumulate(counts)][:-1]


def _numpy_buffers(
    send: np.ndarray, recv_rows: int
) -> tuple[np.ndarray, np.ndarray, int, Callable[[], Any]]:
    src = np.ascontiguousarray(send)
    trailing = src.shape[1:]
    out = np.empty((recv_rows, *trailing), dtype=src.dtype)
    row_bytes = math.prod(trailing) * src.dtype.itemsize
    # (n, *trailing) -> flat bytes, views of the same memory
    return src.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8), row_bytes, lambda: out


def _torch_buffers(
    send: Any, recv_rows: int, gpu_aware: bool
) -> tuple[Any, Any, int, Callable[[], Any]]:
    import torch

    device = send.device
    on_host = device.type == "cpu" or not gpu_aware
    src = send.contiguous()
    if device.type != "cpu":
        if on_host:
            src = src.cpu()  # staging copy; blocks until the device has produced it
        else:
            getattr(torch, device.type).synchronize(device)  # MPI reads the memory directly
    trailing = tuple(src.shape[1:])
    out = torch.empty((recv_rows, *trailing), dtype=src.dtype, device=src.device)
    row_bytes = math.prod(trailing) * src.element_size()
    # (n, *trailing) -> flat bytes, views of the same memory (numpy ones on the host)
    send_buf: Any = src.reshape(-1).view(torch.uint8)
    recv_buf: Any = out.reshape(-1).view(torch.uint8)
    if on_host:
        send_buf, recv_buf = send_buf.numpy(), recv_buf.numpy()

    def finish() -> Any:
        return out if out.device == device else out.to(device)

    return send_buf, recv_buf, row_bytes, finish

