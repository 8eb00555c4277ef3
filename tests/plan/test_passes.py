"""cocodiff.plan.passes: a Ring's repeated block found in a layer's plan, and the plan cut
to fewer repeats of it."""

from __future__ import annotations

from dataclasses import replace

from cocodiff.layout import ParallelLayout
from cocodiff.models import REGISTRY
from cocodiff.plan.lazy import LazyPrograms
from cocodiff.plan.passes import PASS_STEPS, plan_passes, repeated_passes, with_passes
from cocodiff.plan.steps import Exchange
from cocodiff.schedules import PlanOptions, RankGrid, get_schedule
from cocodiff.schedules.hybrid import plan_hybrid
from topology import Placement, build_topology, get_preset

FLUX = replace(REGISTRY["flux1-dev"], num_layers=4)
STREAMS = (1024, 512)


def _grid(nodes: int) -> RankGrid:
    topology = build_topology(get_preset("aurora", nodes))
    return RankGrid.from_placement(topology, Placement.node_major(topology))


def test_the_ring_block_is_found_and_cut_to_any_count():
    grid = _grid(2)
    plan = plan_hybrid("flat", FLUX, grid, STREAMS, ParallelLayout(2, 12))
    layer = plan.program(5).layers[0]
    start, count = repeated_passes(layer)
    assert count == 12 - 2  # the first and the last block differ from the middle ones
    kv_pass = layer.attention[start]
    assert isinstance(kv_pass, Exchange) and kv_pass.tensor == "kv"
    assert plan_passes(plan.programs) == 10
    for count in (1, 3):
        cut = with_passes(plan.programs, count)
        assert isinstance(cut, LazyPrograms) == isinstance(plan.programs, LazyPrograms)
        program = cut[5]
        assert len(program.layers[0].attention) == (len(layer.attention)
                                                     - (10 - count) * PASS_STEPS)
        assert all(other is program.layers[0] for other in program.layers)  # still shared
        assert plan_passes(cut) == (count if count > 1 else None)
        # Everything outside the block is untouched.
        assert program.layers[0].attention[:start] == layer.attention[:start]
        assert program.layers[0].attention[-1] is layer.attention[-1]


def test_no_ring_no_passes():
    grid = _grid(1)
    plan = get_schedule("flat").plan(FLUX, grid, STREAMS, PlanOptions())
    assert plan_passes(plan.programs) is None
    assert with_passes(plan.programs, 1) == plan.programs


def test_equal_repeats_count_as_the_block_and_the_last_block_ends_the_run():
    # The run is found by comparing tuples (identical items at once, others by value):
    # a repeat rebuilt as equal objects still counts, a changed one ends the run.
    grid = _grid(2)
    layer = plan_hybrid("flat", FLUX, grid, STREAMS, ParallelLayout(2, 12)).program(5).layers[0]
    start, count = repeated_passes(layer)
    steps = layer.attention
    fifth = start + 4 * PASS_STEPS
    rebuilt = tuple(replace(step) for step in steps[fifth:fifth + PASS_STEPS])
    assert all(a == b and a is not b for a, b in zip(rebuilt, steps[fifth:], strict=False))
    equal = replace(layer, attention=steps[:fifth] + rebuilt + steps[fifth + PASS_STEPS:])
    assert repeated_passes(equal) == (start, count)
    kv_pass = steps[fifth]
    slower = replace(kv_pass, row_bytes=kv_pass.row_bytes + 1)
    changed = replace(layer, attention=steps[:fifth] + (slower,) + steps[fifth + 1:])
    assert repeated_passes(changed) == (start, 4)
