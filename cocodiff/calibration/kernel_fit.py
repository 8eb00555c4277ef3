"""The kernel model's rates (``topology.DeviceRates``, :mod:`cocodiff.kernels`) read off
kernel microbenchmarks, in closed form: each fit inverts the very formula
:func:`cocodiff.kernels.kernel_seconds` prices that kernel class with, so the model gives
back the times it was fitted on (exactly, for times that follow the formula).

Order matters: every kernel the model prices costs ``launch_us`` beyond its work
(:func:`cocodiff.kernels.device_seconds`), so the elementwise fit, whose intercept *is*
that per-launch cost, comes first and the matrix products and attention are read with
it taken out. Nothing here sees a block or a step: the fits take only microbenchmarks
(the house rule; the real blocks are what the fitted model is then checked against).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cocodiff.calibration.fits import robust_line
from cocodiff.calibration.options import CalibrationError


@dataclass(frozen=True, slots=True)
class ElementwisePoint:
    """One elementwise microbenchmark: an op moving ``num_bytes`` (reads + writes) in one
    kernel, ``seconds`` per call."""

    op: str
    num_bytes: float
    seconds: float


@dataclass(frozen=True, slots=True)
class GemmPoint:
    """One matrix product ``(m x k) @ (k x n)``, ``seconds`` per call (one launch)."""

    m: int
    k: int
    n: int
    seconds: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


@dataclass(frozen=True, slots=True)
class AttentionPoint:
    """One attention forward (SDPA): ``q`` queries against ``kv`` keys, ``heads`` heads of
    ``head_dim``, ``seconds`` per call (one launch)."""

    q_tokens: int
    kv_tokens: int
    heads: int
    head_dim: int
    seconds: float

    @property
    def flops(self) -> float:
        return 4.0 * self.q_tokens * self.kv_tokens * self.heads * self.head_dim


def fit_elementwise(points: Sequence[ElementwisePoint]) -> tuple[float, float, float]:
    """``(memory_gbps, launch_us, max relative error)`` of ``t = launch + bytes / M`` over
    ``points`` (one launch each), read as :func:`~cocodiff.calibration.fits.robust_line`
    reads a link: the slope from the larger sizes, the intercept from the smallest (a
    one-element op is all launch), so that whatever the caches do between small and large
    sizes does not move the per-launch cost the small kernels of a block pay.

    Raises:
        CalibrationError: fewer than two sizes, or times that do not grow with bytes.
    """
    ordered = sorted(points, key=lambda p: p.num_bytes)
    if len({p.num_bytes for p in ordered}) < 2:
        raise CalibrationError("need elementwise timings at two sizes at least")
    intercept_s, slope = robust_line([p.num_bytes for p in ordered],
                                     [p.seconds for p in ordered])
    if slope <= 0:
        raise CalibrationError("elementwise times do not grow with bytes: no memory rate to fit")
    launch_s = max(0.0, intercept_s)
    error = max(abs(launch_s + p.num_bytes * slope - p.seconds) / p.seconds for p in ordered)
    return 1.0 / slope / 1e9, launch_s * 1e6, error


def fit_gemm(points: Sequence[GemmPoint], launch_us: float) -> tuple[float, float, float]:
    """``(gemm_tflops, gemm_fixed_us, max relative error)`` of
    ``t = launch + fixed + F / R`` over the matrix products timed (the kernel model's
    GEMM less its memory bound: at the shapes timed the products are compute-bound, and
    the fit says how far it is from the worst point). Least squares of ``t`` on ``F``;
    an intercept below the launch cost is read as no fixed time, the rate then fitted
    through ``launch``.

    Raises:
        CalibrationError: no point, or a rate that does not come out positive.
    """
    if not points:
        raise CalibrationError("no matrix product timed")
    launch_s = launch_us * 1e-6
    flops = [p.flops for p in points]
    times = [p.seconds for p in points]
    if len(set(flops)) >= 2:
        mean_f, mean_t = statistics.fmean(flops), statistics.fmean(times)
        slope = (sum((f - mean_f) * (t - mean_t) for f, t in zip(flops, times, strict=True))
                 / sum((f - mean_f) ** 2 for f in flops))
        fixed_s = mean_t - slope * mean_f - launch_s
    else:
        slope, fixed_s = 0.0, -1.0
    if slope <= 0 or fixed_s < 0:
        # Through the launch cost alone: least squares of t - launch = F / R.
        fixed_s = 0.0
        slope = (sum(f * (t - launch_s) for f, t in zip(flops, times, strict=True))
                 / sum(f * f for f in flops))
    if slope <= 0:
        raise CalibrationError("matrix products took no longer than a launch: no rate to fit")
    error = max(abs(launch_s + fixed_s + p.flops * slope - p.seconds) / p.seconds
                for p in points)
    return 1.0 / slope / 1e12, fixed_s * 1e6, error


def attention_waves(point: AttentionPoint, sm_count: int) -> float:
    """:func:`cocodiff.kernels.attention_waves` of the point's kernel on ``sm_count`` units."""
    from cocodiff import kernels

    blocks = -(-point.q_tokens // kernels.ATTENTION_Q_TILE) * point.heads
    waves = blocks / sm_count
    return math.ceil(waves) / waves if blocks else 1.0


def fit_attention(points: Sequence[AttentionPoint], launch_us: float, sm_count: int
                  ) -> tuple[tuple[tuple[int, float], ...], tuple[tuple[int, float], ...]]:
    """``(attention_tflops, attention_query_factor)``. The table ``((kv length, TFLOP/s),
    ...)`` from the points with as many queries as keys: at each length timed, the rate at
    which :func:`cocodiff.kernels.kernel_seconds` (``F / rate x waves``) plus a launch gives
    the time measured (the median over points of that length). The query factors
    ``((q, factor), ...)`` from the points with fewer queries than keys: each one's time
    over what that table prices it at (the median per query count), closed by ``(kv, 1)``
    at the longest key length they were timed against; empty without such points.

    Raises:
        CalibrationError: no point with as many queries as keys, or a time no longer than
            a launch.
    """
    from cocodiff import kernels

    def work_s(p: AttentionPoint) -> float:
        seconds = p.seconds - launch_us * 1e-6
        if seconds <= 0:
            raise CalibrationError(f"attention at {p.kv_tokens} tokens took no longer than a "
                                   "launch: no rate to fit")
        return seconds

    square = [p for p in points if p.q_tokens == p.kv_tokens]
    if not square:
        raise CalibrationError("no attention timed")
    by_length: dict[int, list[float]] = {}
    for p in square:
        by_length.setdefault(p.kv_tokens, []).append(
            p.flops * attention_waves(p, sm_count) / work_s(p) / 1e12)
    table = tuple((length, statistics.median(rates))
                  for length, rates in sorted(by_length.items()))
    by_queries: dict[int, list[float]] = {}
    short = [p for p in points if p.q_tokens < p.kv_tokens]
    for p in short:
        priced = (p.flops * attention_waves(p, sm_count)
                  / (kernels.log_interpolated(table, p.kv_tokens) * 1e12))
        by_queries.setdefault(p.q_tokens, []).append(work_s(p) / priced)
    if not by_queries:
        return table, ()
    by_queries.setdefault(max(p.kv_tokens for p in short), [1.0])
    return table, tuple((q, statistics.median(factors))
                        for q, factors in sorted(by_queries.items()))


@dataclass(frozen=True, slots=True)
class KernelFit:
    """The rates fitted and how well each closed form holds on its own points.

    Attributes:
        rates: the kernel model's rates (``topology.DeviceRates``).
        elementwise_error, gemm_error: the largest relative miss of each fit's line.
    """

    rates: Any  # topology.DeviceRates
    elementwise_error: float
    gemm_error: float

    def to_json(self) -> dict[str, Any]:
        import dataclasses

        return {"rates": dataclasses.asdict(self.rates),
                "elementwise_max_error": self.elementwise_error,
                "gemm_max_error": self.gemm_error}


def fit_device_rates(name: str, elementwise: Sequence[ElementwisePoint],
                     gemms: Sequence[GemmPoint], attention: Sequence[AttentionPoint],
                     sm_count: int, host_us: float, on_host: bool,
                     launch_us: float | None = None,
                     host_op_us: float | None = None) -> KernelFit:
    """Every rate of the kernel model from the microbenchmarks.

    ``host_us``: a bare one-element op's host time; ``host_op_us``: the host's time per
    ATen op as model code issues them (:func:`cocodiff.calibration.dispatch.host_stack`;
    None: the bare op's, ``host_us`` or on a CPU the elementwise intercept).
    ``on_host``: the kernels run on the CPU that issues them (a CPU rank). The host
    and the device are then one core, so a step is the sum of its work and its
    dispatched ops, not the larger of the two: ``host_us`` is 0 and eager
    ``launch_us`` is the cost per dispatched op (``host_op_us``; the bare op's dispatch
    is inside it), charged per op (:func:`cocodiff.kernels.device_seconds`); compiled
    keeps the bare op's cost, the elementwise intercept, per launch. On an accelerator
    ``host_us`` is ``host_op_us`` and ``launch_us``, when given, the device's gap per
    kernel (else the elementwise intercept); compiled, the host's cost per launch is the
    bare op's (generated code calls kernels without the modules around them). The
    matrix-product and attention fits take the bare intercept out of their times: their
    microbenchmarks are bare calls. ``torch.compile`` itself is not timed.
    """
    from topology import DeviceRates

    memory_gbps, intercept_us, elementwise_error = fit_elementwise(elementwise)
    launch = intercept_us if launch_us is None else launch_us
    gemm_tflops, gemm_fixed_us, gemm_error = fit_gemm(gemms, launch)
    table, query_factor = fit_attention(attention, launch, sm_count)
    if on_host:
        per_op = launch if host_op_us is None else host_op_us
        eager_launch, host, compiled_host = per_op, 0.0, 0.0
    else:
        per_op = host_us if host_op_us is None else host_op_us
        eager_launch, host, compiled_host = launch, per_op, host_us
    rates = DeviceRates(name=name, gemm_tflops=gemm_tflops, gemm_fixed_us=gemm_fixed_us,
                        attention_tflops=table, memory_gbps=memory_gbps, sm_count=sm_count,
                        launch_us=eager_launch, host_us=host, compiled_launch_us=launch,
                        compiled_host_us=compiled_host, attention_query_factor=query_factor)
    return KernelFit(rates, elementwise_error, gemm_error)
