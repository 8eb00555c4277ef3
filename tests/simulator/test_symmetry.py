"""Symmetry-reduced simulation equals the full one: folding the simulated ranks onto a
period of nodes (``transports.sim``, ``cocodiff.simulator.symmetry``) and folding the
bounds' traffic (``cocodiff.simulator.bounds``) give the full computation's numbers
within 1e-9 relative, across layouts (pure Ulysses, Ring, batch, hybrid, both
placements of the Ring), schedules and 2-16 Aurora nodes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cocodiff.layout import ParallelLayout
from cocodiff.models import REGISTRY
from cocodiff.schedules import DEFAULT_OPTIONS, PlanOptions, RankGrid, get_schedule
from cocodiff.schedules.gather import output_gather
from cocodiff.schedules.hybrid import plan_hybrid
from cocodiff.simulator.bounds import model_bound_s, plan_bound_s
from cocodiff.simulator.simulate import simulate_plan
from cocodiff.simulator.symmetry import fold_period_nodes
from topology import Placement, build_topology, get_preset
from transports.sim import collective_model_for

# One layer keeps the full simulations of 192 ranks quick; every layer is the same.
FLUX = replace(REGISTRY["flux1-dev"], num_layers=1)
STREAMS = (1024, 512)
REL = 1e-9
SCHEDULES = [("flat", DEFAULT_OPTIONS, 0.0), ("tapa", PlanOptions(chunks=2), 0.0),
             ("vfirst", DEFAULT_OPTIONS, 0.0), ("cocodiff", DEFAULT_OPTIONS, 0.5)]
RING_INNER = ("batch", "ulysses", "ring")


def _machine(nodes: int):
    topology = build_topology(get_preset("aurora", nodes))
    placement = Placement.node_major(topology)
    return topology, placement, RankGrid.from_placement(topology, placement)


def _layouts(nodes: int) -> list[ParallelLayout | None]:
    ranks = 12 * nodes
    layouts: list[ParallelLayout | None] = [
        None,  # pure Ulysses over every rank (24 heads: up to two nodes)
        ParallelLayout(12, ranks // 12),
        ParallelLayout(24, ranks // 24),
        ParallelLayout(8, ranks // 8, 1, RING_INNER),
        ParallelLayout(6, ranks // 12, 2),
        ParallelLayout(1, ranks),
    ]
    return [layout for layout in layouts if layout is None and ranks <= 24
            or layout is not None]


def _plan(name, options, ratio, grid, layout):
    if layout is None:
        return get_schedule(name).plan(FLUX, grid, STREAMS, options, ratio)
    return plan_hybrid(name, FLUX, grid, STREAMS, layout, replace(options, batch=layout.batch),
                       ratio)


def _assert_same(fast, full):
    assert fast.step_time_s == pytest.approx(full.step_time_s, rel=REL)
    assert fast.compute_s == pytest.approx(full.compute_s, rel=REL)
    assert fast.exchange_s == pytest.approx(full.exchange_s, rel=REL)
    for tier, num_bytes in full.bytes_by_tier.items():
        assert fast.bytes_by_tier[tier] == pytest.approx(num_bytes, rel=REL)
    assert fast.exchanges_per_step == full.exchanges_per_step


CASES = [(nodes, index, schedule) for nodes in (2, 4, 8, 16)
         for index in range(len(_layouts(nodes))) for schedule in range(len(SCHEDULES))
         # 16 nodes: one schedule per layout keeps the full simulations affordable
         if nodes < 16 or schedule == index % len(SCHEDULES)]


@pytest.mark.parametrize("nodes,layout_index,schedule_index", CASES)
def test_folded_simulation_and_bounds_are_the_full_ones(nodes, layout_index, schedule_index):
    topology, placement, grid = _machine(nodes)
    layout = _layouts(nodes)[layout_index]
    name, options, ratio = SCHEDULES[schedule_index]
    if layout is not None and layout.ring == 1 and layout.batch == 1:
        layout = None
    plan = _plan(name, options, ratio, grid, layout)
    batch = 1 if layout is None else layout.batch
    gathers = output_gather(FLUX, grid, STREAMS, layout, replace(options, batch=batch))
    folded = simulate_plan(plan, topology, placement, gathers=gathers)
    full = simulate_plan(plan, topology, placement, fold=False, gathers=gathers)
    assert folded.folded == (fold_period_nodes(plan, topology, placement) is not None)
    assert not full.folded and full.simulated_ranks == placement.num_ranks
    _assert_same(folded, full)
    model = collective_model_for("aurora")
    assert model_bound_s(plan, topology, placement, model) == pytest.approx(
        model_bound_s(plan, topology, placement, model, fold=False), rel=REL)
    assert plan_bound_s(plan, topology, placement) == pytest.approx(
        plan_bound_s(plan, topology, placement, fold=False), rel=REL)


def test_the_sweep_folds_every_kind_of_layout():
    # the equality above is not vacuous: Ring, batch, hybrid and pure layouts all fold
    kinds = set()
    for nodes in (2, 4, 8, 16):
        topology, placement, grid = _machine(nodes)
        for layout in _layouts(nodes):
            plan = _plan("vfirst", DEFAULT_OPTIONS, 0.0, grid, layout)
            if fold_period_nodes(plan, topology, placement) is not None:
                kinds.add("pure" if layout is None else
                          ("ring" if layout.ulysses == 1 else
                           "batch" if layout.batch > 1 else "hybrid"))
    assert kinds == {"pure", "ring", "batch", "hybrid"}


@pytest.mark.parametrize("nodes,layout_index,schedule_index",
                         [case for case in CASES if case[0] >= 8])
def test_the_model_bound_walks_a_long_ring_once_and_gives_every_pass(
        monkeypatch, nodes, layout_index, schedule_index):
    # model_bound_s walks a Ring's repeated block twice and adds the rest
    # (cocodiff.plan.passes): the same as walking every pass.
    from cocodiff.simulator import bounds

    topology, placement, grid = _machine(nodes)
    name, options, ratio = SCHEDULES[schedule_index]
    plan = _plan(name, options, ratio, grid, _layouts(nodes)[layout_index])
    assert bounds.repeated_passes(plan.program(0).layers[0]) is not None
    model = collective_model_for("aurora")
    once = model_bound_s(plan, topology, placement, model)
    monkeypatch.setattr(bounds, "repeated_passes", lambda layer: None)
    assert once == pytest.approx(model_bound_s(plan, topology, placement, model), rel=REL)
