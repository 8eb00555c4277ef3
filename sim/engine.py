"""One simulation: a SimPy environment, a topology's links as a :class:`Network`,
one compute device per tile, the hosts' cores, and the timeline of what ran where.

Hosts. With a :class:`~topology.spec.HostSpec` the cores of each host are a second
:class:`Network`: one "link" per host of capacity ``cores`` (core-seconds per second),
and every CPU task (a rank's compute, an exchange's CPU work, a busy-poll) is a flow of
its core-seconds over its host's link, capped at what one task can use (at most a core).
Max-min sharing of one resource among capped flows is processor sharing: four one-core
tasks on two cores each run at half speed, two run at full speed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import simpy

from sim.network import FlowBatch, LinkId, Network
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
        self.network = Network(self.env, topology.link_table(),
                               record_intervals=record_link_intervals)
        self.timeline = Timeline()
        self._devices: dict[str, simpy.Resource] = {}
        self.host = topology.spec.host
        self.cpu: Network | None = None
        if self.host is not None:
            per_host = self.host.ranks_per_host or topology.spec.num_tiles
            num_hosts = -(-topology.spec.num_tiles // per_host)
            # One "link" per host, named as links are, of its cores' core-seconds per second.
            self.cpu = Network(self.env, {("host", h): self.host.cores for h in range(num_hosts)},
                               record_intervals=False)
        # CPU tasks (computes, exchanges' CPU, spinning waits) running on each host now.
        self._running: dict[int, int] = {}
        # Transfers across nodes in flight per host, of which its cores lose
        # [host] transfer_cores to the transport's work while there is one (crossing).
        self._crossing: dict[int, int] = {}

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

    def cpu_task(self, rank: int, work_core_s: float, max_cores: float = 1.0,
                 track: str | None = None, name: str = "") -> simpy.Event:
        """Run ``work_core_s`` core-seconds of CPU work for global ``rank`` on its host,
        at most ``max_cores`` at once, sharing the host's cores with every other task
        there; records a span on ``track`` when given. Needs a host."""
        host, cpu = self._host_cpu(rank)
        task = FlowBatch.build([([host], work_core_s, 1, 0.0, (0,))],
                               num_owners=1, max_rate=[max_cores])
        (done,) = cpu.start(task)
        if work_core_s > 0:  # a task of no work never holds a core
            self._count_running(host, 1)
            done.callbacks.append(lambda _e: self._count_running(host, -1))
        if track is not None:
            start = self.env.now
            done.callbacks.append(
                lambda _e: self.timeline.add(track, name, "compute", start, self.env.now))
        return done

    def crossing(self, rank: int, change: int) -> None:
        """A transfer across nodes with data of ``rank``'s starts (``change`` 1) or ends
        (-1). While its host has one, the host's cores lose ``[host] transfer_cores`` to
        the transport's work for the data on the wire (on the emulated cluster the
        kernel's packet handling through the shaped link, which runs before the ranks'
        tasks): every task there shares what is left."""
        host, cpu = self._host_cpu(rank)
        assert self.host is not None
        before = self._crossing.get(host, 0)
        self._crossing[host] = after = before + change
        if self.host.transfer_cores and (before > 0) != (after > 0):
            cores = self.host.cores - (self.host.transfer_cores if after > 0 else 0.0)
            cpu.set_capacity(("host", host), cores)

    def start_poll(self, rank: int) -> simpy.Event:
        """Keep one core of ``rank``'s host busy until :meth:`stop_poll` (a rank spinning
        on a progress engine while it waits); returns the token to stop it with."""
        host, cpu = self._host_cpu(rank)
        spin = FlowBatch.build([([host], float("inf"), 1, 0.0, (0,))],
                               num_owners=1, max_rate=[1.0])
        token = cpu.start_endless(spin)
        self._count_running(host, 1)
        token.callbacks.append(lambda _e: self._count_running(host, -1))
        return token

    def stop_poll(self, token: simpy.Event) -> None:
        assert self.cpu is not None, "no host in the topology"
        self.cpu.stop(token)

    def host_busy(self, rank: int) -> bool:
        """Whether every core of ``rank``'s host is taken now (as many CPU tasks running
        as it has cores): a rank woken then waits to be scheduled."""
        host, _cpu = self._host_cpu(rank)
        assert self.host is not None
        return self._running.get(host, 0) >= self.host.cores

    def _count_running(self, host: int, change: int) -> None:
        self._running[host] = self._running.get(host, 0) + change

    def _host_cpu(self, rank: int) -> tuple[int, Network]:
        """The index of ``rank``'s host among the network of the hosts' cores, and that
        network (a topology with a host)."""
        assert self.host is not None and self.cpu is not None, "no host in the topology"
        return self.host.host_of(rank), self.cpu

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
