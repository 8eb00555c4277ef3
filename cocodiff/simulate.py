"""Executing a plan in the simulator: the SimPy driver of :mod:`cocodiff.executor`.

Every simulated rank is a SimPy process that runs the shared executor; compute steps
take the cost model's roofline time on the rank's tile, exchanges go through the
simulated transport as flows on the topology's links.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from cocodiff.cost import roofline_seconds
from cocodiff.executor import Execution, run_program
from cocodiff.plan import Compute, Exchange, Plan
from sim import Simulation
from topology import TIERS, Placement, Topology
from transports.base import Group, VirtualBuffer
from transports.sim import SimHandle, SimTransport, SimWorld


class SimBackend:
    """Binds plan steps to simulated time on one rank's tile."""

    def __init__(self, transport: SimTransport, tile: str, record_spans: bool) -> None:
        self.transport = transport
        self.simulation = transport.simulation
        spec = self.simulation.topology.spec
        self._tflops = spec.tile_tflops
        self._memory_gbps = spec.tile_memory_gbps
        self._tile = tile
        self._track = f"rank {transport.rank}"
        self._record = record_spans
        self._groups: dict[tuple[int, ...], Group] = {}
        self._started: dict[str, float] = {}
        self.compute_s = 0.0

    def compute(self, step: Compute) -> SimHandle:
        duration_s = roofline_seconds(step.cost, self._tflops, self._memory_gbps)
        self.compute_s += duration_s
        if self._record:
            event = self.simulation.compute(self._tile, duration_s, self._track, step.op)
        else:
            event = self.simulation.env.timeout(duration_s)
        return SimHandle(event)

    def start_exchange(self, step: Exchange) -> SimHandle:
        group = self._groups.get(step.group)
        if group is None:
            group = self._groups[step.group] = self.transport.new_group(step.group)
        self._started[step.tensor] = self.simulation.now
        send = VirtualBuffer(sum(step.send_rows), step.row_bytes)
        return self.transport.all_to_all(send, step.send_rows, step.recv_rows, group)

    def finish_exchange(self, step: Exchange, received: VirtualBuffer) -> None:
        if self._record:
            start = self._started[step.tensor]
            self.simulation.timeline.add(
                self._track, f"a2a {step.tensor}", "comm", start, self.simulation.now
            )


@dataclass(frozen=True, slots=True)
class LinkUse:
    link: tuple[str, str]
    kind: str
    utilisation: float  # bytes carried / (capacity x step time)


@dataclass(slots=True)
class SimResult:
    """One simulated denoising step of one plan."""

    schedule: str
    num_ranks: int
    step_time_s: float
    compute_s: float  # on the slowest rank
    comm_exposed_s: float  # step time the slowest rank spends waiting for exchanges
    bytes_by_tier: dict[str, float]
    busiest_links: list[LinkUse]
    simulated_ranks: int
    folded: bool
    wall_s: float
    num_flows: int
    num_events: int
    simulation: Simulation | None = field(default=None, repr=False)

    @property
    def comm_share(self) -> float:
        return self.comm_exposed_s / self.step_time_s if self.step_time_s > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "schedule": self.schedule,
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "comm_exposed_s": self.comm_exposed_s,
            "comm_share": self.comm_share,
            "bytes_by_tier": dict(self.bytes_by_tier),
            "busiest_link": (
                {
                    "link": "->".join(self.busiest_links[0].link),
                    "kind": self.busiest_links[0].kind,
                    "utilisation": self.busiest_links[0].utilisation,
                }
                if self.busiest_links
                else None
            ),
            "simulated_ranks": self.simulated_ranks,
            "folded": self.folded,
            "sim_wall_s": self.wall_s,
            "sim_flows": self.num_flows,
            "sim_events": self.num_events,
        }


def simulate_plan(
    plan: Plan,
    topology: Topology,
    placement: Placement | None = None,
    fold: bool | None = None,
    record_spans: bool = False,
) -> SimResult:
    """Run one denoising step of ``plan`` on ``topology``.

    Args:
        plan: the plan (all ranks).
        topology: the machine.
        placement: rank -> tile; node-major over the first ``plan.num_ranks`` tiles
            by default.
        fold: simulate node 0 only and fold node-symmetric traffic (exact; see
            ``transports.sim``). Default: whenever plan and placement allow it.
        record_spans: keep per-rank compute/comm spans and link intervals on the
            timeline (for traces and plots).
    """
    wall_start = time.perf_counter()
    placement = placement or Placement.node_major(topology, plan.num_ranks)
    if placement.num_ranks != plan.num_ranks:
        raise ValueError(
            f"plan has {plan.num_ranks} ranks, placement {placement.num_ranks}"
        )
    fold_nodes = _fold_period_nodes(plan, topology, placement)
    if fold is None:
        fold = fold_nodes is not None
    elif fold and fold_nodes is None:
        raise ValueError("this plan and placement are not node-symmetric; cannot fold")
    simulation = Simulation(topology, record_link_intervals=record_spans)
    world = SimWorld(simulation, placement, fold_nodes=fold_nodes if fold else None)
    finish_s: dict[int, float] = {}
    backends: dict[int, SimBackend] = {}
    for rank in world.simulated_ranks:
        backend = SimBackend(world.transport(rank), placement.tile_of(rank), record_spans)
        backends[rank] = backend
        simulation.env.process(
            _rank_process(simulation, run_program(plan.program(rank), backend), rank, finish_s)
        )
    simulation.run()
    missing = [rank for rank in world.simulated_ranks if rank not in finish_s]
    if missing:
        raise RuntimeError(f"ranks {missing[:8]} never finished: a collective was not matched")
    slowest = max(finish_s, key=lambda rank: finish_s[rank])
    step_time_s = finish_s[slowest]
    compute_s = backends[slowest].compute_s
    if record_spans:
        simulation.record_link_spans()
    return SimResult(
        schedule=plan.schedule,
        num_ranks=plan.num_ranks,
        step_time_s=step_time_s,
        compute_s=compute_s,
        comm_exposed_s=max(0.0, step_time_s - compute_s),
        bytes_by_tier={tier: world.bytes_by_tier[tier] for tier in TIERS},
        busiest_links=_busiest_links(simulation, step_time_s),
        simulated_ranks=len(world.simulated_ranks),
        folded=world.folded,
        wall_s=time.perf_counter() - wall_start,
        num_flows=simulation.network.num_flows_started,
        num_events=simulation.env.events_processed,
        simulation=simulation,
    )


def _fold_period_nodes(plan: Plan, topology: Topology, placement: Placement) -> int | None:
    """The fewest whole nodes after which both the plan and the placement repeat, when
    fewer than all of them: those nodes are all the simulator needs to run."""
    if plan.shift_period is None or not placement.is_node_symmetric(topology):
        return None
    per_node = placement.ranks_per_node
    period_ranks = math.lcm(plan.shift_period, per_node)
    nodes = placement.num_ranks // per_node
    period_nodes = period_ranks // per_node
    if period_nodes >= nodes or nodes % period_nodes:
        return None
    return period_nodes


def _rank_process(simulation: Simulation, execution: Execution, rank: int,
                  finish_s: dict[int, float]):
    for handle in execution:
        yield handle.event
    finish_s[rank] = simulation.now


def _busiest_links(simulation: Simulation, step_time_s: float, top: int = 5) -> list[LinkUse]:
    if step_time_s <= 0:
        return []
    graph = simulation.topology.graph
    uses = [
        LinkUse(link, graph.edges[link]["kind"],
                stats.bytes_carried / (stats.capacity_bytes_per_s * step_time_s))
        for link, stats in simulation.network.stats.items()
        if stats.bytes_carried > 0
    ]
    uses.sort(key=lambda use: use.utilisation, reverse=True)
    return uses[:top]
