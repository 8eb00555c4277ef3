"""Whether a late peer goes first: on the transport being calibrated, the second member
of a pair calls late, once to receive a one-way transfer and once for a pair exchange,
and each time its own call is timed.

Under gloo over TCP a transfer waits for its receiver's "ready", and a late member's
"ready" travels on their one connection behind its own data: the late member's data
goes first, the early member's only after it, so the late member's pair exchange takes
the two directions one after the other, twice its one-way transfer
(``bench/pair_lateness.py``: 1.83x the exchange with both on time). A transport that
sends both ways once both have called takes one transfer's time either way. The
verdict is ``[host] late_peer_first``, which the simulator's pair rule follows
(:meth:`transports.sim.SimWorld._launch_late_first`).

Only the late member's own call is timed: a time across the two members would hold
the barrier's spread between them, which on the emulated cluster reached a whole
exchange (with both "on time", a 20 ms exchange took 39 ms in every round of one
calibration: the members were out of step, so the exchange ran one way after the other;
a verdict against that exchange read 1.01x and wrote false).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from cocodiff.calibration.collect import gather_floats
from cocodiff.calibration.fits import LinkFit

# The late member's pair exchange over its one-way transfer, at or above which its data
# went first: the two directions one after the other take 2x, both at once 1x.
LATE_FIRST_RATIO = 1.5
POLL_S = 2e-4


# The late-peer measurement's transfer takes about this long: long beside the polling,
# short beside the calibration; its late member calls twice as long late, or this at
# least (past the barrier's spread between the members).
LATE_PEER_EXCHANGE_S = 0.02


def late_peer_sizes(fit: LinkFit, max_kib: int) -> tuple[int, float]:
    """Bytes each way of the late-peer measurement's transfers on a link fitted as
    ``fit`` (:data:`LATE_PEER_EXCHANGE_S` of its bandwidth, 64 KiB to ``max_kib``), and
    how late its second member calls: twice the fit's time for them, at least
    :data:`LATE_PEER_EXCHANGE_S`."""
    num_bytes = int(min(max(fit.bandwidth_gbps * 1e9 * LATE_PEER_EXCHANGE_S, 64 * 1024),
                        max_kib * 1024))
    transfer_s = fit.latency_us * 1e-6 + num_bytes / (fit.bandwidth_gbps * 1e9)
    return num_bytes, max(2 * transfer_s, LATE_PEER_EXCHANGE_S)


def exchange_time(transport, group, rows, delay_s: float = 0.0,
                  splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> float:
    """Seconds from now to the completion of this rank's exchange of ``rows`` over
    ``group`` (``splits``: rows sent to and received from each member; one each by
    default), called after sleeping ``delay_s``. The handle is polled, so the time is
    its completion, not when this rank looks."""
    send, receive = splits or ((1,) * group.size, (1,) * group.size)
    start = time.perf_counter()
    if delay_s:
        time.sleep(delay_s)
    handle = transport.all_to_all(rows, send, receive, group)
    while not handle.is_completed():
        time.sleep(POLL_S)
    handle.wait()
    return time.perf_counter() - start


@dataclass(frozen=True, slots=True)
class LatePeer:
    """The late member's own calls (medians over rounds), ``late_by_s`` after the
    early member's: receiving ``num_bytes`` one way (``one_way_s``) and exchanging
    ``num_bytes`` each way (``exchange_s``)."""

    num_bytes: int
    late_by_s: float
    one_way_s: float
    exchange_s: float

    @property
    def ratio(self) -> float:
        return self.exchange_s / self.one_way_s

    @property
    def late_peer_first(self) -> bool:
        return self.ratio >= LATE_FIRST_RATIO

    def describe(self) -> str:
        order = ("the late member's data went first, the early member's after it"
                 if self.late_peer_first else "both directions at once")
        return (f"a member calling {self.late_by_s * 1e3:.0f} ms late receives "
                f"{self.num_bytes / 1024:.0f} KiB one way in {self.one_way_s * 1e3:.1f} ms and "
                f"exchanges them both ways in {self.exchange_s * 1e3:.1f} ms "
                f"({self.ratio:.2f}x: {order})")

    def to_json(self) -> dict[str, Any]:
        return {"bytes_each_way": self.num_bytes, "late_by_s": self.late_by_s,
                "one_way_s": self.one_way_s, "exchange_s": self.exchange_s,
                "exchange_over_one_way": self.ratio, "late_peer_first": self.late_peer_first}


def measure_late_peer(transport, group, num_bytes: int, late_by_s: float,
                      rounds: int) -> LatePeer:
    """Time ``group``'s second member calling ``late_by_s`` after the first, ``rounds``
    times each: receiving ``num_bytes`` from the first member, then exchanging
    ``num_bytes`` each way with it (collective: every rank takes part in the barriers).
    ``late_by_s`` must be well past the barrier's spread between the members."""
    import torch

    width = max(num_bytes // 4, 1)
    first, second = group.ranks
    me = transport.rank
    # A one-way transfer: the first member's one row to the second.
    one_way = {first: (torch.zeros(1, width), ((0, 1), (0, 0))),
               second: (torch.zeros(0, width), ((0, 0), (1, 0)))}
    both = torch.zeros(2, width)

    def timed(rows, splits) -> list[float]:
        times = []
        for _ in range(rounds):
            transport.barrier()
            times.append(exchange_time(transport, group, rows, late_by_s, splits)
                         if me == second else
                         exchange_time(transport, group, rows, 0.0, splits)
                         if me == first else 0.0)
        return times

    timed(*one_way.get(me, (both, None)))  # a warm-up: the connection and buffers
    receiving = gather_floats(transport, timed(*one_way.get(me, (both, None))))
    exchanging = gather_floats(transport, timed(both, None))
    # The late member's own call, from its call: the sleep before it taken off.
    return LatePeer(width * 4, late_by_s, statistics.median(receiving[second]) - late_by_s,
                    statistics.median(exchanging[second]) - late_by_s)
