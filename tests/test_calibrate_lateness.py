"""cocodiff.calibration.lateness: the late-peer verdict from the late member's own calls,
and the sizes of its measurement on a fitted link (the transport run is in
tests/test_calibrate.py)."""

import pytest

from cocodiff.calibration.fits import LinkFit
from cocodiff.calibration.lateness import LatePeer, late_peer_sizes


def test_the_verdict_is_the_exchange_over_the_one_way_transfer() -> None:
    # Measured at 0.2 Gbit/s: 19.0 ms one way, 36.8 both ways (one after the other);
    # on loopback 5.5 and 7.5 ms (both at once, CPU-bound).
    serialised = LatePeer(444_000, 0.04, 0.0190, 0.0368)
    assert serialised.late_peer_first and serialised.ratio == pytest.approx(1.937, rel=1e-3)
    assert "went first" in serialised.describe()
    together = LatePeer(4 << 20, 0.02, 0.0055, 0.0075)
    assert not together.late_peer_first and "both directions at once" in together.describe()
    assert together.to_json()["late_peer_first"] is False


def test_sizes_take_a_fiftieth_of_a_second_of_the_link_and_call_twice_that_late() -> None:
    # 0.2 Gbit/s (0.025 GB/s): 500 kB take 20 ms, the late member calls 40 ms late.
    num_bytes, late_by = late_peer_sizes(LinkFit(0.0, 0.025), max_kib=4096)
    assert num_bytes == 500_000 and late_by == pytest.approx(0.04)
    # A fast link: capped at --max-kib, called late by the floor.
    num_bytes, late_by = late_peer_sizes(LinkFit(20.0, 5.0), max_kib=4096)
    assert num_bytes == 4096 * 1024 and late_by == pytest.approx(0.02)
