"""``cocodiff calibrate``: measure this machine and write the topology file the simulator uses.

What is measured (all on the real transport, between real processes):

- **Compute**, on every rank at once (so ranks that share cores are measured sharing them):
  the matrix products of one transformer layer on one Ulysses rank (Q/K/V/out projections,
  the MLP, attention over all tokens for the rank's heads) at the model's shapes, giving an
  effective TFLOP/s (their FLOPs as :mod:`cocodiff.cost` counts them over their measured
  time), and its elementwise work (the adaLN-modulated layer norms) at the same shapes,
  giving an effective memory GB/s (bytes as :mod:`cocodiff.cost` counts them). These are the
  ``[tile]`` rates of the roofline model.
- **The model's real transformer blocks**, on every rank at once (so core sharing is
  included), when calibrate can build the model's transformer (a tiny model or a
  diffusers directory; FLUX): the diffusers modules run on one rank's local token shard,
  no communication, every block timed with forward hooks. Attention there runs over the
  local tokens with every head; the measured difference between scaled-dot-product
  attention at the true Ulysses shape (all tokens, the rank's heads) and at the local one
  is added back. The resulting seconds per layer include what a FLOP count does not see
  (RoPE, modulation, reshapes, a few dozen small ops' dispatch). They become the
  *effective* ``[tile] tflops`` written to the topology: the rate at which the simulator,
  charging every operation of a layer as :mod:`cocodiff.cost` prices it (the roofline of
  each, at the measured memory rate), takes exactly the measured seconds for one layer.
  The matrix-product rate stays in the JSON (``compute.tflops``) beside it
  (``compute.tile_tflops``, ``compute.block``).
- **Each link tier**, with a two-rank exchange (each side sends ``n`` bytes to the other at
  once; an all-to-all over the pair) swept over message sizes, between two ranks of one
  node (intra) and two ranks of different nodes (inter), fitted as
  ``time = latency + n / bandwidth`` (least squares on relative error). The fit's latency
  is the one-way start-up of one message, software included; its bandwidth is what one
  transfer achieves per direction. These become ``[links.gpu]`` and ``[links.nic]`` of the
  ``cluster`` preset's shape.
- **The collective**: flat all-to-alls over the whole world at a few sizes, reported
  next to what the fitted links predict for them (the slowest of the busiest per-rank port
  and the busiest node NIC, each with its latency) so a reader can see how far a
  collective runs from the wire. With the two-rank exchanges they are the table that
  :func:`cocodiff.simulator.collective_fit.fit_collective` fits the simulator's collective model to
  (per span: per-transfer set-up and the rate a rank's transfers reach together), the same
  fit that gives Aurora's preset; written as JSON ``collective`` (the topology file has no
  place for it).

Nodes are the ranks' (hostname, network namespace) pairs, so the ranks of an emulated
cluster's namespaces (``python -m bench.cluster run -- cocodiff calibrate``) group into their
nodes. On one machine without namespaces every rank is one node; ``--nodes K`` then
groups them ``R`` per node by rank, and the "inter-node" pair is measured on loopback too,
or taken from ``--inter-gbps`` / ``--inter-latency-us`` (e.g. an emulated cluster's ``tc``
settings). Started without a launcher, ``cocodiff calibrate`` launches itself on
``nodes x ranks-per-node`` local ranks (torch transport over loopback).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cocodiff.models import read_tiny_marker
from cocodiff.runtime.nodes import detect_nodes, node_major_shape
from cocodiff.util.atomic import check_output_paths
from cocodiff.util.errors import CocodiffError
from cocodiff.util.jsonfile import read_json

ROW_BYTES = 1024  # exchanges move rows of 1 KiB; sizes are whole rows
DEFAULT_SIZES_KIB = (1, 4, 16, 64, 256, 1024, 4096)
QUICK_SIZES_KIB = (1, 16, 256, 2048)
ALL_TO_ALL_KIB = (16, 256, 2048)
QUICK_ALL_TO_ALL_KIB = (64,)


class CalibrationError(CocodiffError):
    """Calibration could not run or its measurements cannot be fitted."""


# ---------------------------------------------------------------------------------------------
# Fitting


@dataclass(frozen=True, slots=True)
class LinkFit:
    """``time = latency_us * 1e-6 + num_bytes / (bandwidth_gbps * 1e9)`` fitted to points.

    Attributes:
        latency_us: fitted one-way start-up of one message.
        bandwidth_gbps: fitted per-direction rate, GB/s (10^9 bytes/s).
        points: ``(num_bytes, median seconds)`` per message size.
        max_rel_error: the largest ``|fit - measured| / measured`` over the points.
        source: ``"measured"``, ``"measured on loopback"`` or ``"given"``.
    """

    latency_us: float
    bandwidth_gbps: float
    points: tuple[tuple[int, float], ...] = ()
    max_rel_error: float = 0.0
    source: str = "measured"

    def seconds(self, num_bytes: float) -> float:
        return self.latency_us * 1e-6 + num_bytes / (self.bandwidth_gbps * 1e9)

    def to_json(self) -> dict[str, Any]:
        return {
            "latency_us": self.latency_us,
            "bandwidth_gbps": self.bandwidth_gbps,
            "max_rel_error": self.max_rel_error,
            "source": self.source,
            "points": [{"num_bytes": n, "seconds": s} for n, s in self.points],
        }


def fit_latency_bandwidth(points: Sequence[tuple[int, float]], source: str = "measured"
                          ) -> LinkFit:
    """Fit ``t = a + n / B`` to ``(n bytes, t seconds)`` points.

    The bandwidth is the Theil-Sen slope (the median of the slopes between every two
    points, robust to one disturbed measurement) over the larger half of the sizes, where
    bytes dominate; the latency is the median, over the smallest quarter of the sizes (at least
    one), of what is left of each time once its bytes are paid at that bandwidth, at least
    0. A single least-squares line through every point would let whatever happens between
    small and large messages (eager versus rendezvous protocols, cache-resident buffers, a
    shaper's burst allowance) drag both numbers off; ``max_rel_error`` reports how far the
    line is from the worst point.

    Raises:
        CalibrationError: fewer than two sizes, a non-positive time, or times that do not
            grow with size (no bandwidth can be read from them).
    """
    import numpy as np

    ordered = sorted((int(n), float(t)) for n, t in points)
    sizes = np.array([n for n, _ in ordered], dtype=float)
    times = np.array([t for _, t in ordered])
    if len(set(sizes.tolist())) < 2:
        raise CalibrationError(f"need at least two message sizes to fit, got {len(ordered)}")
    if np.any(times <= 0):
        raise CalibrationError(f"non-positive measured time in {_points_text(ordered)}")
    half = len(ordered) // 2
    large = slice(half - 1 if len(ordered) % 2 == 0 and half > 1 else half, None)
    slope = _slope(sizes[large], times[large])
    if slope <= 0:
        slope = _slope(sizes, times)
    if slope <= 0:
        raise CalibrationError(
            f"times do not grow with message size ({_points_text(ordered)}): no bandwidth to "
            "fit; use larger sizes"
        )
    small = slice(0, max(1, len(ordered) // 4))
    latency_s = max(0.0, float(np.median(times[small] - sizes[small] * slope)))
    fitted = latency_s + sizes * slope
    error = float(np.max(np.abs(fitted - times) / times))
    return LinkFit(latency_s * 1e6, 1.0 / slope / 1e9, tuple(ordered), error, source)


def _slope(sizes, times) -> float:
    """Theil-Sen: the median slope over every pair of points of different size."""
    slopes = [(times[j] - times[i]) / (sizes[j] - sizes[i])
              for i in range(len(sizes)) for j in range(i + 1, len(sizes))
              if sizes[j] != sizes[i]]
    return float(statistics.median(slopes)) if slopes else 0.0


def _points_text(points: Sequence[tuple[int, float]]) -> str:
    return ", ".join(f"{n} B: {t * 1e6:.0f} us" for n, t in points)


# ---------------------------------------------------------------------------------------------
# Compute


@dataclass(frozen=True, slots=True)
class LayerShapes:
    """The shapes one Ulysses rank computes in one layer.

    Attributes:
        model: the model's name.
        total_tokens: attention sequence length ``S``.
        local_tokens: tokens a rank holds, ``ceil(S / P)``.
        local_heads: heads a rank attends over, ``ceil(H / P)``.
        head_dim: channels per head.
        hidden_size: model width ``d``.
        mlp_ratio: MLP width over ``d``.
    """

    model: str
    total_tokens: int
    local_tokens: int
    local_heads: int
    head_dim: int
    hidden_size: int
    mlp_ratio: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class ComputeRates:
    """Effective rates of one rank while every rank computes.

    Attributes:
        tflops: matrix-product FLOP/s / 10^12 (median over ranks).
        memory_gbps: elementwise bytes/s / 10^9 (median over ranks).
        per_rank_tflops: each rank's own figure.
        per_rank_memory_gbps: each rank's own figure.
        op_seconds: seconds per call of each timed operation on rank 0.
    """

    tflops: float
    memory_gbps: float
    per_rank_tflops: tuple[float, ...]
    per_rank_memory_gbps: tuple[float, ...]
    op_seconds: dict[str, float] = field(default_factory=dict)
    block: dict[str, Any] | None = None

    @property
    def tile_tflops(self) -> float:
        """The rate the topology gets: the real blocks' effective rate when they were
        timed, else the matrix products'."""
        return self.block["effective_tflops"] if self.block else self.tflops

    @property
    def tile_memory_gbps(self) -> float:
        """The memory rate the topology gets: the microbenchmark's, unless the real blocks
        ran faster than it allows (see :func:`effective_rates`)."""
        return self.block["effective_memory_gbps"] if self.block else self.memory_gbps

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "tile_tflops": self.tile_tflops,
                "tile_memory_gbps": self.tile_memory_gbps}


@dataclass(frozen=True, slots=True)
class BlockTiming:
    """One rank's timing of the model's real transformer blocks on its local shard.

    Attributes:
        blocks: transformer blocks timed per forward (the model's layers).
        local_forward_s: seconds of all blocks in one forward on the local tokens (median).
        attention_local_s: one attention call as it ran there (local tokens, all heads).
        attention_ulysses_s: one attention call at the Ulysses shape (all tokens, the
            rank's heads).
        layer_s: seconds per layer with attention at the Ulysses shape:
            ``(local_forward_s + blocks * (attention_ulysses_s - attention_local_s)) / blocks``.
    """

    blocks: int
    local_forward_s: float
    attention_local_s: float
    attention_ulysses_s: float
    layer_s: float


def _time_call(fn: Callable[[], object], min_time_s: float, max_calls: int = 10_000) -> float:
    """Median seconds per call over batches filling ``min_time_s`` (after one warm-up)."""
    fn()
    batches: list[float] = []
    calls = 1
    # Grow the batch until it takes ~1/5 of the budget, then time five batches of it.
    while True:
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - began
        if elapsed >= min_time_s / 5 or calls >= max_calls:
            break
        calls = min(max_calls, calls * 2)
    batches.append(elapsed / calls)
    for _ in range(4):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter() - began) / calls)
    return statistics.median(batches)


def measure_compute(shapes: LayerShapes, dtype_name: str = "float32",
                    min_time_s: float = 0.05) -> tuple[float, float, dict[str, float]]:
    """Time one rank's layer operations at ``shapes``.

    Returns:
        ``(flop/s, bytes/s, seconds per call by op)``: the matrix products' FLOPs over their
        time (weighted as often as they occur in a layer) and the elementwise bytes over
        theirs, counted as :mod:`cocodiff.cost` counts them.
    """
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    size = torch.finfo(dtype).bits // 8
    s_loc, d = shapes.local_tokens, shapes.hidden_size
    inner = max(1, round(shapes.mlp_ratio * d))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)

    x, w, w_up, w_down = rand(s_loc, d), rand(d, d), rand(d, inner), rand(inner, d)
    hidden = rand(s_loc, inner)
    q = rand(1, shapes.local_heads, shapes.total_tokens, shapes.head_dim)
    k, v = rand(*q.shape), rand(*q.shape)
    scale, shift = rand(d), rand(d)
    s, hd, h = shapes.total_tokens, shapes.head_dim, shapes.local_heads
    with torch.inference_mode():
        ops: dict[str, tuple[Callable[[], object], float, int]] = {
            # name: (call, FLOPs per call, calls per layer)
            "projection": (lambda: x @ w, 2.0 * s_loc * d * d, 4),
            "mlp_up": (lambda: x @ w_up, 2.0 * s_loc * d * inner, 1),
            "mlp_down": (lambda: hidden @ w_down, 2.0 * s_loc * inner * d, 1),
            "attention": (lambda: F.scaled_dot_product_attention(q, k, v),
                          4.0 * s * s * hd * h, 1),
        }
        op_seconds = {name: _time_call(call, min_time_s) for name, (call, _, _) in ops.items()}

        def norm() -> object:
            return F.layer_norm(x, (d,)) * (1 + scale) + shift

        op_seconds["norm"] = _time_call(norm, min_time_s)
    flops = sum(f * n for _, f, n in ops.values())
    matmul_s = sum(op_seconds[name] * n for name, (_, _, n) in ops.items())
    # cocodiff.cost: an elementwise pass reads and writes each element once.
    norm_bytes = 2.0 * s_loc * d * size
    return flops / matmul_s, norm_bytes / op_seconds["norm"], op_seconds


def _flux_local_inputs(config, image_tokens: int, text_tokens: int, dtype) -> dict:
    """FLUX transformer inputs holding ``image_tokens`` image and ``text_tokens`` text
    tokens (one rank's shard; positions are a row of the image, values random)."""
    import torch

    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int):
        return torch.randn(*shape, generator=gen).to(dtype)

    img_ids = torch.zeros(image_tokens, 3)
    img_ids[:, 2] = torch.arange(float(image_tokens))
    return {
        "hidden_states": randn(1, image_tokens, config.in_channels),
        "encoder_hidden_states": randn(1, text_tokens, config.joint_attention_dim),
        "pooled_projections": randn(1, config.pooled_projection_dim),
        "timestep": torch.full((1,), 0.5, dtype=dtype),
        "guidance": torch.full((1,), 3.5, dtype=dtype) if config.guidance_embeds else None,
        "img_ids": img_ids,
        "txt_ids": torch.zeros(text_tokens, 3),
    }


# Transformer class -> (builder of local-shard inputs, block lists timed).
_BLOCK_INPUTS: dict[str, tuple[Callable[..., dict], tuple[str, ...]]] = {
    "FluxTransformer2DModel": (_flux_local_inputs,
                               ("transformer_blocks", "single_transformer_blocks")),
}


def build_transformer(config: dict[str, Any]):
    """The diffusers transformer of ``config`` (random weights from a fixed seed)."""
    import diffusers
    import torch

    name = config.get("_class_name")
    cls = getattr(diffusers, str(name), None) if name in _BLOCK_INPUTS else None
    if cls is None:
        raise CalibrationError(
            f"cannot time the real blocks of {name}; supported: {', '.join(_BLOCK_INPUTS)}"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls.from_config(config).eval()


def time_blocks(transformer, shapes: LayerShapes, stream_tokens: Sequence[int], world: int,
                dtype_name: str = "float32", repeats: int = 5) -> BlockTiming:
    """Time ``transformer``'s real blocks on one rank's local shard of ``stream_tokens``
    (image, text) over ``world`` Ulysses ranks, without communication, and correct
    attention to the Ulysses shape (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    name = type(transformer).__name__
    if name not in _BLOCK_INPUTS:
        raise CalibrationError(
            f"cannot time the real blocks of {name}; supported: {', '.join(_BLOCK_INPUTS)}"
        )
    build_inputs, lists = _BLOCK_INPUTS[name]
    dtype = getattr(torch, dtype_name)
    transformer = transformer.to(dtype)
    image, text = (math.ceil(tokens / world) for tokens in stream_tokens)
    inputs = build_inputs(transformer.config, image, text, dtype)
    blocks = [block for attr in lists for block in getattr(transformer, attr)]
    began: list[float] = []
    spent: list[float] = []

    def before(module, args, kwargs) -> None:
        began.append(time.perf_counter())

    def after(module, args, kwargs, output) -> None:
        spent.append(time.perf_counter() - began.pop())

    handles = [hook for block in blocks for hook in (
        block.register_forward_pre_hook(before, with_kwargs=True),
        block.register_forward_hook(after, with_kwargs=True))]
    totals = []
    try:
        with torch.inference_mode():
            for index in range(repeats + 1):  # the first warms up
                spent.clear()
                transformer(**inputs, return_dict=False)
                if index:
                    totals.append(sum(spent))
    finally:
        for handle in handles:
            handle.remove()
    heads, hd = transformer.config.num_attention_heads, shapes.head_dim
    gen = torch.Generator().manual_seed(1)

    def attention(heads_: int, tokens: int) -> Callable[[], object]:
        q, k, v = (torch.randn(1, heads_, tokens, hd, generator=gen).to(dtype)
                   for _ in range(3))
        return lambda: F.scaled_dot_product_attention(q, k, v)

    with torch.inference_mode():
        local = _time_call(attention(heads, image + text), 0.02)
        ulysses = _time_call(attention(shapes.local_heads, shapes.total_tokens), 0.02)
    forward = statistics.median(totals)
    layer = (forward + len(blocks) * (ulysses - local)) / len(blocks)
    return BlockTiming(len(blocks), forward, local, ulysses, layer)


def layer_roofline_seconds(spec, shape, tflops: float, memory_gbps: float) -> float:
    """What the simulator charges for one layer: every operation of :mod:`cocodiff.cost`
    at its roofline (the compute steps a plan emits, one per operation)."""
    from cocodiff.cost import OPS, op_cost, roofline_seconds

    return sum(roofline_seconds(op_cost(spec, op, shape), tflops, memory_gbps) for op in OPS)


def effective_rates(spec, shape, layer_s: float, tflops: float,
                    memory_gbps: float) -> tuple[float, float]:
    """The ``(tflops, memory_gbps)`` at which :func:`layer_roofline_seconds` equals the
    measured ``layer_s``.

    Normally only the compute rate moves (bisection on a log scale, the microbenchmarked
    memory rate kept). When the memory-bound operations alone, at the measured memory rate,
    already take longer than the real blocks did, no compute rate explains the layer: the
    memory microbenchmark ran slower than the blocks (on a loaded host the two are timed at
    different moments). The real blocks are then the better evidence, and both measured
    rates are scaled by one factor; the roofline is homogeneous of degree -1 in the two
    rates, so that factor is ``charged(tflops, memory_gbps) / layer_s`` exactly. This case
    once dropped the block timing altogether, and with it every prediction at the blocks'
    rate (a failure that depended on the machine's load)."""
    def charged(rate: float) -> float:
        return layer_roofline_seconds(spec, shape, rate, memory_gbps)

    low, high = 1e-9, 1e6  # TFLOP/s
    if charged(high) >= layer_s:
        scale = layer_roofline_seconds(spec, shape, tflops, memory_gbps) / layer_s
        return tflops * scale, memory_gbps * scale
    for _ in range(200):
        middle = math.sqrt(low * high)
        if charged(middle) > layer_s:
            low = middle
        else:
            high = middle
        if high / low < 1 + 1e-9:
            break
    return math.sqrt(low * high), memory_gbps


# ---------------------------------------------------------------------------------------------
# Communication


def _exchange(transport, group, num_bytes: int, torch) -> float:
    """One all-to-all over ``group`` sending ``num_bytes`` to every other member; seconds."""
    rows = num_bytes // ROW_BYTES
    me = group.group_rank(transport.rank)
    splits = [0 if member == me else rows for member in range(group.size)]
    send = torch.empty((sum(splits), ROW_BYTES), dtype=torch.uint8)
    began = time.perf_counter()
    transport.all_to_all(send, splits, splits, group).wait()
    return time.perf_counter() - began


def measure_exchanges(transport, group, sizes_bytes: Sequence[int], repeats: int
                      ) -> list[tuple[int, float]]:
    """Median time of an all-to-all over ``group`` per size (every member must call this).

    Each timed exchange follows a 1-row exchange that lines the members up, so one member's
    late start is not counted as transfer time.
    """
    import torch

    points = []
    for num_bytes in sizes_bytes:
        _exchange(transport, group, num_bytes, torch)  # warm-up (connections, buffers)
        times = []
        for _ in range(repeats):
            _exchange(transport, group, ROW_BYTES, torch)
            times.append(_exchange(transport, group, num_bytes, torch))
        points.append((num_bytes, statistics.median(times)))
    return points


# ---------------------------------------------------------------------------------------------
# The whole calibration


@dataclass(slots=True)
class Calibration:
    """Everything measured, and the topology it gives."""

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

    def topology(self, name: str | None = None):
        """The ``cluster`` preset with the measured numbers."""
        from topology.presets import cluster

        spec = cluster(
            num_nodes=self.num_nodes,
            ranks_per_node=self.ranks_per_node,
            intra_gbps=self.intra.bandwidth_gbps,
            inter_gbps=self.inter.bandwidth_gbps,
            intra_latency_us=self.intra.latency_us,
            inter_latency_us=self.inter.latency_us,
            tile_tflops=self.compute.tile_tflops,
            tile_memory_gbps=self.compute.tile_memory_gbps,
        )
        label = name or f"calibrated-{self.num_nodes}x{self.ranks_per_node}"
        return dataclasses.replace(spec, name=label, **unconstrained_host_links(spec))

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
            f"links.gpu: intra-node exchange fit ({self.intra.source}), max error "
            f"{self.intra.max_rel_error:.0%}.",
            f"links.nic: inter-node exchange fit ({self.inter.source}), max error "
            f"{self.inter.max_rel_error:.0%}.",
        ]

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
            "wall_s": self.wall_s,
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


def predict_all_to_all(num_bytes: int, num_nodes: int, ranks_per_node: int,
                       intra: LinkFit, inter: LinkFit) -> float:
    """A flat all-to-all sending ``num_bytes`` to every other rank, on the fitted links:
    the busiest rank port (``R - 1`` messages inside the node) or node NIC
    (``R * (P - R)`` messages out of the node), whichever takes longer."""
    world = num_nodes * ranks_per_node
    times = []
    if ranks_per_node > 1:
        times.append(intra.seconds((ranks_per_node - 1) * num_bytes))
    if num_nodes > 1:
        times.append(inter.seconds(ranks_per_node * (world - ranks_per_node) * num_bytes))
    return max(times) if times else 0.0


def layer_shapes(model: str, tokens: int | None, resolution: str | None, world: int
                 ) -> LayerShapes:
    """The per-rank layer shapes of ``model`` at ``tokens`` (or its tokens at
    ``resolution``, or at its default size) on ``world`` Ulysses ranks.

    ``model`` is a tiny model name (``tiny-flux``...), a directory exported from one, a
    registry name (``flux1-dev``...) or a diffusers config / model directory.
    """
    spec, tokens, _image = model_tokens(model, tokens, resolution)
    return LayerShapes(
        model=spec.name,
        total_tokens=tokens,
        local_tokens=math.ceil(tokens / world),
        local_heads=max(1, math.ceil(spec.num_heads / world)),
        head_dim=spec.head_dim,
        hidden_size=spec.hidden_size,
        mlp_ratio=spec.mlp_ratio,
    )


def model_tokens(model: str, tokens: int | None, resolution: str | None):
    """``(spec, attention tokens, image tokens)`` of ``model`` at ``tokens`` (or its tokens at
    ``resolution``, or at its default size); with ``tokens`` given, the text stream keeps
    the model's text tokens and the image stream has the rest."""
    from cocodiff.models import load_model_spec, parse_resolution, spec_from_config

    tiny = _tiny_name(model)
    if tiny is not None and Path(model).is_dir():
        spec = load_model_spec(model)
    elif tiny is not None:
        spec = spec_from_config(_tiny_transformer_config(tiny), name=tiny)
    else:
        spec = load_model_spec(model)
    if tiny is not None and not Path(model).is_dir():
        from cocodiff.runtime.tiny import TINY_DEFAULTS

        spec = dataclasses.replace(spec, vae_scale=TINY_DEFAULTS[tiny].vae_scale)
    if tiny is not None and spec.text_tokens:
        from cocodiff.runtime.tiny import TINY_DEFAULTS

        spec = dataclasses.replace(spec, text_tokens=TINY_DEFAULTS[tiny].max_sequence_length)
    if tokens is None:
        if resolution is not None:
            width, height = parse_resolution(resolution)
            frames = 1
        elif tiny is not None:
            from cocodiff.runtime.tiny import default_resolution

            width, height, frames = default_resolution(tiny)
        else:
            width, height, frames = 1024, 1024, 1
        tokens = spec.sequence_tokens(width, height, frames)
    return spec, tokens, max(1, tokens - spec.text_tokens)


def tiny_transformer_config(model: str) -> dict[str, Any] | None:
    """The transformer config of a tiny model (a built-in name or a directory exported
    from one, e.g. an enlarged one), or None for any other model: calibrate builds and
    times the real blocks of small models only (a full-size model's weights on every
    rank would not fit)."""
    tiny = _tiny_name(model)
    if tiny is None:
        return None
    if Path(model).is_dir():
        for candidate in (Path(model) / "transformer" / "config.json",
                          Path(model) / "config.json"):
            if candidate.is_file():
                return read_json(candidate, "model config", CalibrationError)
        return None
    return _tiny_transformer_config(tiny)


def _tiny_transformer_config(tiny: str) -> dict[str, Any]:
    """The transformer config of a built-in tiny model (built quietly, weights discarded)."""
    from cocodiff.runtime.quiet import quiet_libraries

    quiet_libraries()
    from cocodiff.runtime.tiny import TINY_MODELS

    if tiny not in TINY_MODELS:
        raise CalibrationError(f"unknown tiny model {tiny!r}; valid: {', '.join(TINY_MODELS)}")
    transformer = TINY_MODELS[tiny]().transformer
    # An in-memory config lacks the "_class_name" a saved config.json has.
    return {"_class_name": type(transformer).__name__, **dict(transformer.config)}


def _tiny_name(model: str) -> str | None:
    if model.startswith("tiny-"):
        return model
    name = (read_tiny_marker(model) or {}).get("tiny_model")
    return name if isinstance(name, str) else None


def _gather_floats(transport, values: Sequence[float]) -> list[list[float]]:
    import torch

    from cocodiff.runtime.exchange import all_gather_rows

    mine = torch.tensor(list(values), dtype=torch.float64)
    return all_gather_rows(transport, mine).tolist()


def calibrate(transport, args: argparse.Namespace) -> Calibration:
    """Run every measurement on every rank of ``transport``'s world (collective)."""
    began = time.perf_counter()
    world = transport.world_size
    rank = transport.rank
    node_of = detect_nodes(transport)
    detected = max(node_of) + 1
    if detected > 1:
        num_nodes, ranks_per_node = node_major_shape(node_of)
        if args.nodes is not None and args.nodes != num_nodes:
            raise CalibrationError(
                f"--nodes {args.nodes} but the ranks sit on {num_nodes} nodes"
            )
    else:
        num_nodes = args.nodes or 1
        if world % num_nodes:
            raise CalibrationError(f"{world} ranks do not split into {num_nodes} nodes")
        ranks_per_node = world // num_nodes
        node_of = [r // ranks_per_node for r in range(world)]
    if ranks_per_node < 2 and num_nodes < 2:
        raise CalibrationError("calibration needs at least 2 ranks")

    shapes = layer_shapes(args.model, args.tokens, args.resolution, world)
    transport.barrier()
    flops, memory, op_seconds = measure_compute(shapes, args.dtype,
                                                0.02 if args.quick else 0.05)
    rates = _gather_floats(transport, [flops / 1e12, memory / 1e9])
    compute = ComputeRates(
        tflops=statistics.median(r[0] for r in rates),
        memory_gbps=statistics.median(r[1] for r in rates),
        per_rank_tflops=tuple(r[0] for r in rates),
        per_rank_memory_gbps=tuple(r[1] for r in rates),
        op_seconds=op_seconds if rank == 0 else {},
    )
    compute = dataclasses.replace(compute, block=measure_blocks(transport, args, shapes,
                                                                 compute, world))

    sizes = [kib * 1024 for kib in (QUICK_SIZES_KIB if args.quick else DEFAULT_SIZES_KIB)
             if kib * 1024 <= args.max_kib * 1024]
    repeats = 3 if args.quick else 5
    # Every group is made by every rank, in the same order (group creation is collective).
    intra_pair = (0, 1) if ranks_per_node > 1 else None
    inter_pair = (0, ranks_per_node) if num_nodes > 1 else None
    pairs = {name: transport.new_group(list(p))
             for name, p in (("intra", intra_pair), ("inter", inter_pair)) if p is not None}
    fits: dict[str, LinkFit] = {}
    for name, group in pairs.items():
        if name == "inter" and args.inter_gbps is not None:
            continue
        transport.barrier()
        points = (measure_exchanges(transport, group, sizes, repeats)
                  if rank in group.ranks else [])
        transport.barrier()
        source = "measured" if detected > 1 or name == "intra" else "measured on loopback"
        fits[name] = _share_fit(transport, group.ranks[0], points, source)
    if args.inter_gbps is not None:
        fits["inter"] = LinkFit(args.inter_latency_us, args.inter_gbps, source="given")
    if "intra" not in fits:  # one rank per node: nothing shares a node, the tier is unused
        fits["intra"] = dataclasses.replace(fits["inter"], source="unused (1 rank per node)")
    if "inter" not in fits:  # one node: the tier is unused
        fits["inter"] = dataclasses.replace(fits["intra"], source="unused (1 node)")

    all_to_all = []
    a2a_sizes = QUICK_ALL_TO_ALL_KIB if args.quick else ALL_TO_ALL_KIB
    for kib in a2a_sizes:
        if kib > args.max_kib:
            continue
        ((num_bytes, seconds),) = measure_exchanges(transport, transport.world, [kib * 1024],
                                                    repeats)
        slowest = max(r[0] for r in _gather_floats(transport, [seconds]))
        predicted = predict_all_to_all(num_bytes, num_nodes, ranks_per_node,
                                       fits["intra"], fits["inter"])
        all_to_all.append({"bytes_per_peer": num_bytes, "measured_s": slowest,
                           "link_model_s": predicted,
                           "error": (predicted - slowest) / slowest})
    return Calibration(num_nodes, ranks_per_node, detected, transport.name, args.dtype, shapes,
                       compute, fits["intra"], fits["inter"], all_to_all,
                       time.perf_counter() - began)


def measure_blocks(transport, args: argparse.Namespace, shapes: LayerShapes,
                   compute: ComputeRates, world: int) -> dict[str, Any] | None:
    """Time the model's real blocks on every rank at once (collective; the same decision
    on every rank) and give the effective rate; None when the model's transformer is not
    built here (see :func:`tiny_transformer_config`)."""
    from cocodiff.schedules.ulysses import layer_shape, ulysses_layout

    config = tiny_transformer_config(args.model)
    if config is None or config.get("_class_name") not in _BLOCK_INPUTS:
        return None
    spec, tokens, image = model_tokens(args.model, args.tokens, args.resolution)
    streams = (image, tokens - image)
    transformer = build_transformer(config)
    transport.barrier()
    timing = time_blocks(transformer, shapes, streams, world, args.dtype,
                         3 if args.quick else 5)
    del transformer
    per_rank = [row[0] for row in _gather_floats(transport, [timing.layer_s])]
    layer_s = statistics.median(per_rank)
    # The layer as a plan charges it on rank 0 (padded per-stream shards, its heads).
    cost_shape = layer_shape(ulysses_layout(spec, world, streams), 0,
                             2 if args.dtype == "bfloat16" else 4)
    effective, effective_memory = effective_rates(spec, cost_shape, layer_s, compute.tflops,
                                                  compute.memory_gbps)
    from cocodiff.cost import MATMUL_OPS, OPS, op_cost

    return {
        "method": "diffusers blocks on the local shard, attention at the Ulysses shape",
        "layer_s": layer_s,
        "per_rank_layer_s": per_rank,
        "rank0": dataclasses.asdict(timing),
        "layer_flops": sum(op_cost(spec, op, cost_shape).flops for op in OPS),
        "layer_matmul_flops": sum(op_cost(spec, op, cost_shape).flops for op in MATMUL_OPS),
        "matmul_rate_layer_s": layer_roofline_seconds(spec, cost_shape, compute.tflops,
                                                      compute.memory_gbps),
        "effective_tflops": effective,
        "effective_memory_gbps": effective_memory,
    }


def fit_calibrated_collective(result: Calibration) -> dict[str, Any]:
    """The simulator's collective model fitted on what calibrate measured: the two-rank
    exchanges (pairs) and the world all-to-alls, on the calibrated topology (the fit of
    :mod:`cocodiff.simulator.collective_fit`, as for Aurora's preset). JSON: the model
    (``transports.sim.CollectiveModel.to_json``) and each measurement's fitted time."""
    from cocodiff.simulator.collective_fit import Measurement, fit_collective
    from topology import build_topology
    from transports.sim import CollectiveModel

    world = result.num_nodes * result.ranks_per_node
    rows = [Measurement(nodes, 2, 2 * num_bytes, seconds, label=f"pair {name}")
            for name, fit, nodes in (("intra", result.intra, 1), ("inter", result.inter, 2))
            if fit.source.startswith("measured") and nodes <= result.num_nodes
            for num_bytes, seconds in fit.points]
    rows += [Measurement(result.num_nodes, world, row["bytes_per_peer"] * world,
                         row["measured_s"], label="all-to-all") for row in result.all_to_all]
    spec = result.topology()
    if not rows:
        return CollectiveModel("calibrated").to_json()

    def topology_for(num_nodes: int):
        return build_topology(dataclasses.replace(spec, num_nodes=num_nodes))

    model, fits = fit_collective(topology_for, rows, CollectiveModel("calibrated"))
    return {**model.to_json(), "fit": [
        {"span": fit.span, "label": m.label, "ranks": m.ranks, "nodes": m.nodes,
         "bytes_per_rank": m.bytes_per_rank, "measured_s": m.time_s, "fitted_s": fitted}
        for fit in fits for m, fitted in fit.rows]}


def _share_fit(transport, owner: int, points: list[tuple[int, float]], source: str) -> LinkFit:
    """Fit on ``owner`` and give every rank the result (fits are collective here so that
    every rank can build the same topology)."""
    values: list[float] = []
    if transport.rank == owner:
        values = [v for point in points for v in point]
    width = 2 * max(len(DEFAULT_SIZES_KIB), len(QUICK_SIZES_KIB))
    padded = values + [0.0] * (width - len(values))
    rows = _gather_floats(transport, padded)[owner]
    shared = [(int(rows[i]), rows[i + 1]) for i in range(0, width, 2) if rows[i] > 0]
    return fit_latency_bandwidth(shared, source)


# ---------------------------------------------------------------------------------------------
# The command


def add_calibrate_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    parser.add_argument("--model", default="tiny-flux",
                        help="whose layer to time: a tiny model (tiny-flux...), a registry name "
                        "or a diffusers model directory / config.json (default: tiny-flux)")
    parser.add_argument("--tokens", type=positive_int, default=None,
                        help="attention sequence length (default: the model's at --resolution)")
    parser.add_argument("--resolution", default=None,
                        help="PIXELS or WIDTHxHEIGHT giving the tokens (default: the model's)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--nodes", type=positive_int, default=None,
                        help="nodes to describe when every rank is on one machine and "
                        "namespace (default: the nodes detected, else 2 when self-launched)")
    parser.add_argument("--ranks-per-node", type=positive_int, default=2,
                        help="ranks per node when self-launched without a launcher (default 2)")
    parser.add_argument("--inter-gbps", type=float, default=None,
                        help="take the inter-node link rate (GB/s) from here instead of "
                        "measuring it, e.g. an emulated cluster's tc rate")
    parser.add_argument("--inter-latency-us", type=float, default=20.0,
                        help="inter-node latency (us) used with --inter-gbps (default 20)")
    parser.add_argument("--max-kib", type=positive_int, default=4096,
                        help="largest message in the sweeps, KiB (default 4096)")
    parser.add_argument("--transport", default="auto", help="auto, torch or mpi")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a rank waits for its peers (and a self-launched job may "
                        "run) before giving up (default 120)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes and repeats (a few seconds of measuring)")
    parser.add_argument("--output", type=Path, default=Path("cluster.toml"),
                        help="topology TOML to write (default: cluster.toml)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write every measurement as JSON here")


def calibrate_command(args: argparse.Namespace) -> int:
    """The ``cocodiff calibrate`` handler: calibrate under a launcher, or launch itself."""
    from transports.launch import detect_launch

    _check_arguments(args)
    launch = detect_launch()
    if not launch.is_distributed:
        return _self_launch(args)
    from transports.registry import TRANSPORTS, auto_transport_name, create_transport

    name = auto_transport_name() if args.transport == "auto" else args.transport
    if name not in TRANSPORTS:
        create_transport(name)  # raises the registry's one-line error
    options = {"timeout_s": args.timeout} if name == "torch" else {}
    transport = create_transport(name, **options)
    try:
        result = calibrate(transport, args)
        if transport.rank == 0:
            _write_outputs(result, args)
        transport.barrier()
    finally:
        transport.close()
    return 0


def _check_arguments(args: argparse.Namespace) -> None:
    check_output_paths((args.output, args.json))
    if args.inter_gbps is not None and args.inter_gbps <= 0:
        raise CalibrationError(f"--inter-gbps must be positive, got {args.inter_gbps}")
    if args.inter_latency_us < 0:
        raise CalibrationError(f"--inter-latency-us must be >= 0, got {args.inter_latency_us}")
    if args.timeout <= 0:
        raise CalibrationError(f"--timeout must be positive, got {args.timeout}")


def _write_outputs(result: Calibration, args: argparse.Namespace) -> None:
    from cocodiff.util.atomic import atomic_write_text
    from topology import dump_topology

    spec = result.topology()
    result.collective = fit_calibrated_collective(result)
    header = "".join(f"# {line}\n" for line in result.notes())
    atomic_write_text(args.output, header + dump_topology(spec))
    if args.json is not None:
        atomic_write_text(args.json, json.dumps(result.to_json(), indent=2))
    print(summary(result, args.output))


def summary(result: Calibration, output: Path) -> str:
    """What a user reads: the fitted numbers and the all-to-all check."""
    c, s = result.compute, result.shapes
    lines = [
        f"calibrated {result.num_nodes} node(s) x {result.ranks_per_node} ranks over "
        f"{result.transport} in {result.wall_s:.1f} s -> {output}",
        f"  compute ({s.model} layer, {s.local_tokens}/{s.total_tokens} tokens, "
        f"{s.local_heads} heads, d={s.hidden_size}, {result.dtype}): {c.tflops * 1e3:.2f} "
        f"GFLOP/s, {c.memory_gbps:.2f} GB/s per rank",
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
    for name, fit in (("intra", result.intra), ("inter", result.inter)):
        lines.append(f"  {name}-node: {fit.latency_us:.1f} us + bytes / {fit.bandwidth_gbps:.3f}"
                     f" GB/s ({fit.source}, max fit error {fit.max_rel_error:.0%})")
    for row in result.all_to_all:
        lines.append(f"  flat all-to-all, {row['bytes_per_peer'] // 1024} KiB per peer: "
                     f"measured {row['measured_s'] * 1e3:.2f} ms, links predict "
                     f"{row['link_model_s'] * 1e3:.2f} ms ({row['error']:+.0%})")
    if result.collective:
        from transports.sim import CollectiveModel

        model = CollectiveModel.from_json(result.collective)
        lines.append(f"  collective model fitted on these: {model.describe()}")
    return "\n".join(lines)


def _self_launch(args: argparse.Namespace) -> int:
    """No launcher: run this command on ``nodes x ranks-per-node`` local ranks (torch
    transport, loopback rendezvous) and wait for them, killing them all if one fails."""
    num_nodes = args.nodes or 2
    world = num_nodes * args.ranks_per_node
    if world < 2:
        raise CalibrationError("calibration needs at least 2 ranks (--nodes x --ranks-per-node)")
    if args.transport not in ("auto", "torch"):
        raise CalibrationError(
            f"--transport {args.transport} needs its launcher (e.g. mpiexec -n 4 cocodiff "
            "calibrate); without one, calibrate launches itself with the torch transport"
        )
    argv = [sys.executable, "-m", "cocodiff", "calibrate", *_argv_of(args, num_nodes)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(_free_port())
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    processes = []
    try:
        for rank in range(world):
            rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(world),
                            LOCAL_RANK=str(rank % args.ranks_per_node))
            processes.append(subprocess.Popen(argv, env=rank_env, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
        deadline = time.monotonic() + args.timeout + 60  # + start-up of the ranks
        while True:
            codes = [p.poll() for p in processes]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                rank, code = bad[0]
                raise CalibrationError(f"calibration rank {rank} exited with code {code}")
            if all(c == 0 for c in codes):
                return 0
            if time.monotonic() > deadline:
                raise CalibrationError(
                    f"calibration did not finish in {args.timeout + 60:g} s"
                )
            time.sleep(0.05)
    finally:
        for process in processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()


def _argv_of(args: argparse.Namespace, num_nodes: int) -> list[str]:
    argv = ["--model", args.model, "--dtype", args.dtype, "--nodes", str(num_nodes),
            "--ranks-per-node", str(args.ranks_per_node), "--inter-latency-us",
            str(args.inter_latency_us), "--max-kib", str(args.max_kib), "--transport", "torch",
            "--timeout", str(args.timeout), "--output", str(args.output.resolve())]
    for flag, value in (("--tokens", args.tokens), ("--resolution", args.resolution),
                        ("--inter-gbps", args.inter_gbps)):
        if value is not None:
            argv += [flag, str(value)]
    if args.json is not None:
        argv += ["--json", str(args.json.resolve())]
    if args.quick:
        argv.append("--quick")
    return argv


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
