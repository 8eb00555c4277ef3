"""The simulator's executor backend: plan steps as simulated time on one rank's tile.

The shared executor (:mod:`cocodiff.plan.executor`) walks a rank's program and asks a
backend to carry out each step; here compute steps take the cost model's roofline time
on the tile and exchanges go through the simulated transport as flows on the
topology's links (a phased exchange chunk by chunk, phase by phase, as the runtime's
:class:`~cocodiff.runtime.tapa.PhasedHandle` carries it).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from cocodiff.cost import compute_seconds
from cocodiff.plan.executor import Execution, InFlight, PlanError, run_layer
from cocodiff.plan.gather import GatherStage
from cocodiff.plan.phasing import ChunkPipeline, Posting, chunk_member_bytes
from cocodiff.plan.steps import Compute, Exchange, LayerPlan, Phase, Plan, Wait
from sim import Simulation
from transports.base import VirtualBuffer
from transports.sim import (
    IdentityMemo,
    SimHandle,
    SimTransport,
    blocked_at_once,
    not_blocked,
)

if TYPE_CHECKING:
    import simpy

    from topology import TopologySpec


class _InFlight:
    """A phased exchange in flight on a simulated rank, held as the runtime's
    ``PhasedHandle`` holds it: its pipeline, what has arrived and not landed, and whether
    the rank waits for it (or for one started after it)."""

    __slots__ = ("step", "early", "pipeline", "arrived", "driven", "done")

    def __init__(self, step: Exchange, early: frozenset[int], done: simpy.Event) -> None:
        self.step = step
        self.early = early
        self.pipeline = ChunkPipeline(step.chunks, len(step.phases))
        self.arrived: list[Posting] = []
        self.driven = False
        self.done = done


class SimBackend:
    """Binds plan steps to simulated time on one rank's tile."""

    def __init__(self, transport: SimTransport, tile: str, record_spans: bool) -> None:
        self.transport = transport
        self.simulation = transport.simulation
        spec = self.simulation.topology.spec
        self._tile_spec = spec
        self._tile = tile
        self._track = f"rank {transport.rank}"
        self._record = record_spans
        # By identity: the plan's steps hold their group tuples (a Ring's: thousands of
        # ranks, hashed on every pass if looked up by value) and are the same objects
        # pass after pass; a step's rows are summed once.
        self._group = IdentityMemo(self.transport.new_group)
        self._send_buffer = IdentityMemo(
            lambda step: VirtualBuffer(sum(step.send_rows), step.row_bytes))
        # A gather stage's group for this rank and its splits (one row to every member),
        # made once: the same tuples call after call, found by identity downstream.
        self._gather_of = IdentityMemo(self._gather_group)
        self._started: dict[str, float] = {}
        self._splits: dict[tuple, tuple] = {}
        # A step's time by its identity: a rank runs the same layer objects again and
        # again (every layer, every patch), and the plan keeps them alive meanwhile.
        self._step_s: dict[int, float] = {}
        self.compute_s = 0.0
        self.exchanges_started = 0
        self.exchange_intervals: list[tuple[float, float]] = []  # start -> arrival
        self._exchange_handles: set[int] = set()  # ids of exchanges a wait may spin on
        # Phased exchanges in flight, in start order, and by their handles' ids.
        self._in_flight: list[_InFlight] = []
        self._flights: dict[int, _InFlight] = {}

    def compute(self, step: Compute) -> SimHandle:
        duration_s = self._step_s.get(id(step))
        if duration_s is None:
            duration_s = self._step_s[id(step)] = compute_seconds(step.cost, self._tile_spec)
        return self._compute(duration_s, step.op)

    def step_overhead(self, plan: Plan) -> SimHandle | None:
        """The step's compute outside the transformer's blocks (:func:`step_overhead_s`:
        embedders, norm_out/proj_out, the scheduler's step), charged like a compute step,
        once per step before its first layer; None when the topology has none (nothing is
        charged, so step times stay as they were).

        It is charged here, by the simulator's rank, rather than as a step of the plan:
        the plan says what the blocks and their exchanges do, which the runtime carries
        out step by step; this work is the unmodified pipeline's, which the runtime runs
        as it is, so it has no plan step to carry out."""
        overhead_s = step_overhead_s(self.simulation.topology.spec, plan)
        return self._compute(overhead_s, "step overhead") if overhead_s else None

    def _compute(self, duration_s: float, name: str) -> SimHandle:
        """``duration_s`` of compute (at one core on a host) on the rank's tile."""
        host = self.simulation.host
        if host is not None and host.compute_core_demand > 0:
            # A CPU rank's compute: duration_s at its demand, shared with its host's tasks
            # (dearer among exchange calls than timed alone); its compute time is what it
            # took, sharing included.
            demand = host.compute_core_demand
            core_s = duration_s * demand * host.compute_among_calls
            done = self.simulation.cpu_task(self.transport.rank, core_s, demand,
                                            self._track if self._record else None, name)
            start = self.simulation.now
            done.callbacks.append(self._add_compute_since(start))
            return SimHandle(done)
        self.compute_s += duration_s
        if self._record:
            event = self.simulation.compute(self._tile, duration_s, self._track, name)
        else:
            event = self.simulation.env.timeout(duration_s)
        return SimHandle(event)

    def _add_compute_since(self, start: float):
        def add(_event) -> None:
            self.compute_s += self.simulation.now - start
        return add

    def blocked_on(self, handle: SimHandle) -> simpy.Event:
        """What the rank's process yields to wait for ``handle``: its event, or, on a host
        that busy-polls, a process that spins on a core until an exchange completes."""
        handle.awaited = blocked_at_once  # from now the rank sleeps until it completes
        flight = self._flights.pop(id(handle), None)
        if flight is not None:
            self._drive(flight)
        if id(handle) not in self._exchange_handles:
            return handle.event
        self._exchange_handles.discard(id(handle))
        if handle.event.processed:
            return handle.event
        return self.simulation.env.process(self._poll(handle))

    def _poll(self, handle: SimHandle):
        token = self.simulation.start_poll(self.transport.rank)
        yield handle.event
        self.simulation.stop_poll(token)

    def start_exchange(self, step: Exchange, early: frozenset[int] = frozenset()) -> SimHandle:
        self._started[step.tensor] = self.simulation.now
        # A point-to-point transfer counts once, on its sender's side.
        self.exchanges_started += step.direction != "p2p" or step.tensor == "send"
        if step.phases:
            # As the runtime's PhasedHandle carries it (cocodiff.plan.phasing): the first
            # postings now, the rest at progress points (the early phases) or in the wait.
            flight = _InFlight(step, early, self.simulation.env.event())
            self._in_flight.append(flight)
            handle = SimHandle(flight.done)
            self._flights[id(handle)] = flight
            for posting in flight.pipeline.take():
                self._post(flight, posting)
        else:
            send = self._send_buffer(step)
            # A point-to-point transfer's two sides ("send", "recv") are one call.
            tag = "p2p" if step.direction == "p2p" else step.tensor
            handle = self.transport.all_to_all(send, step.send_rows, step.recv_rows,
                                               self._group(step.group), tag=tag)
            handle.awaited = not_blocked  # until blocked_on: the rank may go on computing
            if step.direction == "p2p" and step.tensor == "send":
                # An eager send (xDiT's pipeline_isend is never waited for): the sender
                # goes on at once; the bytes leave when the receiver has posted its side.
                done = self.simulation.env.event()
                done.succeed()
                return SimHandle(done)
        return self._pollable(handle)

    def _pollable(self, handle: SimHandle) -> SimHandle:
        """``handle``, which :meth:`blocked_on` spins on when the host busy-polls."""
        if self.simulation.host is not None and self.simulation.host.busy_poll:
            self._exchange_handles.add(id(handle))
        return handle

    def _chunk_splits(self, step: Exchange, phase: Phase, chunk: int
                      ) -> tuple[list[int], list[int]]:
        """Bytes to and from each member for one chunk of one phase (layers repeat the
        same phase objects, so this is computed once per phase and chunk)."""
        key = (id(phase), chunk, step.row_bytes, step.chunk_tokens)
        cached = self._splits.get(key)
        if cached is None:
            send, recv = chunk_member_bytes(step, phase, chunk)
            cached = self._splits[key] = (phase, send, recv)  # keeps the phase alive
        return cached[1], cached[2]

    def _carry(self, flight: _InFlight, chunk: int, p: int):
        """One posting of a phased exchange: the call, then its landing at the rank's
        next progress point (at once when the rank waits on it)."""
        step = flight.step
        phase = step.phases[p]
        send, recv = self._chunk_splits(step, phase, chunk)
        # V-Major's sender picks and packs each message's blocks as it makes the call:
        # CPU of the call, not a task before it that would part a selective phase from
        # the phase before (which skips the call wait). The phase's own extra CPU
        # (phase_cpu_us) is spent while its bytes travel.
        encode_s = self._messages(phase, send) * self._codec_s(phase)
        handle = self.transport.all_to_all(
            VirtualBuffer(sum(send), 1), send, recv, self._group(phase.group),
            tag=(step.tensor, chunk, p), routing_cpu_s=encode_s, wire_cpu_s=self._phase_s(),
        )
        # The rank sleeps on a phase's call once it waits for the exchange (or for one
        # started after it); before that it is computing and finds the phase arrived.
        handle.awaited = lambda: flight.driven
        yield handle.event
        handle.wait()
        flight.arrived.append((chunk, p))
        if flight.driven:  # the rank waits on it: a landing it takes is a progress point
            self._progress_point()

    def _decode_s(self, flight: _InFlight, posting: Posting) -> float:
        """CPU seconds the receiver spends unpacking a selective posting's messages into
        its copy; 0 for an exact phase."""
        chunk, p = posting
        phase = flight.step.phases[p]
        codec_s = self._codec_s(phase)
        if not codec_s:
            return 0.0
        return self._messages(phase, self._chunk_splits(flight.step, phase, chunk)[1]) * codec_s

    def _progress_point(self) -> simpy.Process | None:
        """A progress point, as the runtime's (cocodiff.plan.phasing): land what has
        arrived, then post what may go out. A process while unpacking selective messages
        takes the rank's time, else None (done)."""
        landing = [(flight, posting) for flight in self._in_flight
                   for posting in flight.arrived]
        for flight in self._in_flight:
            flight.arrived = []
        decode_s = sum(self._decode_s(flight, posting) for flight, posting in landing)
        if decode_s:
            return self.simulation.env.process(self._decode_then_land(landing, decode_s))
        self._land(landing)
        return None

    def _decode_then_land(self, landing: list[tuple[_InFlight, Posting]], decode_s: float):
        yield self.simulation.cpu_task(self.transport.rank, decode_s)
        self._land(landing)

    def _land(self, landing: list[tuple[_InFlight, Posting]]) -> None:
        for flight, posting in landing:
            flight.pipeline.landed(*posting)
            if flight.pipeline.finished:
                self._in_flight.remove(flight)
                flight.done.succeed()
        # Post what may go out now: an exchange the rank waits for (or for one started
        # after it) all its ready postings, another its early phases'; each only once
        # every exchange started before it has posted all of its own.
        for flight in list(self._in_flight):
            for posting in flight.pipeline.take(None if flight.driven else flight.early):
                self._post(flight, posting)
            if not flight.pipeline.fully_posted:
                return

    def _post(self, flight: _InFlight, posting: Posting) -> None:
        self.simulation.env.process(self._carry(flight, *posting))

    def progress(self) -> SimHandle | None:
        """The executor's progress point, before a compute step."""
        if not any(flight.arrived or flight.pipeline.has_ready for flight in self._in_flight):
            return None
        process = self._progress_point()
        return SimHandle(process) if process is not None else None

    def _drive(self, flight: _InFlight) -> None:
        """The rank waits for ``flight``: it and every exchange started before it post
        all they may as their postings land (the runtime's wait posts all of theirs
        first); beginning to wait is a progress point."""
        if flight not in self._in_flight:  # landed at progress points already
            return
        for earlier in self._in_flight:
            earlier.driven = True
            if earlier is flight:
                break
        self._progress_point()

    def gather(self, stage: GatherStage, index: int) -> SimHandle:
        """The rank's part of one output gather (the runtime's ``all_gather_rows``: its
        chunk to every member of its group)."""
        group, ones = self._gather_of(stage)
        return self._pollable(self.transport.all_to_all(
            VirtualBuffer(len(group), stage.bytes_per_member), ones, ones, self._group(group),
            tag=("output", index)))

    def _gather_group(self, stage: GatherStage) -> tuple[tuple[int, ...], tuple[int, ...]]:
        group = stage.group_of(self.transport.rank)
        return group, _ones(len(group))

    def finish_gather(self, start: float) -> None:
        if self._record:
            self.simulation.timeline.add(self._track, "output gather", "comm", start,
                                         self.simulation.now)

    def _codec_s(self, phase: Phase) -> float:
        """CPU seconds of V-Major's codec per message of ``phase`` at one end (the host's
        ``codec_cpu_us``); 0 for an exact phase, or without a host."""
        host = self.simulation.host
        return host.codec_cpu_us * 1e-6 if host is not None and phase.selective else 0.0

    def _phase_s(self) -> float:
        """CPU seconds one phase posting costs beyond its call's price, spent while its
        bytes travel (the host's ``phase_cpu_us``: calibrate found it in the waits); 0
        without a host."""
        host = self.simulation.host
        return host.phase_cpu_us * 1e-6 if host is not None else 0.0

    def _messages(self, phase: Phase, member_bytes: list[int]) -> int:
        """Messages to or from the other members of ``phase`` that carry bytes."""
        me = phase.group.index(self.transport.rank)
        return sum(1 for j, b in enumerate(member_bytes) if j != me and b)

    def finish_exchange(self, step: Exchange, received: VirtualBuffer) -> None:
        start = self._started[step.tensor]
        self.exchange_intervals.append((start, self.simulation.now))
        if self._record:
            self.simulation.timeline.add(
                self._track, f"a2a {step.tensor}", "comm", start, self.simulation.now
            )


def sequence_share(plan: Plan) -> float:
    """The share of one sample's sequence a rank's forward carries, times the samples it
    holds: ``1/P`` for Ulysses over P ranks, ``1/(U R)`` in a Ulysses x Ring layout,
    ``1/u`` in a PipeFusion stage of u ranks (its forward runs the stage's whole shard;
    the plan's split is one patch's), doubled by two samples on a rank."""
    split = plan.head_split
    ring = plan.parallel.ring if plan.parallel is not None else 1
    return split.batch / (split.num_ranks * ring)


def step_overhead_s(spec: TopologySpec, plan: Plan) -> float:
    """Seconds of a rank's step outside the blocks: ``tile_step_overhead_us`` plus
    ``tile_step_overhead_sequence_us`` times its :func:`sequence_share`."""
    return (spec.tile_step_overhead_us
            + spec.tile_step_overhead_sequence_us * sequence_share(plan)) * 1e-6


def generation_execution(plans: Sequence[Plan], step_plans: Sequence[int], rank: int,
                         backend: SimBackend, gathers: tuple[GatherStage, ...] = ()
                         ) -> Execution:
    """Rank ``rank``'s PipeFusion generation (each step's program in turn, a transfer in
    flight from one step to the next), each step paying its overhead outside the blocks
    and its output gather (``gathers``, the stage's: :func:`~cocodiff.schedules.gather.
    stage_gather`) where the runtime's forward runs them: the overhead at the step's
    start, while the rank waits for its first patch, and the gather after its last
    block. A rank of the first stage runs both after the next step's leading waits,
    which are for the last stage's output: the runtime takes it at the output
    projection, before the gather, and the scheduler step that needs it and the
    embedders come before its first block."""
    first_stage = _starts_pipeline(plans[step_plans[0]].program(rank).layers)
    in_flight: InFlight = {}
    for number, index in enumerate(step_plans):
        plan = plans[index]
        layers = plan.program(rank).layers
        leading = 0
        if first_stage:
            while leading < len(layers) and not any(isinstance(step, Compute)
                                                    for step in layers[leading].steps):
                leading += 1
        for layer in layers[:leading]:
            yield from run_layer(layer, backend, in_flight)
        if first_stage and number:
            yield from output_gathers(backend, gathers)  # the step before's
        overhead = backend.step_overhead(plan)
        if overhead is not None:
            yield overhead
            overhead.wait()
        for layer in layers[leading:]:
            yield from run_layer(layer, backend, in_flight)
        if not first_stage or number == len(step_plans) - 1:
            yield from output_gathers(backend, gathers)
    if in_flight:
        raise PlanError(f"exchanges never waited for: {sorted(in_flight)}")


def _starts_pipeline(layers: Sequence[LayerPlan]) -> bool:
    """Whether a rank's program of a generation's first step computes before it waits
    for anything: the first stage's (nothing comes back from the last stage yet; every
    rank of a one-stage pipeline)."""
    for layer in layers:
        for step in layer.steps:
            if isinstance(step, Compute):
                return True
            if isinstance(step, Wait):
                return False
    return True


def output_gathers(backend: SimBackend, gathers: tuple[GatherStage, ...]) -> Execution:
    """The step's output gathers on the rank, one after the other (their handles, as an
    execution yields them)."""
    for index, stage in enumerate(gathers):
        start = backend.simulation.now
        yield backend.gather(stage, index)
        backend.finish_gather(start)


def rank_process(simulation: Simulation, execution: Execution, rank: int,
                 finish_s: dict[int, float], backend: SimBackend, overhead_of: Plan | None,
                 gathers: tuple[GatherStage, ...] = ()):
    """One rank's step: the step overhead of ``overhead_of`` (None: none; a PipeFusion
    generation charges it per step in its execution, and its gathers too), the plan, the
    output gathers."""
    overhead = backend.step_overhead(overhead_of) if overhead_of is not None else None
    if overhead is not None:
        yield overhead.event
    for handle in itertools.chain(execution, output_gathers(backend, gathers)):
        yield backend.blocked_on(cast(SimHandle, handle))  # the simulated transport's handles
    finish_s[rank] = simulation.now


@functools.lru_cache(maxsize=16)
def _ones(size: int) -> tuple[int, ...]:
    # One tuple per group size, shared by every rank and simulation: the transport's caches
    # find a gather's splits by identity (a gather over 49,152 ranks sums them once).
    return (1,) * size
