"""How much of a host's CPU a transfer across nodes takes from its ranks' compute: every
rank runs the same fixed loop of matrix products twice, once quiet and once while the
slowest pair's first member sends its second a one-way transfer, and the loops' wall
times say how many cores the host lost while the data was on the wire.

Why: on the emulated cluster (TCP through a ``tc`` shaped link between network
namespaces) the kernel handles the data packet by packet while it trickles through the
shaper, ahead of the ranks' threads, and every rank computing on the host slows, not only
the transfer's two ends (2 x 2 at 0.2 Gbit/s, 1 MB one way, 40 ms: the two ranks not in
the transfer, each on its own core, took 15 and 35 ms longer over a 136 ms loop; the
transfer's ends 15 and 29 ms). Idle, the same transfer costs the host a fifth of a core
(``/proc/stat``): the compute loses more than the packets' own CPU. A PipeFusion stage
computes its next patch while the last one crosses nodes, so the simulator, not charging
this, priced those steps short at 0.2 Gbit/s (docs/pipefusion.md). The verdict is
``[host] transfer_cores``, which the simulator takes from the host's cores while data of
its ranks crosses nodes (:meth:`sim.engine.Simulation.crossing`).

With ``R`` ranks computing on ``C`` cores (each a core at most), a host that loses ``s``
cores during a transfer of ``T`` seconds runs the loops meanwhile at
``min(R, C - s) / min(R, C)`` of their speed, stretching each by ``T`` times what they
lost; solved for ``s``: ``C - min(R, C) x (1 - stretch / T)`` (0 within the loops' noise).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from cocodiff.calibration.collect import gather_floats
from cocodiff.calibration.lateness import POLL_S
from cocodiff.calibration.model_shapes import LayerShapes

# The one-way transfer takes about this long at the fitted rate (long beside a loop's
# noise, short beside the calibration); the loop lasts this many times the transfer as
# timed alone, so that the transfer ends within it.
TRANSFER_S = 0.08
LOOP_OVER_TRANSFER = 1.5
TRIAL_CHUNKS = 20
# What the host keeps at least (the topology refuses a host left with no core).
KEPT_CORES = 0.1


@dataclass(frozen=True, slots=True)
class TransferLoad:
    """Every rank's fixed loop, quiet and with a one-way transfer across nodes in flight
    (medians over rounds, then over ranks).

    Attributes:
        num_bytes: the transfer's bytes.
        transfer_s: the transfer's time, from its post to the receiver seeing it done.
        quiet_s: the loop's wall time with no transfer.
        loaded_s: the same with the transfer in flight from the loop's start.
        noise_s: twice the standard error of the rounds' stretch (each round's loaded
            loop less the quiet one just before it; the spread by the median absolute
            deviation): a stretch within it says nothing.
        cores: the host's cores; ranks: ranks computing on it.
    """

    num_bytes: int
    transfer_s: float
    quiet_s: float
    loaded_s: float
    noise_s: float
    cores: float
    ranks: int

    @property
    def stretch_s(self) -> float:
        return self.loaded_s - self.quiet_s

    @property
    def transfer_cores(self) -> float:
        """Cores the host lost while the transfer ran (0 when the loop did not stretch
        past its noise; at most all but :data:`KEPT_CORES`)."""
        if self.stretch_s <= self.noise_s or self.transfer_s <= 0:
            return 0.0
        busy = min(float(self.ranks), self.cores)  # cores the loops keep busy
        slowed = max(0.0, 1.0 - self.stretch_s / self.transfer_s)  # their speed meanwhile
        return min(max(self.cores - busy * slowed, 0.0), self.cores - KEPT_CORES)

    def describe(self) -> str:
        return (f"every rank's loop took {self.quiet_s * 1e3:.1f} ms quiet and "
                f"{self.loaded_s * 1e3:.1f} ms while {self.num_bytes / 1024:.0f} KiB crossed "
                f"nodes one way in {self.transfer_s * 1e3:.1f} ms (noise "
                f"{self.noise_s * 1e3:.1f} ms): {self.transfer_cores:.2f} of "
                f"{self.cores:g} cores lost to the transfer")

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.num_bytes, "transfer_s": self.transfer_s,
                "quiet_s": self.quiet_s, "loaded_s": self.loaded_s, "noise_s": self.noise_s,
                "cores": self.cores, "ranks": self.ranks,
                "transfer_cores": self.transfer_cores}


def transfer_bytes(bandwidth_gbps: float, max_kib: int) -> int:
    """Bytes of a one-way transfer of :data:`TRANSFER_S` at ``bandwidth_gbps`` (GB/s),
    64 KiB to ``max_kib``."""
    return int(min(max(bandwidth_gbps * 1e9 * TRANSFER_S, 64 * 1024), max_kib * 1024))


def measure_transfer_load(transport, pair, shapes: LayerShapes, num_bytes: int,
                          cores: float, ranks: int, rounds: int) -> TransferLoad:
    """Time every rank's loop quiet and with ``pair``'s first member sending ``num_bytes``
    to its second, ``rounds`` times each, in turn (collective). The loop is the model's
    MLP matrix product on a rank's tokens (its caches as a step's), as many chunks as
    take :data:`LOOP_OVER_TRANSFER` times the transfer alone, every rank looping at
    once (rank 0's trial loop); the receiver looks at its transfer between chunks,
    so its time is the transfer's, not the loop's. The loaded loop's time is the quiet
    one's plus the median of each round's stretch (the two back to back: the machine's
    drift between rounds cancels)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    width = max(1, round(shapes.hidden_size * shapes.mlp_ratio))
    a = torch.randn(shapes.local_tokens, shapes.hidden_size, generator=gen)
    b = torch.randn(shapes.hidden_size, width, generator=gen)

    def chunk() -> None:
        (a @ b).relu_()

    first, second = pair.ranks
    me = transport.rank
    cols = max(num_bytes // 4, 1)

    def loop(chunks: int, transfer: bool) -> tuple[float, float]:
        """(the wall seconds of ``chunks`` chunks, the transfer's as this rank saw it: 0
        but on the receiver)."""
        handle = None
        began = time.perf_counter()
        if transfer and me == first:
            handle = transport.all_to_all(torch.zeros(1, cols), (0, 1), (0, 0), pair)
        elif transfer and me == second:
            handle = transport.all_to_all(torch.zeros(0, cols), (0, 0), (1, 0), pair)
        arrived = 0.0
        for _ in range(chunks):
            chunk()
            if handle is not None and not arrived and handle.is_completed():
                arrived = time.perf_counter() - began
        wall = time.perf_counter() - began
        if handle is not None:
            while not handle.is_completed():
                time.sleep(POLL_S)
            handle.wait()
            arrived = arrived or time.perf_counter() - began
        return wall, arrived if me == second else 0.0

    # The transfer alone (also a warm-up: the connection, the buffers) and a trial loop,
    # every rank at once, on rank 0 set every rank's count: the same loop everywhere.
    transport.barrier()
    alone_s = loop(0, True)[1]
    trials = []
    for _ in range(3):
        transport.barrier()
        trials.append(loop(TRIAL_CHUNKS, False)[0])
    shared = gather_floats(transport, [alone_s, statistics.median(trials)])
    count = max(1, round(LOOP_OVER_TRANSFER * shared[second][0] / shared[0][1]
                         * TRIAL_CHUNKS))
    quiet, loaded, seen = [], [], []
    for _ in range(rounds):
        transport.barrier()
        quiet.append(loop(count, False)[0])
        transport.barrier()
        wall, arrived = loop(count, True)
        loaded.append(wall)
        seen.append(arrived)
    stretches = [after - before for before, after in zip(quiet, loaded, strict=True)]
    middle = statistics.median(stretches)
    # The spread by the median absolute deviation (a round a neighbour burst into moves
    # it little), as a standard deviation's equivalent.
    spread = 1.4826 * statistics.median(abs(x - middle) for x in stretches)
    noise_s = 2 * spread / len(stretches) ** 0.5
    rows = gather_floats(transport, [statistics.median(quiet),
                                     statistics.median(quiet) + middle,
                                     noise_s, statistics.median(seen)])
    return TransferLoad(cols * 4, rows[second][3],
                        statistics.median(row[0] for row in rows),
                        statistics.median(row[1] for row in rows),
                        statistics.median(row[2] for row in rows), cores, ranks)
