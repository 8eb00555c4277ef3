"""What a machine is made of, as plain frozen data, and the checks that make it valid.

A machine is ``num_nodes`` identical nodes. A node holds ``gpus_per_node`` GPUs, each
with ``tiles_per_gpu`` tiles (Aurora's "stacks"; one rank runs on one tile), a host
(CPU and PCIe root) and ``nics_per_node`` NICs into one inter-node fabric. Bandwidths
are gigabytes per second in each direction; latencies are microseconds per link.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from topology.errors import TopologyError

GPU_FABRICS = ("all-to-all", "switch")
"""How the GPUs of one node are wired: one direct link per GPU pair, or one link from
every GPU to a node switch."""

MAX_TILES = 1_000_000
"""Largest machine accepted (tiles, and separately NICs), to refuse typos like
``count = 80000000`` before building a graph that would never fit in memory."""

LINK_FIELDS = ("tile_link", "gpu_link", "port_link", "host_link", "nic_link")

# The range of physical sense of each kind of number, in its unit: (low, high, low in words,
# high in words). Outside it a value is a typo or a unit slip, never a machine: a bandwidth
# of 5e-324 GB/s makes the simulator divide by subnormal numbers (and never finish), and a
# latency of 1e300 us prints 300-digit step times. Bounds are inclusive.
PHYSICAL_RANGE: dict[str, tuple[float, float, str, str]] = {
    "GB/s": (1e-9, 1e9, "1 B/s", "1 EB/s"),
    "TF/s": (1e-6, 1e9, "1 MFLOP/s", "1 ZFLOP/s"),
    "us": (0.0, 1e6, "0", "1 s"),
    "cores": (1e-3, 1e6, "a thousandth of a core", "a million cores"),
    "GB": (1e-6, 1e6, "1 kB", "1 PB"),
    "x": (1e-3, 1e3, "a thousandth", "a thousand times"),
}

HOST_FIELDS = ("cores", "ranks_per_host", "compute_core_demand", "call_cpu_us", "message_cpu_us",
               "copy_gbps", "busy_poll", "call_wait_us", "codec_cpu_us", "phase_cpu_us",
               "diffusers_call_cpu_us", "follow_wait_us", "wake_cpu_us", "late_peer_first",
               "compute_among_calls", "transfer_cores")


def exchange_cpu_s(calls: int, num_messages: int, num_bytes: float, *, call_cpu_us: float,
                   message_cpu_us: float, copy_gbps: float | None) -> float:
    """Core-seconds of CPU for ``calls`` exchange calls moving ``num_messages`` messages of
    ``num_bytes`` bytes in all: the one host cost model that the simulator charges and that
    calibrate fits (``copy_gbps`` None: bytes cost no CPU)."""
    copy_s = 0.0 if copy_gbps is None else num_bytes / (copy_gbps * 1e9)
    return (calls * call_cpu_us + num_messages * message_cpu_us) * 1e-6 + copy_s


@dataclass(frozen=True, slots=True)
class HostSpec:
    """The CPU that ranks share: its cores, which ranks sit on it, and what they draw.

    A rank's compute and the CPU work of each of its exchanges are tasks on its host's
    cores, shared among all tasks running there at once as links share bandwidth
    (processor sharing, each task at most one core). Without a ``HostSpec`` every rank
    has a device of its own and handles its messages for free.

    Attributes:
        cores: cores of one host (core-seconds per second).
        ranks_per_host: consecutive global ranks per host (ranks ``0..k-1`` on host 0,
            ...); ``None``: every rank of the machine on one host (a laptop, or the
            emulated cluster whose namespaces all share this machine).
        compute_core_demand: cores one rank's compute occupies while it runs: 1 for a
            rank computing on one CPU core, 0 for a rank whose compute runs on its own
            accelerator (then compute never waits for the host).
        call_cpu_us: CPU time per exchange call, whatever it carries: the collective's
            set-up, handing the call to the transport's threads and waking the caller when
            it completes. Each TAPA phase and chunk is a call of its own, so this is what an
            extra exchange costs beyond its messages.
        message_cpu_us: CPU time per message sent or received in an exchange (LogGP's
            ``o``: posting, protocol, the transport's threads).
        copy_gbps: GB/s one core moves bytes through an exchange (staging copies, the
            kernel's TCP stack); each byte sent or received costs ``1 / copy_gbps``
            core-ns. ``None``: bytes cost no CPU.
        busy_poll: a rank blocked on an exchange spins on a core until it completes (MPI
            progress engines), instead of sleeping (gloo's waits).
        call_wait_us: wall time a call waits, spending no CPU, when its data arrives
            while every core of its host is taken: on shared cores the members of a call
            are time-sliced, and a call completes only once each has been scheduled again.
        follow_wait_us: wall time a call made the moment the rank's previous call
            finished (flat's K and V after Q) waits, busy cores or not, when its rank is
            blocked on it: its members were just woken by the call before, but the rank
            still sleeps in this one and is handed it back by the transport's thread
            (calibrate's loops with and without such calls;
            ``cocodiff.calibration.result.Loops.fitted_waits_us``).
        wake_cpu_us: the part of ``call_cpu_us`` spent only when the rank is blocked on the
            call as its data arrives (putting the rank to sleep and waking it): a call
            started ahead and done by the time its rank waits for it (V-First's V) does
            not spend it (calibrate's loops with one more call started at each place and
            waited for at the next; ``cocodiff.calibration.loaded.wake_cpu_from_loops``).
        codec_cpu_us: CPU time of V-Major's codec per message of a selective phase, at
            each end: the sender choosing and packing the blocks that changed most, the
            receiver unpacking them into its copy (``cocodiff.runtime.vmajor``).
        phase_cpu_us: CPU time per TAPA phase (and chunk) beyond what its call and
            messages are charged: the runtime routing the blocks' rows from one phase to
            the next (splitting what arrived, concatenating each member's message;
            ``cocodiff.runtime.tapa``), which a flat exchange does not do, and what the
            transport spends on a phase's calls beyond their price
            (``cocodiff.calibration.routing``).
        diffusers_call_cpu_us: CPU time per exchange call that diffusers' own context
            parallelism makes (its functional collective and wait), in place of
            ``call_cpu_us`` when its baseline is predicted; ``None``: the same as ours.
        late_peer_first: two ranks that exchange both ways, one posting its part later
            than the other, move the late rank's data first and the early rank's only
            after it: the transport sends nothing before the receiver says it is ready,
            and the late rank's "ready" travels behind its own data on their one
            connection when it sends to the early rank before it receives from it (gloo
            over TCP; in gloo's order always in a pair, for some pairs of a larger
            group). The early rank is done when the late rank's data is in, the late rank
            when the early rank's is. Calibrate measures it on one pair
            (``cocodiff.calibration.lateness``).
        compute_among_calls: the CPU a rank's compute takes among a step's exchange
            calls over what the same compute takes with no calls (every rank computing at
            once either way; the tile's rates are the latter): a rank that sleeps in its
            calls and is woken finds its caches cold. Multiplies every compute the host
            runs. calibrate's loops, timing the CPU outside their calls
            (``cocodiff.calibration.loaded.compute_among_calls``).
        transfer_cores: cores of a host that the transport's work takes while data of
            its ranks crosses nodes, ahead of the ranks' tasks (on the emulated cluster
            the kernel's handling of TCP through the shaped link, packet by packet: it
            slows every rank computing on the host, not only the transfer's ends). The
            host's cores less this while any transfer or exchange with data of its ranks
            spans nodes (not folded). calibrate times every rank computing with and
            without a one-way transfer on the slowest pair
            (``cocodiff.calibration.inflight``).
    """

    cores: float
    ranks_per_host: int | None = None
    compute_core_demand: float = 1.0
    message_cpu_us: float = 0.0
    copy_gbps: float | None = None
    busy_poll: bool = False
    call_cpu_us: float = 0.0  # last: positional construction keeps its meaning
    call_wait_us: float = 0.0
    codec_cpu_us: float = 0.0
    phase_cpu_us: float = 0.0
    diffusers_call_cpu_us: float | None = None
    follow_wait_us: float = 0.0
    wake_cpu_us: float = 0.0
    late_peer_first: bool = False
    compute_among_calls: float = 1.0
    transfer_cores: float = 0.0

    def host_of(self, rank: int) -> int:
        """The host of global ``rank``."""
        return 0 if self.ranks_per_host is None else rank // self.ranks_per_host

    def exchange_cpu_s(self, num_messages: int, num_bytes: float, calls: int = 0) -> float:
        """Core-seconds of CPU work to make ``calls`` exchange calls that send or receive
        ``num_messages`` messages holding ``num_bytes`` bytes in all."""
        return exchange_cpu_s(calls, num_messages, num_bytes, call_cpu_us=self.call_cpu_us,
                              message_cpu_us=self.message_cpu_us, copy_gbps=self.copy_gbps)

    @property
    def charges_exchanges(self) -> bool:
        """Whether an exchange costs anything on the host (its cores, or a call's wait)."""
        return (self.call_cpu_us > 0 or self.message_cpu_us > 0 or self.copy_gbps is not None
                or self.call_wait_us > 0 or self.follow_wait_us > 0)


@dataclass(frozen=True, slots=True)
class DeviceRates:
    """What one tile's kernels achieve, from kernel microbenchmarks (the compute model of
    ``cocodiff.kernels``; presets cite their sources in ``topology.presets``).

    Attributes:
        name: the device, for reports (``h100-sxm``).
        gemm_tflops: large bf16 GEMMs' achieved rate, TFLOP/s (the shape curve's slope).
        gemm_fixed_us: a GEMM's fixed time, us (the shape curve's intercept).
        attention_tflops: ``(sequence length, TFLOP/s)`` of the attention kernel's forward
            pass (head dim 128, non-causal), ascending lengths.
        memory_gbps: streaming elementwise kernels' achieved HBM rate, GB/s.
        sm_count: the units thread blocks are spread over (SMs, Xe-cores).
        launch_us: GPU time per eager kernel launch beyond its work, us.
        host_us: host CPU time to issue one eager PyTorch op, us.
        compiled_launch_us: the same as ``launch_us`` under ``torch.compile``.
        compiled_host_us: the same as ``host_us`` under ``torch.compile``.
        attention_query_factor: ``(query tokens, time factor)``, ascending: attention with
            fewer queries than keys (a PipeFusion patch against its K/V buffer) takes this
            factor times what ``attention_tflops`` at its key length gives, read at its
            query count (held flat past the table's ends; 1 with as many queries as keys).
            Timed by calibrate at the model's length (the patch's attention step as the
            runtime runs it); empty (the presets): the length table and the partial wave
            alone.
    """

    name: str
    gemm_tflops: float
    gemm_fixed_us: float
    attention_tflops: tuple[tuple[int, float], ...]
    memory_gbps: float
    sm_count: int
    launch_us: float
    host_us: float
    compiled_launch_us: float
    compiled_host_us: float
    attention_query_factor: tuple[tuple[int, float], ...] = ()


COMPUTE_MODES = ("eager", "compiled")
"""How a run executes its kernels: eager PyTorch, or ``torch.compile``'s fused graph."""


def check_device_rates(rates: DeviceRates, where: str) -> None:
    """Refuse device rates that are not physical numbers (one line naming ``where``)."""
    if not isinstance(rates, DeviceRates):
        raise TopologyError(f"expected DeviceRates for {where}, got {rates!r}")
    _check_number(rates.gemm_tflops, "compute rate", "TF/s", f"gemm_tflops of {where}",
                  positive=True)
    _check_number(rates.memory_gbps, "memory bandwidth", "GB/s", f"memory_gbps of {where}",
                  positive=True)
    for field in ("gemm_fixed_us", "launch_us", "host_us", "compiled_launch_us",
                  "compiled_host_us"):
        _check_number(getattr(rates, field), "latency", "us", f"{field} of {where}")
    if not _is_int(rates.sm_count) or rates.sm_count < 1:
        raise TopologyError(f"sm_count of {where} must be a positive integer, got "
                            f"{rates.sm_count!r}")
    if not rates.attention_tflops:
        raise TopologyError(f"attention_tflops of {where} must be (length, TF/s) pairs in "
                            "ascending length, got ()")
    _check_pairs(rates.attention_tflops, "attention_tflops", ("length", "TF/s"),
                 ("compute rate", "TF/s"), where)
    _check_pairs(rates.attention_query_factor, "attention_query_factor",
                 ("query tokens", "factor"), ("time factor", "x"), where)


def _check_pairs(table: tuple[tuple[int, float], ...], key: str, names: tuple[str, str],
                 value: tuple[str, str], where: str) -> None:
    """``table``'s keys positive ints in ascending order, its values positive numbers."""
    if any(not _is_int(k) or k < 1 for k, _ in table) \
            or [k for k, _ in table] != sorted({k for k, _ in table}):
        raise TopologyError(f"{key} of {where} must be ({names[0]}, {names[1]}) pairs in "
                            f"ascending {names[0]}, got {table!r}")
    for k, number in table:
        _check_number(number, value[0], value[1], f"{key}[{k}] of {where}", positive=True)


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One physical link, the same in both directions.

    Attributes:
        bandwidth_gbps: gigabytes/s in each direction.
        latency_us: time for a message's first byte to cross the link, in microseconds.
    """

    bandwidth_gbps: float
    latency_us: float


@dataclass(frozen=True, slots=True)
class TopologySpec:
    """A whole machine: ``num_nodes`` identical nodes joined by one fabric.

    Attributes:
        name: a label for reports (the preset or file name).
        num_nodes: nodes in the machine.
        gpus_per_node: GPUs in one node.
        tiles_per_gpu: tiles (stacks) in one GPU; a rank runs on one tile.
        nics_per_node: NICs in one node; 0 only makes sense for one node.
        tile_tflops: dense bf16 TFLOP/s of one tile.
        tile_memory_gbps: HBM GB/s of one tile.
        tile_link: the direct link between every two tiles of one GPU (``None`` iff
            ``tiles_per_gpu == 1``).
        gpu_link: GPU <-> GPU inside a node (``None`` iff ``gpus_per_node == 1``): per GPU
            pair for ``gpu_fabric == "all-to-all"``, per GPU <-> switch port for "switch".
        gpu_fabric: ``"all-to-all"`` (one direct link per GPU pair, Aurora's Xe Link) or
            ``"switch"`` (every GPU links to one node switch, NVSwitch).
        port_link: tile <-> its GPU (on package; by default not a constraint).
        host_link: GPU <-> the node's host (PCIe); inter-node traffic crosses it.
        nic_link: one NIC <-> the fabric switch. A route between nodes crosses two of
            them (one at each end), so it pays ``latency_us`` twice.
        fabric_latency_us: traversal of the inter-node fabric (switch hops x per-hop).
        host: the CPU the ranks share (see :class:`HostSpec`); ``None``: every rank has
            its own device and free message handling.
        device: the tile's kernel rates (``cocodiff.kernels``); ``None``: compute is priced
            by the roofline of ``tile_tflops`` and ``tile_memory_gbps`` (a calibrated CPU).
        tile_memory_gb: the tile's device memory in GB (10^9 bytes); the planner refuses
            a layout whose ranks need more (``cocodiff.simulator.memory``); 0: not known,
            nothing is refused.
        compute_mode: ``eager`` or ``compiled`` (:data:`COMPUTE_MODES`), how a run issues
            its kernels; used with ``device`` only. A property of the run, not the machine:
            topology files do not hold it, ``--compute-mode`` sets it.
        tile_step_overhead_us: microseconds of compute per denoising step outside the
            transformer's blocks (embedders, norm_out/proj_out, the scheduler's step), once
            per step per rank, at one core on a host. A property of the model as much as
            of the tile, as ``tile_tflops`` of a calibrated topology is (the effective rate
            of the blocks it timed); 0: not charged. With
            ``tile_step_overhead_sequence_us`` it is the part that does not grow with the
            rank's share of the sequence.
        tile_step_overhead_sequence_us: what the step's work outside the blocks adds per
            whole sample's sequence the rank carries (the embedders, RoPE's positions and
            the output projection run on the rank's own tokens): a rank charges
            ``tile_step_overhead_us + share x this``, the share being ``1/P`` under Ulysses
            over P ranks, ``1/u`` in a PipeFusion stage of u ranks (whose forward carries
            u times a flat rank's tokens), doubled by two samples on a rank. 0: every rank
            pays ``tile_step_overhead_us`` alone.
    """

    name: str
    num_nodes: int
    gpus_per_node: int
    tiles_per_gpu: int
    nics_per_node: int
    tile_tflops: float
    tile_memory_gbps: float
    tile_link: LinkSpec | None
    gpu_link: LinkSpec | None
    gpu_fabric: str
    port_link: LinkSpec
    host_link: LinkSpec
    nic_link: LinkSpec
    fabric_latency_us: float
    host: HostSpec | None = None
    tile_step_overhead_us: float = 0.0
    device: DeviceRates | None = None
    compute_mode: str = "eager"
    tile_memory_gb: float = 0.0
    tile_step_overhead_sequence_us: float = 0.0

    @property
    def tiles_per_node(self) -> int:
        return self.gpus_per_node * self.tiles_per_gpu

    @property
    def num_tiles(self) -> int:
        return self.num_nodes * self.tiles_per_node

    def with_nodes(self, num_nodes: int) -> TopologySpec:
        """The same machine with ``num_nodes`` nodes.

        Raises:
            TopologyError: ``num_nodes`` is not a positive integer.
        """
        check_num_nodes(num_nodes)
        return dataclasses.replace(self, num_nodes=num_nodes)


def check_num_nodes(num_nodes: object) -> None:
    """Refuse a node count given on its own (a CLI flag, a function argument)."""
    if not _is_int(num_nodes) or num_nodes < 1:  # type: ignore[operator]
        raise TopologyError(f"number of nodes must be a positive integer, got {num_nodes!r}")


def validate_spec(spec: TopologySpec, locations: Mapping[str, str] | None = None) -> None:
    """Check everything about a spec; raise on the first problem.

    Args:
        spec: the machine.
        locations: field name -> where the user wrote it, used in messages (a TOML
            loader passes e.g. ``{"gpu_link": "[links.gpu] of cluster.toml"}``). Fields
            not in it are named ``"<field> of topology '<name>'"``.

    Raises:
        TopologyError: one line naming the value and where it came from.
    """
    if not isinstance(spec, TopologySpec):
        raise TopologyError(f"expected a TopologySpec, got {type(spec).__name__}")

    def where(field: str) -> str:
        if locations is not None and field in locations:
            return locations[field]
        return f"{field} of topology {spec.name!r}"

    if not isinstance(spec.name, str) or not spec.name.strip():
        raise TopologyError(f"topology name must be a non-empty string, got {spec.name!r}")
    for field, minimum in (
        ("num_nodes", 1),
        ("gpus_per_node", 1),
        ("tiles_per_gpu", 1),
        ("nics_per_node", 0),
    ):
        value = getattr(spec, field)
        if not _is_int(value):
            raise TopologyError(f"expected an integer for {where(field)}, got {value!r}")
        if value < minimum:
            problem = "non-positive" if minimum == 1 else "negative"
            raise TopologyError(f"{problem} count {value} in {where(field)}")
    if spec.num_tiles > MAX_TILES:
        raise TopologyError(
            f"too many tiles: {spec.num_nodes} nodes x {spec.gpus_per_node} GPUs x "
            f"{spec.tiles_per_gpu} tiles = {spec.num_tiles} > {MAX_TILES} "
            f"({where('num_nodes')})"
        )
    if spec.num_nodes * spec.nics_per_node > MAX_TILES:
        raise TopologyError(
            f"too many NICs: {spec.num_nodes} nodes x {spec.nics_per_node} NICs > {MAX_TILES} "
            f"({where('nics_per_node')})"
        )
    _check_number(spec.tile_tflops, "compute rate", "TF/s", where("tile_tflops"), positive=True)
    _check_number(
        spec.tile_memory_gbps, "memory bandwidth", "GB/s", where("tile_memory_gbps"), positive=True
    )
    _check_number(spec.fabric_latency_us, "latency", "us", where("fabric_latency_us"))
    _check_number(spec.tile_step_overhead_us, "step overhead", "us",
                  where("tile_step_overhead_us"))
    _check_number(spec.tile_step_overhead_sequence_us, "step overhead per sequence", "us",
                  where("tile_step_overhead_sequence_us"))
    if not isinstance(spec.gpu_fabric, str) or spec.gpu_fabric not in GPU_FABRICS:
        raise TopologyError(
            f"unknown GPU fabric {spec.gpu_fabric!r} in {where('gpu_fabric')} "
            f"(valid: {', '.join(GPU_FABRICS)})"
        )
    for field in LINK_FIELDS:
        link = getattr(spec, field)
        if link is None and field in ("tile_link", "gpu_link"):
            continue
        if not isinstance(link, LinkSpec):
            raise TopologyError(f"expected a LinkSpec for {where(field)}, got {link!r}")
        _check_number(link.bandwidth_gbps, "bandwidth", "GB/s", where(field), positive=True)
        _check_number(link.latency_us, "latency", "us", where(field))

    if spec.host is not None:
        _check_host(spec.host, where)
    if spec.device is not None:
        check_device_rates(spec.device, where("device"))
    _check_number(spec.tile_memory_gb, "device memory", "GB", where("tile_memory_gb"),
                  zero_allowed=True)
    if spec.compute_mode not in COMPUTE_MODES:
        raise TopologyError(f"unknown compute mode {spec.compute_mode!r} "
                            f"(valid: {', '.join(COMPUTE_MODES)})")

    # Every tile must reach every other tile.
    if spec.tiles_per_gpu > 1 and spec.tile_link is None:
        raise TopologyError(
            f"no route from n0.g0.t0 to n0.g0.t1: {spec.tiles_per_gpu} tiles per GPU but no "
            f"tile link ({where('tile_link')})"
        )
    if spec.gpus_per_node > 1 and spec.gpu_link is None:
        raise TopologyError(
            f"no route from n0.g0.t0 to n0.g1.t0: {spec.gpus_per_node} GPUs per node but no "
            f"GPU link ({where('gpu_link')})"
        )
    if spec.num_nodes > 1 and spec.nics_per_node == 0:
        raise TopologyError(
            f"no route from n0.g0.t0 to n1.g0.t0: {spec.num_nodes} nodes but no NICs "
            f"({where('nics_per_node')} is 0)"
        )
    # A link between parts that do not exist is a mistake in the spec, not a harmless extra.
    if spec.tiles_per_gpu == 1 and spec.tile_link is not None:
        raise TopologyError(
            f"a tile link is given but there is 1 tile per GPU ({where('tile_link')})"
        )
    if spec.gpus_per_node == 1 and spec.gpu_link is not None:
        raise TopologyError(
            f"a GPU link is given but there is 1 GPU per node ({where('gpu_link')})"
        )


def _check_host(host: object, where) -> None:
    if not isinstance(host, HostSpec):
        raise TopologyError(f"expected a HostSpec for {where('host')}, got {host!r}")
    _check_number(host.cores, "core count", "cores", where("host.cores"), positive=True)
    if host.ranks_per_host is not None and (
        not _is_int(host.ranks_per_host) or host.ranks_per_host < 1
    ):
        raise TopologyError(f"ranks per host must be a positive integer, got "
                            f"{host.ranks_per_host!r} in {where('host.ranks_per_host')}")
    _check_number(host.compute_core_demand, "compute core demand", "cores",
                  where("host.compute_core_demand"), zero_allowed=True)
    if host.compute_core_demand > 1:
        # One rank's compute is one task; a task runs on at most one core.
        raise TopologyError(f"compute core demand {host.compute_core_demand!r} in "
                            f"{where('host.compute_core_demand')} is above 1 core: one "
                            "rank's compute is one task on one core")
    _check_number(host.call_cpu_us, "CPU time per exchange call", "us",
                  where("host.call_cpu_us"))
    _check_number(host.message_cpu_us, "CPU time per message", "us",
                  where("host.message_cpu_us"))
    _check_number(host.call_wait_us, "wait per exchange call", "us", where("host.call_wait_us"))
    _check_number(host.follow_wait_us, "wait per exchange call made straight after another",
                  "us", where("host.follow_wait_us"))
    _check_number(host.wake_cpu_us, "CPU time per exchange call its rank is woken from",
                  "us", where("host.wake_cpu_us"))
    if host.wake_cpu_us > host.call_cpu_us:
        raise TopologyError(f"wake_cpu_us {host.wake_cpu_us} us exceeds call_cpu_us "
                            f"{host.call_cpu_us} us, of which it is a part, in "
                            f"{where('host.wake_cpu_us')}")
    _check_number(host.compute_among_calls, "compute factor among exchange calls", "x",
                  where("host.compute_among_calls"), positive=True)
    _check_number(host.transfer_cores, "cores taken by transfers across nodes", "cores",
                  where("host.transfer_cores"), zero_allowed=True)
    if host.transfer_cores >= host.cores:
        raise TopologyError(f"transfer_cores {host.transfer_cores} leaves no core of the "
                            f"host's {host.cores} in {where('host.transfer_cores')}")
    _check_number(host.codec_cpu_us, "V-Major codec CPU time per message", "us",
                  where("host.codec_cpu_us"))
    _check_number(host.phase_cpu_us, "TAPA phase routing CPU time", "us",
                  where("host.phase_cpu_us"))
    if host.diffusers_call_cpu_us is not None:
        _check_number(host.diffusers_call_cpu_us, "CPU time per diffusers exchange call", "us",
                      where("host.diffusers_call_cpu_us"))
    if host.copy_gbps is not None:
        _check_number(host.copy_gbps, "copy rate", "GB/s", where("host.copy_gbps"),
                      positive=True)
    for flag in ("busy_poll", "late_peer_first"):
        if not isinstance(getattr(host, flag), bool):
            raise TopologyError(f"expected true or false for {where('host.' + flag)}, "
                                f"got {getattr(host, flag)!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number(
    value: object, what: str, unit: str, where: str, *, positive: bool = False,
    zero_allowed: bool = False,
) -> None:
    """A finite int or float; > 0 when ``positive``, else >= 0; within
    :data:`PHYSICAL_RANGE` of ``unit`` (or exactly 0 when ``zero_allowed``). Messages
    quote the value as given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TopologyError(f"expected a number for {what} in {where}, got {value!r}")
    if not math.isfinite(value):
        raise TopologyError(f"{what} {value} {unit} is not finite in {where}")
    if value < 0:
        raise TopologyError(f"negative {what} {value} {unit} in {where}")
    if positive and value == 0:
        raise TopologyError(f"zero {what} {value} {unit} in {where}")
    low, high, low_words, high_words = PHYSICAL_RANGE[unit]
    if zero_allowed and value == 0:
        return
    if value < low:
        raise TopologyError(f"{what} {value!r} {unit} in {where} is below {low_words}: "
                            "not a physical machine (a unit slip?)")
    if value > high:
        raise TopologyError(f"{what} {value!r} {unit} in {where} is above {high_words}: "
                            "not a physical machine (a unit slip?)")
