"""Hybrid plans (cocodiff.schedules.hybrid) and their simulation: the Ulysses schedule
inside each Ulysses group, the Ring across them, against the layout and closed forms."""

from __future__ import annotations

import math

import pytest

from cocodiff.cost import roofline_seconds
from cocodiff.layout import LayoutError, ParallelLayout
from cocodiff.models import REGISTRY
from cocodiff.plan.steps import Compute, Exchange, Wait
from cocodiff.schedules import RankGrid, plan_flat, plan_tapa
from cocodiff.schedules.hybrid import plan_hybrid
from cocodiff.simulator.simulate import simulate_plan
from topology import Placement, build_topology, get_preset
from topology.presets import cluster
from transports.sim import COLLECTIVE_MODELS

FLUX = REGISTRY["flux1-dev"]
STREAMS = (1024, 512)
IDEAL = COLLECTIVE_MODELS["ideal"]


def test_pure_ulysses_is_the_plain_schedule():
    grid = RankGrid((2, 2, 2), tuple(range(8)))
    hybrid = plan_hybrid("tapa", FLUX, grid, STREAMS, ParallelLayout(8))
    plain = plan_tapa(FLUX, grid, STREAMS)
    assert hybrid.programs == plain.programs and hybrid.parallel == ParallelLayout(8)


@pytest.mark.parametrize("order", [("batch", "ring", "ulysses"), ("batch", "ulysses", "ring")])
def test_ring_steps_match_the_layout(order):
    layout = ParallelLayout(4, 3, 1, order)
    grid = RankGrid((3, 2, 2), tuple(range(12)))
    plan = plan_hybrid("flat", FLUX, grid, STREAMS, layout)
    sent = {}
    for rank in range(12):
        attention = plan.program(rank).layers[0].attention
        ulysses = [s for s in attention if isinstance(s, Exchange) and s.tensor != "kv"]
        passes = [s for s in attention if isinstance(s, Exchange) and s.tensor == "kv"]
        blocks = [s for s in attention if isinstance(s, Compute) and s.op == "attention"]
        assert {s.group for s in ulysses} == {layout.ulysses_group(rank)}
        assert len(blocks) == 3 and len(passes) == 2
        ring = layout.ring_group(rank)
        me = ring.index(rank)
        for kv in passes:
            assert kv.group == ring and kv.direction == "ring"
            assert kv.send_rows[(me + 1) % 3] == 1 and sum(kv.send_rows) == 1
            assert kv.recv_rows[(me - 1) % 3] == 1 and sum(kv.recv_rows) == 1
            # one row: K and V of S/ring padded tokens, this rank's heads, bf16
            local = sum(math.ceil(t / 12) for t in STREAMS)
            assert kv.row_bytes == 2 * 4 * local * (24 // 4) * FLUX.head_dim * 2
        sent[rank] = ring[(me + 1) % 3]
        # each pass is started before a block's attention and waited right after it
        index = attention.index(passes[0])
        assert attention[index + 1] is blocks[0] and attention[index + 2] == Wait("kv")
    assert sorted(sent.values()) == list(range(12))  # every rank receives one block


def test_tapa_phases_stay_inside_the_ulysses_group():
    # 2 nodes x 2 GPUs x 2 tiles; Ulysses over one node's 4 tiles, Ring across nodes.
    grid = RankGrid((2, 2, 2), tuple(range(8)))
    plan = plan_hybrid("tapa", FLUX, grid, STREAMS, ParallelLayout(4, 2))
    for rank in range(8):
        q = next(s for s in plan.program(rank).layers[0].attention
                 if isinstance(s, Exchange) and s.tensor == "q")
        group = set(ParallelLayout(4, 2).ulysses_group(rank))
        assert [p.level for p in q.phases] == ["gpu", "tile"]
        assert all(set(p.group) <= group for p in q.phases)


def test_bytes_per_rank_are_the_flat_plans_over_the_group():
    grid = RankGrid((1, 8, 1), tuple(range(8)))
    plan = plan_hybrid("flat", FLUX, grid, STREAMS, ParallelLayout(4, 2))
    alone = plan_flat(FLUX, RankGrid((1, 4, 1), tuple(range(4))),
                      tuple(math.ceil(t / 8) * 4 for t in STREAMS))
    ours = [s for s in plan.program(5).layers[0].attention if isinstance(s, Exchange)
            and s.tensor != "kv"]
    theirs = [s for s in alone.program(1).layers[0].attention if isinstance(s, Exchange)]
    assert [(s.send_rows, s.recv_rows, s.row_bytes) for s in ours] == \
        [(s.send_rows, s.recv_rows, s.row_bytes) for s in theirs]


def test_invalid_layout_is_refused():
    grid = RankGrid((1, 8, 1), tuple(range(8)))
    with pytest.raises(LayoutError, match="ulysses degree 8 is above the model's 4 heads"):
        plan_hybrid("flat", REGISTRY["flux1-dev"].__class__(
            **{**{f: getattr(FLUX, f) for f in FLUX.__slots__}, "num_heads": 4}),
            grid, STREAMS, ParallelLayout(8))


@pytest.mark.parametrize(("nodes", "attention_tflops"), [(2, 1e3), (3, 1e3), (2, 1e-4)])
def test_ring_on_one_link_per_node_is_the_closed_form(nodes, attention_tflops):
    """Pure Ring, one rank per node: every layer pays its compute plus, per pass, what the
    pass takes beyond the block's attention it hides behind (pass b behind block b; block 0
    converts its output, later blocks also merge theirs, cocodiff.cost.ring_block_cost):
    step = compute + layers * sum over b < ring - 1 of
    max(0, latency + bytes / bandwidth - attention(b))."""
    spec = cluster(num_nodes=nodes, ranks_per_node=1, inter_gbps=0.5, inter_latency_us=80.0,
                   tile_tflops=attention_tflops)
    topology = build_topology(spec)
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    plan = plan_hybrid("flat", FLUX, grid, STREAMS, ParallelLayout(1, nodes))
    result = simulate_plan(plan, topology, placement, collective=IDEAL)
    blocks = [s for s in plan.program(0).layers[0].attention
              if isinstance(s, Compute) and s.op == "attention"]
    assert len(blocks) == nodes
    attention_s = [roofline_seconds(block.cost, spec.tile_tflops, spec.tile_memory_gbps)
                   for block in blocks]
    kv = next(s for s in plan.program(0).layers[0].attention if isinstance(s, Exchange)
              and s.tensor == "kv")
    pass_s = 80e-6 + kv.row_bytes / 0.5e9
    exposed = FLUX.num_layers * sum(max(0.0, pass_s - attention_s[b]) for b in range(nodes - 1))
    assert result.step_time_s == pytest.approx(result.compute_s + exposed, rel=1e-9)
    if attention_tflops < 1:
        assert exposed == 0.0  # compute-bound: passes hidden
    else:
        assert exposed > 0.1 * result.step_time_s  # link-bound: passes exposed


def test_hybrid_plans_fold_exactly():
    topology = build_topology(get_preset("aurora", 4))
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    small = type(FLUX)(**{**{f: getattr(FLUX, f) for f in FLUX.__slots__}, "num_layers": 2})
    for layout in (ParallelLayout(12, 4), ParallelLayout(24, 2, 1, ("batch", "ulysses", "ring"))):
        plan = plan_hybrid("vfirst", small, grid, STREAMS, layout)
        folded = simulate_plan(plan, topology, placement, fold=True)
        whole = simulate_plan(plan, topology, placement, fold=False)
        assert folded.folded and folded.simulated_ranks < 48
        assert folded.step_time_s == pytest.approx(whole.step_time_s, rel=1e-9)
