"""Named machines: a registry of functions that return a :class:`TopologySpec`.

Sources, cited next to every number:
    [ALCF] ALCF Aurora user guide, "Aurora Machine Overview" and "Node Performance
           Overview" (docs.alcf.anl.gov/aurora/).
    [2512] arXiv 2512.04291 (Aurora performance characterisation).
    [D4]   /work/shared/DESIGN.md section 4, which summarises the two above.
    [H100] NVIDIA H100 Tensor Core GPU datasheet and DGX H100 user guide.

No trustworthy per-link latency is published for these machines: every ``latency_us``
below is an assumption, a parameter to calibrate, and says so.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from topology.errors import TopologyError
from topology.spec import HostSpec, LinkSpec, TopologySpec, check_num_nodes, validate_spec

PCIE_GEN5_X16_GBPS = 64.0  # 32 GT/s x 16 lanes, 128b/130b: ~63 GB/s per direction


def aurora(num_nodes: int = 1) -> TopologySpec:
    """Aurora (ALCF): 6 Intel Max 1550 GPUs x 2 tiles per node, Xe Link all-to-all,
    8 Slingshot-11 NICs per node, dragonfly fabric."""
    return TopologySpec(
        name="aurora",
        num_nodes=num_nodes,
        gpus_per_node=6,  # 6 x Intel Data Center GPU Max 1550 per node [ALCF]
        tiles_per_gpu=2,  # 2 stacks ("tiles") per GPU, one rank per tile [ALCF]
        nics_per_node=8,  # 8 HPE Slingshot-11 NICs per node [ALCF]
        tile_tflops=256.0,  # BF16 GEMM measured ~256 TF/s per tile [2512][D4]
        tile_memory_gbps=1000.0,  # HBM2e ~1 TB/s per tile measured [2512][D4]
        # Tile <-> sibling tile of the same GPU: ~185-196 GB/s uni measured [ALCF][D4].
        # Latency: assumption (not public).
        tile_link=LinkSpec(bandwidth_gbps=185.0, latency_us=2.0),
        # Xe Link: 15 GB/s uni per GPU pair measured (28 GB/s theoretical) [ALCF][D4].
        # Latency: assumption (not public).
        gpu_link=LinkSpec(bandwidth_gbps=15.0, latency_us=3.0),
        gpu_fabric="all-to-all",  # "The GPUs are connected all-to-all with Xe Link" [ALCF]
        # On package: the tile's own HBM rate, i.e. never the bottleneck. Assumption.
        port_link=LinkSpec(bandwidth_gbps=1000.0, latency_us=0.0),
        # GPUs reach the host and the NICs over PCIe Gen5 x16 ("The GPUs may send messages
        # directly to the NIC via PCIe") [ALCF]. Latency: assumption.
        host_link=LinkSpec(bandwidth_gbps=PCIE_GEN5_X16_GBPS, latency_us=1.0),
        # Slingshot-11: 200 Gb/s = 25 GB/s per NIC [ALCF][D4]. Latency per NIC <-> switch
        # hop: assumption (a route pays it at both ends: 2 us NIC to NIC).
        nic_link=LinkSpec(bandwidth_gbps=25.0, latency_us=1.0),
        # Dragonfly, <= 3 switch hops [ALCF][D4] x 0.5 us per hop (assumption).
        fabric_latency_us=3 * 0.5,
    )


def dgx_h100(num_nodes: int = 1) -> TopologySpec:
    """A DGX-H100-like node: 8 H100 SXM GPUs on NVSwitch, 8 x 400 Gb/s NICs."""
    return TopologySpec(
        name="dgx-h100",
        num_nodes=num_nodes,
        gpus_per_node=8,  # 8 x H100 SXM5 [H100]
        tiles_per_gpu=1,  # one die per GPU
        nics_per_node=8,  # 8 x ConnectX-7 for the compute fabric [H100]
        tile_tflops=989.0,  # H100 SXM dense BF16 (1979 with sparsity) [H100]
        tile_memory_gbps=3350.0,  # HBM3 3.35 TB/s [H100]
        tile_link=None,
        # NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction per GPU, through the
        # NVSwitch [H100]. Latency per GPU <-> switch hop: assumption (1 us GPU to GPU).
        gpu_link=LinkSpec(bandwidth_gbps=450.0, latency_us=0.5),
        gpu_fabric="switch",
        port_link=LinkSpec(bandwidth_gbps=3350.0, latency_us=0.0),  # not a constraint
        # PCIe Gen5 x16 to the host and NICs [H100]. Latency: assumption.
        host_link=LinkSpec(bandwidth_gbps=PCIE_GEN5_X16_GBPS, latency_us=1.0),
        # 400 Gb/s InfiniBand NDR = 50 GB/s per NIC [H100]. Latency: assumption.
        nic_link=LinkSpec(bandwidth_gbps=50.0, latency_us=1.0),
        # Fat tree, 3 switch hops x 0.2 us: assumption.
        fabric_latency_us=3 * 0.2,
    )


def cluster(
    num_nodes: int = 2,
    ranks_per_node: int = 2,
    intra_gbps: float = 5.0,
    inter_gbps: float = 0.125,
    intra_latency_us: float = 20.0,
    inter_latency_us: float = 100.0,
    tile_tflops: float = 0.1,
    tile_memory_gbps: float = 20.0,
) -> TopologySpec:
    """A generic cluster of ``num_nodes`` x ``ranks_per_node`` ranks, one rank per "GPU".

    Meant for laptops and for the emulated cluster of DESIGN.md section 6 (network
    namespaces joined by ``tc``-shaped veth links). The defaults are rough figures for a
    laptop-class CPU; calibrate them (``cocodiff calibrate``) before trusting
    predictions.

    Args:
        num_nodes: nodes (network namespaces).
        ranks_per_node: ranks in one node; each is a 1-tile GPU.
        intra_gbps: GB/s per direction of one rank into the node (loopback TCP on a
            laptop moves a few GB/s; 5 by default).
        inter_gbps: GB/s per direction of the node's one NIC (default 1 Gbit/s =
            0.125 GB/s, a shaped veth or gigabit Ethernet).
        intra_latency_us: one-way rank-to-rank latency inside a node (default 20 us,
            loopback TCP).
        inter_latency_us: one-way latency between nodes (default 100 us, a LAN).
        tile_tflops: compute rate of one rank (default 0.1 TF/s, a few CPU cores).
        tile_memory_gbps: memory bandwidth of one rank (default 20 GB/s).

    Returns:
        The spec. Rank-to-rank latencies are split so that a route sums to exactly
        ``intra_latency_us`` or ``inter_latency_us``: the GPU <-> switch hop is crossed
        twice (half each) and the NIC <-> fabric hop twice (half each); the on-node host
        links are not a constraint (the rank's memory rate, no latency).
    """
    unconstrained = LinkSpec(bandwidth_gbps=tile_memory_gbps, latency_us=0.0)
    return TopologySpec(
        name="cluster",
        num_nodes=num_nodes,
        gpus_per_node=ranks_per_node,
        tiles_per_gpu=1,
        nics_per_node=1,
        tile_tflops=tile_tflops,
        tile_memory_gbps=tile_memory_gbps,
        tile_link=None,
        gpu_link=(
            LinkSpec(bandwidth_gbps=intra_gbps, latency_us=intra_latency_us / 2)
            if ranks_per_node > 1
            else None
        ),
        gpu_fabric="switch",
        port_link=unconstrained,
        host_link=unconstrained,
        nic_link=LinkSpec(bandwidth_gbps=inter_gbps, latency_us=inter_latency_us / 2),
        fabric_latency_us=0.0,
    )


# What one rank's exchange costs this machine's CPU before calibration says otherwise:
# loopback TCP through gloo costs tens of microseconds of CPU per message and copies at a
# few GB/s per core (assumptions; `cocodiff calibrate` measures both into [host]).
LOCAL_MESSAGE_CPU_US = 30.0
LOCAL_COPY_GBPS = 2.0


def machine_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cluster_local(num_nodes: int = 2, ranks_per_node: int = 2) -> TopologySpec:
    """The ``cluster`` preset with every rank on *this* machine's cores: a laptop, or the
    emulated cluster whose namespaces all share one host. Compute and every exchange's
    CPU work share :func:`machine_cores` cores (``[host]``, :class:`HostSpec`)."""
    spec = cluster(num_nodes=num_nodes, ranks_per_node=ranks_per_node)
    host = HostSpec(cores=float(machine_cores()), message_cpu_us=LOCAL_MESSAGE_CPU_US,
                    copy_gbps=LOCAL_COPY_GBPS)
    return dataclasses.replace(spec, name="cluster-local", host=host)


PRESETS: dict[str, Callable[..., TopologySpec]] = {
    "aurora": aurora,
    "cluster": cluster,
    "cluster-local": cluster_local,
    "dgx-h100": dgx_h100,
}
"""Preset name -> function returning its spec; every function takes ``num_nodes``."""


def get_preset(name: str, num_nodes: int | None = None) -> TopologySpec:
    """The named preset, validated.

    Args:
        name: a key of :data:`PRESETS`.
        num_nodes: nodes in the machine; ``None`` keeps the preset's default.

    Raises:
        TopologyError: unknown name (the message lists the valid ones) or bad
            ``num_nodes``.
    """
    factory = PRESETS.get(name) if isinstance(name, str) else None
    if factory is None:
        raise TopologyError(
            f"unknown topology preset {name!r} (valid: {', '.join(sorted(PRESETS))})"
        )
    if num_nodes is None:
        spec = factory()
    else:
        check_num_nodes(num_nodes)
        spec = factory(num_nodes=num_nodes)
    validate_spec(spec)
    return spec
