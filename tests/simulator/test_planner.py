"""The planner (cocodiff.simulator.planner): which layouts it considers, that its layer
extrapolation is the full simulation, and that it ranks what it simulates."""

from __future__ import annotations

import pytest

from cocodiff.layout import ParallelLayout
from cocodiff.models import REGISTRY
from cocodiff.schedules import RankGrid
from cocodiff.schedules.hybrid import plan_hybrid
from cocodiff.simulator.planner import candidate_layouts, rank_layouts, simulate_step
from cocodiff.simulator.simulate import simulate_plan
from topology import Placement, build_topology, get_preset

FLUX = REGISTRY["flux1-dev"]
PIXART = REGISTRY["pixart-sigma"]  # 16 heads, 28 layers: a quick planner


def test_candidates_are_every_valid_layout_once():
    layouts = candidate_layouts(96, 24)
    names = [layout.name for layout in layouts]
    assert len(names) == len(set(names))
    for layout in layouts:
        layout.check(96, 24, 1)
    ulysses = {layout.ulysses for layout in layouts}
    assert ulysses == {1, 2, 3, 4, 6, 8, 12, 16, 24}
    # both placements of each mixed layout, one of a pure Ring
    assert {"U24xR4xB1", "U24xR4xB1/ring-inner", "U1xR96xB1"} <= set(names)
    assert len(layouts) == 17
    # a batch of two adds batch-2 layouts
    assert any(layout.batch == 2 for layout in candidate_layouts(96, 24, batch_size=2))


@pytest.mark.parametrize("name", ["flat", "vfirst"])
def test_layer_extrapolation_is_the_full_simulation(name):
    topology = build_topology(get_preset("aurora", 2))
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    plan = plan_hybrid(name, FLUX, grid, (1024, 512), ParallelLayout(12, 2))
    step_s, compute_s = simulate_step(plan, topology, placement)
    full = simulate_plan(plan, topology, placement)
    assert step_s == pytest.approx(full.step_time_s, rel=1e-9)
    assert compute_s == pytest.approx(full.compute_s, rel=1e-9)


def test_ranking_is_sorted_and_beats_idle_ranks():
    topology = build_topology(get_preset("aurora", 4))
    result = rank_layouts(FLUX, topology, (1024, 512), ("vfirst",))
    times = [c.step_time_s for c in result.candidates]
    assert times == sorted(times)
    best = result.best
    best.layout.check(48, 24, 1)
    assert best.step_time_s >= best.compute_s > 0 and best.bound_s > 0
    # pure Ring (no head exchange) is simulated once, whatever the schedules
    assert sum(1 for c in result.candidates if c.layout.ulysses == 1) == 1


@pytest.mark.parametrize("name", ["flat", "tapa", "vfirst"])
def test_step_floor_never_exceeds_the_simulation(name):
    from cocodiff.simulator.bounds import step_floor_s
    from transports.sim import collective_model_for

    topology = build_topology(get_preset("aurora", 2))
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    model = collective_model_for("aurora")
    for layout in candidate_layouts(24, 16):
        plan = plan_hybrid(name, PIXART, grid, (1024, 512), layout)
        step_s, _ = simulate_step(plan, topology, placement)
        assert 0 < step_floor_s(plan, topology, placement, model) <= step_s * (1 + 1e-9)


def test_pruned_search_picks_what_the_full_ranking_picks():
    from cocodiff.simulator.planner import best_layouts

    topology = build_topology(get_preset("aurora", 2))
    names = ("flat", "vfirst", "cocodiff")  # cocodiff takes vfirst's layout
    chosen = best_layouts(PIXART, topology, (1024, 512), names, workers=2)
    assert chosen["cocodiff"] == chosen["vfirst"]
    for name in ("flat", "vfirst"):
        ranked = rank_layouts(PIXART, topology, (1024, 512), (name,), with_bounds=False)
        assert chosen[name] == ranked.best.layout, name


def _pipeline_machine():
    from cocodiff.simulator.pipelines import pipeline_layouts

    # The two fewest stages: pipelines of many patches take longest to simulate.
    topology = build_topology(get_preset("aurora", 1))
    return topology, pipeline_layouts(12, PIXART)[:2]


@pytest.mark.parametrize("overlap", [False, True])
def test_generation_floor_never_exceeds_the_simulation(overlap):
    """The floor bounds both orders of PipeFusion's steps (the planner's default, what
    `run` executes, is the slower one)."""
    from dataclasses import replace

    from cocodiff.schedules import DEFAULT_OPTIONS
    from cocodiff.schedules.pipefusion import pipefusion_step_plans
    from cocodiff.simulator.bounds import generation_floor_s
    from cocodiff.simulator.simulate import simulate_generation
    from transports.sim import collective_model_for

    topology, layouts = _pipeline_machine()
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    model = collective_model_for("aurora")
    for layout in (replace(layout, overlap=overlap) for layout in layouts):
        assert layout.overlap is overlap
        plans, steps = pipefusion_step_plans(PIXART, grid, (1024, 512), layout, 4,
                                             DEFAULT_OPTIONS)
        simulated = simulate_generation(plans, steps, topology, placement).step_time_s
        floor_s = generation_floor_s(plans, steps, topology, placement, model)
        assert 0 < floor_s <= simulated * (1 + 1e-9), layout.name


def test_pruned_ranking_has_the_full_rankings_top():
    from cocodiff.simulator.pipelines import rank_pipelines
    from cocodiff.simulator.ranking import rank_with_floors

    topology, pipelines = _pipeline_machine()
    names = ("flat", "vfirst")
    layouts = candidate_layouts(12, PIXART.num_heads)
    full = list(rank_layouts(PIXART, topology, (1024, 512), names, layouts=layouts).candidates)
    full += rank_pipelines(PIXART, topology, (1024, 512), 4, layouts=pipelines)[0]
    full.sort(key=lambda c: (c.step_time_s, c.layout.name, c.schedule))
    for top, workers in ((3, 2),):  # two workers: candidates simulated in pairs
        ranked = rank_with_floors(PIXART, topology, (1024, 512), names, layouts, pipelines, 4,
                                  top=top, workers=workers)
        assert len(ranked.candidates) + len(ranked.pruned) == len(full)
        assert [(c.layout, c.schedule, c.step_time_s, c.compute_s, c.bound_s)
                for c in ranked.candidates[:top]] == [
            (c.layout, c.schedule, c.step_time_s, c.compute_s, c.bound_s) for c in full[:top]]
        assert ranked.pruned, "the bounds prune something here"
        assert all(p.floor_s > ranked.candidates[top - 1].step_time_s for p in ranked.pruned)


def test_chunk_search_reuses_the_planners_step():
    from cocodiff.simulator.planner import choose_chunks, choose_layouts

    topology = build_topology(get_preset("aurora", 2))
    choice = choose_layouts(PIXART, topology, (1024, 512), ("vfirst",))["vfirst"]
    reused = choose_chunks("vfirst", PIXART, topology, (1024, 512), choice.layout,
                           known=choice.result)
    fresh = choose_chunks("vfirst", PIXART, topology, (1024, 512), choice.layout)
    assert (reused.chunks, reused.step_times_s) == (fresh.chunks, fresh.step_times_s)
    assert reused.step_times_s[1] == choice.result.step_time_s


def test_step_times_equal_to_seven_digits_tie_so_the_name_decides(monkeypatch):
    """Two placements that mirror each other simulate equal to ~1e-13: which one wins must
    not rest on those bits, and the later-named one whose floor already ties the best is
    not simulated (at 1,024 Aurora nodes that twin took 7 CPU-minutes)."""
    from types import SimpleNamespace

    from cocodiff.layout import RING_INNER_ORDER
    from cocodiff.simulator import planner

    assert planner.step_key(0.1283700000001) == planner.step_key(0.12837)
    assert planner.step_key(0.12837) < planner.step_key(0.1283702)
    first = ParallelLayout(4, 6, 1)
    twin = ParallelLayout(4, 6, 1, order=RING_INNER_ORDER)  # "U4xR6xB1/ring-inner"
    slower = ParallelLayout(2, 12, 1)
    assert first.name < twin.name
    floors = {first.name: 1.0, twin.name: 1.0, slower.name: 2.0}
    times = {first.name: 1.0, twin.name: 1.0 - 1e-13, slower.name: 2.0}
    simulated = []

    def fake_floor(plan, *args):
        return floors[plan.layout_name]

    def fake_simulation(plan, *args):
        simulated.append(plan.layout_name)
        return SimpleNamespace(step_time_s=times[plan.layout_name], simulation=None)

    def fake_plan(name, spec, grid, streams, layout, options):
        return SimpleNamespace(layout_name=layout.name)

    monkeypatch.setattr(planner, "candidate_layouts", lambda *a: [slower, twin, first])
    monkeypatch.setattr(planner, "step_floor_s", fake_floor)
    monkeypatch.setattr(planner, "simulate_layers", fake_simulation)
    monkeypatch.setattr(planner, "plan_hybrid", fake_plan)
    topology = build_topology(get_preset("aurora", 2))
    choice = planner.choose_layouts(PIXART, topology, (1024, 512), ("flat",))["flat"]
    assert choice.layout == first
    assert simulated == [first.name]


def test_floors_worked_out_first_give_the_same_choices():
    """simulate works the floors out before the planner (the guard counts from them):
    handing them to choose_layouts changes nothing it picks or simulates."""
    from cocodiff.simulator.planner import choose_layouts, layout_floors

    topology = build_topology(get_preset("aurora", 2))
    names = ("flat", "vfirst", "cocodiff")
    floors = layout_floors(PIXART, topology, (1024, 512), names)
    assert set(floors) == {"flat", "vfirst"}  # cocodiff is ranked as vfirst
    for walked in floors.values():
        assert [floor for floor, _, _ in walked] == sorted(floor for floor, _, _ in walked)
    given = choose_layouts(PIXART, topology, (1024, 512), names, floors=floors)
    fresh = choose_layouts(PIXART, topology, (1024, 512), names)
    for name in names:
        assert given[name].layout == fresh[name].layout
        if fresh[name].result is not None:
            assert given[name].result.step_time_s == fresh[name].result.step_time_s
