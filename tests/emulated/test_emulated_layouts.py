"""bench/emulated_layouts.py's pieces that need no cluster: layout names as the session
reads them, the (layout, schedule) pairs it runs, and the rank correlation it reports.
The benchmark itself needs root and minutes (run by hand; see the README)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from emulated_session import parse_layout_name  # noqa: E402

from bench.emulated_layouts import _layouts, _pairs, spearman  # noqa: E402
from cocodiff.util.errors import CocodiffError  # noqa: E402


def test_layout_names_read_back_to_the_planners_layouts():
    layouts = _layouts(None, 8, 8)
    assert {layout.name for layout in layouts} == {
        "U1xR8xB1", "U2xR4xB1", "U2xR4xB1/ring-inner", "U4xR2xB1", "U4xR2xB1/ring-inner",
        "U8xR1xB1"}
    for layout in layouts:
        assert parse_layout_name(layout.name) == layout
    with pytest.raises(CocodiffError, match="not a layout name"):
        parse_layout_name("U4R2")


def test_pairs_run_one_schedule_without_a_ulysses_exchange():
    pairs = _pairs(_layouts("U1xR4xB1,U2xR2xB1", 4, 8), ["flat", "vfirst"])
    assert pairs == [("U1xR4xB1", "flat"), ("U2xR2xB1", "flat"), ("U2xR2xB1", "vfirst")]


def test_spearman():
    order = ["a", "b", "c", "d"]
    assert spearman(order, order) == 1.0
    assert spearman(order, order[::-1]) == -1.0
    assert spearman(order, ["b", "a", "c", "d"]) == pytest.approx(0.8)
