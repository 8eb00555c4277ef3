"""cocodiff.simulator.simulate.simulate_layers: a step extrapolated from one and two layers is the
full simulation, field by field."""

from __future__ import annotations

import pytest

from cocodiff.layout import ParallelLayout
from cocodiff.models import REGISTRY
from cocodiff.schedules import DEFAULT_OPTIONS, PlanOptions, RankGrid, get_schedule
from cocodiff.schedules.hybrid import plan_hybrid
from cocodiff.simulator.simulate import simulate_layers, simulate_plan
from topology import Placement, build_topology, get_preset

FLUX = REGISTRY["flux1-dev"]
STREAMS = (1024, 512)


def _machine(preset: str, nodes: int):
    topology = build_topology(get_preset(preset, nodes))
    placement = Placement.node_major(topology)
    return topology, placement, RankGrid.from_placement(topology, placement)


def _assert_same(fast, full):
    rel = 1e-9
    assert fast.step_time_s == pytest.approx(full.step_time_s, rel=rel)
    assert fast.compute_s == pytest.approx(full.compute_s, rel=rel)
    assert fast.comm_exposed_s == pytest.approx(full.comm_exposed_s, rel=rel, abs=1e-15)
    assert fast.exchange_s == pytest.approx(full.exchange_s, rel=rel)
    for tier, num_bytes in full.bytes_by_tier.items():
        assert fast.bytes_by_tier[tier] == pytest.approx(num_bytes, rel=rel)
    assert [u.link for u in fast.busiest_links] == [u.link for u in full.busiest_links]
    for fast_use, full_use in zip(fast.busiest_links, full.busiest_links, strict=True):
        assert fast_use.utilisation == pytest.approx(full_use.utilisation, rel=rel)
    assert (fast.simulated_ranks, fast.folded) == (full.simulated_ranks, full.folded)
    assert fast.exchanges_per_step == full.exchanges_per_step


@pytest.mark.parametrize("name,options,ratio", [
    ("flat", DEFAULT_OPTIONS, 0.0), ("tapa", PlanOptions(chunks=2), 0.0),
    ("vfirst", DEFAULT_OPTIONS, 0.0), ("cocodiff", DEFAULT_OPTIONS, 0.5),
])
def test_pure_ulysses_step_from_two_layers_is_the_full_simulation(name, options, ratio):
    topology, placement, grid = _machine("aurora", 2)
    plan = get_schedule(name).plan(FLUX, grid, STREAMS, options, ratio)
    _assert_same(simulate_layers(plan, topology, placement),
                 simulate_plan(plan, topology, placement))


@pytest.mark.parametrize("layout", [ParallelLayout(12, 4),
                                    ParallelLayout(8, 6, 1, ("batch", "ulysses", "ring"))])
def test_hybrid_step_from_two_layers_is_the_full_simulation(layout):
    # 4 nodes: folded onto a period of nodes; ring-inner places the Ring on fast tiers
    topology, placement, grid = _machine("aurora", 4)
    plan = plan_hybrid("vfirst", FLUX, grid, STREAMS, layout)
    _assert_same(simulate_layers(plan, topology, placement),
                 simulate_plan(plan, topology, placement))


def test_another_machine_and_model_and_no_simulation_kept():
    topology, placement, grid = _machine("dgx-h100", 1)
    plan = get_schedule("flat").plan(REGISTRY["dit-xl-2"], grid, (256,), DEFAULT_OPTIONS)
    assert len(plan.program(0).layers) > 2
    fast = simulate_layers(plan, topology, placement)
    assert fast.simulation is None
    _assert_same(fast, simulate_plan(plan, topology, placement))


def test_a_two_layer_plan_stands_for_the_whole_step():
    # what the planner does: plans of two layers, extrapolated to the model's layer count
    from dataclasses import replace

    topology, placement, grid = _machine("aurora", 4)
    layout = ParallelLayout(12, 4)
    short = plan_hybrid("tapa", replace(FLUX, num_layers=2), grid, STREAMS, layout)
    full = plan_hybrid("tapa", FLUX, grid, STREAMS, layout)
    _assert_same(simulate_layers(short, topology, placement, num_layers=FLUX.num_layers),
                 simulate_plan(full, topology, placement))
    with pytest.raises(ValueError, match="repeats one layer"):
        simulate_layers(_first_layer(short), topology, placement, num_layers=5)


def _first_layer(plan):
    from dataclasses import replace

    from cocodiff.plan.steps import RankProgram

    return replace(plan, programs=tuple(RankProgram(p.rank, p.layers[:1]) for p in plan.programs))
