"""Transport conformance checks, run inside every rank of a real multi-process job.

Started by ``tests/transports/test_transports_real.py``::

    torchrun --standalone --nproc-per-node N tests/transports/transport_worker.py \
        --backend torch ...
    mpiexec -n N python tests/transports/transport_worker.py --backend mpi ...

Each rank prints ``conformance passed on rank R`` and exits 0 when every check holds; a
failed check raises (non-zero exit, and the launcher stops the other ranks).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from transports import LaunchInfo, Transport, TransportError, create_transport, detect_launch
from transports.base import Group, Handle
from transports.registry import auto_transport_name

TRAILING = (2, 3)  # every buffer is (rows, 2, 3): splits count rows of dim 0


def rows(src: int, dst: int, salt: int) -> int:
    """Rows global rank ``src`` sends to ``dst``: uneven, and zero for some pairs."""
    return (src + 2 * dst + salt) % 4


def block(src: int, dst: int, salt: int, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``src`` sends ``dst``: every value says who sent it to whom, and which row."""
    base = torch.arange(num_rows * 6, dtype=torch.float32).reshape(num_rows, *TRAILING)
    return (base + 100 * src + 10 * dst + salt / 4).to(dtype)


def start(
    transport: Transport,
    group: Group,
    salt: int,
    dtype: torch.dtype = torch.float32,
    rows_fn: Callable[[int, int, int], int] = rows,
    convert: Callable[[torch.Tensor], Any] = lambda t: t,
) -> tuple[Any, torch.Tensor]:
    """Start one all-to-all over ``group``; return its handle and the rows it must deliver."""
    me = transport.rank
    send_splits = [rows_fn(me, dst, salt) for dst in group.ranks]
    recv_splits = [rows_fn(src, me, salt) for src in group.ranks]
    # (sum send_splits, 2, 3), blocks in group-rank order of destination
    send = torch.cat([block(me, dst, salt, rows_fn(me, dst, salt), dtype) for dst in group.ranks])
    handle = transport.all_to_all(convert(send), send_splits, recv_splits, group)
    expected = torch.cat(
        [block(src, me, salt, rows_fn(src, me, salt), dtype) for src in group.ranks]
    )
    return handle, expected


def assert_rows(received: Any, expected: torch.Tensor, what: str) -> None:
    if isinstance(received, np.ndarray):
        received = torch.from_numpy(received)
    assert received.dtype == expected.dtype, f"{what}: dtype {received.dtype}"
    assert received.shape == expected.shape, f"{what}: shape {received.shape} != {expected.shape}"
    assert torch.equal(received, expected), f"{what}: wrong rows\n{received}\n!= {expected}"


def check_identity(t: Transport, world: int, launcher: str) -> None:
    info: LaunchInfo = detect_launch()
    assert isinstance(t, Transport), f"{type(t).__name__} does not satisfy Transport"
    assert info.launcher == launcher, f"launcher {info.launcher} != {launcher}"
    assert t.world_size == world == info.world_size, f"world {t.world_size} != {world}"
    assert t.rank == info.rank, f"rank {t.rank} != launcher rank {info.rank}"
    assert t.world.ranks == tuple(range(world))
    mpi = launcher == "mpiexec" and sys.modules.get("mpi4py", True) is not None
    assert auto_transport_name() == ("mpi" if mpi else "torch"), auto_transport_name()


def check_uneven(t: Transport) -> None:
    for salt, dtype in ((0, torch.float32), (1, torch.bfloat16), (3, torch.float32)):
        handle, expected = start(t, t.world, salt, dtype)
        assert isinstance(handle, Handle), f"{type(handle).__name__} does not satisfy Handle"
        assert_rows(handle.wait(), expected, f"uneven {dtype} salt {salt}")
        assert handle.is_completed()


def check_zero_sizes(t: Transport) -> None:
    handle, expected = start(t, t.world, 0, rows_fn=lambda s, d, salt: 0)
    assert_rows(handle.wait(), expected, "all splits zero")
    # rank 0 sends nothing and receives one row from each other rank
    handle, expected = start(t, t.world, 0, rows_fn=lambda s, d, salt: int(s != 0))
    assert_rows(handle.wait(), expected, "rank 0 sends nothing")


def check_subgroups(t: Transport) -> None:
    world = t.world_size
    pairs = [(r, r + 1) for r in range(0, world, 2)]
    # Every rank creates every group, in the same order: new_group is collective.
    groups = [t.new_group(p) for p in pairs]
    groups += [t.new_group(p[::-1]) for p in pairs]  # members not in ascending order
    groups.append(t.new_group(tuple(reversed(range(world)))))
    assert t.new_group(pairs[0]) is groups[0], "new_group is not cached"
    for salt, group in enumerate(groups):
        if t.rank not in group.ranks:
            continue
        assert group.group_rank(t.rank) == group.ranks.index(t.rank)
        handle, expected = start(t, group, salt)
        assert_rows(handle.wait(), expected, f"group {group.ranks}")
        handle, expected = start(t, group, salt, torch.bfloat16)
        assert_rows(handle.wait(), expected, f"group {group.ranks} bfloat16")
    other = next((g for g in groups[: len(pairs)] if t.rank not in g.ranks), None)
    if other is not None:
        try:
            t.all_to_all(torch.zeros(0, *TRAILING), [0, 0], [0, 0], other)
        except ValueError as exc:
            assert "not in group" in str(exc)
        else:
            raise AssertionError("all_to_all over a group without this rank did not raise")
    t.barrier()


def check_in_flight(t: Transport) -> None:
    pair = t.new_group((t.rank // 2 * 2, t.rank // 2 * 2 + 1))
    first, first_expected = start(t, t.world, 5)
    second, second_expected = start(t, pair, 6, torch.bfloat16)
    third, third_expected = start(t, t.world, 7)
    assert_rows(third.wait(), third_expected, "third of three in flight")
    assert_rows(second.wait(), second_expected, "second of three in flight")
    assert_rows(first.wait(), first_expected, "first of three in flight")


def check_wait_twice(t: Transport) -> None:
    handle, _ = start(t, t.world, 0)
    handle.wait()
    assert handle.is_completed()
    try:
        handle.wait()
    except TransportError as exc:
        assert "twice" in str(exc)
    else:
        raise AssertionError("second wait() did not raise TransportError")


def check_bad_arguments(t: Transport) -> None:
    send = torch.zeros(3, *TRAILING)
    bad_calls = {
        "too few splits": ([3], [0] * t.world_size),
        "wrong sum": ([1] * t.world_size, [1] * t.world_size),
    }
    for what, (send_splits, recv_splits) in bad_calls.items():
        try:
            t.all_to_all(send, send_splits, recv_splits)
        except ValueError:
            continue
        raise AssertionError(f"{what}: no ValueError")


def check_numpy(t: Transport) -> None:
    """The MPI backend also takes numpy arrays and returns numpy arrays."""
    handle, expected = start(t, t.world, 2, convert=lambda x: x.numpy())
    received = handle.wait()
    assert isinstance(received, np.ndarray), type(received)
    assert_rows(received, expected, "numpy all_to_all")


def check_close(t: Transport) -> None:
    t.barrier()
    t.close()
    t.close()  # idempotent
    try:
        t.barrier()
    except TransportError:
        return
    raise AssertionError("barrier after close() did not raise TransportError")


def check_hung_peer(t: Transport, timeout_s: float) -> None:
    """A peer that never joins the collective makes it fail within the timeout."""
    if t.rank != 0:
        time.sleep(timeout_s + 1)  # alive but silent, then gone
        return
    began = time.monotonic()
    handle, _ = start(t, t.world, 0)
    try:
        handle.wait()
    except TransportError as exc:
        elapsed = time.monotonic() - began
        assert "\n" not in str(exc), f"message is not one line: {exc!r}"
        assert elapsed < timeout_s + 2, f"failed after {elapsed:.1f} s, timeout {timeout_s} s"
        print(f"hung peer: TransportError after {elapsed:.1f} s: {exc}", flush=True)
    else:
        raise AssertionError("all_to_all with a silent peer did not raise")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--launcher", required=True)
    parser.add_argument(
        "--no-mpi4py", action="store_true", help="hide mpi4py: torch rendezvous via a FileStore"
    )
    parser.add_argument(
        "--hung-peer",
        type=float,
        metavar="TIMEOUT_S",
        help="instead of the conformance checks: ranks > 0 stay silent, rank 0 must fail",
    )
    args = parser.parse_args(argv)
    if args.no_mpi4py:
        sys.modules["mpi4py"] = None  # type: ignore[assignment]  # makes imports fail

    timeout_s = 20.0 if args.hung_peer is None else args.hung_peer
    kwargs: dict[str, Any] = {"timeout_s": timeout_s} if args.backend == "torch" else {}
    t = create_transport(args.backend, **kwargs)
    if args.hung_peer is not None:
        check_hung_peer(t, timeout_s)
        return 0  # without close(): the transport must still let the process exit cleanly
    assert t.name == args.backend, f"{t.name} != {args.backend}"
    check_identity(t, args.world, args.launcher)
    check_uneven(t)
    check_zero_sizes(t)
    check_subgroups(t)
    check_in_flight(t)
    check_wait_twice(t)
    check_bad_arguments(t)
    if args.backend == "mpi":
        check_numpy(t)
    rank = t.rank
    check_close(t)
    print(f"conformance passed on rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
