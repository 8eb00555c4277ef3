"""Named machines: a registry of functions that return a :class:`TopologySpec`.

Sources, cited next to every number:
    [ALCF] ALCF Aurora user guide, "Aurora Machine Overview" and "Node Performance
           Overview" (docs.alcf.anl.gov/aurora/).
    [2512] arXiv 2512.04291 (Aurora performance characterisation).
    [H100] NVIDIA H100 Tensor Core GPU datasheet and DGX H100 user guide.
    [A100] NVIDIA A100 Tensor Core GPU datasheet and DGX A100 user guide.
    [L40]  NVIDIA L40 GPU datasheet (48 GB GDDR6, 864 GB/s, 181.05 dense BF16 TFLOP/s,
           PCIe Gen4 x16 64 GB/s bidirectional, no NVLink).
    [PCIE4] PCI Express Base Specification 4.0: 16 GT/s per lane, 128b/130b encoding.
    [CX6]  NVIDIA ConnectX-6 Dx Ethernet adapter datasheet: 100 Gb/s per port.

Kernel rates (:data:`DEVICES`, ``cocodiff.kernels``) come from kernel microbenchmarks:
    [GEMM]  bench/device_block.py's matrix-product microbenchmarks on one H100 80GB HBM3
            (docs/gpu.md, 2026-11-26: projection, MLP up and down GEMMs at 1152, 1536 and
            4608 rows, bf16, 18 timings): least squares of t = F / R + t0 gives
            R = 716 TFLOP/s, t0 = 2.2 us (every point within 6%).
    [FA3]   Shah et al., FlashAttention-3 (arXiv 2407.08608), figure "Attention forward
            speed, head dim 128 (H100 80GB SXM5)", non-causal, FlashAttention-2's bars (the
            kernel xDiT's and yunchang's attention call).
    [FA2]   Dao, FlashAttention-2 (arXiv 2307.08691): forward 50-73% of A100's peak.
    [BRRR]  H. He, "Making Deep Learning Go Brrrr From First Principles"
            (horace.io/brrr_intro.html), "Overhead": eager PyTorch spends on the order of
            10 us of host time per operator.

No trustworthy per-link latency is published for these machines: every ``latency_us``
below is an assumption, a parameter to calibrate, and says so.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from topology.errors import TopologyError
from topology.spec import (
    DeviceRates,
    HostSpec,
    LinkSpec,
    TopologySpec,
    check_num_nodes,
    validate_spec,
)

PCIE_GEN5_X16_GBPS = 64.0  # 32 GT/s x 16 lanes, 128b/130b: ~63 GB/s per direction
PCIE_GEN4_X16_GBPS = 32.0  # 16 GT/s x 16 lanes, 128b/130b: ~31.5 GB/s per direction [PCIE4]

# FlashAttention-2 forward on an H100 SXM5, head dim 128, non-causal (TFLOP/s by sequence
# length) [FA3].
_FA2_H100 = ((512, 309.0), (1024, 350.0), (2048, 362.0), (4096, 368.0), (8192, 370.0),
             (16384, 370.0))
# Host and launch costs (assumptions anchored as stated): an eager op costs the host ~9 us
# (docs/gpu.md's adaLN-norm microbenchmark: 4 eager ops in 36 us at 1152 tokens, an upper
# bound; [BRRR]: "order of 10 us"); a kernel's launch gap on the GPU ~1 us; torch.compile's
# generated code calls its kernels without the dispatcher, ~3 us each (assumption).
_HOST_US, _LAUNCH_US, _COMPILED_HOST_US = 9.0, 1.0, 3.0

DEVICES: dict[str, DeviceRates] = {
    "h100-sxm": DeviceRates(
        name="h100-sxm",
        gemm_tflops=716.0, gemm_fixed_us=2.2,  # [GEMM]
        attention_tflops=_FA2_H100,  # [FA3]
        # Streaming kernels at 90% of HBM3's 3.35 TB/s [H100] (assumption: the usual
        # copy-kernel fraction; calibrate's adaLN norm reached only 1.5 TB/s, docs/gpu.md)
        memory_gbps=3015.0,
        sm_count=132,  # H100 SXM5 [H100]
        launch_us=_LAUNCH_US, host_us=_HOST_US,
        compiled_launch_us=_LAUNCH_US, compiled_host_us=_COMPILED_HOST_US,
    ),
    "a100-sxm": DeviceRates(
        name="a100-sxm",
        # No GEMM microbenchmark of ours on an A100: H100's achieved share of its peak
        # (716 / 989) applied to A100's 312 TFLOP/s [A100] (assumption), the same t0.
        gemm_tflops=226.0, gemm_fixed_us=2.2,
        # [FA2]: 50-73% of 312 TFLOP/s; H100's FA2 curve shape scaled to end at 73%.
        attention_tflops=tuple((s_, round(r * 0.73 * 312.0 / 370.0, 1)) for s_, r in _FA2_H100),
        memory_gbps=1835.0,  # 90% of 2039 GB/s HBM2e [A100] (assumption as for H100)
        sm_count=108,  # [A100]
        launch_us=_LAUNCH_US, host_us=_HOST_US,
        compiled_launch_us=_LAUNCH_US, compiled_host_us=_COMPILED_HOST_US,
    ),
    "max1550-tile": DeviceRates(
        name="max1550-tile",
        gemm_tflops=256.0, gemm_fixed_us=2.2,  # BF16 GEMM ~256 TF/s per tile measured [2512]
        # No FlashAttention table is published for the Max 1550: FA2's share of the H100
        # GEMM rate (370 / 716) applied to the tile's GEMM rate (assumption).
        attention_tflops=tuple((s_, round(r * 256.0 / 716.0, 1)) for s_, r in _FA2_H100),
        memory_gbps=1000.0,  # HBM2e ~1 TB/s per tile measured [2512]
        sm_count=64,  # 64 Xe-cores per tile [ALCF]
        launch_us=_LAUNCH_US, host_us=_HOST_US,  # assumptions, as for the H100
        compiled_launch_us=_LAUNCH_US, compiled_host_us=_COMPILED_HOST_US,
    ),
}
"""Kernel rates of one tile, by device (``[tile] device = "h100-sxm"`` in a topology file)."""


def aurora(num_nodes: int = 1) -> TopologySpec:
    """Aurora (ALCF): 6 Intel Max 1550 GPUs x 2 tiles per node, Xe Link all-to-all,
    8 Slingshot-11 NICs per node, dragonfly fabric."""
    return TopologySpec(
        name="aurora",
        num_nodes=num_nodes,
        gpus_per_node=6,  # 6 x Intel Data Center GPU Max 1550 per node [ALCF]
        tiles_per_gpu=2,  # 2 stacks ("tiles") per GPU, one rank per tile [ALCF]
        nics_per_node=8,  # 8 HPE Slingshot-11 NICs per node [ALCF]
        tile_tflops=256.0,  # BF16 GEMM measured ~256 TF/s per tile [2512]
        tile_memory_gbps=1000.0,  # HBM2e ~1 TB/s per tile measured [2512]
        tile_memory_gb=64.0,  # 128 GB HBM2e per Max 1550, 64 GB per tile [ALCF]
        device=DEVICES["max1550-tile"],
        # Tile <-> sibling tile of the same GPU: ~185-196 GB/s uni measured [ALCF].
        # Latency: assumption (not public).
        tile_link=LinkSpec(bandwidth_gbps=185.0, latency_us=2.0),
        # Xe Link: 15 GB/s uni per GPU pair measured (28 GB/s theoretical) [ALCF].
        # Latency: assumption (not public).
        gpu_link=LinkSpec(bandwidth_gbps=15.0, latency_us=3.0),
        gpu_fabric="all-to-all",  # "The GPUs are connected all-to-all with Xe Link" [ALCF]
        # On package: the tile's own HBM rate, i.e. never the bottleneck. Assumption.
        port_link=LinkSpec(bandwidth_gbps=1000.0, latency_us=0.0),
        # GPUs reach the host and the NICs over PCIe Gen5 x16 ("The GPUs may send messages
        # directly to the NIC via PCIe") [ALCF]. Latency: assumption.
        host_link=LinkSpec(bandwidth_gbps=PCIE_GEN5_X16_GBPS, latency_us=1.0),
        # Slingshot-11: 200 Gb/s = 25 GB/s per NIC [ALCF]. Latency per NIC <-> switch
        # hop: assumption (a route pays it at both ends: 2 us NIC to NIC).
        nic_link=LinkSpec(bandwidth_gbps=25.0, latency_us=1.0),
        # Dragonfly, <= 3 switch hops [ALCF] x 0.5 us per hop (assumption).
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
        tile_memory_gb=80.0,  # H100 SXM 80 GB HBM3 [H100]
        device=DEVICES["h100-sxm"],
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


def dgx_a100(num_nodes: int = 1) -> TopologySpec:
    """A DGX-A100-like node: 8 A100 SXM4 GPUs on NVSwitch, 8 x 200 Gb/s NICs."""
    return TopologySpec(
        name="dgx-a100",
        num_nodes=num_nodes,
        gpus_per_node=8,  # 8 x A100 SXM4 [A100]
        tiles_per_gpu=1,
        nics_per_node=8,  # 8 x ConnectX-6 HDR for the compute fabric [A100]
        tile_tflops=312.0,  # A100 dense BF16 [A100]
        tile_memory_gbps=2039.0,  # HBM2e 2039 GB/s (80 GB) [A100]
        tile_memory_gb=80.0,  # A100 SXM4 80 GB HBM2e [A100]
        device=DEVICES["a100-sxm"],
        tile_link=None,
        # NVLink 3: 600 GB/s bidirectional = 300 GB/s per direction per GPU [A100].
        # Latency per GPU <-> switch hop: assumption.
        gpu_link=LinkSpec(bandwidth_gbps=300.0, latency_us=0.5),
        gpu_fabric="switch",
        port_link=LinkSpec(bandwidth_gbps=2039.0, latency_us=0.0),  # not a constraint
        host_link=LinkSpec(bandwidth_gbps=32.0, latency_us=1.0),  # PCIe Gen4 x16 [A100]
        nic_link=LinkSpec(bandwidth_gbps=25.0, latency_us=1.0),  # HDR 200 Gb/s [A100]
        fabric_latency_us=3 * 0.2,  # assumption
    )


def l40_pcie(num_nodes: int = 1) -> TopologySpec:
    """8 L40 GPUs per node on PCIe Gen4 (no NVLink), one NIC per node: the machine of xDiT's
    16 x L40 figures (two such nodes).

    GPU to GPU traffic crosses each GPU's own x16 link to the host's root complex, modelled
    as a switch port of the x16 link's rate. The two sockets' link (UPI/QPI) is not
    modelled: at Intel's datasheet rate (3 UPI links x 11.2 GT/s, ~67 GB/s per direction)
    it does not bind before the GPUs' x16 links do, and the slowdown xDiT reports across
    sockets ("Using 8xL40 actually slows down due to the need for QPI communication",
    docs/performance/flux.md) comes from peer-to-peer staging through host memory, for
    which no datasheet gives a rate."""
    return TopologySpec(
        name="l40-pcie",
        num_nodes=num_nodes,
        gpus_per_node=8,  # 8 x L40 per node (xDiT's 8xL40 machine)
        tiles_per_gpu=1,
        nics_per_node=1,  # one NIC per node (the machine)
        tile_tflops=181.05,  # dense BF16 tensor TFLOP/s [L40]
        tile_memory_gbps=864.0,  # GDDR6 864 GB/s [L40]
        tile_memory_gb=48.0,  # 48 GB GDDR6 [L40]
        tile_link=None,
        # Each GPU's PCIe Gen4 x16 link, 64 GB/s bidirectional [L40] = 32 GB/s per
        # direction [PCIE4], to the root complex. Latency: assumption.
        gpu_link=LinkSpec(bandwidth_gbps=PCIE_GEN4_X16_GBPS, latency_us=1.0),
        gpu_fabric="switch",
        port_link=LinkSpec(bandwidth_gbps=864.0, latency_us=0.0),  # not a constraint
        # The NIC's PCIe Gen4 x16 slot [PCIE4]. Latency: assumption.
        host_link=LinkSpec(bandwidth_gbps=PCIE_GEN4_X16_GBPS, latency_us=1.0),
        # One 100 Gb/s Ethernet port = 12.5 GB/s [CX6] (which NIC xDiT's nodes have is not
        # published: an assumption). Latency per NIC <-> switch hop: assumption.
        nic_link=LinkSpec(bandwidth_gbps=12.5, latency_us=2.0),
        fabric_latency_us=1.0,  # one Ethernet switch: assumption
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
    "dgx-a100": dgx_a100,
    "dgx-h100": dgx_h100,
    "l40-pcie": l40_pcie,
    # 8 x A100 SXM on NVLink 3 (NVSwitch): the dgx-a100 machine, under the name issue 35
    # gives it.
    "a100-nvlink": dgx_a100,
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
