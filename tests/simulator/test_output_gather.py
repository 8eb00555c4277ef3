"""The step's output gather (cocodiff.plan.gather): what it moves, in closed form, and what
it costs the simulated step. That the runtime moves the same bytes is checked where a real
run is compared with the simulator (tests/plan/test_plan_file.py, the V-Major replay in
tests/runtime/test_runtime_vmajor.py)."""

from __future__ import annotations

import dataclasses

import pytest

from cocodiff.layout import ParallelLayout
from cocodiff.models.registry import REGISTRY
from cocodiff.plan.gather import GatherStage, image_stream
from cocodiff.plan.steps import HeadSplit, LayerPlan, Plan, RankProgram
from cocodiff.schedules import PlanOptions, RankGrid
from cocodiff.schedules.gather import output_gather
from cocodiff.schedules.run_plan import build_run_plan
from cocodiff.simulator.simulate import simulate_plan, simulate_run_plan
from topology import build_topology
from topology.presets import cluster
from transports.sim import COLLECTIVE_MODELS

FLUX = REGISTRY["flux1-dev"]  # 64 output values per token
FLOAT32 = PlanOptions(dtype="float32")


def test_every_rank_sends_its_padded_share_to_every_other() -> None:
    # 1024 image tokens over 3 ranks: chunks padded to 342 tokens, 64 float32 values each.
    grid = RankGrid((3, 1, 1), (0, 1, 2))
    [stage] = output_gather(FLUX, grid, (1024, 512), None, FLOAT32)
    assert stage == GatherStage(((0, 1, 2),), 342 * 64 * 4)


def test_a_pure_ulysses_layout_gathers_as_no_layout() -> None:
    # The planner names pure Ulysses as a layout, a run's plan records it as none.
    grid = RankGrid((2, 2, 1), (0, 2, 1, 3))
    assert output_gather(FLUX, grid, (1024, 512), ParallelLayout(ulysses=4), FLOAT32) == \
        output_gather(FLUX, grid, (1024, 512), None, FLOAT32)


def test_a_hybrid_layout_gathers_its_sequence_then_the_batch() -> None:
    # U2 x B2 over 4 ranks, 2 samples: each sequence group of 2 holds one sample, each rank
    # half its tokens; then each batch group swaps the whole sample.
    grid = RankGrid((2, 2, 1), (0, 1, 2, 3))
    layout = ParallelLayout(ulysses=2, ring=1, batch=2)
    options = PlanOptions(dtype="bfloat16", batch=2)
    sequence, batch = output_gather(FLUX, grid, (1024, 512), layout, options)
    assert sequence.bytes_per_member == 512 * 64 * 2
    assert batch.bytes_per_member == 1024 * 64 * 2
    for stage, size in ((sequence, 2), (batch, 2)):
        members = sorted(rank for group in stage.groups for rank in group)
        assert members == [0, 1, 2, 3] and {len(g) for g in stage.groups} == {size}
    assert set(sequence.groups).isdisjoint(batch.groups)


def test_nothing_is_gathered_when_the_output_width_is_unknown() -> None:
    spec = dataclasses.replace(FLUX, output_channels=0)
    assert output_gather(spec, RankGrid((2, 1, 1), (0, 1)), (1024, 512), None, FLOAT32) == ()


@pytest.mark.parametrize(("streams", "image"), [((4096,), 4096), ((512, 4096), 4096),
                                                ((512, 256), 256), ((512, 512), 512)])
def test_the_image_stream_is_the_one_that_is_not_the_text(streams, image) -> None:
    assert image_stream(FLUX, streams) == image  # FLUX joins 512 text tokens


def test_a_gather_over_one_link_takes_its_latency_and_its_bytes_at_the_link_rate() -> None:
    # Two nodes of one rank, nothing else in the step: each rank's share crosses the link
    # (one direction each), so the step is the route's latency plus bytes / rate.
    gbps, latency_us, num_bytes = 0.5, 200.0, 1_000_000
    topology = build_topology(cluster(num_nodes=2, ranks_per_node=1, inter_gbps=gbps,
                                      inter_latency_us=latency_us, intra_gbps=1e6))
    empty = LayerPlan((), (), ())
    plan = Plan("flat", "test", HeadSplit(2, 2, (1, 1), 8),
                tuple(RankProgram(rank, (empty,)) for rank in range(2)), shift_period=None)
    route_s = topology.route_latency_us(topology.route("n0.g0.t0", "n1.g0.t0")) * 1e-6
    gathers = (GatherStage(((0, 1),), num_bytes),)
    ideal = COLLECTIVE_MODELS["ideal"]  # links only: no per-message set-up
    result = simulate_plan(plan, topology, collective=ideal, gathers=gathers)
    assert result.step_time_s == pytest.approx(route_s + num_bytes / (gbps * 1e9), rel=1e-9)
    assert result.bytes_by_tier["inter-node"] == 2 * num_bytes
    assert simulate_plan(plan, topology, collective=ideal).step_time_s == 0.0


def test_a_run_plan_pays_its_gather_once_per_step() -> None:
    # flat on 2 x 1 ranks: the run plan's step is the plan's step plus one gather,
    # whatever the layer count (extrapolated from one and two layers).
    topology = build_topology(cluster(num_nodes=2, ranks_per_node=1))
    grid = RankGrid((2, 1, 1), (0, 1))
    run_plan = build_run_plan("flat", FLUX, grid, (1024, 512), 2, FLOAT32)
    with_gather = simulate_run_plan(run_plan, topology, with_bound=False)
    without = simulate_run_plan(
        dataclasses.replace(run_plan, spec=dataclasses.replace(FLUX, output_channels=0)),
        topology, with_bound=False)
    gather_bytes = 2 * 512 * 64 * 4  # each rank's half of the image, one way each
    assert with_gather.bytes_by_tier["inter-node"] - without.bytes_by_tier["inter-node"] \
        == pytest.approx(gather_bytes)
    assert with_gather.step_time_s > without.step_time_s
