"""One simulation: a SimPy environment, a topology's links as a :class:`Network`,
one compute device per tile, and the timeline of what ran where."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import simpy

from sim.network import LinkId, Network
from sim.timeline import Timeline

if TYPE_CHECKING:
    from topology import Topology


class CountingEnvironment(simpy.Environment):
    """A SimPy environment that counts the events it processes (for benchmarks)."""

    def __init__(self) -> None:
        super().__init__()
        self.events_processed = 0

    def step(self) -> None:
        self.events_processed += 1
        super().step()


class Simulation:
    """Everything that is shared by the simulated ranks of one run.

    Args:
        topology: the machine.
        record_link_intervals: keep per-link busy intervals for traces (costs memory on
            very large runs).
    """

    def __init__(self, topology: Topology, record_link_intervals: bool = True) -> None:
        self.env = CountingEnvironment()
        self.topology = topology
        self.network = Network(
            self.env,
            {link: bandwidth_gbps * 1e9 for link, bandwidth_gbps, _, _ in topology.links()},
            record_intervals=record_link_intervals,
        )
        self.timeline = Timeline()
        self._devices: dict[str, simpy.Resource] = {}

    @property
    def now(self) -> float:
        return self.env.now

    def compute(self, tile: str, duration_s: float, track: str, name: str) -> simpy.Process:
        """Run a task of ``duration_s`` on ``tile``; tasks on one tile run one at a time."""
        if tile not in self._devices:
            self._devices[tile] = simpy.Resource(self.env, capacity=1)
        return self.env.process(self._compute(self._devices[tile], duration_s, track, name))

    def _compute(self, device: simpy.Resource, duration_s: float, track: str, name: str):
        with device.request() as slot:
            yield slot
            start = self.env.now
            yield self.env.timeout(duration_s)
            self.timeline.add(track, name, "compute", start, self.env.now)

    def transfer(
        self,
        links: Iterable[LinkId],
        num_bytes: float,
        latency_s: float,
        count: int = 1,
        label: str = "",
    ) -> simpy.Event:
        """Move bytes over explicit links (see :meth:`Network.transfer`)."""
        return self.network.transfer(links, num_bytes, latency_s, count=count, label=label)

    def run(self, until: float | simpy.Event | None = None) -> None:
        self.env.run(until=until)
        self.network.finish()

    def record_link_spans(self) -> None:
        """Copy every link's busy intervals onto the timeline (one track per busy link)."""
        for (src, dst), stats in self.network.stats.items():
            for start, end in stats.busy_intervals:
                self.timeline.add(f"link {src}->{dst}", "busy", "link", start, end)
