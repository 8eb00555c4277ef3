"""Parallel layouts (cocodiff.layout): validation with one clear line, and where the
Ulysses groups, Rings and batch groups sit on the ranks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cocodiff.layout import AXES, LayoutError, ParallelLayout, parse_degrees

RING_INNER = ("batch", "ulysses", "ring")


def test_default_puts_ulysses_on_consecutive_ranks_and_the_ring_across():
    layout = ParallelLayout(4, 3, 2)
    assert layout.ulysses_group(0) == (0, 1, 2, 3)
    assert layout.ring_group(1) == (1, 5, 9)
    assert layout.batch_group(0) == (0, 12)
    assert layout.sequence_group(13) == tuple(range(12, 24))


def test_ring_inner_swaps_them():
    layout = ParallelLayout(4, 3, 1, RING_INNER)
    assert layout.ring_group(0) == (0, 1, 2)
    assert layout.ulysses_group(0) == (0, 3, 6, 9)
    assert layout.name == "U4xR3xB1/ring-inner"


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.permutations(AXES))
def test_groups_partition_the_ranks_and_chunks_cover_the_sequence(u, r, b, order):
    layout = ParallelLayout(u, r, b, tuple(order))
    n = layout.num_ranks
    for groups_of, size in ((layout.ulysses_group, u), (layout.ring_group, r),
                            (layout.batch_group, b), (layout.sequence_group, u * r)):
        groups = {groups_of(p) for p in range(n)}
        members = sorted(p for group in groups for p in group)
        assert members == list(range(n)) and all(len(g) == size for g in groups)
        assert all(p in groups_of(p) for p in range(n))
    for p in range(n):
        assert layout.position(*layout.coords(p)) == p
        # a sequence group holds every chunk once, in chunk order
        chunks = [layout.sequence_index(q) for q in layout.sequence_group(p)]
        assert chunks == list(range(u * r))
        # the Ring member at ring index j holds chunks j*u .. j*u+u-1
        b_, r_, _ = layout.coords(p)
        assert [layout.sequence_index(q) for q in layout.ulysses_group(p)] == \
            list(range(r_ * u, r_ * u + u))


@pytest.mark.parametrize(("layout", "ranks", "heads", "batch", "message"), [
    (ParallelLayout(4, 2), 12, 24, 1, r"= 8 ranks, but the run has 12"),
    (ParallelLayout(32, 3), 96, 24, 1, r"ulysses degree 32 is above the model's 24 heads"),
    (ParallelLayout(4, 1, 2), 8, 24, 1, r"batch degree 2 does not divide the 1 sample"),
])
def test_invalid_layouts_are_refused_with_one_line(layout, ranks, heads, batch, message):
    with pytest.raises(LayoutError, match=message) as error:
        layout.check(ranks, heads, batch)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_degrees_must_be_positive_integers(bad):
    with pytest.raises(LayoutError, match="ring degree must be a positive integer"):
        ParallelLayout(2, bad)


def test_order_must_name_each_axis_once():
    with pytest.raises(LayoutError, match="must name each of batch, ring, ulysses once"):
        ParallelLayout(2, 2, 1, ("ring", "ring", "batch"))


def test_parse_degrees_fills_the_missing_one():
    assert parse_degrees(None, None, None, 12) == ParallelLayout(12)
    assert parse_degrees(None, 4, None, 96) == ParallelLayout(24, 4, 1)
    assert parse_degrees(12, None, None, 96) == ParallelLayout(12, 8, 1)
    assert parse_degrees(2, 2, 2, 8) == ParallelLayout(2, 2, 2)
    with pytest.raises(LayoutError, match="multiply to 5, which does not divide the 12"):
        parse_degrees(5, None, None, 12)


def test_shift_period():
    # Ulysses inside nodes of 4, Ring across: shifting by one Ulysses group is a symmetry.
    assert ParallelLayout(4, 3).shift_period((1, 1, 1, 1)) == 4
    # Uneven heads repeat only with the group.
    assert ParallelLayout(4, 3).shift_period((2, 1, 2, 1)) == 4
    # Pure Ring over 6 ranks: every rank alike.
    assert ParallelLayout(1, 6).shift_period((3,)) == 1
    # Batch groups of Rings: the Ring wraps inside its batch group, so only a whole
    # batch group is a symmetry.
    assert ParallelLayout(2, 3, 2).shift_period((1, 1)) == 6
