"""A calibration's result: everything measured, the topology it gives, the collective model
fitted on it, and the summary a user reads."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cocodiff.calibration.compute import ComputeRates
from cocodiff.calibration.fits import CpuFit, LinkFit
from cocodiff.calibration.inflight import TransferLoad
from cocodiff.calibration.lateness import LatePeer
from cocodiff.calibration.loaded import CallCpuFit, LoadedPoint, predict_loop_s
from cocodiff.calibration.model_shapes import LayerShapes
from cocodiff.calibration.neighbours import foreign_text
from cocodiff.calibration.options import CalibrateOptions, CalibrationError
from cocodiff.calibration.verdict import Verdict, judge, machine_warnings

if TYPE_CHECKING:
    from cocodiff.calibration.kernel_bench import KernelCalibration
    from topology import TopologySpec
    from transports.sim import CollectiveModel


@dataclass(frozen=True, slots=True)
class HostMeasurement:
    """The host the ranks share, as measured.

    Attributes:
        cores: cores a rank may run on (the fewest over ranks).
        ranks_per_host: consecutive ranks per host; None: every rank on one host.
        cpu: what an exchange costs a rank's CPU lined up, the others idle (None when no
            pair was measured); its copy rate and busy-poll verdict are the host's.
        loaded: what exchange calls cost with every rank computing and exchanging at once
            (the host's per-call and per-message CPU); None: see ``loaded_note``.
        loaded_note: why ``loaded`` is None, or what it leaves out (a busy-polling
            transport's loops: timed, not priced).
        call_wait_us: the wall time a call waits to be scheduled when it completes on a
            busy host (:meth:`Loops.fitted_waits_us`, from the same loops).
        follow_wait_us: the same for a call made straight after the rank's previous one.
        codec_cpu_us: CPU of V-Major's codec per selective message at one end
            (:mod:`cocodiff.calibration.codec`).
        phase_cpu_us: CPU per TAPA phase posting beyond its call's price: the routing
            and the transport's extra
            (:mod:`cocodiff.calibration.routing`; 0 on one node: no phases).
        compute_core_demand: cores a rank's compute takes: 1 where it computes on the CPU,
            0 where it computes on an accelerator (the runtime's device).
        late_peer: a pair exchange on time and with one member late
            (:mod:`cocodiff.calibration.lateness`), whose verdict is ``late_peer_first``;
            None when not measured.
        transfer_load: every rank's loop quiet and with a transfer across nodes in flight
            (:mod:`cocodiff.calibration.inflight`), whose verdict is ``transfer_cores``;
            None when not measured (one node, or ranks computing on accelerators).
    """

    cores: float
    ranks_per_host: int | None
    cpu: CpuFit | None
    loaded: CallCpuFit | None = None
    loaded_note: str = ""
    call_wait_us: float = 0.0
    codec_cpu_us: float = 0.0
    phase_cpu_us: float = 0.0
    compute_core_demand: float = 1.0
    follow_wait_us: float = 0.0
    late_peer: LatePeer | None = None
    transfer_load: TransferLoad | None = None

    def spec(self):
        """The ``[host]`` of the topology: its ranks' compute (on a core or on their
        accelerators), the fitted exchange costs; a busy-polling transport's cost is its
        spinning, nothing else."""
        from topology import HostSpec

        cpu = self.cpu
        mine = {"cores": self.cores, "ranks_per_host": self.ranks_per_host,
                "codec_cpu_us": self.codec_cpu_us, "phase_cpu_us": self.phase_cpu_us,
                "compute_core_demand": self.compute_core_demand,
                "late_peer_first": self.late_peer is not None and self.late_peer.late_peer_first,
                "compute_among_calls": (self.loaded.compute_among_calls
                                        if self.loaded is not None else 1.0),
                "transfer_cores": (self.transfer_load.transfer_cores
                                   if self.transfer_load is not None else 0.0)}
        waits = {"call_wait_us": self.call_wait_us, "follow_wait_us": self.follow_wait_us}
        if cpu is None or cpu.busy_poll:  # the waits per call: fitted on the loops, if timed
            return HostSpec(**mine, busy_poll=cpu is not None, **waits)
        if self.loaded is not None:
            return HostSpec(**mine, call_cpu_us=self.loaded.call_cpu_us,
                            message_cpu_us=self.loaded.message_cpu_us, copy_gbps=cpu.copy_gbps,
                            diffusers_call_cpu_us=self.loaded.diffusers_call_cpu_us,
                            wake_cpu_us=self.loaded.wake_cpu_us, **waits)
        return HostSpec(**mine, message_cpu_us=cpu.message_cpu_us, copy_gbps=cpu.copy_gbps)

    def to_json(self) -> dict[str, Any]:
        return {"cores": self.cores, "ranks_per_host": self.ranks_per_host,
                "cpu": None if self.cpu is None else self.cpu.to_json(),
                "loaded": (self.loaded.to_json() if self.loaded is not None
                           else {}) | ({"note": self.loaded_note} if self.loaded_note else {}),
                "call_wait_us": self.call_wait_us, "follow_wait_us": self.follow_wait_us,
                "codec_cpu_us": self.codec_cpu_us,
                "phase_cpu_us": self.phase_cpu_us,
                "compute_core_demand": self.compute_core_demand,
                "late_peer": None if self.late_peer is None else self.late_peer.to_json(),
                "transfer_load": (None if self.transfer_load is None
                                  else self.transfer_load.to_json())}


@dataclass(slots=True)
class Calibration:
    """Everything measured, and the topology it gives.

    ``intra`` and ``inter`` are the wall-clock fits of the pair exchanges; ``intra_wire``
    and ``inter_wire`` what is left of them once the host charges each exchange's CPU
    (the topology's links, with ``host``).
    """

    num_nodes: int
    ranks_per_node: int
    nodes_detected: int
    transport: str
    dtype: str
    shapes: LayerShapes
    compute: ComputeRates
    intra: LinkFit
    inter: LinkFit
    all_to_all: list[dict[str, float]]
    wall_s: float = 0.0
    collective: dict[str, Any] | None = None  # the fitted collective model (rank 0 fits it)
    # The loaded loops beside the simulator's time for each on the calibrated topology.
    loops_check: list[dict[str, Any]] | None = None
    host: HostMeasurement | None = None
    intra_wire: LinkFit | None = None
    inter_wire: LinkFit | None = None
    # The machine's 1-minute load average at the start and the end: rates measured while
    # other work holds the cores are that moment's, and say so.
    load_average: tuple[float, float] | None = None
    # The share of the hosts' cores other processes used meanwhile
    # (cocodiff.calibration.neighbours): the same warning, from the host's own account.
    foreign_share: float | None = None
    # CPU seconds of the same reference work at the start and the end (measure.py): the
    # machine's speed, twice.
    reference_cpu_s: tuple[float, float] | None = None
    # A step's exchanges as the schedules issue them (cocodiff.calibration.patterns).
    patterns: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # The kernel model's rates from its microbenchmarks (cocodiff.calibration.kernel_bench).
    kernels: KernelCalibration | None = None
    # Whether predictions from it can hold (cocodiff.calibration.verdict), set on writing.
    verdict: dict[str, Any] | None = None

    def topology(self, name: str | None = None):
        """The ``cluster`` preset with the measured numbers (and ``[host]`` when measured).
        The tile's rates are one core's, as measured (process CPU time): the simulator
        shares the host's cores among the ranks computing at once."""
        from topology.presets import cluster

        intra, inter = self._link("intra"), self._link("inter")
        spec = cluster(
            num_nodes=self.num_nodes,
            ranks_per_node=self.ranks_per_node,
            intra_gbps=intra.bandwidth_gbps,
            inter_gbps=inter.bandwidth_gbps,
            intra_latency_us=intra.latency_us,
            inter_latency_us=inter.latency_us,
            tile_tflops=self.compute.tile_tflops,
            tile_memory_gbps=self.compute.tile_memory_gbps,
        )
        label = name or f"calibrated-{self.num_nodes}x{self.ranks_per_node}"
        host = None if self.host is None else self.host.spec()
        device = self.kernels.rates if self.kernels is not None and self.kernels.used else None
        return dataclasses.replace(spec, name=label, host=host,
                                   tile_step_overhead_us=self.step_overhead_us,
                                   tile_step_overhead_sequence_us=self.step_overhead_sequence_us,
                                   device=device, **unconstrained_host_links(spec))

    @property
    def step_overhead_us(self) -> float:
        """The topology's ``tile_step_overhead_us``: the CPU a rank spends per step outside
        the blocks (one core's, as the tile's rates) that does not grow with its share of
        the sequence; all of it when only the shard was timed (a calibration written
        before the whole sequence was); 0 when the real blocks were not timed."""
        block = self.compute.block or {}
        return block.get("step_overhead_fixed_s", block.get("step_overhead_s", 0.0)) * 1e6

    @property
    def step_overhead_sequence_us(self) -> float:
        """The topology's ``tile_step_overhead_sequence_us``: what that work adds per whole
        sequence on the rank (:func:`~cocodiff.calibration.blocks.step_overhead_line`)."""
        return (self.compute.block or {}).get("step_overhead_sequence_s", 0.0) * 1e6

    def _link(self, tier: str) -> LinkFit:
        """The fit a tier's link gets: the wire's when a host takes the CPU part."""
        wall, wire = (self.intra, self.intra_wire) if tier == "intra" else (self.inter,
                                                                             self.inter_wire)
        return wire if self.host is not None and wire is not None else wall

    def notes(self) -> list[str]:
        s = self.shapes
        return [
            f"Written by `cocodiff calibrate` over {self.transport} "
            f"({self.nodes_detected} node(s) detected, {self.num_nodes} x "
            f"{self.ranks_per_node} ranks described).",
            f"tile: {s.model} layer on one of {self.num_nodes * self.ranks_per_node} ranks at "
            f"{s.total_tokens} tokens (local {s.local_tokens} tokens, {s.local_heads} heads, "
            f"d={s.hidden_size}, {self.dtype}), all ranks computing at once; tflops "
            + (f"= the real blocks' effective rate ({self._block_text()})."
               if self.compute.block else "= the matrix products' rate."),
            *self._overhead_notes(),
            *([f"device: the kernel model's rates from calibrate's kernel microbenchmarks, "
               f"{self.kernels.verdict()}."] if self.kernels is not None else []),
            f"links.gpu: intra-node exchange fit ({self._link('intra').source}), max "
            f"error {self.intra.max_rel_error:.0%}.",
            f"links.nic: inter-node exchange fit ({self._link('inter').source}), max "
            f"error {self.inter.max_rel_error:.0%}.",
            *self._host_notes(),
        ]

    def _overhead_notes(self) -> list[str]:
        block = self.compute.block
        if not block or "step_overhead_s" not in block:
            return []
        line = (f"tile.step_overhead_us: each rank's forward outside its blocks (on its "
                f"shard) and a scheduler step, {block['step_overhead_s'] * 1e3:.2f} ms of CPU "
                "with all ranks at once; charged once per denoising step")
        if "step_overhead_sequence_s" not in block:
            return [line + "."]
        return [line + f"; with the whole sequence on each rank "
                f"{block['whole_sequence_overhead_s'] * 1e3:.2f} ms: a line in the rank's share "
                f"of the sequence, {block['step_overhead_fixed_s'] * 1e3:.2f} ms + "
                f"{block['step_overhead_sequence_s'] * 1e3:.2f} ms x the share "
                "(step_overhead_sequence_us; 1/u on a PipeFusion stage of u ranks)."]

    def _host_notes(self) -> list[str]:
        if self.host is None:
            return []
        world = self.num_nodes * self.ranks_per_node
        cpu = self.host.cpu
        charged = ("nothing per message: waits spin (busy_poll)" if cpu and cpu.busy_poll
                   else "none measured" if cpu is None else
                   "process CPU time of loops of compute (the model's forward where it "
                   "runs here) and exchange calls, every rank at once, fitted as calls x "
                   "call_cpu_us + messages x message_cpu_us once the compute is charged as it "
                   "runs among the calls (compute_among_calls: their CPU outside the calls "
                   "over the compute's alone), of which wake_cpu_us is what a "
                   "call started ahead saves (the same loops with one started ahead); "
                   "bytes / copy_gbps from the pair exchanges" if self.host.loaded is not None
                   else
                   "process CPU time per pair exchange, fitted as messages x message_cpu_us "
                   "+ bytes / copy_gbps")
        return [
            f"host: {self.host.cores:g} cores shared by "
            f"{self.host.ranks_per_host or world} ranks; tile rates are one core's (process "
            f"CPU time, every rank computing at once); exchange CPU: {charged}; V-Major's "
            f"codec: {self.host.codec_cpu_us:.0f} us per selective message at each end (an "
            f"encode and a decode of the model's V message to one member, every rank at once); "
            f"TAPA's phases: {self.host.phase_cpu_us:.0f} us per phase beyond their calls' "
            f"price (the model's phased exchanges of one layer through the transport, every "
            f"rank at once, less the same exchanges made flat and less what the prices "
            f"above charge the difference).{self._diffusers_note()}{self._late_peer_note()}"
            f"{self._transfer_note()}",
        ]

    def _late_peer_note(self) -> str:
        late = self.host.late_peer if self.host is not None else None
        if late is None:
            return ""
        return (f" late_peer_first: {late.describe()}.")

    def _transfer_note(self) -> str:
        load = self.host.transfer_load if self.host is not None else None
        if load is None:
            return ""
        return f" transfer_cores: {load.describe()}."

    def _diffusers_note(self) -> str:
        loaded = self.host.loaded if self.host is not None else None
        if loaded is None or loaded.diffusers_call_cpu_us is None:
            return ""
        return (f" diffusers' baseline: {loaded.diffusers_call_cpu_us:.0f} us per call (the "
                "world loops again with its exchange function making the calls).")

    def _block_text(self) -> str:
        block = self.compute.block or {}
        return (f"{block.get('layer_s', 0) * 1e3:.2f} ms per layer; matrix products "
                f"{self.compute.tflops * 1e3:.2f} GFLOP/s")

    def to_json(self) -> dict[str, Any]:
        return {
            "num_nodes": self.num_nodes,
            "ranks_per_node": self.ranks_per_node,
            "nodes_detected": self.nodes_detected,
            "transport": self.transport,
            "dtype": self.dtype,
            "layer": self.shapes.to_json(),
            "compute": self.compute.to_json(),
            "intra": self.intra.to_json(),
            "inter": self.inter.to_json(),
            "all_to_all": self.all_to_all,
            "collective": self.collective,
            "loops_check": self.loops_check,
            "host": None if self.host is None else self.host.to_json(),
            "intra_wire": None if self.intra_wire is None else self.intra_wire.to_json(),
            "inter_wire": None if self.inter_wire is None else self.inter_wire.to_json(),
            "wall_s": self.wall_s,
            "load_average": self.load_average,
            "foreign_share": self.foreign_share,
            "reference_cpu_s": self.reference_cpu_s,
            "patterns": self.patterns,
            "kernels": None if self.kernels is None else self.kernels.to_json(),
            "verdict": self.verdict,
        }


UNCONSTRAINED_FACTOR = 100.0


def unconstrained_host_links(spec) -> dict[str, Any]:
    """``port_link`` and ``host_link`` that never limit anything.

    The ``cluster`` preset gives them the rank's memory rate, meant as "not a constraint";
    a measured effective memory rate of a small layer can be below the network's rate,
    which would make them the bottleneck of every transfer. Here a rank's port and its
    node's host path are :data:`UNCONSTRAINED_FACTOR` x the fastest other link, 0 us.
    """
    from topology import LinkSpec

    links = [link for link in (spec.gpu_link, spec.nic_link) if link is not None]
    fastest = max([spec.tile_memory_gbps, *(link.bandwidth_gbps for link in links)])
    free = LinkSpec(bandwidth_gbps=UNCONSTRAINED_FACTOR * fastest, latency_us=0.0)
    return {"port_link": free, "host_link": free}


def fit_calibrated_collective(result: Calibration, fit_patterns: bool = False
                              ) -> dict[str, Any]:
    """The simulator's collective model fitted on what calibrate measured: the two-rank
    exchanges (pairs) and the world all-to-alls, and with ``fit_patterns`` a step's
    exchange patterns too (the world as a step issues it sets the several-node rate;
    TAPA's cross-node phase, the inter-node per-transfer cap), on the calibrated topology
    (the fit of :mod:`cocodiff.simulator.collective_fit`, as for Aurora's preset). JSON:
    the model (``transports.sim.CollectiveModel.to_json``) and each measurement's fitted
    time.

    The patterns are left out by default: over five full runs of the emulated cluster
    (docs/changelog.md, "Measured on 2026-11-26, evening and night") they did not predict the steps
    better than the sweeps alone, and on fast links they read the hosts' fixed costs as
    bandwidth (a 6.8 MB/s cap per transfer on a 5 Gbit/s link). :func:`check_patterns`
    sets each beside the simulator instead."""
    from cocodiff.simulator.collective_fit import Measurement, fit_collective
    from transports.sim import CollectiveModel

    world = result.num_nodes * result.ranks_per_node
    rows = [Measurement(nodes, 2, 2 * num_bytes, seconds, label=f"pair {name}")
            for name, fit, nodes in (("intra", result.intra, 1), ("inter", result.inter, 2))
            if fit.source.startswith("measured") and nodes <= result.num_nodes
            for num_bytes, seconds in fit.points]
    rows += [Measurement(result.num_nodes, world, row["bytes_per_peer"] * world,
                         row["measured_s"], label="all-to-all") for row in result.all_to_all]
    if fit_patterns:
        rows += [Measurement(result.num_nodes, world, row["bytes_per_rank"], row["measured_s"],
                             label=pattern_label(row), pattern=row["pattern"])
                 for row in result.patterns]
    if not rows:
        return CollectiveModel("calibrated").to_json()
    model, fits = fit_collective(_alone_topology(result), rows, CollectiveModel("calibrated"))
    return {**model.to_json(), "fit": [
        {"span": fit.span, "label": m.label, "ranks": m.ranks, "nodes": m.nodes,
         "bytes_per_rank": m.bytes_per_rank, "measured_s": m.time_s, "fitted_s": fitted}
        for fit in fits for m, fitted in fit.rows]}


def _alone_topology(result: Calibration):
    """The calibrated topology at a node count, with no wait per call: that wait is a
    call's on a host busy computing (the loops'), and the exchanges the collective is
    fitted and checked on were timed on hosts doing nothing else. With the loops' wait,
    their own scheduling was counted twice (2 x 2 at 5 Gbit/s: a 1.8 ms world exchange
    simulated 6.8 ms)."""
    from topology import build_topology

    spec = result.topology()
    if spec.host is not None:
        spec = dataclasses.replace(spec, host=dataclasses.replace(
            spec.host, call_wait_us=0.0, follow_wait_us=0.0))

    def topology_for(num_nodes: int):
        return build_topology(dataclasses.replace(spec, num_nodes=num_nodes))

    return topology_for


def check_patterns(result: Calibration) -> None:
    """Each measured exchange pattern's simulated time (``simulated_s``) and error, on the
    calibrated topology and collective: how the simulator meets a step's exchanges as the
    schedules issue them, timed alone."""
    from cocodiff.simulator.collective import simulate_pattern
    from transports.sim import CollectiveModel

    if not result.patterns:
        return
    topology = _alone_topology(result)(result.num_nodes)
    collective = CollectiveModel.from_json(result.collective) if result.collective else None
    for row in result.patterns:
        row["simulated_s"] = simulate_pattern(topology, row["pattern"], row["bytes_per_rank"],
                                              collective)
        row["error"] = row["simulated_s"] / row["measured_s"] - 1


def pattern_label(row: dict[str, Any]) -> str:
    """A measured exchange pattern's label in the collective fit and the summary."""
    return f"{row['pattern']} as a step issues it, {row['bytes_per_rank'] // 1024} KiB per rank"


# The longest wait per call Loops.fitted_waits_us considers (a scheduler's slice is a few ms).
MAX_CALL_WAIT_US = 20_000.0


@dataclass(frozen=True, slots=True)
class Loops:
    """The loaded loops of a calibration, as the simulator replays them: the calibrated
    topology (a :class:`topology.TopologySpec` with its ``[host]``), the loops measured
    on it, the cluster's shape and the collective model fitted there (None: links only)."""

    spec: TopologySpec
    points: tuple[LoadedPoint, ...]
    burst_cpu_s: float
    num_nodes: int
    ranks_per_node: int
    collective: CollectiveModel | None = None
    piece_cpu_s: tuple[float, ...] = ()

    @staticmethod
    def of(result: Calibration) -> Loops | None:
        """``result``'s loops; None when it has no host or ran none."""
        host = result.host
        if host is None or host.loaded is None:
            return None
        from transports.sim import CollectiveModel

        return Loops(result.topology(), tuple(host.loaded.points), host.loaded.burst_cpu_s,
                     result.num_nodes, result.ranks_per_node,
                     CollectiveModel.from_json(result.collective) if result.collective
                     else None, host.loaded.piece_cpu_s)

    def simulated_s(self, call_wait_us: float | None = None,
                    follow_wait_us: float | None = None,
                    points: tuple[LoadedPoint, ...] | None = None) -> list[float]:
        """Each loop's simulated time per iteration (of ``points``, default all; with the
        waits given in place of the spec's)."""
        from topology import build_topology

        host = self.spec.host
        if call_wait_us is not None:
            host = dataclasses.replace(host, call_wait_us=call_wait_us)
        if follow_wait_us is not None:
            host = dataclasses.replace(host, follow_wait_us=follow_wait_us)
        topology = build_topology(dataclasses.replace(self.spec, host=host))
        return [predict_loop_s(topology, point, self.burst_cpu_s, self.num_nodes,
                               self.ranks_per_node, self.collective, self.piece_cpu_s)
                for point in (self.points if points is None else points)]

    def fitted_waits_us(self) -> tuple[float, float]:
        """``(call_wait_us, follow_wait_us)``: the waits that make the simulator's time of
        the loops right in the median, what is left of their wall time once every rank's
        CPU and the wires are charged (on shared cores a call's members are time-sliced,
        and a call that completes while every core is taken waits to be scheduled). The
        loops are microbenchmarks (compute and exchange calls), never a step.

        Where calibrate ran spaced loops (calls only where the plan computes first), the
        call wait is fitted on them, and the follow wait, of a call made straight after
        another, on the other loops with that call wait (flat's K and V, or the pairs'
        second call, follow the call before). Without spaced loops the follow wait is 0
        and the call wait is fitted on every loop, as before 2026-11-29."""
        spaced = tuple(point for point in self.points if point.spaced and not point.ahead)
        others = tuple(point for point in self.points if not point.spaced)
        if not spaced or not others:
            return self._fitted_wait_us(lambda wait: self.simulated_s(wait, 0.0)), 0.0
        call_wait = self._fitted_wait_us(
            lambda wait: self.simulated_s(wait, 0.0, spaced), spaced)
        follow_wait = self._fitted_wait_us(
            lambda wait: self.simulated_s(call_wait, wait, others), others)
        return call_wait, follow_wait

    def _fitted_wait_us(self, simulated_s: Callable[[float], list[float]],
                        points: tuple[LoadedPoint, ...] | None = None) -> float:
        """The wait that ``simulated_s(wait)`` (the times of ``points``, default all)
        needs to meet ``points`` in the median. 0 when the simulator is already at or
        above the loops' median; found by bisection (the loops' simulated times grow with
        the wait). Where no wait up to :data:`MAX_CALL_WAIT_US` meets the loops, the cap
        if the wait moves them at all; 0 if it does not (no call of theirs completes on
        busy cores, e.g. as many ranks as cores: the loops cannot measure a wait, and a
        cap charged to every step's call that does would be a guess: V-First predicted
        +61% on 2 ranks, 2 cores)."""
        import statistics

        points = self.points if points is None else points

        def median_error(wait_us: float) -> float:
            return statistics.median(
                simulated / point.wall_s - 1
                for point, simulated in zip(points, simulated_s(wait_us), strict=True)
                if point.wall_s > 0)

        unwaited = median_error(0.0)
        if unwaited >= 0:
            return 0.0
        low, high = 0.0, MAX_CALL_WAIT_US
        capped = median_error(high)
        if capped < 0:
            return high if capped - unwaited > 1e-9 else 0.0
        while high - low > 1.0:  # to the microsecond
            middle = (low + high) / 2
            low, high = (middle, high) if median_error(middle) < 0 else (low, middle)
        return (low + high) / 2

    def check(self) -> list[dict[str, Any]]:
        """Each loop beside what the simulator takes for it: whether the host model
        reproduces the microbenchmarks it was fitted on (the CPU) and those it was not
        (the wall time of every rank computing and exchanging at once)."""
        return [{"shape": point.shape, "bytes_per_peer": point.bytes_per_peer,
                 "spaced": point.spaced, "ahead": point.ahead, "measured_s": point.wall_s,
                 "predicted_s": predicted,
                 "error": predicted / point.wall_s - 1 if point.wall_s > 0 else None}
                for point, predicted in zip(self.points, self.simulated_s(), strict=True)]


# Past this relative change of the reference work's CPU time, calibrate warns.
SPEED_DRIFT_WARNING = 0.10


def speed_drift(result: Calibration) -> float | None:
    """The reference work's CPU time at the end over the start, less 1; None when either
    was not timed."""
    if result.reference_cpu_s is None or min(result.reference_cpu_s) <= 0:
        return None
    began, ended = result.reference_cpu_s
    return ended / began - 1


def summary(result: Calibration, output: Path) -> str:
    """What a user reads: the fitted numbers and the all-to-all check."""
    c, s = result.compute, result.shapes
    on_device = result.host is not None and result.host.compute_core_demand == 0
    lines = [
        f"calibrated {result.num_nodes} node(s) x {result.ranks_per_node} ranks over "
        f"{result.transport} in {result.wall_s:.1f} s -> {output}",
        f"  compute ({s.model} layer, {s.local_tokens}/{s.total_tokens} tokens, "
        f"{s.local_heads} heads, d={s.hidden_size}, {result.dtype}): {c.tflops * 1e3:.2f} "
        f"GFLOP/s, {c.memory_gbps:.2f} GB/s per rank " + (
            "on its accelerator (wall clock, device synchronised, all ranks at once)"
            if on_device else "at one core (CPU time, all ranks at once)"),
    ]
    if c.block:
        b = c.block
        lines.append(
            f"  real blocks: {b['layer_s'] * 1e3:.2f} ms per layer (the matrix products' rate "
            f"charges {b['matmul_rate_layer_s'] * 1e3:.2f} ms) -> effective "
            f"{b['effective_tflops'] * 1e3:.2f} GFLOP/s, written as the tile's rate"
            + (f" (memory rate raised to {b['effective_memory_gbps']:.2f} GB/s: the memory-bound "
               "operations alone took longer at the measured rate than the real blocks did)"
               if b["effective_memory_gbps"] != c.memory_gbps else ""))
    if result.kernels is not None:
        lines += result.kernels.summary_lines()
    if c.block and "step_overhead_s" in c.block:
        lines.append(
            f"  outside the blocks: {c.block['step_overhead_s'] * 1e3:.2f} ms "
            f"{'on the device' if on_device else 'of CPU'} per step "
            "and rank (the forward's other modules + a scheduler step)"
            + (f"; {c.block['whole_sequence_overhead_s'] * 1e3:.2f} ms with the whole "
               f"sequence on the rank: written as {c.block['step_overhead_fixed_s'] * 1e3:.2f} "
               f"ms + {c.block['step_overhead_sequence_s'] * 1e3:.2f} ms x its share "
               "(step_overhead_us, step_overhead_sequence_us)"
               if "step_overhead_sequence_s" in c.block else ", written as step_overhead_us"))
    for name, fit in (("intra", result.intra), ("inter", result.inter)):
        lines.append(f"  {name}-node: {fit.latency_us:.1f} us + bytes / {fit.bandwidth_gbps:.3f}"
                     f" GB/s ({fit.source}, max fit error {fit.max_rel_error:.0%})")
    host = result.host
    if host is not None and result.load_average is not None:
        busiest = max(result.load_average)
        ranks = host.ranks_per_host or result.num_nodes * result.ranks_per_node
        if busiest > host.cores + ranks:
            lines.append(f"  warning: load average {busiest:.1f} on {host.cores:g} cores: other "
                         "work shared the cores, and the rates are that moment's")
    foreign = foreign_text(result.foreign_share)
    if foreign is not None:
        lines.append(f"  warning: {foreign}")
    drift = speed_drift(result)
    if drift is not None and abs(drift) > SPEED_DRIFT_WARNING:
        lines.append(f"  warning: the same reference work took {drift:+.0%} CPU time at the end "
                     "than at the start: the machine's speed moved during the calibration, "
                     "and its rates are a mix of both")
    if host is not None:
        cpu = host.cpu
        ranks = host.ranks_per_host or result.num_nodes * result.ranks_per_node
        text = f"  host: {host.cores:g} cores for {ranks} ranks"
        if cpu is not None:
            copy = "bytes free" if cpu.copy_gbps is None else f"{cpu.copy_gbps:.3g} GB/s per core"
            spin = ("" if cpu.wait_spin is None
                    else f"waiting on a late peer burns {cpu.wait_spin:.0%} of a core: ")
            text += (f"; pair exchange CPU {cpu.message_cpu_us:.1f} us per message, {copy} "
                     f"({spin}{'busy-polls' if cpu.busy_poll else 'sleeps'} while waiting)")
        lines.append(text)
        if host.late_peer is not None:
            verdict = "true" if host.late_peer.late_peer_first else "false"
            lines.append(f"  late peer: {host.late_peer.describe()}: late_peer_first = "
                         f"{verdict}, written to [host]")
        if host.transfer_load is not None:
            lines.append(f"  transfer across nodes: {host.transfer_load.describe()}: "
                         f"transfer_cores = {host.transfer_load.transfer_cores:.2f}, written "
                         "to [host]")
        loaded = host.loaded
        if loaded is not None and cpu is not None and cpu.busy_poll:
            lines.append(f"  exchanges under load (every rank computing and exchanging; "
                         f"{loaded.compute or 'a compute burst, then the calls'}): the "
                         f"spinning is their CPU; a call completing on busy cores waits "
                         f"{host.call_wait_us:.0f} us more, {host.follow_wait_us:.0f} us "
                         "straight after another (the loops' median): written to [host]")
        elif loaded is not None:
            lines.append(
                f"  exchanges under load (every rank computing and exchanging; "
                f"{loaded.compute or 'a compute burst, then the calls'}): "
                f"{loaded.call_cpu_us:.0f} us CPU per call + {loaded.message_cpu_us:.0f} us per "
                f"message (max fit error {loaded.max_error:.0%}), the compute itself "
                f"x{loaded.compute_among_calls:.2f} its CPU with no calls (the loops' CPU "
                f"outside their calls); a call completing on busy "
                f"cores waits {host.call_wait_us:.0f} us more, {host.follow_wait_us:.0f} us "
                "straight after another (the loops' median): written to [host]")
            if any(point.ahead for point in loaded.points):
                lines.append(f"  a call started ahead, done before its rank waits for it, "
                             f"spends {loaded.wake_cpu_us:.0f} us of that call price less "
                             "(the loops with a call started ahead against those without; "
                             "its rank is never put to sleep and woken): written to [host]")
            if loaded.diffusers_call_cpu_us is not None:
                lines.append(f"  diffusers' exchange call under load: "
                             f"{loaded.diffusers_call_cpu_us:.0f} us CPU per call (the world "
                             "loops with its call in place of ours): written to [host]")
        elif host.loaded_note:
            lines.append(f"  exchanges under load: {host.loaded_note}")
        for name, fit in (("intra", result.intra_wire), ("inter", result.inter_wire)):
            if fit is not None:
                lines.append(f"  {name}-node wire (less the CPU): {fit.latency_us:.1f} us + "
                             f"bytes / {fit.bandwidth_gbps:.3f} GB/s")
    for row in result.all_to_all:
        lines.append(f"  flat all-to-all, {row['bytes_per_peer'] // 1024} KiB per peer: "
                     f"measured {row['measured_s'] * 1e3:.2f} ms, links predict "
                     f"{row['link_model_s'] * 1e3:.2f} ms ({row['error']:+.0%})")
    for row in result.patterns:
        text = f"  {pattern_label(row)}: measured {row['measured_s'] * 1e3:.2f} ms"
        if "simulated_s" in row:
            text += f", simulated {row['simulated_s'] * 1e3:.2f} ms ({row['error']:+.0%})"
        lines.append(text)
    if result.collective:
        from transports.sim import CollectiveModel

        model = CollectiveModel.from_json(result.collective)
        lines.append(f"  collective model fitted on these: {model.describe()}")
    for row in result.loops_check or ():
        spaced = (" (only after compute, one more started ahead)" if row.get("ahead") else
                  " (only after compute)" if row.get("spaced") else "")
        lines.append(f"  loop of compute + {row['shape']} calls{spaced}, "
                     f"{row['bytes_per_peer'] // 1024} "
                     f"KiB per peer: measured {row['measured_s'] * 1e3:.2f} ms, simulated "
                     f"{row['predicted_s'] * 1e3:.2f} ms ({row['error']:+.0%})")
    return "\n".join(lines)


def write_outputs(result: Calibration, options: CalibrateOptions) -> None:
    """Write the topology file (and the JSON) atomically and print the summary (rank 0)."""
    from cocodiff.util.atomic import atomic_write_text
    from topology import dump_topology

    # The collective first (it prices exchanges timed alone, with no wait), then the wait
    # on the loops with that collective: one order, so what is written refits to itself.
    result.collective = fit_calibrated_collective(result, options.fit_patterns)
    check_patterns(result)
    loops = Loops.of(result)
    if loops is not None:
        call_wait, follow_wait = loops.fitted_waits_us()
        result.host = dataclasses.replace(result.host, call_wait_us=call_wait,
                                          follow_wait_us=follow_wait)
        loops = Loops.of(result)  # with the wait just fitted
    result.loops_check = loops.check() if loops is not None else []
    verdict = judge_calibration(result)
    result.verdict = verdict.to_json()
    if options.strict and verdict.line() is not None:  # before anything is written
        raise CalibrationError(f"refused (--strict): {verdict.line()}")
    spec = result.topology()
    header = "".join(f"# {line}\n" for line in [*result.notes(), *verdict_notes(verdict)])
    unused = (result.kernels.commented_table()
              if result.kernels is not None and not result.kernels.used else "")
    atomic_write_text(options.output, header + dump_topology(spec) + unused)
    if options.json is not None:
        atomic_write_text(options.json, json.dumps(result.to_json(), indent=2))
    print(summary(result, options.output))
    if verdict.line() is not None:
        print(f"warning: {verdict.line()}")


def judge_calibration(result: Calibration) -> Verdict:
    """calibrate's verdict on ``result`` (:mod:`cocodiff.calibration.verdict`): its loops
    simulated back, the machine's load and speed drift."""
    host = result.host
    ranks = result.num_nodes * result.ranks_per_node
    if host is not None:
        ranks = host.ranks_per_host or ranks
    warnings = machine_warnings(result.load_average, None if host is None else host.cores,
                                ranks, speed_drift(result), SPEED_DRIFT_WARNING,
                                result.foreign_share)
    if host is not None and host.call_wait_us >= MAX_CALL_WAIT_US:
        # The fit stopped at its bound, not where the loops are met: the loops simulated
        # back may pass while every call of a step is charged the cap (2 ranks on 2
        # cores, the machine slowing during calibrate: V-First then predicted +66%).
        warnings.append(f"the calls' wait fitted to calibrate's loops reached its "
                        f"{MAX_CALL_WAIT_US / 1e3:g} ms cap: the loops took longer than "
                        "waiting on shared cores explains (calibrate again)")
    return judge(result.loops_check, warnings)


def verdict_notes(verdict: Verdict) -> list[str]:
    """The verdict as the topology file's header says it."""
    if verdict.holds is None:
        return [f"verdict: not checked ({'; '.join(verdict.notes)})."]
    if verdict.holds:
        return [f"verdict: the simulator reproduces calibrate's loops (median |error| "
                f"{verdict.loops_median_abs_error:.0%}, limit {verdict.limit:.0%})."]
    return [f"verdict: {verdict.line()}."]
