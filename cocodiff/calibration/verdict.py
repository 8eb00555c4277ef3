"""Calibrate's verdict on its own topology: whether the simulator, given what was just
written, reproduces the step-like microbenchmarks calibrate timed, and whether the machine
held still while it measured. One line when it does not, and why.

Which checks decide, and which only inform. A step is compute on shared cores plus
exchange calls among it; the one microbenchmark of that shape is the loaded loops (every
rank running the model's forward and making exchange calls at its exchanges,
:mod:`cocodiff.calibration.loaded`), simulated back on the topology written
(``loops_check``). It decides. The other checks price pieces alone and stay in the
summary and the JSON as they were: the pair fits' worst point, the world all-to-alls
against the links, a step's exchange patterns. On the emulated cluster they missed by
as much as the one-host runs of issue 38 (a pair fit +308%, the 16 KiB all-to-all -91%
against the links, TAPA's pattern +139%) in calibrations whose validation then held
within a median 2.4-11% (run 27: `git show
26d5b02:results/measured/validate/run27.json`); gating on them would refuse calibrations
that work. The loops there missed by a median 2-14% (19-28% beside a
foreign load, run28), and 4 MPICH ranks on 2 cores, before calibrate timed loops under a
busy-polling transport, by 27-38%: as much as the steps.

Why a warning and not a refusal (``--strict`` refuses). A calibration is a measurement:
what it found is true of the moment, the file is the user's way to see how far the
simulator then misses (``cocodiff validate``), and the README's two commands, on a busy
laptop or shared node, would otherwise stop at the first with nothing to look at. So
calibrate writes the topology, says in one line that predictions from it will not hold
and why, records the verdict in the TOML's header and the JSON (``verdict``), and
``--strict`` makes it refuse (exit 2, nothing written) for scripts that must not go on.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from cocodiff.calibration.neighbours import foreign_text

# The loops' median |error| past which the host model does not reproduce a step-like
# load: above the emulated cluster's worst calibration that validated (28%, beside a
# foreign load), below the 35% of the uncorrected one-host MPI case.
LOOPS_LIMIT = 0.30


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether predictions from a calibration can be expected to hold.

    Attributes:
        holds: True when every deciding check passed; False when one failed; None when
            none could run (no loops timed: nothing step-like was checked).
        reasons: why not, one short clause each (empty when it holds).
        loops_median_abs_error: the loops' median |simulated / measured - 1|, or None.
        limit: :data:`LOOPS_LIMIT`.
    """

    holds: bool | None
    reasons: tuple[str, ...] = ()
    loops_median_abs_error: float | None = None
    limit: float = LOOPS_LIMIT
    notes: tuple[str, ...] = field(default=())

    def line(self) -> str | None:
        """The one line a user reads when predictions will not hold (None when they may)."""
        if self.holds is not False:
            return None
        return ("predictions from this topology will not hold: " + "; ".join(self.reasons)
                + " (cocodiff validate measures by how much)")

    def to_json(self) -> dict[str, Any]:
        return {"holds": self.holds, "reasons": list(self.reasons),
                "loops_median_abs_error": self.loops_median_abs_error,
                "loops_limit": self.limit, "notes": list(self.notes)}


def judge(loops_check: list[dict[str, Any]] | None, warnings: list[str]) -> Verdict:
    """The verdict from the loops simulated back (``Calibration.loops_check``) and the
    machine's own warnings (load, speed drift: :func:`machine_warnings`)."""
    errors = [abs(row["error"]) for row in loops_check or () if row.get("error") is not None]
    reasons = list(warnings)
    median = statistics.median(errors) if errors else None
    if median is not None and median > LOOPS_LIMIT:
        worst = max(loops_check or (), key=lambda row: abs(row.get("error") or 0.0))
        reasons.insert(0, f"the simulator misses calibrate's loops of the model's forward and "
                       f"exchange calls by a median {median:.0%} (limit {LOOPS_LIMIT:.0%}; "
                       f"worst: {worst['shape']} at {worst['bytes_per_peer'] // 1024} KiB, "
                       f"measured {worst['measured_s'] * 1e3:.2f} ms, simulated "
                       f"{worst['predicted_s'] * 1e3:.2f} ms)")
    if reasons:
        return Verdict(False, tuple(reasons), median)
    if median is None:
        return Verdict(None, (), None, notes=(
            "no loops were timed (no pair exchange, or the loops could not be fitted): "
            "nothing step-like checked the host model",))
    return Verdict(True, (), median)


def machine_warnings(load_average: tuple[float, float] | None, cores: float | None,
                     ranks: int, drift: float | None, drift_limit: float,
                     foreign_share: float | None = None) -> list[str]:
    """The machine did not hold still: other processes used more than
    :data:`~cocodiff.calibration.neighbours.FOREIGN_WARNING` of the cores, a load above
    the cores and the calibration's own ranks (other work shared the cores), or the same
    reference work taking more than ``drift_limit`` more or less CPU at the end than at
    the start."""
    reasons = []
    foreign = foreign_text(foreign_share)
    if foreign is not None:
        reasons.append(foreign)
    if load_average is not None and cores is not None and max(load_average) > cores + ranks:
        reasons.append(f"load average {max(load_average):.1f} on {cores:g} cores: other work "
                       "shared them (calibrate again on a quiet machine)")
    if drift is not None and abs(drift) > drift_limit:
        reasons.append(f"the machine's speed moved {drift:+.0%} during the calibration "
                       "(calibrate again)")
    return reasons
