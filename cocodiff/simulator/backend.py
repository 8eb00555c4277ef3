"""The simulator's executor backend: plan steps as simulated time on one rank's tile.

The shared executor (:mod:`cocodiff.plan.executor`) walks a rank's program and asks a
backend to carry out each step; here compute steps take the cost model's roofline time
on the tile and exchanges go through the simulated transport as flows on the
topology's links (a phased exchange chunk by chunk, phase by phase, as the runtime's
:class:`~cocodiff.runtime.tapa.PhasedHandle` carries it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from cocodiff.cost import roofline_seconds
from cocodiff.plan.executor import Execution
from cocodiff.plan.gather import GatherStage
from cocodiff.plan.phasing import ChunkPipeline, member_bytes
from cocodiff.plan.steps import Compute, Exchange, Phase
from sim import Simulation
from transports.base import Group, VirtualBuffer
from transports.sim import SimHandle, SimTransport

if TYPE_CHECKING:
    import simpy


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
        self.exchanges_started = 0
        self.exchange_intervals: list[tuple[float, float]] = []  # start -> arrival
        self._exchange_handles: set[int] = set()  # ids of exchanges a wait may spin on
        # Phased exchanges in flight -> the event their wait triggers (see _phased).
        self._phased_waits: dict[int, simpy.Event] = {}

    def compute(self, step: Compute) -> SimHandle:
        return self._compute(roofline_seconds(step.cost, self._tflops, self._memory_gbps),
                             step.op)

    def step_overhead(self) -> SimHandle | None:
        """The step's compute outside the transformer's blocks (the topology's
        ``tile_step_overhead_us``: embedders, norm_out/proj_out, the scheduler's step),
        charged like a compute step, once per step before the first layer; None when the
        topology has none (nothing is charged, so step times stay as they were).

        It is charged here, by the simulator's rank, rather than as a step of the plan:
        the plan says what the blocks and their exchanges do, which the runtime carries
        out step by step; this work is the unmodified pipeline's, which the runtime runs
        as it is, so it has no plan step to carry out."""
        overhead_us = self.simulation.topology.spec.tile_step_overhead_us
        return self._compute(overhead_us * 1e-6, "step overhead") if overhead_us else None

    def _compute(self, duration_s: float, name: str) -> SimHandle:
        """``duration_s`` of compute (at one core on a host) on the rank's tile."""
        host = self.simulation.host
        if host is not None and host.compute_core_demand > 0:
            # A CPU rank's compute: duration_s at its demand, shared with its host's tasks;
            # its compute time is what it took, sharing included.
            demand = host.compute_core_demand
            done = self.simulation.cpu_task(self.transport.rank, duration_s * demand, demand,
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
        waited = self._phased_waits.pop(id(handle), None)
        if waited is not None:
            waited.succeed()
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

    def _group(self, ranks: tuple[int, ...]) -> Group:
        group = self._groups.get(ranks)
        if group is None:
            group = self._groups[ranks] = self.transport.new_group(ranks)
        return group

    def start_exchange(self, step: Exchange) -> SimHandle:
        self._started[step.tensor] = self.simulation.now
        self.exchanges_started += 1
        if step.phases:
            env = self.simulation.env
            waited = env.event()
            handle = SimHandle(env.process(self._phased(step, waited)))
            self._phased_waits[id(handle)] = waited
        else:
            send = VirtualBuffer(sum(step.send_rows), step.row_bytes)
            handle = self.transport.all_to_all(send, step.send_rows, step.recv_rows,
                                               self._group(step.group), tag=step.tensor)
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
        key = (id(phase), chunk, step.row_bytes)
        cached = self._splits.get(key)
        if cached is None:
            send_rows, recv_rows = phase.chunk_rows(chunk, step.chunks)
            send = [member_bytes(phase, rows, step.row_bytes) for rows in send_rows]
            recv = [member_bytes(phase, rows, step.row_bytes) for rows in recv_rows]
            cached = self._splits[key] = (phase, send, recv)  # keeps the phase alive
        return cached[1], cached[2]

    def _phased(self, step: Exchange, waited: simpy.Event):
        """The phases of a TAPA exchange, its chunks pipelined through them as
        :class:`~cocodiff.plan.phasing.ChunkPipeline` orders them (the runtime's order).

        As the runtime's ``PhasedHandle`` does: the first postings go out when the exchange
        starts; the rest only once the rank waits for the exchange (``waited``, triggered
        by :meth:`blocked_on`), each (chunk, phase) then landed and the next posted as soon
        as the pipeline allows. A rank that starts Q's, K's and V's exchanges and waits for
        them in turn so carries their later phases one exchange after the other."""
        env = self.simulation.env
        pipeline = ChunkPipeline(step.chunks, len(step.phases))
        done = env.event()

        def carry(chunk: int, p: int):
            phase = step.phases[p]
            send, recv = self._chunk_splits(step, phase, chunk)
            codec_s = self._codec_s(phase)
            # V-Major's sender picks and packs each message's blocks as it makes the call,
            # as the routing between phases is: CPU of the call, not a task before it that
            # would part a selective phase from the phase before (which skips the call wait).
            encode_s = self._messages(phase, send) * codec_s
            handle = self.transport.all_to_all(
                VirtualBuffer(sum(send), 1), send, recv, self._group(phase.group),
                tag=(step.tensor, chunk, p), routing_cpu_s=self._routing_s() + encode_s,
            )
            yield handle.event
            if not waited.processed:  # the runtime lands a phase inside wait() only
                yield waited
            handle.wait()
            if codec_s:  # and its receiver unpacks each into its copy
                yield self.simulation.cpu_task(self.transport.rank,
                                               self._messages(phase, recv) * codec_s)
            for posting in pipeline.landed(chunk, p):
                env.process(carry(*posting))
            if pipeline.finished:
                done.succeed()

        for posting in pipeline.first():
            env.process(carry(*posting))
        yield done

    def gather(self, stage: GatherStage, index: int) -> SimHandle:
        """The rank's part of one output gather (the runtime's ``all_gather_rows``: its
        chunk to every member of its group)."""
        group = stage.group_of(self.transport.rank)
        ones = [1] * len(group)
        return self._pollable(self.transport.all_to_all(
            VirtualBuffer(len(group), stage.bytes_per_member), ones, ones, self._group(group),
            tag=("output", index)))

    def finish_gather(self, start: float) -> None:
        if self._record:
            self.simulation.timeline.add(self._track, "output gather", "comm", start,
                                         self.simulation.now)

    def _codec_s(self, phase: Phase) -> float:
        """CPU seconds of V-Major's codec per message of ``phase`` at one end (the host's
        ``codec_cpu_us``); 0 for an exact phase, or without a host."""
        host = self.simulation.host
        return host.codec_cpu_us * 1e-6 if host is not None and phase.selective else 0.0

    def _routing_s(self) -> float:
        """CPU seconds the runtime spends routing one phase's rows (the host's
        ``phase_cpu_us``); 0 without a host."""
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


def rank_process(simulation: Simulation, execution: Execution, rank: int,
                 finish_s: dict[int, float], backend: SimBackend, denoising_step: bool = True,
                 gathers: tuple[GatherStage, ...] = ()):
    """One rank's step: the step overhead (``denoising_step``), the plan, the output
    gathers."""
    overhead = backend.step_overhead() if denoising_step else None
    if overhead is not None:
        yield overhead.event
    for handle in execution:
        yield backend.blocked_on(cast(SimHandle, handle))  # the simulated transport's handles
    for index, stage in enumerate(gathers):
        start = simulation.now
        yield backend.blocked_on(backend.gather(stage, index))
        backend.finish_gather(start)
    finish_s[rank] = simulation.now
