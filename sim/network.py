"""Flows on links with max-min fair bandwidth sharing (SimGrid's fluid model).

A *flow* moves ``num_bytes`` over a fixed list of links. Every link's capacity is
shared max-min fairly among the flows crossing it (progressive filling / water
filling), and the allocation is recomputed whenever a flow starts or ends. A flow
first pays its path latency, then transfers at its allocated rate.

A flow may stand for ``count`` identical flows on the same links (a *bundle*): it
receives one member's rate and loads every link with ``count`` times that rate. The
simulated transport uses bundles so that an all-to-all over P ranks does not create
P^2 flows when many pairs share exactly the same links.

Invariant after every reallocation: for each link, sum(count * rate) over its flows
<= capacity (up to float rounding), and every flow is limited by at least one
saturated link on its path (that is what max-min fair means).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field

import simpy

LinkId = Hashable

# A flow is finished when less than this fraction of its bytes is left: rates times
# durations accumulate float rounding, and a completion timer must not fire twice.
_REL_EPS = 1e-9


@dataclass(slots=True, eq=False)
class Flow:
    links: tuple[LinkId, ...]
    num_bytes: float  # per member of the bundle
    count: int
    done: simpy.Event
    label: str
    remaining: float = 0.0
    rate: float = 0.0  # bytes/s per member
    started_at: float = 0.0


@dataclass(slots=True)
class LinkStats:
    """What one link carried during a simulation."""

    capacity_bytes_per_s: float
    bytes_carried: float = 0.0
    busy_s: float = 0.0
    peak_flows: int = 0
    busy_intervals: list[tuple[float, float]] = field(default_factory=list)


class Network:
    """The links of a topology and the flows currently crossing them.

    Args:
        env: the SimPy environment all processes share.
        capacities: bytes/s of each directed link.
        record_intervals: keep each link's busy intervals (for traces).
    """

    def __init__(
        self,
        env: simpy.Environment,
        capacities: Mapping[LinkId, float],
        record_intervals: bool = True,
    ) -> None:
        for link, capacity in capacities.items():
            if not capacity > 0:
                raise ValueError(f"link {link} has non-positive capacity {capacity} B/s")
        self.env = env
        self.stats: dict[LinkId, LinkStats] = {
            link: LinkStats(capacity) for link, capacity in capacities.items()
        }
        self._record_intervals = record_intervals
        self._flows: list[Flow] = []
        self._last_update = 0.0
        self._generation = 0  # invalidates completion timers made stale by a reallocation
        self._update_pending = False
        self._busy_since: dict[LinkId, float] = {}
        self.num_reallocations = 0
        self.num_flows_started = 0

    # -- public ---------------------------------------------------------------------

    def transfer(
        self,
        links: Iterable[LinkId],
        num_bytes: float,
        latency_s: float = 0.0,
        count: int = 1,
        label: str = "",
    ) -> simpy.Event:
        """Start moving ``num_bytes`` (per bundle member) over ``links``.

        Returns:
            An event that succeeds when the last byte has arrived.
        """
        links = tuple(links)
        unknown = [link for link in links if link not in self.stats]
        if unknown:
            raise KeyError(f"flow {label!r} crosses unknown link {unknown[0]}")
        if num_bytes < 0 or count < 1 or latency_s < 0:
            raise ValueError(
                f"flow {label!r}: bytes {num_bytes}, count {count}, latency {latency_s} s"
            )
        done = self.env.event()
        flow = Flow(links, float(num_bytes), count, done, label, remaining=float(num_bytes))
        self.num_flows_started += 1
        if latency_s > 0:
            self.env.timeout(latency_s).callbacks.append(lambda _event: self._admit(flow))
        else:
            self._admit(flow)
        return done

    @property
    def active_flows(self) -> int:
        return len(self._flows)

    def finish(self) -> None:
        """Close the busy intervals still open at the end of a simulation."""
        now = self.env.now
        for link, since in self._busy_since.items():
            self._close_interval(link, since, now)
        self._busy_since.clear()

    # -- internals ------------------------------------------------------------------

    def _admit(self, flow: Flow) -> None:
        if flow.num_bytes == 0 or not flow.links:
            # Nothing to share: a zero-byte message or a rank sending to itself.
            flow.done.succeed()
            return
        self._advance()
        flow.started_at = self.env.now
        self._flows.append(flow)
        self._request_update()

    def _request_update(self) -> None:
        # Flows admitted at the same instant are batched into one reallocation: the
        # zero-delay timer runs after the processes already scheduled for this instant.
        if not self._update_pending:
            self._update_pending = True
            self.env.timeout(0).callbacks.append(self._update)

    def _update(self, _event: simpy.Event | None = None) -> None:
        self._update_pending = False
        self._advance()
        self._complete_finished()
        self._reallocate()
        self._schedule_next_completion()

    def _advance(self) -> None:
        """Move every flow forward to ``env.now`` at its current rate."""
        now = self.env.now
        elapsed = now - self._last_update
        if elapsed > 0:
            for flow in self._flows:
                moved = min(flow.remaining, flow.rate * elapsed)
                flow.remaining -= moved
                carried = moved * flow.count
                for link in flow.links:
                    self.stats[link].bytes_carried += carried
        self._last_update = now

    def _complete_finished(self) -> None:
        still_running = []
        for flow in self._flows:
            if flow.remaining <= _REL_EPS * flow.num_bytes:
                flow.done.succeed()
            else:
                still_running.append(flow)
        self._flows = still_running

    def _reallocate(self) -> None:
        """Max-min fair rates by progressive filling.

        Repeatedly find the link whose remaining capacity divided by the number of
        unfrozen flow members crossing it is smallest; that fair share is the rate
        of every unfrozen flow on it. Freeze them and charge their links.
        """
        self.num_reallocations += 1
        residual: dict[LinkId, float] = {}
        members: dict[LinkId, int] = {}
        flows_on: dict[LinkId, list[Flow]] = {}
        for flow in self._flows:
            for link in flow.links:
                if link not in residual:
                    residual[link] = self.stats[link].capacity_bytes_per_s
                    members[link] = 0
                    flows_on[link] = []
                members[link] += flow.count
                flows_on[link].append(flow)
        unfrozen = set(map(id, self._flows))
        while unfrozen:
            share, bottleneck = min(
                (residual[link] / members[link], link) for link in residual if members[link] > 0
            )
            for flow in flows_on[bottleneck]:
                if id(flow) not in unfrozen:
                    continue
                unfrozen.discard(id(flow))
                flow.rate = share
                for link in flow.links:
                    residual[link] = max(0.0, residual[link] - share * flow.count)
                    members[link] -= flow.count
        self._record_busy(flows_on)

    def _record_busy(self, flows_on: Mapping[LinkId, list[Flow]]) -> None:
        now = self.env.now
        for link, flows in flows_on.items():
            stats = self.stats[link]
            stats.peak_flows = max(stats.peak_flows, sum(f.count for f in flows))
            if link not in self._busy_since:
                self._busy_since[link] = now
        for link in [link for link in self._busy_since if link not in flows_on]:
            self._close_interval(link, self._busy_since.pop(link), now)

    def _close_interval(self, link: LinkId, start: float, end: float) -> None:
        stats = self.stats[link]
        stats.busy_s += end - start
        if self._record_intervals and end > start:
            stats.busy_intervals.append((start, end))

    def _schedule_next_completion(self) -> None:
        self._generation += 1
        if not self._flows:
            return
        rated = [flow.remaining / flow.rate for flow in self._flows if flow.rate > 0]
        if not rated:
            raise RuntimeError(f"{len(self._flows)} flows stalled with zero rate")
        delay = min(rated)
        generation = self._generation

        def on_timer(_event: simpy.Event) -> None:
            if generation == self._generation:
                self._update()

        self.env.timeout(max(delay, 0.0)).callbacks.append(on_timer)
