"""Collective helpers of a calibration: every rank gets what the others measured."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cocodiff.calibration.fits import LinkFit, fit_latency_bandwidth
from cocodiff.calibration.options import DEFAULT_SIZES_KIB, QUICK_SIZES_KIB


def gather_floats(transport, values: Sequence[float]) -> list[list[float]]:
    import torch

    from cocodiff.runtime.exchange import all_gather_rows

    mine = torch.tensor(list(values), dtype=torch.float64)
    return all_gather_rows(transport, mine).tolist()


def share_fit(transport, owner: int, points: list[tuple[int, float]], source: str) -> LinkFit:
    """Fit on ``owner`` and give every rank the result (fits are collective here so that
    every rank can build the same topology)."""
    values: list[float] = []
    if transport.rank == owner:
        values = [v for point in points for v in point]
    width = 2 * max(len(DEFAULT_SIZES_KIB), len(QUICK_SIZES_KIB))
    padded = values + [0.0] * (width - len(values))
    rows = gather_floats(transport, padded)[owner]
    shared = [(int(rows[i]), rows[i + 1]) for i in range(0, width, 2) if rows[i] > 0]
    return fit_latency_bandwidth(shared, source)


@dataclass(frozen=True, slots=True)
class WorldLineup:
    """Every rank of ``transport``'s world timing at once (a
    :class:`~cocodiff.calibration.compute.Lineup`; collective, like every call here)."""

    transport: Any

    def barrier(self) -> None:
        self.transport.barrier()

    def agree(self, value: float) -> float:
        return statistics.median(row[0] for row in gather_floats(self.transport, [value]))
