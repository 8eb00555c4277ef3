"""The emulated link's shaper: its bucket holds about 1 ms of traffic, so a link that
idled (while the ranks computed) cannot burst far past its rate afterwards, as the
simulator's links cannot (a 128 KiB bucket made a 0.05 Gbit/s step 1.7x faster than its
link: docs/changelog.md); its queue holds at least 4 MiB, so that concurrent TCP windows
queue instead of dropping (the simulator's links lose nothing). No root needed: the
numbers only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster.netns import tbf_bucket  # noqa: E402

FRAME_BYTES = 1514  # one full Ethernet frame, as tbf charges it


@pytest.mark.parametrize("gbit", [0.01, 0.05, 0.2, 1.0, 5.0, 25.0])
def test_the_bucket_holds_one_millisecond_of_traffic_and_passes_a_frame(gbit):
    burst, limit = tbf_bucket(gbit)
    one_ms = gbit * 1e9 / 8 * 1e-3
    assert burst >= 2 * FRAME_BYTES  # a bucket smaller than a frame passes nothing
    assert burst <= max(2 * FRAME_BYTES, one_ms) + 1
    assert limit >= burst + 20 * one_ms - 1  # the queue: 20 ms of traffic beyond it,
    assert limit >= burst + 4 * 2**20  # and room for every rank's TCP window: no drops


def test_at_a_slow_rate_the_bucket_is_far_below_the_old_128_kib():
    burst, _ = tbf_bucket(0.05)
    assert burst * 8 / 0.05e9 <= 1e-3 + 1e-9  # at most 1 ms of traffic: 6.25 KB
