"""The guard's count for a simulation on a parallel layout
(cocodiff.simulator.budget.estimate_layout): the collectives the simulated ranks post,
exactly, for hybrid, Ring and pure-Ulysses layouts, folded, extrapolated from one and two
layers (as simulate runs them), a long Ring's passes extrapolated, and in full (a recorded
timeline); a PipeFusion generation's (estimate_pipelines); and the planned run's estimate
stays quick at 4,096 nodes."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

import transports.sim as sim_transport
from cocodiff.layout import ParallelLayout
from cocodiff.models import REGISTRY
from cocodiff.schedules import DEFAULT_OPTIONS, PlanOptions, RankGrid
from cocodiff.schedules.gather import output_gather
from cocodiff.schedules.hybrid import plan_hybrid
from cocodiff.simulator import budget
from cocodiff.simulator.simulate import simulate_layers, simulate_plan
from topology import Placement, build_topology, get_preset

FLUX = replace(REGISTRY["flux1-dev"], num_layers=4)
STREAMS = (1024, 512)
RING_INNER = ("batch", "ulysses", "ring")


@pytest.mark.parametrize(("name", "layout", "chunks"), [
    ("flat", ParallelLayout(12, 4), 1),
    ("vfirst", ParallelLayout(24, 2), 1),
    ("tapa", ParallelLayout(24, 2), 2),
    ("flat", ParallelLayout(1, 48), 1),
    ("vfirst", ParallelLayout(12, 4, 1, RING_INNER), 1),
    ("flat", ParallelLayout(8, 6, 1, RING_INNER), 1),
])
@pytest.mark.parametrize("extrapolated", [True, False])
def test_the_layout_count_is_what_the_simulator_posts(monkeypatch, name, layout, chunks,
                                                      extrapolated):
    posted = []
    original = sim_transport.SimWorld.post_all_to_all
    monkeypatch.setattr(sim_transport.SimWorld, "post_all_to_all",
                        lambda self, *args, **kw: posted.append(1) or original(self, *args,
                                                                                **kw))
    spec = get_preset("aurora", 4)
    topology = build_topology(spec)
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    options = PlanOptions(chunks=chunks)
    plan = plan_hybrid(name, FLUX, grid, STREAMS, layout, options)
    gathers = output_gather(FLUX, grid, STREAMS, layout, options)
    if extrapolated:
        result = simulate_layers(plan, topology, placement, gathers=gathers)
    else:
        result = simulate_plan(plan, topology, placement, gathers=gathers)
    estimate = budget.estimate_layout(spec, FLUX.num_layers, FLUX.num_heads, layout, name, 1,
                                      chunks, extrapolated)
    assert estimate.collectives == len(posted)
    assert estimate.collectives // result.simulated_ranks * result.simulated_ranks \
        == estimate.collectives


def test_the_planned_estimate_of_4096_nodes_is_quick_and_grows_with_the_nodes():
    plans = {name: budget.distinct_plans(name, 28, DEFAULT_OPTIONS, None)
             for name in ("flat", "tapa", "vfirst", "cocodiff")}
    model = REGISTRY["flux1-dev"]
    began = time.process_time()
    large = budget.estimate_planned(get_preset("aurora", 4096), model.num_layers,
                                    model.num_heads, plans, 1, True)
    assert time.process_time() - began < 10  # CPU, generous: about 3 s here
    small = budget.estimate_planned(get_preset("aurora", 1024), model.num_layers,
                                    model.num_heads, plans, 1, True)
    # The simulated ranks are one fold period either way, and a long Ring's passes are
    # extrapolated from the same few; what grows with the nodes is the per-rank work
    # (docs/hardening.md: measured 11 s and 19 s of CPU).
    assert large.wall_s > 2 * small.wall_s
    assert large.collectives == small.collectives and large.messages == small.messages


@pytest.mark.parametrize(("stages", "steps", "warmup"),
                         [(2, 8, 1), (4, 8, 1), (3, 3, 1), (6, 28, 1), (4, 9, 2), (4, 4, 4)])
def test_the_pipeline_count_is_what_a_generation_posts(monkeypatch, stages, steps, warmup):
    """Every rank's stage exchanges and transfers, per synchronous step and per patch of a
    pipelined one, over the steps a generation simulates (two short ones past W + 3):
    exact with pipelined steps, within 5% where every step is synchronous."""
    from cocodiff.layout import PipelineLayout
    from cocodiff.simulator.pipelines import rank_pipelines

    posted = []
    original = sim_transport.SimWorld.post_all_to_all
    monkeypatch.setattr(sim_transport.SimWorld, "post_all_to_all",
                        lambda self, *args, **kw: posted.append(1) or original(self, *args,
                                                                                **kw))
    model = replace(REGISTRY["flux1-dev"], num_layers=6)
    spec = get_preset("aurora", 1)
    layout = PipelineLayout(stages, spec.num_tiles // stages, stages, warmup)
    rank_pipelines(model, build_topology(spec), STREAMS, steps, layouts=[layout])
    estimate = budget.estimate_pipelines(spec, model.num_layers, [layout], steps)
    if warmup < steps:
        assert estimate.collectives == len(posted)
    else:
        assert estimate.collectives == pytest.approx(len(posted), rel=0.05)


def test_the_planned_estimate_counts_the_candidates_floored_below_the_winner():
    """Given the planner's floors, every candidate whose floor is below the assumed
    winner's (the largest Ulysses degree, innermost) is counted: the planner simulates
    it before the winner and cannot prune it (Wan2.1-14B on 256 nodes: the winner's
    Ring-innermost twin). Those above it are not."""
    from cocodiff.simulator.planner import candidate_layouts

    spec = get_preset("aurora", 4)
    model = REGISTRY["flux1-dev"]
    plans = {"flat": 1}
    layouts = candidate_layouts(spec.num_tiles, model.num_heads)
    winner = next(i for i, layout in enumerate(layouts)
                  if layout.ulysses == 24 and layout.order[-1] == "ulysses")
    twin = next(i for i, layout in enumerate(layouts)
                if layout.ulysses == 24 and layout.order[-1] == "ring")
    others = [i for i in range(len(layouts)) if i not in (winner, twin)]

    def floors(twin_floor: float) -> dict:
        walked = [(1.0, layouts[winner].name, winner), (twin_floor, layouts[twin].name, twin)]
        walked += [(2.0 + i, layouts[i].name, i) for i in others]
        return {"flat": tuple(sorted(walked))}

    shape_only = budget.estimate_planned(spec, model.num_layers, model.num_heads, plans, 1,
                                         False)
    above = budget.estimate_planned(spec, model.num_layers, model.num_heads, plans, 1, False,
                                    floors(1.5))
    below = budget.estimate_planned(spec, model.num_layers, model.num_heads, plans, 1, False,
                                    floors(0.5))
    assert above == shape_only
    twin_alone = budget.estimate_layout(spec, model.num_layers, model.num_heads,
                                        layouts[twin], "flat", 1, 1)
    assert below.wall_s == pytest.approx(shape_only.wall_s + twin_alone.wall_s)
    assert below.collectives == shape_only.collectives + twin_alone.collectives
    assert below.gather_bundles == shape_only.gather_bundles + twin_alone.gather_bundles > 0
