"""TAPA, V-First and V-Major plans: TAPA's phases deliver exactly the flat
all-to-all's blocks, each once, to the right rank; the layer orders; V-Major's
cache-ratio schedule; and what the simulator makes of them."""

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cocodiff.models import REGISTRY
from cocodiff.plan.steps import Compute
from cocodiff.schedules import (
    SCHEDULES,
    PlanOptions,
    RankGrid,
    VMajorOptions,
    plan_cocodiff,
    plan_flat,
    plan_tapa,
    plan_vfirst,
)
from cocodiff.schedules.grid import LEVELS
from cocodiff.simulator.simulate import simulate_plan, simulate_schedule
from cocodiff.util.errors import ScheduleError
from topology import Placement, build_topology, get_preset
from topology.presets import cluster

FLUX = REGISTRY["flux1-dev"]


def deliver(plan, grid, tensor_index):
    """Move every block through the plan's phases; check each phase's row counts."""
    exchanges = {
        r: plan.program(r).layers[0].exchanges[tensor_index] for r in range(grid.num_ranks)
    }
    holding = defaultdict(list)
    for src, exchange in exchanges.items():
        for dst, rows in zip(exchange.group, exchange.send_rows, strict=True):
            holding[src].append((src, dst, rows))
    for phase_index, level in enumerate(p.level for p in exchanges[0].phases):
        axis = LEVELS.index(level)
        moved = defaultdict(list)
        sent = defaultdict(int)
        for holder, blocks in holding.items():
            for src, dst, rows in blocks:
                target = list(grid.coords(holder))
                target[axis] = grid.coords(dst)[axis]
                member = grid.rank_at(tuple(target))
                moved[member].append((src, dst, rows))
                sent[(holder, member)] += rows
        for holder, exchange in exchanges.items():
            phase = exchange.phases[phase_index]
            for member, send, recv in zip(
                phase.group, phase.send_rows, phase.recv_rows, strict=True
            ):
                assert send == sent[(holder, member)]
                assert recv == sent[(member, holder)]
        holding = moved
    if not exchanges[0].phases:  # one tier: the flat exchange sends each block directly
        delivered = defaultdict(list)
        for blocks in holding.values():
            for block in blocks:
                delivered[block[1]].append(block)
        holding = delivered
    return holding


@settings(max_examples=40, deadline=None)
@given(
    nodes=st.integers(1, 3),
    gpus=st.integers(1, 4),
    tiles=st.integers(1, 3),
    heads=st.integers(1, 13),
    tensor_index=st.integers(0, 3),
)
def test_tapa_phases_deliver_every_block_once_to_its_destination(
    nodes, gpus, tiles, heads, tensor_index
):
    grid = RankGrid((nodes, gpus, tiles), tuple(range(nodes * gpus * tiles)))
    spec = FLUX.__class__(**{**{f: getattr(FLUX, f) for f in FLUX.__slots__}, "num_heads": heads})
    plan = plan_tapa(spec, grid, (50, 7))
    holding = deliver(plan, grid, tensor_index)
    flat = plan_flat(spec, grid, (50, 7))
    for dst in range(grid.num_ranks):
        blocks = holding[dst]
        assert all(d == dst for _, d, _ in blocks)
        assert sorted(s for s, _, _ in blocks) == list(range(grid.num_ranks))
        expected = flat.program(dst).layers[0].exchanges[tensor_index].recv_rows
        assert [rows for _, _, rows in sorted(blocks)] == list(expected)


def test_tapa_cuts_the_messages_per_rank():
    grid = RankGrid((8, 6, 2), tuple(range(96)))
    exchange = plan_tapa(FLUX, grid, (4096, 512)).program(0).layers[0].exchanges[0]
    assert [len(p.group) - 1 for p in exchange.phases] == [7, 5, 1]  # 13 messages, not 95


def test_vfirst_starts_v_before_q_and_k_are_projected():
    grid = RankGrid((2, 2, 1), tuple(range(4)))
    steps = plan_vfirst(FLUX, grid, (64, 8)).program(0).layers[0].attention
    names = [s.op if isinstance(s, Compute) else f"{type(s).__name__} {s.tensor}" for s in steps]
    assert names[:4] == ["proj_v", "Exchange v", "proj_q", "proj_k"]
    assert names.index("Wait v") > names.index("Exchange k") > names.index("rope")


def test_vmajor_ratio_schedule():
    linear = VMajorOptions("linear", 1.0, warmup=2, refresh=0)
    ratios = [linear.cache_ratio(s, 10) for s in range(10)]
    assert ratios[:2] == [0.0, 0.0] and ratios[-1] == 1.0
    assert ratios == sorted(ratios)
    refresh = VMajorOptions("constant", 0.5, warmup=1, refresh=4)
    assert [refresh.cache_ratio(s, 9) for s in range(9)] == [0, 0.5, 0.5, 0.5, 0, 0.5, 0.5, 0.5, 0]


@pytest.mark.parametrize("text", ["linear:1.5", "constant:-0.1", "cubic", "linear:x"])
def test_bad_vmajor_options_are_refused(text):
    with pytest.raises(ScheduleError):
        VMajorOptions.parse(text)


def test_vmajor_sends_less_over_the_inter_node_tier_only():
    topology = build_topology(get_preset("aurora", 2))
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    full = simulate_plan(plan_cocodiff(FLUX, grid, (4096, 512), cache_ratio=0.0), topology)
    half = simulate_plan(plan_cocodiff(FLUX, grid, (4096, 512), cache_ratio=0.5), topology)
    assert half.bytes_by_tier["inter-node"] < full.bytes_by_tier["inter-node"]
    assert half.bytes_by_tier["intra-node"] == pytest.approx(full.bytes_by_tier["intra-node"])
    assert half.step_time_s <= full.step_time_s


def test_one_tier_tapa_is_the_flat_exchange():
    grid = RankGrid((1, 4, 1), tuple(range(4)))
    assert plan_tapa(FLUX, grid, (64, 8)).program(1).layers[0].exchanges[2].phases == ()


def test_schedules_beat_flat_on_aurora_8_nodes_and_stay_above_the_bound():
    topology = build_topology(get_preset("aurora", 8))
    placement = Placement.node_major(topology)
    results = {
        name: simulate_schedule(name, FLUX, topology, placement, (4096, 512), 4)
        for name in ("flat", "tapa", "vfirst")
    }
    assert results["flat"].step_time_s > results["tapa"].step_time_s > results["vfirst"].step_time_s
    for result in results.values():
        assert 0 < result.efficiency <= 1
        assert result.exchange_s >= result.bound_s


def test_tapa_on_a_cluster_matches_the_flat_bytes_across_nodes():
    topology = build_topology(cluster(num_nodes=2, ranks_per_node=2))
    placement = Placement.node_major(topology)
    flat = simulate_schedule("flat", FLUX, topology, placement, (1024, 64), 1)
    tapa = simulate_schedule("tapa", FLUX, topology, placement, (1024, 64), 1)
    assert tapa.bytes_by_tier["inter-node"] == pytest.approx(flat.bytes_by_tier["inter-node"])


def small_trace(num_ranks, num_layers, blocks, steps):
    from cocodiff.schedules.activity import parse_activity

    return parse_activity(
        {
            "format": "cocodiff-activity/1",
            "num_ranks": num_ranks,
            "num_layers": num_layers,
            "blocks_per_rank": blocks,
            "steps": [
                {
                    "step": s,
                    "sent": [
                        [list(range(blocks - s)) for _ in range(num_layers)]
                        for _ in range(num_ranks)
                    ],
                }
                for s in range(steps)
            ],
        }
    )


def test_an_activity_trace_drives_v_major_and_round_trips(tmp_path):
    from cocodiff.schedules.activity import load_activity

    topology = build_topology(cluster(num_nodes=2, ranks_per_node=2))
    placement = Placement.node_major(topology)
    spec = FLUX.__class__(**{**{f: getattr(FLUX, f) for f in FLUX.__slots__}, "num_layers": 2})
    trace = small_trace(4, 2, blocks=4, steps=3)
    path = tmp_path / "trace.json"
    path.write_text(trace.to_json())
    assert load_activity(path) == trace
    result = simulate_schedule("cocodiff", spec, topology, placement, (256, 16), 3, activity=trace)
    assert len(result.step_times_s) == 3
    assert result.step_times_s[2] <= result.step_times_s[0]  # fewer blocks sent later


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format="x"), "not a cocodiff-activity/1 trace"),
        (lambda d: d.update(num_ranks=0), "num_ranks must be a positive integer"),
        (lambda d: d["steps"][0]["sent"].pop(), "must list 4 ranks"),
        (lambda d: d["steps"][0]["sent"][1].pop(), "must list 2 layers"),
        (lambda d: d["steps"][0]["sent"][1][0].append(9), "blocks must be distinct integers"),
    ],
)
def test_malformed_activity_traces_are_refused(edit, message):
    import json

    from cocodiff.schedules.activity import parse_activity

    data = json.loads(small_trace(4, 2, 4, 1).to_json())
    edit(data)
    with pytest.raises(ScheduleError, match=message):
        parse_activity(data)


def test_a_trace_for_another_shape_is_refused_by_the_cli(tmp_path, capsys):
    from cocodiff.commands.cli import main

    path = tmp_path / "trace.json"
    path.write_text(small_trace(4, 2, 4, 1).to_json())
    code = main(
        [
            "simulate",
            "--topology",
            "cluster",
            "--schedule",
            "cocodiff",
            "--activity-trace",
            str(path),
        ]
    )
    assert code == 2
    assert "activity trace is for 4 ranks x 2 layers" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_each_registry_entry_says_what_its_plans_are(name):
    entry = SCHEDULES[name]
    grid = RankGrid((2, 2, 1), tuple(range(4)))
    options = PlanOptions(chunks=2)
    plans = [entry.plan(FLUX, grid, (64, 8), options, ratio) for ratio in (0.0, 0.5)]
    exchanges = plans[0].program(0).layers[0].exchanges
    assert plans[0].schedule == name
    assert all(bool(e.phases) == entry.phased for e in exchanges)
    assert all(e.chunks == (2 if entry.phased else 1) for e in exchanges)
    assert (plans[0] != plans[1]) == entry.step_dependent
    assert SCHEDULES[entry.ranked_as].exact
    # The ranked-as twin moves the same exchanges before V-Major trims any.
    twin = SCHEDULES[entry.ranked_as].plan(FLUX, grid, (64, 8), options)
    assert [(e.tensor, e.group, e.send_rows) for e in twin.program(0).layers[0].exchanges] \
        == [(e.tensor, e.group, e.send_rows) for e in exchanges]


def test_plan_options_are_keyword_only_and_checked():
    with pytest.raises(TypeError):
        PlanOptions("float32")  # type: ignore[misc]
    with pytest.raises(ScheduleError, match="unknown dtype 'int8'"):
        PlanOptions(dtype="int8")
    with pytest.raises(ScheduleError, match="chunks must be a positive integer"):
        PlanOptions(chunks=0)
    assert PlanOptions(dtype="float32").dtype_bytes == 4
