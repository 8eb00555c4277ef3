"""The compute rates of one rank: its layer's matrix products and elementwise work timed at
the model's shapes, and the effective rates that make the roofline match a measured layer."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from cocodiff.calibration.model_shapes import LayerShapes


@dataclass(frozen=True, slots=True)
class ComputeRates:
    """Effective rates of one rank at one core while every rank computes (from the
    process's CPU time: see :class:`Round`).

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


class Lineup(Protocol):
    """Ranks that time the same thing at the same moment (see :func:`timed_rounds`)."""

    def barrier(self) -> None: ...

    def agree(self, value: float) -> float:
        """One value every rank gets back the same (the median of the ranks' ``value``)."""
        ...


@dataclass(frozen=True, slots=True)
class Round:
    """One round of :func:`timed_rounds`, per call.

    Attributes:
        wall_s: wall-clock seconds per call (with every rank of the lineup busy).
        cpu_s: this process's CPU seconds per call (all its threads): the call's work at
            one core, however the cores were shared and whatever else ran on them.
        inside_wall_s: wall-clock seconds per call inside the hooked parts of the call.
        inside_cpu_s: CPU seconds per call inside them.
    """

    wall_s: float
    cpu_s: float
    inside_wall_s: float = 0.0
    inside_cpu_s: float = 0.0


def timed_rounds(call: Callable[[], object], rounds: int, round_s: float,
                 lineup: Lineup | None = None,
                 inside: Callable[[], tuple[float, float]] | None = None,
                 max_calls: int = 10_000,
                 sync: Callable[[], object] | None = None) -> list[Round]:
    """Throughput of ``call`` in ``rounds`` rounds: each round a loop of the same number of
    calls (enough for about ``round_s``, agreed by every rank of ``lineup``), started on
    every rank at once after a barrier.

    Why a throughput: ranks that share cores time each call as the OS happens to
    interleave them, and a median of single calls kept that luck (block rates 1.9x apart
    in two calibrations seconds apart, docs/changelog.md, 2026-11-23). A loop long enough to span
    many time slices averages it; the median round takes out a round a neighbour burst
    into. ``inside`` reads the cumulative (wall, CPU) seconds that hooks counted inside
    the calls; it is read at each round's start and end. ``sync`` waits for an
    accelerator's queued work (``torch.cuda.synchronize``): called before each clock is
    read, so that a round's wall time is the device's, not the time to queue it.
    """
    read = inside or (lambda: (0.0, 0.0))
    wait = sync or (lambda: None)
    call()  # warm up
    wait()
    began = time.perf_counter()
    call()
    wait()
    once_s = max(time.perf_counter() - began, 1e-9)
    calls = min(max_calls, max(1, math.ceil(round_s / once_s)))
    if lineup is not None:
        calls = max(1, round(lineup.agree(float(calls))))
    results = []
    for _ in range(rounds):
        if lineup is not None:
            lineup.barrier()
        wait()
        wall_in, cpu_in = read()
        cpu_began = time.process_time()
        began = time.perf_counter()
        for _ in range(calls):
            call()
        wait()
        elapsed = time.perf_counter() - began
        cpu_s = time.process_time() - cpu_began
        wall_out, cpu_out = read()
        results.append(Round(elapsed / calls, cpu_s / calls, (wall_out - wall_in) / calls,
                             (cpu_out - cpu_in) / calls))
    return results


def median_of(rounds: list[Round], attribute: str) -> float:
    """The median over ``rounds`` of one :class:`Round` attribute."""
    return statistics.median(getattr(r, attribute) for r in rounds)


def measure_compute(shapes: LayerShapes, dtype_name: str = "float32",
                    min_time_s: float = 0.05, lineup: Lineup | None = None,
                    rounds: int = 5, device: Any = "cpu") -> tuple[float, float, dict[str, float]]:
    """Time one rank's layer operations at ``shapes``: each the process's CPU seconds per
    call (one core's), the median of ``rounds`` rounds of :func:`timed_rounds` of about
    ``min_time_s``, lined up over ``lineup`` (every rank timing the same operation at
    once, as in a step). On an accelerator (``device``), the wall-clock seconds per call
    with the device synchronised around each round (its CPU time says nothing of the
    device's work).

    Returns:
        ``(flop/s, bytes/s, seconds per call by op)``: the matrix products' FLOPs over their
        time (weighted as often as they occur in a layer) and the elementwise bytes over
        theirs, counted as :mod:`cocodiff.cost` counts them.
    """
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    device = torch.device(device)
    sync, clock = device_clock(device)
    size = torch.finfo(dtype).bits // 8
    s_loc, d = shapes.local_tokens, shapes.hidden_size
    inner = max(1, round(shapes.mlp_ratio * d))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device, dtype)

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
        def norm() -> object:
            return F.layer_norm(x, (d,)) * (1 + scale) + shift

        calls = {name: call for name, (call, _, _) in ops.items()} | {"norm": norm}
        op_seconds = {name: median_of(timed_rounds(call, rounds, min_time_s, lineup,
                                                   sync=sync), clock)
                      for name, call in calls.items()}
    flops = sum(f * n for _, f, n in ops.values())
    matmul_s = sum(op_seconds[name] * n for name, (_, _, n) in ops.items())
    # cocodiff.cost: an elementwise pass reads and writes each element once.
    norm_bytes = 2.0 * s_loc * d * size
    return flops / matmul_s, norm_bytes / op_seconds["norm"], op_seconds


def device_clock(device) -> tuple[Callable[[], object] | None, str]:
    """``(sync, clock)`` for timing on ``device``: on the CPU no sync and the process's CPU
    time (``"cpu_s"``, see :class:`Round`); on an accelerator its ``synchronize`` and the
    wall clock (``"wall_s"``)."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return None, "cpu_s"
    backend = getattr(torch, device.type)
    return (lambda: backend.synchronize(device)), "wall_s"


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
