"""The step's compute outside the blocks (``tile_step_overhead_us``) in closed form: once
per denoising step per rank, on the host's shared cores like any compute."""

from __future__ import annotations

import dataclasses

import pytest

from cocodiff.cost import Cost
from cocodiff.plan.steps import Compute, HeadSplit, LayerPlan, Plan, RankProgram
from cocodiff.simulator.simulate import simulate_layers, simulate_plan
from topology import HostSpec, build_topology
from topology.presets import cluster

TFLOPS = 1.0
LAYER_S = 0.010  # one layer's compute: 1e10 FLOPs at 1 TF/s
OVERHEAD_S = 0.004


def machine(num_ranks: int, host: HostSpec | None, overhead_s: float):
    """One node whose links cost nothing worth measuring: only compute takes time."""
    spec = cluster(num_nodes=1, ranks_per_node=num_ranks, intra_gbps=1e8, intra_latency_us=0.0,
                   tile_tflops=TFLOPS, tile_memory_gbps=1e8)
    return build_topology(dataclasses.replace(spec, name="overhead-test", host=host,
                                              tile_step_overhead_us=overhead_s * 1e6))


def layers_plan(num_ranks: int, num_layers: int) -> Plan:
    """Every rank computes ``num_layers`` identical layers (one shared object, as the
    schedulers build them)."""
    layer = LayerPlan((), (Compute("mlp", Cost(flops=LAYER_S * TFLOPS * 1e12,
                                                memory_bytes=0.0)),), ())
    programs = tuple(RankProgram(rank, (layer,) * num_layers) for rank in range(num_ranks))
    return Plan("flat", "test", HeadSplit(num_ranks, num_ranks, (1,) * num_ranks, 8), programs,
                shift_period=None)


@pytest.mark.parametrize("num_layers", [1, 2, 5])
@pytest.mark.parametrize(("num_ranks", "cores"), [(1, 2), (2, 2), (4, 2), (4, 1)])
def test_n_layers_and_the_overhead_on_shared_cores(num_layers: int, num_ranks: int,
                                                   cores: int) -> None:
    # Every rank computes N layers and the overhead once; r ranks on c cores share them:
    # step = (N x layer + overhead) x max(1, r / c).
    topology = machine(num_ranks, HostSpec(cores=cores), OVERHEAD_S)
    slowdown = max(1.0, num_ranks / cores)
    expected = (num_layers * LAYER_S + OVERHEAD_S) * slowdown
    plan = layers_plan(num_ranks, num_layers)
    full = simulate_plan(plan, topology, fold=False)
    assert full.step_time_s == pytest.approx(expected, rel=1e-9)
    assert full.compute_s == pytest.approx(expected, rel=1e-9)  # it is compute, not waiting
    # Extrapolated from one and two layers, the overhead still counts once.
    assert simulate_layers(plan, topology).step_time_s == pytest.approx(expected, rel=1e-9)


def test_accelerator_ranks_pay_it_on_their_own_device() -> None:
    topology = machine(4, None, OVERHEAD_S)
    result = simulate_plan(layers_plan(4, 3), topology, fold=False)
    assert result.step_time_s == pytest.approx(3 * LAYER_S + OVERHEAD_S, rel=1e-9)


def test_a_real_schedule_pays_it_once_per_step() -> None:
    # flux1-dev's 57 layers of flat Ulysses on 2 x 2: the overhead adds exactly itself on
    # accelerators (ranks start in step, so it delays every rank alike), and no overhead
    # is bit-identical to the key left out.
    from cocodiff.models import REGISTRY
    from cocodiff.simulator.simulate import simulate_schedule
    from topology import Placement

    spec = cluster(num_nodes=2, ranks_per_node=2)
    steps = {}
    for overhead_us in (0.0, OVERHEAD_S * 1e6):
        topology = build_topology(dataclasses.replace(spec, tile_step_overhead_us=overhead_us))
        steps[overhead_us] = simulate_schedule("flat", REGISTRY["flux1-dev"], topology,
                                               Placement.node_major(topology), (256, 64), 2)
    without = simulate_schedule("flat", REGISTRY["flux1-dev"], build_topology(spec),
                                Placement.node_major(build_topology(spec)), (256, 64), 2)
    assert steps[0.0].step_times_s == without.step_times_s
    added = steps[OVERHEAD_S * 1e6].step_time_s - without.step_time_s
    assert added == pytest.approx(OVERHEAD_S, rel=1e-6)


@pytest.mark.parametrize(("num_ranks", "batch", "ring", "share"), [
    (4, 1, 1, 1 / 4),   # Ulysses over 4: a quarter of the sequence
    (4, 2, 1, 2 / 4),   # two samples on every rank
    (2, 1, 2, 1 / 4),   # Ulysses 2 x Ring 2: a Ulysses group holds half
    (1, 1, 1, 1.0),
])
def test_the_sequence_part_is_charged_by_the_ranks_share(num_ranks, batch, ring, share):
    # fixed + per-sequence x share, once per step, on top of the layers (accelerators:
    # every rank its own device).
    from cocodiff.layout import ParallelLayout
    from cocodiff.simulator.backend import sequence_share

    fixed_s, sequence_s = 0.002, 0.008
    plan = dataclasses.replace(layers_plan(num_ranks, 2), parallel=ParallelLayout(
        num_ranks, ring), head_split=HeadSplit(num_ranks, num_ranks, (1,) * num_ranks, 8,
                                               batch))
    assert sequence_share(plan) == pytest.approx(share)
    topology = build_topology(dataclasses.replace(
        machine(num_ranks, None, fixed_s).spec, tile_step_overhead_sequence_us=sequence_s * 1e6))
    result = simulate_plan(plan, topology, fold=False)
    assert result.step_time_s == pytest.approx(2 * LAYER_S + fixed_s + sequence_s * share,
                                               rel=1e-9)
