"""A step's exchanges as the schedules issue them (cocodiff.calibration.patterns): which
patterns a world times, and that each runs its calls over the right groups (one rank's
view through the stand-in transport, which checks every call's shape)."""

from __future__ import annotations

import pytest

from cocodiff.calibration import patterns
from cocodiff.calibration.standin import StandInTransport


@pytest.mark.parametrize("shape, expected", [
    ((1, 4), ()),  # one node: nothing crosses a node boundary
    ((4, 1), ("world",)),  # one rank per node: TAPA's column is the world
    ((2, 2), ("world", "column+sync")),
])
def test_which_patterns_a_world_times(shape, expected) -> None:
    assert patterns.patterns_to_time(*shape) == expected


def test_each_pattern_is_timed_in_rounds_at_whole_rows(monkeypatch) -> None:
    monkeypatch.setattr(patterns, "gather_floats", lambda transport, values: [values])
    calls = []
    transport = StandInTransport(1, 4)
    transport.on_exchange = lambda: calls.append(1)
    rows = patterns.measure_patterns(transport, 2, 2, [10 * 1024 + 5, 40 * 1024], rounds=2,
                                     repeats=3)
    assert [(row["pattern"], row["bytes_per_rank"]) for row in rows] == [
        ("world", 10 << 10), ("column+sync", 10 << 10),  # whole 1 KiB rows
        ("world", 40 << 10), ("column+sync", 40 << 10)]
    assert all(len(row["rounds_s"]) == 2 and row["measured_s"] > 0 for row in rows)
    # Per size and round: the world once to warm up and 3 times timed; the column and its
    # sync (2 calls) as often.
    assert len(calls) == 2 * 2 * (4 * 1 + 4 * 2)


def test_the_sizes_are_a_steps_exchange_and_four_times_it() -> None:
    # 8 ranks, 16 KiB blocks: 128 and 512 KiB per rank; a 32 KiB cap on a block stops the
    # second at 256.
    assert patterns.pattern_sizes(128 << 10, 8, 4096) == [128 << 10, 512 << 10]
    assert patterns.pattern_sizes(128 << 10, 8, 32) == [128 << 10, 256 << 10]
    assert patterns.pattern_sizes(128 << 10, 8, 16) == [128 << 10]
