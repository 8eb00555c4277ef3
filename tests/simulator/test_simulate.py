"""cocodiff.simulator.simulate.simulate_layers: a step extrapolated from one and two layers,
and a long Ring's passes extrapolated from three short simulations, is the full simulation,
field by field."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cocodiff.layout import ParallelLayout
from cocodiff.models import REGISTRY
from cocodiff.plan.passes import plan_passes
from cocodiff.schedules import DEFAULT_OPTIONS, PlanOptions, RankGrid, get_schedule
from cocodiff.schedules.hybrid import plan_hybrid
from cocodiff.simulator import simulate
from cocodiff.simulator.simulate import simulate_layers, simulate_plan
from topology import HostSpec, Placement, build_topology, get_preset
from topology.presets import cluster

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


# -- a long Ring's passes extrapolated (simulate._simulate_passes) ---------------------

FLUX4 = replace(FLUX, num_layers=4)  # four layers: short, still extrapolated


def _every_pass(monkeypatch, plan, topology, placement):
    with monkeypatch.context() as patch:
        patch.setattr(simulate, "MIN_EXTRAPOLATED_PASSES", 10**9)
        return simulate_layers(plan, topology, placement)


@pytest.mark.parametrize("preset,nodes,name,layout,nic_gbps", [
    ("aurora", 2, "flat", ParallelLayout(2, 12), None),
    ("aurora", 2, "tapa", ParallelLayout(1, 24), None),
    ("aurora", 4, "vfirst", ParallelLayout(4, 12), None),
    ("aurora", 4, "cocodiff", ParallelLayout(4, 12, 1, ("batch", "ulysses", "ring")), None),
    ("aurora", 8, "flat", ParallelLayout(8, 12), None),
    ("aurora", 16, "tapa", ParallelLayout(12, 16), None),
    ("aurora", 2, "flat", ParallelLayout(2, 12), 0.05),  # passes slower than the blocks
    ("aurora", 8, "vfirst", ParallelLayout(4, 24), 0.05),
    ("dgx-h100", 2, "flat", ParallelLayout(1, 16), None),
    ("dgx-h100", 3, "tapa", ParallelLayout(2, 12, 1, ("batch", "ulysses", "ring")), 0.5),
])
def test_extrapolated_passes_are_every_pass_simulated(monkeypatch, preset, nodes, name, layout,
                                                      nic_gbps):
    spec = get_preset(preset, nodes)
    if nic_gbps is not None:
        spec = replace(spec, nic_link=replace(spec.nic_link, bandwidth_gbps=nic_gbps))
    topology = build_topology(spec)
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    plan = plan_hybrid(name, FLUX4, grid, STREAMS, layout)
    assert plan_passes(plan.programs) >= simulate.MIN_EXTRAPOLATED_PASSES
    fast = simulate_layers(plan, topology, placement)
    full = _every_pass(monkeypatch, plan, topology, placement)
    assert fast.passes_extrapolated and not full.passes_extrapolated
    _assert_same(fast, full)


def test_extrapolated_passes_are_the_full_simulation():
    # no extrapolation at all on the other side: every layer and every pass
    topology, placement, grid = _machine("aurora", 2)
    plan = plan_hybrid("vfirst", FLUX4, grid, STREAMS, ParallelLayout(2, 12))
    _assert_same(simulate_layers(plan, topology, placement),
                 simulate_plan(plan, topology, placement))


def test_a_third_point_off_the_line_falls_back_to_every_pass(monkeypatch):
    topology, placement, grid = _machine("aurora", 2)
    plan = plan_hybrid("flat", FLUX4, grid, STREAMS, ParallelLayout(2, 12))
    monkeypatch.setattr(simulate._Point, "matches", lambda self, other: False)
    fallback = simulate_layers(plan, topology, placement)
    assert not fallback.passes_extrapolated
    _assert_same(fallback, _every_pass(monkeypatch, plan, topology, placement))
    assert fallback.to_json()["passes_extrapolated"] is False


def test_a_host_whose_late_peers_go_first_is_simulated_in_full():
    # There a pair out of step in one layer exchanges one way after the other, which
    # changes how far out of step it starts the next: the layers stop repeating, so the
    # one/two-layer extrapolation would be wrong; simulate_layers runs every layer.
    host = HostSpec(cores=2.0, call_cpu_us=400.0, message_cpu_us=200.0, call_wait_us=7000.0)
    model = replace(REGISTRY["pixart-sigma"], num_layers=6)
    steps = {}
    for late_peer_first in (False, True):
        spec = replace(cluster(2, 2), host=replace(host, late_peer_first=late_peer_first))
        topology = build_topology(spec)
        placement = Placement.node_major(topology)
        grid = RankGrid.from_placement(topology, placement)
        plan = plan_hybrid("flat", model, grid, (1024, 120), ParallelLayout(2, 2))
        full = simulate_plan(plan, topology, placement)
        steps[late_peer_first] = full.step_time_s
        if late_peer_first:
            _assert_same(simulate_layers(plan, topology, placement), full)
    assert steps[True] > steps[False] * 1.001  # the rule is in play on this machine
