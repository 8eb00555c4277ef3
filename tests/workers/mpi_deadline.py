"""One rank of the MPI deadline check: every rank but 0 stays silent, and rank 0's
all-to-all, barrier and new_group must each raise TransportError within the timeout,
naming what it waited for.

Usage: mpi_deadline.py TIMEOUT_S. Prints one "deadline ok" line per check on rank 0.
Both ranks leave with os._exit: after a timed-out collective MPI_Finalize may wait for the
silent peer (cocodiff run calls MPI_Abort instead).
"""

import os
import sys
import time

import numpy as np

from transports.base import TransportError
from transports.mpi import MpiTransport


def expect_timeout(what, call, timeout_s):
    began = time.monotonic()
    try:
        call()
    except TransportError as error:
        elapsed = time.monotonic() - began
        message = str(error)
        assert "\n" not in message, message
        assert "timed out" in message and "rank 1" in message, message
        assert timeout_s <= elapsed < timeout_s + 2, f"{what}: {elapsed:.2f} s"
        print(f"deadline ok: {what} after {elapsed:.2f} s: {message}", flush=True)
        return
    raise AssertionError(f"{what} with a silent peer did not raise")


def main():
    timeout_s = float(sys.argv[1])
    transport = MpiTransport(timeout_s=timeout_s)
    if transport.rank != 0:
        time.sleep(3 * timeout_s + 3)  # alive but silent, then gone
        os._exit(0)
    send = np.arange(8, dtype=np.float32).reshape(4, 2)  # (rows, 2)
    splits = [2, 2]
    expect_timeout("all_to_all", lambda: transport.all_to_all(send, splits, splits).wait(),
                   timeout_s)
    expect_timeout("barrier", transport.barrier, timeout_s)
    expect_timeout("new_group", lambda: transport.new_group([1, 0]), timeout_s)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
