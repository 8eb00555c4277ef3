"""What one calibration is asked to do, and how it fails: plain data, no argument parsing
(``cocodiff.commands.calibrate`` turns flags into :class:`CalibrateOptions`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cocodiff.util.atomic import check_output_paths
from cocodiff.util.errors import CocodiffError

ROW_BYTES = 1024  # exchanges move rows of 1 KiB; sizes are whole rows
DEFAULT_SIZES_KIB = (1, 4, 16, 64, 256, 1024, 4096)
QUICK_SIZES_KIB = (1, 16, 256, 2048)
ALL_TO_ALL_KIB = (16, 256, 2048)
QUICK_ALL_TO_ALL_KIB = (64,)


class CalibrationError(CocodiffError):
    """Calibration could not run or its measurements cannot be fitted."""


@dataclass(frozen=True, slots=True)
class CalibrateOptions:
    """One calibration's settings (``cocodiff calibrate --help`` says what each means).

    Attributes:
        model: whose layer to time (a tiny model, a registry name or a directory).
        tokens: attention sequence length; None: the model's at ``resolution``.
        resolution: ``PIXELS`` or ``WIDTHxHEIGHT`` giving the tokens; None: the model's.
        dtype: ``"float32"`` or ``"bfloat16"``.
        nodes: nodes to describe when every rank is on one machine; None: as detected.
        ranks_per_node: ranks per node when self-launched.
        inter_gbps: the inter-node link rate to take instead of measuring it, GB/s.
        inter_latency_us: the inter-node latency used with ``inter_gbps``.
        max_kib: largest message in the sweeps, KiB.
        transport: ``"auto"``, ``"torch"`` or ``"mpi"``.
        timeout_s: seconds a rank waits for its peers.
        quick: fewer sizes and repeats.
        fit_patterns: also fit the collective on a step's exchange patterns (the several-
            node rate, the inter-node per-transfer cap); by default they are only checked.
        strict: refuse to write a topology whose own checks say its predictions will
            not hold (:mod:`cocodiff.calibration.verdict`); by default it is written with
            a warning.
        output: the topology TOML to write.
        json: where to write every measurement as JSON, or None.
    """

    model: str = "tiny-flux"
    tokens: int | None = None
    resolution: str | None = None
    dtype: str = "float32"
    nodes: int | None = None
    ranks_per_node: int = 2
    inter_gbps: float | None = None
    inter_latency_us: float = 20.0
    max_kib: int = 4096
    transport: str = "auto"
    timeout_s: float = 120.0
    quick: bool = False
    fit_patterns: bool = False
    strict: bool = False
    output: Path = Path("cluster.toml")
    json: Path | None = None


def check_options(options: CalibrateOptions) -> None:
    """Refuse, in one line, options no calibration can run with (before any rank starts)."""
    check_output_paths((options.output, options.json))
    if options.inter_gbps is not None and options.inter_gbps <= 0:
        raise CalibrationError(f"--inter-gbps must be positive, got {options.inter_gbps}")
    if options.inter_latency_us < 0:
        raise CalibrationError(
            f"--inter-latency-us must be >= 0, got {options.inter_latency_us}")
    if options.timeout_s <= 0:
        raise CalibrationError(f"--timeout must be positive, got {options.timeout_s}")
