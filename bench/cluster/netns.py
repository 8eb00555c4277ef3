"""An emulated two-tier cluster on one Linux machine: network namespaces joined by shaped veths.

What :class:`EmulatedCluster` builds (DESIGN.md section 6)::

    namespace <name>-n0            namespace <name>-sw            namespace <name>-n1
    +-----------------+           +-------------------+          +-----------------+
    | lo (up)         |  veth     |  bridge br0       |   veth   | lo (up)         |
    | fabric 10.213.  |-----------| p0            p1  |----------| fabric 10.213.  |
    |   0.1/24        | tbf (and  |  (tbf, netem on   |          |   0.2/24        |
    | ranks 0..R-1    |  netem)   |   egress)         |          | ranks R..2R-1   |
    +-----------------+           +-------------------+          +-----------------+

- One namespace per node holds that node's ranks. Its loopback is up, and its one
  ``fabric`` interface carries the node's address. Ranks bind the node address (gloo:
  ``GLOO_SOCKET_IFNAME=fabric``); traffic between two ranks of one node goes to the node's
  own address, which the kernel routes over ``lo`` (the ``local`` routing table), so it
  never touches the veth: the fast tier. Traffic to another node's address leaves through
  ``fabric``: the slow tier.
- A dedicated switch namespace holds the bridge. Nothing is created in the root network
  namespace, so the cluster cannot reach, or be reached from, any real network.
- Each node's link is shaped on both ends (egress of ``fabric`` and egress of the switch
  port), so both directions are limited: ``tbf`` at ``inter_gbit`` Gbit/s, and, when
  ``inter_delay_ms`` > 0, ``netem`` adding half the node-to-node one-way delay on each end
  (a route crosses two shaped links: out of the sender's node, into the receiver's).
  That is the ``cluster`` topology preset's shape: one NIC per node shared by its ranks,
  ``nic_link`` latency half the inter-node latency.

Everything created is removed by :meth:`EmulatedCluster.close`: on leaving the ``with``
block, on an exception, on SIGINT/SIGTERM (a handler turns them into exceptions so the
block unwinds) and at interpreter exit (``atexit``). Processes started with
:meth:`EmulatedCluster.spawn` are killed first (their whole process group), then any other
process still inside the cluster's namespaces, then the namespaces themselves, which takes
their veths and bridge with them. A process killed with SIGKILL cannot clean up: its
namespaces carry its pid in their name, and :func:`remove_stale` (run before every new
cluster, and by ``python -m bench.cluster cleanup``) removes those whose owner is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

from topology import TopologySpec, dump_topology
from topology.presets import cluster as cluster_preset

PREFIX = "ccd"
"""Every namespace made here is named ``ccd<owner pid>x<serial>-<role>``."""

NODE_INTERFACE = "fabric"
"""The name of each node's veth end, inside the node's namespace."""

BRIDGE = "br0"
SUBNET = "10.213.0"
"""Node k gets ``10.213.0.<k+1>/24``. The addresses exist only inside the cluster's own
namespaces (the root namespace never sees them), so they cannot clash with a real network."""

MAX_NODES = 64
COMMAND_TIMEOUT_S = 15.0

# TCP over Ethernet with a 1500-byte MTU: each full frame the shaper counts is 1514 bytes
# (14 Ethernet + 20 IP + 32 TCP with timestamps + 1448 payload); tbf charges the frame.
TCP_PAYLOAD_PER_FRAME = 1448 / 1514

# tbf's bucket: 1 ms of traffic at the rate, and at least two full frames (a bucket smaller
# than a frame passes nothing; tbf cuts larger GSO super-packets into frames itself). The
# bucket refills while the link idles, and an exchange after a compute gap drains it at
# loopback speed: a link that bursts where the simulator's links do not. Measured: with
# two 64 KiB GSO packets as the floor (21 ms of traffic at 0.05 Gbit/s), 4 x 2 at
# 0.05 Gbit/s stepped in 190 ms where the simulator predicted 327 (+72%); with this floor,
# 291 ms against 332 (+14%) (docs/changelog.md, 2026-11-25, "The emulated link made honest").
# Its queue: 20 ms of traffic and at least 4 MiB, so that every rank's concurrent TCP
# windows queue rather than drop: the simulator's links share their rate and lose nothing.
# Measured: with 20 ms alone (125 KB at 0.05 Gbit/s), a flat step on 4 x 2 dropped 810
# packets at the shaper (gloo posts every transfer at once), retransmission timeouts made
# steps 0.25-0.55 s apart, and diffusers' own Ulysses (no drops) measured 1.70x faster
# on the same exchanges.
_MIN_BURST_BYTES = 2 * 1514
_BURST_S = 1e-3
_QUEUE_S = 20e-3
_MIN_QUEUE_BYTES = 4 * 2**20
_NETEM_LIMIT_PACKETS = 100_000


def tbf_bucket(inter_gbit: float) -> tuple[int, int]:
    """``(burst, limit)`` bytes of the tbf that shapes a link to ``inter_gbit`` Gbit/s."""
    rate_bytes = inter_gbit * 1e9 / 8
    burst = int(max(_MIN_BURST_BYTES, rate_bytes * _BURST_S))
    return burst, int(burst + max(_MIN_QUEUE_BYTES, rate_bytes * _QUEUE_S))


# What the topology file says for the parts the shaping does not set (documented
# assumptions; `cocodiff calibrate` measures them instead).
ASSUMED_INTRA_GBPS = 5.0  # loopback TCP on a laptop-class CPU moves a few GB/s
ASSUMED_INTRA_LATENCY_US = 20.0  # one loopback TCP message, kernel + socket overhead
ASSUMED_STACK_LATENCY_US = 20.0  # the same stack overhead, paid on top of netem's delay


class ClusterError(RuntimeError):
    """The emulated cluster could not be built, used or run; the message is one line."""


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The shape of an emulated cluster.

    Attributes:
        num_nodes: nodes (network namespaces), 1 to :data:`MAX_NODES`.
        ranks_per_node: ranks each node runs (the launcher uses it; namespaces do not).
        inter_gbit: each node's link rate in Gbit/s (10^9 bit/s), in each direction.
        inter_delay_ms: one-way node-to-node delay in milliseconds (``netem``; 0 adds none).
    """

    num_nodes: int = 2
    ranks_per_node: int = 2
    inter_gbit: float = 1.0
    inter_delay_ms: float = 0.0

    def __post_init__(self) -> None:
        for name, value in (("num_nodes", self.num_nodes),
                            ("ranks_per_node", self.ranks_per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ClusterError(f"{name} must be a positive integer, got {value!r}")
        if self.num_nodes > MAX_NODES:
            raise ClusterError(f"num_nodes {self.num_nodes} exceeds {MAX_NODES}")
        if not 0 < self.inter_gbit <= 1000:
            raise ClusterError(f"inter_gbit must be in (0, 1000] Gbit/s, got {self.inter_gbit}")
        if not 0 <= self.inter_delay_ms <= 10_000:
            raise ClusterError(
                f"inter_delay_ms must be in [0, 10000] ms, got {self.inter_delay_ms}"
            )

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @property
    def inter_payload_gbps(self) -> float:
        """TCP payload GB/s (10^9 bytes/s) one node's link carries in one direction."""
        return self.inter_gbit / 8 * TCP_PAYLOAD_PER_FRAME


@dataclass(frozen=True, slots=True)
class Node:
    """One emulated node.

    Attributes:
        index: node number, 0-based.
        namespace: its network namespace.
        address: its IPv4 address, on :data:`NODE_INTERFACE`.
        switch_port: its veth's other end, in the switch namespace.
    """

    index: int
    namespace: str
    address: str
    switch_port: str

    @property
    def interface(self) -> str:
        return NODE_INTERFACE


def run_command(argv: Sequence[str], *, timeout_s: float = COMMAND_TIMEOUT_S,
                env: Mapping[str, str] | None = None) -> str:
    """Run a short command (``ip``, ``tc``) and return its stdout.

    Raises:
        ClusterError: it is missing, fails or times out; the message names the command and
            the first line of what it printed.
    """
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s,
            stdin=subprocess.DEVNULL, env=None if env is None else dict(env),
        )
    except FileNotFoundError:
        raise ClusterError(f"{argv[0]!r} not found on PATH (it comes with iproute2)") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`{' '.join(argv)}` did not finish in {timeout_s:g} s") from None
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines()
                 if line.strip()]
        reason = lines[0] if lines else f"exit code {done.returncode}"
        raise ClusterError(f"`{' '.join(argv)}` failed: {reason}")
    return done.stdout


def check_prerequisites(env: Mapping[str, str] | None = None) -> None:
    """Refuse early, with one line, what would make building a cluster fail.

    Raises:
        ClusterError: not root, or ``ip`` / ``tc`` not on ``PATH``.
    """
    path = (os.environ if env is None else env).get("PATH", "")
    for tool in ("ip", "tc"):
        if shutil.which(tool, path=path) is None:
            raise ClusterError(
                f"`{tool}` not found on PATH ({path or 'empty'}); install iproute2"
            )
    if os.geteuid() != 0:
        raise ClusterError(
            f"creating network namespaces needs root (running as uid {os.geteuid()}); "
            "run as root or with CAP_NET_ADMIN and CAP_SYS_ADMIN"
        )


def list_namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows."""
    out = run_command(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


_OWNED = re.compile(rf"^{PREFIX}(\d+)x\d+-(?:n\d+|sw)$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(*, include_live: bool = False) -> list[str]:
    """Delete namespaces left behind by an emulated cluster whose owner process is gone.

    Args:
        include_live: also delete those of owners that are still running (a manual
            ``cleanup --all``).

    Returns:
        The namespaces deleted.
    """
    removed = []
    for namespace in list_namespaces():
        match = _OWNED.match(namespace)
        if match is None:
            continue
        if not include_live and _pid_alive(int(match.group(1))):
            continue
        _kill_namespace_processes(namespace)
        with contextlib.suppress(ClusterError):
            run_command(["ip", "netns", "delete", namespace])
            removed.append(namespace)
    return removed


def _kill_namespace_processes(namespace: str) -> None:
    """SIGKILL every process inside ``namespace`` (a namespace this module created)."""
    try:
        out = run_command(["ip", "netns", "pids", namespace])
    except ClusterError:
        return
    for word in out.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(word), signal.SIGKILL)


class ClusterInterrupted(BaseException):
    """SIGTERM (or SIGHUP) arrived while a cluster was up; raised to unwind and clean up."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


_serial = itertools.count()


class EmulatedCluster:
    """K network namespaces ("nodes") joined through a bridge by ``tc``-shaped veth links.

    Use it as a context manager; everything is created on entry and removed on exit::

        with EmulatedCluster(ClusterSpec(num_nodes=2, ranks_per_node=2, inter_gbit=1.0)) as c:
            c.write_topology("cluster.toml")
            proc = c.spawn(c.nodes[1], ["python", "-c", "print('hello from node 1')"])

    Args:
        spec: the cluster's shape and link settings.
        name: prefix of its namespaces; default ``ccd<pid>x<serial>``, whose embedded pid
            lets :func:`remove_stale` tell leftovers of dead owners.
        env: environment whose ``PATH`` finds ``ip`` and ``tc`` (default ``os.environ``).
    """

    def __init__(self, spec: ClusterSpec, *, name: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.spec = spec
        self.name = name if name is not None else f"{PREFIX}{os.getpid()}x{next(_serial)}"
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", self.name):
            raise ClusterError(f"cluster name {self.name!r} must be 1-40 of [A-Za-z0-9_.-]")
        self._env = dict(os.environ if env is None else env)
        self.switch_namespace = f"{self.name}-sw"
        self.nodes: tuple[Node, ...] = tuple(
            Node(k, f"{self.name}-n{k}", f"{SUBNET}.{k + 1}", f"p{k}")
            for k in range(spec.num_nodes)
        )
        self._created: list[str] = []  # namespaces this object made, in creation order
        self._processes: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._old_handlers: dict[int, Any] = {}
        self._open = False

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        """Build the namespaces, bridge, links and shaping; on any failure remove what was
        built and raise :class:`ClusterError`."""
        check_prerequisites(self._env)
        if self._open:
            raise ClusterError(f"cluster {self.name} is already up")
        self._open = True
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            remove_stale()
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        switch = self.switch_namespace
        self._add_namespace(switch)
        self._ip(switch, "link", "add", BRIDGE, "type", "bridge")
        self._ip(switch, "link", "set", BRIDGE, "up")
        for node in self.nodes:
            self._add_namespace(node.namespace)
            self._ip(node.namespace, "link", "set", "lo", "up")
            # Both ends are born inside their namespaces: nothing appears in the root one.
            self._run("ip", "link", "add", NODE_INTERFACE, "netns", node.namespace,
                      "type", "veth", "peer", "name", node.switch_port, "netns", switch)
            self._ip(switch, "link", "set", node.switch_port, "master", BRIDGE)
            self._ip(switch, "link", "set", node.switch_port, "up")
            self._ip(node.namespace, "addr", "add", f"{node.address}/24", "dev", NODE_INTERFACE)
            self._ip(node.namespace, "link", "set", NODE_INTERFACE, "up")
            self._shape(node.namespace, NODE_INTERFACE)  # node -> switch
            self._shape(switch, node.switch_port)  # switch -> node

    def close(self) -> None:
        """Kill what runs in the cluster and delete its namespaces. Idempotent; safe from
        ``atexit`` and after a partial :meth:`create`."""
        with self._lock:
            if not self._open:
                return
            self._open = False
            try:
                self._terminate_processes()
                for namespace in reversed(self._created):
                    _kill_namespace_processes(namespace)
                while self._created:
                    namespace = self._created[-1]
                    try:
                        run_command(["ip", "netns", "delete", namespace], env=self._env)
                    except ClusterError:
                        # A process may still hold it for a moment: once more, after a beat.
                        time.sleep(0.2)
                        _kill_namespace_processes(namespace)
                        with contextlib.suppress(ClusterError):
                            run_command(["ip", "netns", "delete", namespace], env=self._env)
                    self._created.pop()
            finally:
                self._restore_signal_handlers()
                atexit.unregister(self.close)

    @property
    def is_up(self) -> bool:
        return self._open

    def _add_namespace(self, namespace: str) -> None:
        self._run("ip", "netns", "add", namespace)
        self._created.append(namespace)

    def _ip(self, namespace: str, *args: str) -> None:
        self._run("ip", "-n", namespace, *args)

    def _run(self, *argv: str) -> str:
        return run_command(argv, env=self._env)

    def _shape(self, namespace: str, device: str) -> None:
        burst, limit = tbf_bucket(self.spec.inter_gbit)
        tbf = ["tbf", "rate", f"{self.spec.inter_gbit * 1000:.6g}mbit", "burst", str(burst),
               "limit", str(limit)]
        tc = ["tc", "-n", namespace, "qdisc", "add", "dev", device]
        if self.spec.inter_delay_ms == 0:
            self._run(*tc, "root", "handle", "1:", *tbf)
            return
        half_delay_us = self.spec.inter_delay_ms * 1000 / 2
        try:
            self._run(*tc, "root", "handle", "1:", "netem", "delay", f"{half_delay_us:.3f}us",
                      "limit", str(_NETEM_LIMIT_PACKETS))
        except ClusterError as error:
            raise ClusterError(
                f"cannot add a delay with netem on this kernel ({error}); "
                "use no delay (--delay-ms 0); bandwidth shaping needs only tbf"
            ) from None
        self._run(*tc, "parent", "1:1", "handle", "10:", *tbf)

    # -- signals -----------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals are only delivered to the main thread; atexit still covers us

        def on_signal(signum: int, frame: FrameType | None) -> None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise ClusterInterrupted(signum)

        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[signum] = signal.signal(signum, on_signal)

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler)
        self._old_handlers.clear()

    # -- processes ---------------------------------------------------------------------------

    def node_of_rank(self, rank: int) -> Node:
        """Node-major placement: ranks ``k*R .. k*R+R-1`` run on node ``k``."""
        if not 0 <= rank < self.spec.num_ranks:
            raise ClusterError(f"rank {rank} outside a cluster of {self.spec.num_ranks} ranks")
        return self.nodes[rank // self.spec.ranks_per_node]

    def spawn(self, node: Node, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              stdout: IO[Any] | int | None = None, stderr: IO[Any] | int | None = None,
              cwd: str | Path | None = None) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace, in a process group of its own.

        The process is killed (with its group) when the cluster closes, if still running.
        """
        if not self._open:
            raise ClusterError(f"cluster {self.name} is not up")
        process = subprocess.Popen(
            ["ip", "netns", "exec", node.namespace, *argv],
            env=dict(self._env if env is None else env), stdout=stdout, stderr=stderr,
            stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True,
        )
        self._processes.append(process)
        return process

    def kill_stragglers(self) -> None:
        """SIGKILL every process still inside the cluster's node namespaces (e.g. the ranks
        of a failed MPI job, which are children of hydra's proxies, not of this process).
        The cluster stays up."""
        for node in self.nodes:
            if node.namespace in self._created:
                _kill_namespace_processes(node.namespace)

    def _terminate_processes(self, grace_s: float = 3.0) -> None:
        # A group is signalled only while its leader is alive and unreaped, so its id cannot
        # have been reused; members that outlive their leader are still inside the cluster's
        # namespaces, where close() kills them by pid.
        running = [p for p in self._processes if p.poll() is None]
        for process in running:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
        for process in running:
            if process.poll() is None:
                _signal_group(process, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=5)
        self._processes.clear()

    # -- inspection --------------------------------------------------------------------------

    def namespaces(self) -> list[str]:
        """The namespaces this cluster has created and not yet removed."""
        return list(self._created)

    def link_bytes(self) -> dict[int, tuple[int, int]]:
        """Bytes each node's shaped link has sent: ``{node: (node->switch, switch->node)}``,
        read from the qdisc counters (frames, headers included)."""
        counts = {}
        for node in self.nodes:
            out_bytes = _qdisc_sent_bytes(self._run(
                "tc", "-s", "-n", node.namespace, "qdisc", "show", "dev", NODE_INTERFACE))
            in_bytes = _qdisc_sent_bytes(self._run(
                "tc", "-s", "-n", self.switch_namespace, "qdisc", "show", "dev",
                node.switch_port))
            counts[node.index] = (out_bytes, in_bytes)
        return counts

    # -- the topology file -------------------------------------------------------------------

    def topology_spec(self, *, intra_gbps: float = ASSUMED_INTRA_GBPS,
                      intra_latency_us: float = ASSUMED_INTRA_LATENCY_US,
                      tile_tflops: float | None = None,
                      tile_memory_gbps: float | None = None) -> TopologySpec:
        """The ``cluster`` preset shaped like this cluster (see :func:`describe`)."""
        return describe(self.spec, intra_gbps=intra_gbps, intra_latency_us=intra_latency_us,
                        tile_tflops=tile_tflops, tile_memory_gbps=tile_memory_gbps)

    def write_topology(self, path: str | Path, **measured: float) -> TopologySpec:
        """Write :meth:`topology_spec` as a topology TOML file (topology/FORMAT.md).

        Keyword arguments are those of :meth:`topology_spec`: measured values replace the
        documented assumptions, and the file's header says which is which.
        """
        spec = self.topology_spec(**measured)
        write_topology_file(path, spec, topology_notes(self.spec, measured))
        return spec


def describe(spec: ClusterSpec, *, intra_gbps: float = ASSUMED_INTRA_GBPS,
             intra_latency_us: float = ASSUMED_INTRA_LATENCY_US,
             tile_tflops: float | None = None,
             tile_memory_gbps: float | None = None) -> TopologySpec:
    """The topology of an emulated cluster: the ``cluster`` preset with its shape.

    The inter-node link is the ``tbf`` rate as TCP payload (:data:`TCP_PAYLOAD_PER_FRAME`
    of it) and the ``netem`` delay plus :data:`ASSUMED_STACK_LATENCY_US` of socket
    overhead. Intra-node (loopback) rate and latency and the ranks' compute rates are not
    set by the emulation: measured values when given, else documented assumptions
    (:data:`ASSUMED_INTRA_GBPS`, :data:`ASSUMED_INTRA_LATENCY_US`, the preset's compute).
    """
    defaults = cluster_preset()
    return _renamed(cluster_preset(
        num_nodes=spec.num_nodes,
        ranks_per_node=spec.ranks_per_node,
        intra_gbps=intra_gbps,
        inter_gbps=spec.inter_payload_gbps,
        intra_latency_us=intra_latency_us,
        inter_latency_us=spec.inter_delay_ms * 1000 + ASSUMED_STACK_LATENCY_US,
        tile_tflops=defaults.tile_tflops if tile_tflops is None else tile_tflops,
        tile_memory_gbps=(defaults.tile_memory_gbps if tile_memory_gbps is None
                          else tile_memory_gbps),
    ), spec)


def _renamed(topology: TopologySpec, spec: ClusterSpec) -> TopologySpec:
    import dataclasses

    from cocodiff.calibration import unconstrained_host_links

    return dataclasses.replace(topology, name=cluster_label(spec),
                               **unconstrained_host_links(topology))


def cluster_label(spec: ClusterSpec) -> str:
    delay = f"-{spec.inter_delay_ms:g}ms" if spec.inter_delay_ms else ""
    return f"emulated-{spec.num_nodes}x{spec.ranks_per_node}-{spec.inter_gbit:g}gbit{delay}"


def topology_notes(spec: ClusterSpec, measured: Mapping[str, float]) -> list[str]:
    """Comment lines saying where each number of :func:`describe` comes from."""
    def source(key: str, assumption: str) -> str:
        return "measured" if key in measured else f"assumed ({assumption})"

    return [
        f"Emulated cluster: {spec.num_nodes} network namespaces x {spec.ranks_per_node} ranks, "
        "one bridge.",
        f"links.nic: tbf {spec.inter_gbit:g} Gbit/s per direction on both ends of each node's "
        f"veth = {spec.inter_payload_gbps:.6g} GB/s of TCP payload "
        f"(x {TCP_PAYLOAD_PER_FRAME:.4f});",
        f"  latency: netem {spec.inter_delay_ms:g} ms one way + {ASSUMED_STACK_LATENCY_US:g} us "
        "of TCP stack (assumed), half on each NIC hop.",
        "links.gpu (loopback inside a node): "
        + source("intra_gbps", f"{ASSUMED_INTRA_GBPS:g} GB/s") + " rate, "
        + source("intra_latency_us", f"{ASSUMED_INTRA_LATENCY_US:g} us") + " latency.",
        "tile: " + source("tile_tflops", "the cluster preset's") + " TFLOP/s, "
        + source("tile_memory_gbps", "the cluster preset's") + " GB/s; "
        "`cocodiff calibrate` measures them.",
    ]


def write_topology_file(path: str | Path, spec: TopologySpec, notes: Sequence[str]) -> None:
    """Write ``spec`` as TOML with ``notes`` as a comment header, whole or not at all."""
    from cocodiff.util.atomic import atomic_write_text

    header = "".join(f"# {line}\n" for line in notes)
    atomic_write_text(path, header + dump_topology(spec))


def _qdisc_sent_bytes(text: str) -> int:
    # The root qdisc's "Sent N bytes" comes first; children repeat the same traffic.
    match = re.search(r"Sent (\d+) bytes", text)
    return int(match.group(1)) if match else 0


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


@contextlib.contextmanager
def emulated_cluster(spec: ClusterSpec, **kwargs: Any) -> Iterator[EmulatedCluster]:
    """``with emulated_cluster(spec) as cluster:``, the functional spelling."""
    with EmulatedCluster(spec, **kwargs) as cluster:
        yield cluster
