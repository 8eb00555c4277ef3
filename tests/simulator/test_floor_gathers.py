"""The planner's step floor with the output gathers (cocodiff.simulator.bounds.step_floor_s):
still never above the simulated step, across layouts and schedules, scaled from a
two-layer plan to the model's layers as the planner scales it; and the layout it picks
is unchanged (the floor only decides what is simulated, never what wins)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cocodiff.models import REGISTRY
from cocodiff.schedules import DEFAULT_OPTIONS, RankGrid
from cocodiff.schedules.gather import output_gather
from cocodiff.schedules.hybrid import plan_hybrid
from cocodiff.simulator.bounds import step_floor_s
from cocodiff.simulator.planner import candidate_layouts
from cocodiff.simulator.simulate import simulate_layers
from topology import Placement, build_topology, get_preset
from transports.sim import collective_model_for

FLUX = REGISTRY["flux1-dev"]
STREAMS = (1024, 512)


@pytest.mark.parametrize("nodes", [2, 4])
@pytest.mark.parametrize("name", ["flat", "tapa", "vfirst"])
def test_floor_with_gathers_never_exceeds_the_simulation(nodes, name):
    assert FLUX.output_channels  # the gathers are not empty
    topology = build_topology(get_preset("aurora", nodes))
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    model = collective_model_for("aurora")
    short = replace(FLUX, num_layers=2)
    for layout in candidate_layouts(placement.num_ranks, FLUX.num_heads):
        plan = plan_hybrid(name, short, grid, STREAMS, layout)
        gathers = output_gather(FLUX, grid, STREAMS, layout, DEFAULT_OPTIONS)
        assert gathers
        simulated = simulate_layers(plan, topology, placement, None, FLUX.num_layers,
                                    gathers).step_time_s
        floor_s = step_floor_s(plan, topology, placement, model, gathers, FLUX.num_layers)
        without = step_floor_s(plan, topology, placement, model) * FLUX.num_layers / 2
        assert 0 < without < floor_s <= simulated * (1 + 1e-9), layout.name


def test_the_gathers_floor_holds_at_64_nodes():
    # 64 nodes: every rank's chunk goes to 767 others; the floor stays under the
    # simulated step and close to it.
    topology = build_topology(get_preset("aurora", 64))
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    layout = candidate_layouts(placement.num_ranks, FLUX.num_heads)[-1]
    plan = plan_hybrid("vfirst", replace(FLUX, num_layers=2), grid, STREAMS, layout)
    gathers = output_gather(FLUX, grid, STREAMS, layout, DEFAULT_OPTIONS)
    simulated = simulate_layers(plan, topology, placement, None, FLUX.num_layers,
                                gathers).step_time_s
    floor_s = step_floor_s(plan, topology, placement, collective_model_for("aurora"),
                           gathers, FLUX.num_layers)
    assert 0.5 * simulated < floor_s <= simulated * (1 + 1e-9)
