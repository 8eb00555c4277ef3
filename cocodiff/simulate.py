"""Executing a plan in the simulator: the SimPy driver of :mod:`cocodiff.executor`.

Every simulated rank is a SimPy process that runs the shared executor; compute steps
take the cost model's roofline time on the rank's tile, exchanges go through the
simulated transport as flows on the topology's links.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import simpy

from cocodiff.bounds import plan_bound_s
from cocodiff.cost import roofline_seconds
from cocodiff.executor import Execution, run_program
from cocodiff.layout import ParallelLayout
from cocodiff.models import ModelSpec
from cocodiff.plan import Compute, Exchange, Phase, Plan, RankProgram
from cocodiff.schedules import (
    STEP_DEPENDENT,
    RankGrid,
    VMajorOptions,
    get_schedule,
)
from cocodiff.schedules.activity import ActivityTrace, plan_from_activity
from cocodiff.schedules.hybrid import plan_hybrid
from cocodiff.schedules.vmajor import message_bytes
from sim import Simulation
from sim.timeline import merged_length
from topology import TIERS, Placement, Topology
from transports.base import Group, VirtualBuffer
from transports.sim import (
    CollectiveModel,
    SimHandle,
    SimTransport,
    SimWorld,
    collective_model_for,
)


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
        self._splits: dict[tuple, tuple] = {}
        self.compute_s = 0.0
        self.exchange_intervals: list[tuple[float, float]] = []  # start -> arrival

    def compute(self, step: Compute) -> SimHandle:
        duration_s = roofline_seconds(step.cost, self._tflops, self._memory_gbps)
        self.compute_s += duration_s
        if self._record:
            event = self.simulation.compute(self._tile, duration_s, self._track, step.op)
        else:
            event = self.simulation.env.timeout(duration_s)
        return SimHandle(event)

    def _group(self, ranks: tuple[int, ...]) -> Group:
        group = self._groups.get(ranks)
        if group is None:
            group = self._groups[ranks] = self.transport.new_group(ranks)
        return group

    def start_exchange(self, step: Exchange) -> SimHandle:
        self._started[step.tensor] = self.simulation.now
        if step.phases:
            env = self.simulation.env
            return SimHandle(env.process(self._phased(step)))
        send = VirtualBuffer(sum(step.send_rows), step.row_bytes)
        return self.transport.all_to_all(send, step.send_rows, step.recv_rows,
                                         self._group(step.group), tag=step.tensor)

    def _chunk_splits(self, step: Exchange, phase, chunk: int) -> tuple[list[int], list[int]]:
        """Bytes to and from each member for one chunk of one phase (layers repeat the
        same phase objects, so this is computed once per phase and chunk)."""
        key = (id(phase), chunk, step.chunks, step.row_bytes)
        cached = self._splits.get(key)
        if cached is None:
            def split(rows_per_member):
                return [_chunk_bytes(rows, chunk, step.chunks, step.row_bytes, phase)
                        for rows in rows_per_member]

            send, recv = split(phase.send_rows), split(phase.recv_rows)
            cached = self._splits[key] = (phase, send, recv)  # keeps the phase alive
        return cached[1], cached[2]

    def _phased(self, step: Exchange):
        """The phases of a TAPA exchange, the rows cut into chunks that flow through
        the phases as a pipeline: chunk c enters phase p once it has left phase p-1
        and chunk c-1 has left phase p."""
        env = self.simulation.env
        left = {(c, p): env.event() for c in range(step.chunks) for p in range(len(step.phases))}

        def chunk(c: int):
            for p, phase in enumerate(step.phases):
                if c > 0:
                    yield left[(c - 1, p)]
                send, recv = self._chunk_splits(step, phase, c)
                handle = self.transport.all_to_all(
                    VirtualBuffer(sum(send), 1), send, recv, self._group(phase.group),
                    tag=(step.tensor, c, p),
                )
                yield handle.event
                handle.wait()
                left[(c, p)].succeed()

        yield simpy.AllOf(env, [env.process(chunk(c)) for c in range(step.chunks)])

    def finish_exchange(self, step: Exchange, received: VirtualBuffer) -> None:
        start = self._started[step.tensor]
        self.exchange_intervals.append((start, self.simulation.now))
        if self._record:
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
    exchange_s: float = 0.0  # time the slowest rank has an exchange in flight
    bound_s: float = 0.0  # the topology's lower bound for the same exchanges
    step_times_s: list[float] = field(default_factory=list)  # per denoising step
    simulation: Simulation | None = field(default=None, repr=False)

    @property
    def efficiency(self) -> float:
        """Lower bound over simulated exchange time (1 = as fast as the links allow)."""
        return self.bound_s / self.exchange_s if self.exchange_s > 0 else 1.0

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
            "exchange_s": self.exchange_s,
            "bound_s": self.bound_s,
            "efficiency": self.efficiency,
            "step_times_s": self.step_times_s or [self.step_time_s],
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
    collective: CollectiveModel | None = None,
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
        collective: how collectives are carried out beyond the wire; by default the
            model of the topology's preset (``transports.sim.COLLECTIVE_MODELS``).
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
    collective = collective or collective_model_for(topology.spec.name)
    world = SimWorld(simulation, placement, fold_nodes=fold_nodes if fold else None,
                     collective=collective)
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
        # Concurrent exchanges (V-First) count once: the time any exchange is in flight.
        exchange_s=merged_length(backends[slowest].exchange_intervals),
        simulation=simulation,
    )


def _with_layers(plan: Plan, num_layers: int) -> Plan:
    return replace(plan, programs=tuple(RankProgram(p.rank, p.layers[:num_layers])
                                        for p in plan.programs))


def _repeats_one_layer(plan: Plan) -> bool:
    """Whether every layer of every rank is the same object (schedulers share it)."""
    return all(all(layer is p.layers[0] for layer in p.layers) for p in plan.programs)


def simulate_layers(
    plan: Plan,
    topology: Topology,
    placement: Placement | None = None,
    collective: CollectiveModel | None = None,
    num_layers: int | None = None,
) -> SimResult:
    """:func:`simulate_plan`'s result for a plan whose layers are all the same, from a
    one-layer and a two-layer simulation.

    Every layer ends with exchanges that resynchronise the ranks, so everything a step
    accumulates is affine in its number of layers ``L`` after the first:
    ``x(L) = x(1) + (L - 1) * (x(2) - x(1))`` for the step time, the slowest rank's
    compute and exchange time, and the bytes on every tier and link.
    ``tests/test_simulate.py`` checks every field against the full simulation. A plan
    of two layers or fewer, or with layers that differ, is simulated in full. The
    result holds no :class:`Simulation` (traces and plots need the full one).

    ``num_layers``: the step's layer count when ``plan`` holds only its first layers
    (at least two, all the same; the planner builds such plans, which is faster).
    """
    held = len(plan.program(0).layers)
    num_layers = num_layers or held
    repeats = _repeats_one_layer(plan)
    if num_layers != held and not (repeats and held >= min(num_layers, 2)):
        raise ValueError(f"a plan of {held} layers stands for {num_layers} only when it "
                         "repeats one layer at least twice")
    if num_layers <= 2 or not repeats:
        return simulate_plan(_with_layers(plan, num_layers) if held != num_layers else plan,
                             topology, placement, collective=collective)
    one, two = (simulate_plan(_with_layers(plan, k), topology, placement, collective=collective)
                for k in (1, 2))
    extra = num_layers - 1

    def affine(first: float, second: float) -> float:
        return first + extra * (second - first)

    step_time_s = affine(one.step_time_s, two.step_time_s)
    compute_s = affine(one.compute_s, two.compute_s)
    links_one, links_two = (
        {link: s.bytes_carried for link, s in r.simulation.network.stats.items()}
        for r in (one, two)
    )
    return SimResult(
        schedule=plan.schedule,
        num_ranks=plan.num_ranks,
        step_time_s=step_time_s,
        compute_s=compute_s,
        comm_exposed_s=max(0.0, step_time_s - compute_s),
        bytes_by_tier={tier: affine(one.bytes_by_tier[tier], two.bytes_by_tier[tier])
                       for tier in TIERS},
        busiest_links=_busiest_links(
            two.simulation, step_time_s,
            bytes_carried={link: affine(links_one[link], num_bytes)
                           for link, num_bytes in links_two.items()}),
        simulated_ranks=two.simulated_ranks,
        folded=two.folded,
        wall_s=one.wall_s + two.wall_s,
        num_flows=one.num_flows + two.num_flows,
        num_events=one.num_events + two.num_events,
        exchange_s=affine(one.exchange_s, two.exchange_s),
    )


def simulate_schedule(
    name: str,
    spec: ModelSpec,
    topology: Topology,
    placement: Placement,
    stream_tokens: Sequence[int],
    num_steps: int,
    *,
    chunks: int | None = None,
    vmajor: VMajorOptions | None = None,
    collective: CollectiveModel | None = None,
    record_spans: bool = False,
    with_bound: bool = True,
    activity: ActivityTrace | None = None,
    parallel: ParallelLayout | None = None,
    batch: int = 1,
    known: SimResult | None = None,
) -> SimResult:
    """Simulate a schedule over a whole generation of ``num_steps`` denoising steps.

    Most schedules do the same thing every step, so one step is simulated. V-Major's
    plan changes with the step's cache ratio: ratios are rounded to multiples of
    :data:`RATIO_RESOLUTION`, each distinct one is simulated once, and the step times
    are averaged over the steps (``step_times_s`` lists them all). With an ``activity``
    trace, V-Major's selection is the recorded one, step by step. With ``parallel`` (a
    Ulysses x Ring x batch layout) the schedule runs inside each Ulysses group
    (:func:`cocodiff.schedules.hybrid.plan_hybrid`); ``batch`` is the samples per step.
    A step is simulated by :func:`simulate_layers` (one and two layers, extrapolated),
    except the one a trace or plot records (``record_spans``), which runs in full.
    ``known``: that simulated step of this schedule's one plan, when the caller already
    has it (the planner simulated it to choose ``parallel``); then it is not run again.
    """
    wall_start = time.perf_counter()
    grid = RankGrid.from_placement(topology, placement)
    kwargs = {} if name == "flat" or chunks is None else {"chunks": chunks}
    by_plan: dict[float, SimResult] = {}
    per_step: list[SimResult] = []
    if parallel is not None:
        if activity is not None:
            raise ValueError("an activity trace replays a pure-Ulysses run; it cannot drive "
                             "a parallel layout")
        scheduler = partial(plan_hybrid, name, parallel=parallel, batch=batch)
        flat_scheduler = partial(plan_hybrid, "flat", parallel=parallel, batch=batch)
    else:
        scheduler = partial(get_schedule(name), batch=batch)
        flat_scheduler = partial(get_schedule("flat"), batch=batch)
    if activity is not None and name in STEP_DEPENDENT:
        for step in range(activity.num_steps):
            plan = plan_from_activity(spec, grid, stream_tokens, activity, step,
                                      chunks=chunks or 1)
            by_plan[float(step)] = simulate_layers(plan, topology, placement, collective)
            per_step.append(by_plan[float(step)])
    for step in range(num_steps if name in STEP_DEPENDENT and activity is None else
                      0 if per_step else 1):
        ratio = (vmajor or VMajorOptions()).cache_ratio(step, num_steps)
        key = round(ratio / RATIO_RESOLUTION) * RATIO_RESOLUTION
        if key not in by_plan:
            if name in STEP_DEPENDENT:
                kwargs |= {"cache_ratio": key,
                           "slow_levels": (vmajor or VMajorOptions()).slow_levels}
            if known is not None and name not in STEP_DEPENDENT and not record_spans:
                by_plan[key] = known
            elif record_spans and not by_plan:  # the trace and the plot show this one
                by_plan[key] = simulate_plan(scheduler(spec, grid, stream_tokens, **kwargs),
                                             topology, placement, collective=collective,
                                             record_spans=True)
            else:
                by_plan[key] = simulate_layers(scheduler(spec, grid, stream_tokens, **kwargs),
                                               topology, placement, collective)
        per_step.append(by_plan[key])
    first = per_step[0]
    result = SimResult(
        schedule=name,
        num_ranks=first.num_ranks,
        step_time_s=_mean(r.step_time_s for r in per_step),
        compute_s=_mean(r.compute_s for r in per_step),
        comm_exposed_s=_mean(r.comm_exposed_s for r in per_step),
        bytes_by_tier={tier: _mean(r.bytes_by_tier[tier] for r in per_step) for tier in TIERS},
        busiest_links=first.busiest_links,
        simulated_ranks=first.simulated_ranks,
        folded=first.folded,
        wall_s=0.0,
        num_flows=sum(r.num_flows for r in by_plan.values()),
        num_events=sum(r.num_events for r in by_plan.values()),
        exchange_s=_mean(r.exchange_s for r in per_step),
        step_times_s=[r.step_time_s for r in per_step],
        simulation=first.simulation,
    )
    if with_bound:
        flat = flat_scheduler(spec, grid, stream_tokens)
        result.bound_s = plan_bound_s(flat, topology, placement)
    result.wall_s = time.perf_counter() - wall_start
    return result


# V-Major's cache ratios are simulated at this resolution (5 distinct plans at most).
RATIO_RESOLUTION = 1 / 4


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


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


def _chunk_bytes(rows: int, chunk: int, chunks: int, row_bytes: int, phase: Phase) -> int:
    """Bytes of chunk ``chunk`` of ``rows`` rows (rows split as evenly as possible) in
    ``phase``: all of them, or a selective (V-Major) phase's message."""
    base, extra = divmod(rows, chunks)
    chunk_rows = base + (1 if chunk < extra else 0)
    if not phase.selective:
        return chunk_rows * row_bytes
    per_row = phase.blocks_per_row
    return message_bytes(chunk_rows * per_row, row_bytes // per_row, phase.sent_fraction)


def _rank_process(simulation: Simulation, execution: Execution, rank: int,
                  finish_s: dict[int, float]):
    for handle in execution:
        yield handle.event
    finish_s[rank] = simulation.now


def _busiest_links(simulation: Simulation, step_time_s: float, top: int = 5,
                   bytes_carried: dict | None = None) -> list[LinkUse]:
    """The ``top`` links by utilisation; ``bytes_carried`` (link -> bytes) replaces
    what the simulation's links carried (an extrapolated step's bytes)."""
    if step_time_s <= 0:
        return []
    graph = simulation.topology.graph
    stats = simulation.network.stats
    carried = bytes_carried or {link: s.bytes_carried for link, s in stats.items()}
    uses = [
        LinkUse(link, graph.edges[link]["kind"],
                num_bytes / (stats[link].capacity_bytes_per_s * step_time_s))
        for link, num_bytes in carried.items()
        if num_bytes > 0
    ]
    uses.sort(key=lambda use: use.utilisation, reverse=True)
    return uses[:top]
