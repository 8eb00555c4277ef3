"""TAPA's chunk pipeline against its closed form, on free links (no per-transfer set-up:
the ``ideal`` collective model).

One exchange alone on 2 nodes x 1 GPU x 2 tiles, one head per rank (every block one row,
so chunks cut tokens): phase 0 (node) sends each rank's 2 rows bound for the other node
over the node's one NIC, which its 2 tiles share max-min (each at half the NIC's rate);
phase 1 (tile) sends 2 rows to the sibling tile over the tile link. With C chunks each
phase of a chunk carries 1/C of the bytes, and a flow pays its route's latency, then its
bytes at its rate:

    slow = L_node + 2 R / (C * nic / 2),    fast = L_tile + 2 R / (C * tile)

Chunk c's node phase follows chunk c-1's (one NIC), and its tile phase follows both its
own node phase and chunk c-1's tile phase (:class:`cocodiff.plan.phasing.ChunkPipeline`),
so the slow phase of chunk c overlaps the fast phase of chunk c-1:

    T(C) = slow + fast + (C - 1) * max(slow, fast)
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from cocodiff.models import REGISTRY
from cocodiff.plan.steps import LayerPlan, Plan, RankProgram, Wait
from cocodiff.schedules import PlanOptions, RankGrid, plan_tapa
from cocodiff.simulator.simulate import simulate_plan
from topology import Placement, build_topology
from topology.spec import LinkSpec, TopologySpec
from transports.sim import COLLECTIVE_MODELS

FAST = LinkSpec(1e6, 0.0)  # on-package and PCIe hops: never the constraint here
TOKENS = 6000  # one stream: 1500 tokens per rank, which 1, 2, 3 and 4 chunks divide


def machine(nic_gbps: float, tile_gbps: float):
    spec = TopologySpec(
        name="two-tier", num_nodes=2, gpus_per_node=1, tiles_per_gpu=2, nics_per_node=1,
        tile_tflops=100.0, tile_memory_gbps=1000.0, tile_link=LinkSpec(tile_gbps, 0.5),
        gpu_link=None, gpu_fabric="all-to-all", port_link=FAST, host_link=FAST,
        nic_link=LinkSpec(nic_gbps, 1.0), fabric_latency_us=2.0)
    return build_topology(spec)


def one_exchange(chunks: int) -> Plan:
    """The Q exchange of a TAPA plan, alone: each rank starts it and waits for it."""
    spec = replace(REGISTRY["flux1-dev"], num_heads=4)
    grid = RankGrid((2, 1, 2), (0, 1, 2, 3))
    plan = plan_tapa(spec, grid, (TOKENS,), PlanOptions(chunks=chunks))
    programs = []
    for program in plan.programs:
        q = program.layers[0].exchanges[0]
        assert q.tensor == "q" and [p.level for p in q.phases] == ["node", "tile"]
        programs.append(RankProgram(program.rank, (LayerPlan((), (q, Wait("q")), ()),)))
    return replace(plan, programs=tuple(programs), shift_period=None)


@pytest.mark.parametrize(("nic_gbps", "tile_gbps"), [(1.0, 4.0), (4.0, 1.0), (2.0, 1.0)])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_chunked_tapa_takes_the_pipelined_closed_form_time(nic_gbps, tile_gbps, chunks):
    topology = machine(nic_gbps, tile_gbps)
    plan = one_exchange(chunks)
    q = plan.program(0).layers[0].exchanges[0]
    assert q.chunks == chunks and (chunks == 1 or sum(q.chunk_tokens) == TOKENS // 4)
    row_bytes = q.row_bytes
    tiles = Placement.node_major(topology)
    node_s = topology.route_latency_us(topology.route(tiles.tile_of(0), tiles.tile_of(2))) * 1e-6
    tile_s = topology.route_latency_us(topology.route(tiles.tile_of(0), tiles.tile_of(1))) * 1e-6
    slow = node_s + 2 * row_bytes / chunks / (nic_gbps * 1e9 / 2)
    fast = tile_s + 2 * row_bytes / chunks / (tile_gbps * 1e9)
    expected = slow + fast + (chunks - 1) * max(slow, fast)
    result = simulate_plan(plan, topology, fold=False, collective=COLLECTIVE_MODELS["ideal"],
                           denoising_step=False)
    assert result.step_time_s == pytest.approx(expected, rel=1e-9)


def test_chunks_change_the_time_where_the_closed_form_says_so():
    # The symptom: one head per rank, and 1, 2, 3 chunks all took the same time.
    topology = machine(1.0, 4.0)
    times = [simulate_plan(one_exchange(c), topology, fold=False,
                           collective=COLLECTIVE_MODELS["ideal"],
                           denoising_step=False).step_time_s for c in (1, 2, 3)]
    assert times[0] > times[1] > times[2]


@pytest.mark.parametrize("chunks", [1, 3])
def test_the_model_bound_is_the_closed_form_where_nothing_else_waits(chunks):
    # On free links the collective model adds nothing, and this exchange alone waits on
    # nothing but its own pipeline: its model bound is the closed form, met exactly.
    from cocodiff.simulator.bounds import model_bound_s

    topology = machine(1.0, 4.0)
    plan = one_exchange(chunks)
    ideal = COLLECTIVE_MODELS["ideal"]
    simulated = simulate_plan(plan, topology, fold=False, collective=ideal,
                              denoising_step=False)
    bound = model_bound_s(plan, topology, Placement.node_major(topology), ideal)
    assert bound == pytest.approx(simulated.step_time_s, rel=1e-9)


@pytest.mark.parametrize("schedule", ["flat", "tapa", "vfirst"])
@pytest.mark.parametrize(("nodes", "chunks"), [(1, 1), (2, 1), (2, 2), (2, 3)])
def test_no_simulated_plan_beats_its_model_bound_on_aurora(schedule, nodes, chunks):
    from cocodiff.models import REGISTRY as MODELS
    from cocodiff.simulator.simulate import simulate_schedule
    from topology import resolve_topology

    topology = build_topology(resolve_topology("aurora", nodes))
    spec = MODELS["flux1-dev"]
    result = simulate_schedule(schedule, spec, topology, Placement.node_major(topology),
                               (spec.image_tokens(1024, 1024, 1), spec.text_tokens), 1,
                               options=PlanOptions(chunks=chunks))
    assert 0 < result.model_bound_s <= result.exchange_s * (1 + 1e-9)
    if schedule == "flat":  # the link bound is of flat's exchanges: the model adds to it
        assert result.bound_s <= result.model_bound_s * (1 + 1e-9)
