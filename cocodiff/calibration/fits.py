"""Fits of measured times: ``latency + bytes / bandwidth`` per link tier, robust to a
disturbed point."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cocodiff.calibration.options import CalibrationError
from topology.spec import exchange_cpu_s


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
    one, two from four sizes), of what is left of each time once its bytes are paid at that
    bandwidth, at least
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
    intercept_s, slope = robust_line(sizes, times)
    if slope <= 0:
        raise CalibrationError(
            f"times do not grow with message size ({_points_text(ordered)}): no bandwidth to "
            "fit; use larger sizes"
        )
    latency_s = max(0.0, intercept_s)
    fitted = latency_s + sizes * slope
    error = float(np.max(np.abs(fitted - times) / times))
    return LinkFit(latency_s * 1e6, 1.0 / slope / 1e9, tuple(ordered), error, source)


def robust_line(sizes, times) -> tuple[float, float]:
    """``(intercept, slope)`` of times over sizes (sorted by size), as
    :func:`fit_latency_bandwidth` reads them: the slope from the larger half of the sizes
    (every point if that gives none), the intercept from the smallest quarter."""
    import numpy as np

    sizes, times = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    count = len(sizes)
    half = count // 2
    large = slice(half - 1 if count % 2 == 0 and half > 1 else half, None)
    slope = _slope(sizes[large], times[large])
    if slope <= 0:
        slope = _slope(sizes, times)
    # Two small sizes at least (when there are four or more): one size's median alone let
    # a single disturbed size move the start-up between two calibrations.
    small = slice(0, max(1, count // 4, 2 if count >= 4 else 1))
    return float(np.median(times[small] - sizes[small] * max(slope, 0.0))), slope


def _slope(sizes, times) -> float:
    """Theil-Sen: the median slope over every pair of points of different size."""
    slopes = [(times[j] - times[i]) / (sizes[j] - sizes[i])
              for i in range(len(sizes)) for j in range(i + 1, len(sizes))
              if sizes[j] != sizes[i]]
    return float(statistics.median(slopes)) if slopes else 0.0


def _points_text(points: Sequence[tuple[int, float]]) -> str:
    return ", ".join(f"{n} B: {t * 1e6:.0f} us" for n, t in points)


# A rank whose process burns at least this fraction of an exchange's wall time in CPU is
# spinning while it waits (MPI progress engines), not sleeping (gloo).
BUSY_POLL_FRACTION = 0.8
# A rank that burns at least this share of a core while it waits for a late peer spins
# (exchanges.measure_wait_spin: ~0 for sleeping waits, ~1 for spinning ones, so the
# verdict does not sit on the edge).
WAIT_SPIN_FRACTION = 0.5


@dataclass(frozen=True, slots=True)
class CpuFit:
    """The CPU an exchange costs one rank: ``message_cpu_us`` per message sent or received
    and one core-second per ``copy_gbps`` GB sent or received (``topology.HostSpec``).

    Attributes:
        message_cpu_us: CPU per message, microseconds.
        copy_gbps: GB/s one core moves; None when bytes cost no measurable CPU.
        busy_fraction: median over sizes of CPU time over wall time per exchange.
        points: ``(messages, bytes, CPU seconds, wall seconds)`` per size (medians).
        wait_spin: the share of a core a rank burns waiting for a late peer
            (:func:`~cocodiff.calibration.exchanges.measure_wait_spin`); None: not measured,
            the busy fraction decides.
    """

    message_cpu_us: float
    copy_gbps: float | None
    busy_fraction: float
    points: tuple[tuple[int, int, float, float], ...] = ()
    wait_spin: float | None = None

    @property
    def busy_poll(self) -> bool:
        if self.wait_spin is not None:
            return self.wait_spin >= WAIT_SPIN_FRACTION
        return self.busy_fraction >= BUSY_POLL_FRACTION

    def cpu_s(self, num_messages: int, num_bytes: float) -> float:
        """CPU seconds of one exchange (the pair sweep prices messages and bytes, no calls)."""
        return exchange_cpu_s(0, num_messages, num_bytes, call_cpu_us=0.0,
                              message_cpu_us=self.message_cpu_us, copy_gbps=self.copy_gbps)

    def to_json(self) -> dict[str, Any]:
        return {"message_cpu_us": self.message_cpu_us, "copy_gbps": self.copy_gbps,
                "busy_fraction": self.busy_fraction, "wait_spin": self.wait_spin,
                "busy_poll": self.busy_poll,
                "points": [{"messages": m, "bytes": n, "cpu_s": c, "wall_s": w}
                           for m, n, c, w in self.points]}


def fit_exchange_cpu(points: Sequence[tuple[int, int, float, float]]) -> CpuFit:
    """Fit ``cpu = messages * o + bytes / copy_rate`` to ``(messages, bytes, cpu s, wall s)``
    per size (every point with the same message count, as a pair exchange gives).

    The line is read as :func:`fit_latency_bandwidth` reads it (:func:`robust_line`: the
    Theil-Sen slope of the larger sizes, the intercept from the smallest), the intercept
    shared among the messages, at least 0. A slope at or below 0 means bytes cost no CPU
    that can be told from noise: ``copy_gbps`` is None.

    Raises:
        CalibrationError: fewer than two sizes, or a point with no messages.
    """
    ordered = sorted(points, key=lambda p: p[1])
    if len({n for _, n, _, _ in ordered}) < 2:
        raise CalibrationError(f"need at least two message sizes to fit CPU cost, got "
                               f"{len(ordered)}")
    if any(m < 1 for m, _, _, _ in ordered):
        raise CalibrationError("every CPU point needs at least one message")
    messages = ordered[0][0]
    if any(m != messages for m, _, _, _ in ordered):
        raise CalibrationError("every CPU point must have the same message count")
    intercept_s, slope = robust_line([n for _, n, _, _ in ordered],
                                     [c for _, _, c, _ in ordered])
    slope = max(slope, 0.0)
    per_message_s = max(0.0, intercept_s) / messages
    busy = statistics.median(c / w for _, _, c, w in ordered if w > 0)
    return CpuFit(per_message_s * 1e6, 1.0 / slope / 1e9 if slope > 0 else None, busy,
                  tuple((int(m), int(n), float(c), float(w)) for m, n, c, w in ordered))


# A loopback "wire" is the kernel copying, which the process's CPU time already counts:
# what is left of an exchange once its CPU is paid can be ~0 or, with noise, negative. The
# wire keeps at least this fraction of the wall time, so its fit sees positive times.
WIRE_FLOOR_FRACTION = 0.02


def wire_points(wall: Sequence[tuple[int, float]], cpu: CpuFit, messages: int
                ) -> list[tuple[int, float]]:
    """``(bytes, seconds)`` of the wire alone: each wall time less the CPU its exchange cost
    one rank (``messages`` messages, twice ``bytes`` sent and received), at least
    :data:`WIRE_FLOOR_FRACTION` of it. The simulator charges that CPU on the host's cores
    and the rest on the links, so a pair exchange on free cores takes the wall time."""
    return [(n, max(t - cpu.cpu_s(messages, 2 * n), WIRE_FLOOR_FRACTION * t)) for n, t in wall]
