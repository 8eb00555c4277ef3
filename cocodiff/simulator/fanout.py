"""Independent jobs spread over this machine's cores, or over the ranks of an MPI launch.

The planner's candidates and the sweep's configurations are independent, deterministic
simulations: where each one runs changes nothing in its result, so they can be spread
freely and gathered back in their own order.

* :func:`map_local` runs them in worker processes on the local cores (``fork`` where
  the platform has it, so the workers inherit the job's context without pickling it).
* :func:`map_mpi` gives rank ``r`` of ``size`` the jobs ``r, r + size, ...`` (each rank
  may fan its share out locally) and gathers every result on rank 0.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any

Job = Callable[[Any, Any], Any]  # (context, item) -> result
Progress = Callable[[int], None]  # called with the index of each finished item

# The job and its context inside a worker process: set once by the pool's initializer
# (a worker runs one job function for its whole life).
_WORKER: dict[str, Any] = {}


def local_cores() -> int:
    """Cores this process may run on (its CPU affinity where the platform tells)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def map_local(job: Job, context: Any, items: Sequence[Any], workers: int | None = None,
              progress: Progress | None = None) -> list[Any]:
    """``[job(context, item) for item in items]``, on up to ``workers`` processes.

    Args:
        job: a module-level function (workers started by ``spawn`` import it by name).
        context: what every call shares (model, topology, options); inherited by the
            workers, not sent with every item.
        items: one per call.
        workers: processes to use; default :func:`local_cores`. One runs in this process.
        progress: called in this process with each item's index as it finishes.

    Returns:
        The results in the order of ``items``.
    """
    workers = min(workers or local_cores(), len(items))
    results: list[Any] = []
    if workers <= 1:
        for index, item in enumerate(items):
            results.append(job(context, item))
            if progress is not None:
                progress(index)
        return results
    methods = multiprocessing.get_all_start_methods()
    start = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    results = [None] * len(items)
    with start.Pool(workers, initializer=_start_worker, initargs=(job, context)) as pool:
        # chunksize 1: jobs differ in cost by 10x and more, so hand them out one by one.
        for index, result in pool.imap_unordered(_run_item, enumerate(items), chunksize=1):
            results[index] = result
            if progress is not None:
                progress(index)
    return results


def map_mpi(comm: Any, job: Job, context: Any, items: Sequence[Any],
            workers: int | None = None, progress: Progress | None = None) -> list[Any] | None:
    """:func:`map_local` over this rank's share of ``items`` (``rank::size``); the
    results of all ranks gathered on rank 0 in the order of ``items`` (None elsewhere).

    ``progress`` sees this rank's items only (their indices in ``items``)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = list(range(rank, len(items), size))
    done = map_local(job, context, [items[i] for i in mine], workers,
                     None if progress is None else (lambda k: progress(mine[k])))
    gathered = comm.gather(list(zip(mine, done, strict=True)), root=0)
    if rank != 0:
        return None
    results: list[Any] = [None] * len(items)
    for share in gathered:
        for index, result in share:
            results[index] = result
    return results


def _start_worker(job: Job, context: Any) -> None:
    _WORKER["job"], _WORKER["context"] = job, context


def _run_item(indexed: tuple[int, Any]) -> tuple[int, Any]:
    index, item = indexed
    return index, _WORKER["job"](_WORKER["context"], item)
