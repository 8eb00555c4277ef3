"""The transfer-load verdict: cores a host lost while a transfer crossed nodes, from its
ranks' loops quiet and loaded (cocodiff.calibration.inflight)."""

from __future__ import annotations

import pytest

from cocodiff.calibration.inflight import KEPT_CORES, TransferLoad, transfer_bytes


def load(stretch_s: float, ranks: int = 4, cores: float = 2.0, noise_s: float = 0.005,
         transfer_s: float = 0.08) -> TransferLoad:
    return TransferLoad(1 << 20, transfer_s, 0.1, 0.1 + stretch_s, noise_s, cores, ranks)


def test_a_host_full_of_ranks_loses_what_slowed_them() -> None:
    # Four ranks on two cores: losing s cores for T runs them at (2 - s) / 2 meanwhile,
    # so each loop stretches by T s / 2.
    for lost in (0.25, 0.5, 1.0):
        assert load(0.08 * lost / 2).transfer_cores == pytest.approx(lost)


def test_a_host_with_idle_cores_loses_them_first() -> None:
    # One rank on two cores runs at full speed until the host keeps less than a core:
    # a loop stretched by a quarter of the transfer ran at 3/4, so 2 - 3/4 cores went.
    assert load(0.02, ranks=1).transfer_cores == pytest.approx(1.25)


def test_a_stretch_within_the_noise_is_no_loss_and_the_host_keeps_a_core_tenth() -> None:
    assert load(0.004).transfer_cores == 0.0
    assert load(-0.01).transfer_cores == 0.0
    assert load(0.5).transfer_cores == pytest.approx(2.0 - KEPT_CORES)


def test_the_transfer_takes_80_ms_of_the_fitted_link_clamped() -> None:
    assert transfer_bytes(0.025, 4096) == 2_000_000  # 0.2 Gbit/s: 80 ms
    assert transfer_bytes(100.0, 4096) == 4096 * 1024
    assert transfer_bytes(1e-6, 4096) == 64 * 1024


def test_it_says_what_it_measured() -> None:
    text = load(0.04).describe()
    assert "1024 KiB" in text and "80.0 ms" in text and "1.00 of 2 cores" in text
    assert load(0.04).to_json()["transfer_cores"] == pytest.approx(1.0)
