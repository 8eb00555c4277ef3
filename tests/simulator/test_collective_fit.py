"""The collective model fitted from microbenchmarks (cocodiff.simulator.collective_fit): Aurora's
preset against the published all-to-all cells, and the fit recovering known costs."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cocodiff.simulator.collective import simulate_all_to_all, spread_placement
from cocodiff.simulator.collective_fit import (
    LEVEL_STACK,
    TREND_STACK,
    Measurement,
    all_to_all_time_s,
    aurora_topology,
    fit_aurora,
    fit_collective,
    load_table,
)
from topology import build_topology, get_preset
from transports.sim import COLLECTIVE_MODELS, CollectiveModel, SpanCost, group_span

AURORA = COLLECTIVE_MODELS["aurora"]


def _published(stack: str) -> dict[tuple[int, int], float]:
    """(ranks, bytes per rank) -> busbw GB/s of one stack's all-to-all cells."""
    return {(c["ranks"], c["bytes_per_rank"]): c["busbw_gbps"]
            for c in load_table()["cell"] if c["stack"] == stack}


def _simulated_busbw(ranks: int, bytes_per_rank: int) -> float:
    topology = aurora_topology(ranks // 12)
    return simulate_all_to_all(topology, bytes_per_rank, "flat", AURORA).busbw_gbps


def test_every_torch_distributed_cell_is_reproduced_within_15_percent():
    cells = _published(LEVEL_STACK)
    assert len(cells) == 2  # 4 MiB at 12 and at 24 ranks
    for (ranks, size), busbw in cells.items():
        assert _simulated_busbw(ranks, size) == pytest.approx(busbw, rel=0.15), (ranks, size)


def test_the_torchcomms_trend_from_1_to_4_mib_is_reproduced_within_25_percent():
    cells = _published(TREND_STACK)
    for ranks in (12, 24):
        published = cells[(ranks, 4 << 20)] / cells[(ranks, 1 << 20)]
        simulated = _simulated_busbw(ranks, 4 << 20) / _simulated_busbw(ranks, 1 << 20)
        assert simulated == pytest.approx(published, rel=0.25), ranks


def test_the_preset_is_the_fit_of_the_shipped_table():
    """transports.sim.AURORA_SPANS holds the fit's output (rounded): re-run it."""
    fitted, fits = fit_aurora()
    assert {fit.span for fit in fits} == {"node", "nodes", "pair"}
    for span, cost in fitted.spans:
        preset = AURORA.cost(span)
        assert preset.startup_us == pytest.approx(cost.startup_us, rel=2e-3, abs=1e-3), span
        assert preset.rank_gbps == pytest.approx(cost.rank_gbps, rel=2e-3), span
    # Past the node boundary the algorithm, not the wire, sets the pace; a pair is
    # priced on the links alone (the point-to-point control does not degrade).
    assert AURORA.cost("nodes").startup_us > 2 * AURORA.cost("node").startup_us
    assert AURORA.cost("pair") == SpanCost()


def test_the_table_is_data_with_its_source():
    table = load_table()
    assert "argonne-lcf/DLcomm_benchmark" in table["source"]
    # The source's own example: 1,048,560 B in 508.706 us at 12 ranks is 1.89 GB/s busbw.
    assert all_to_all_time_s(1_048_560, 12, 1.89) == pytest.approx(508.706e-6, rel=2e-3)


def test_the_fit_recovers_known_costs_from_simulated_measurements():
    """Measurements made by the simulator with known span costs give those costs back."""
    spec = get_preset("cluster", 2)
    spec = dataclasses.replace(spec, gpus_per_node=4)

    def topology_for(nodes: int):
        return build_topology(dataclasses.replace(spec, num_nodes=nodes))

    truth = CollectiveModel("truth", spans=(("nodes", SpanCost(30.0, 1, 0.02)),
                                            ("node", SpanCost(8.0))))
    rows = [Measurement(nodes, ranks, size, simulate_all_to_all(
                topology_for(nodes), size, "flat", truth, ranks).time_s)
            for nodes, ranks in ((1, 4), (2, 8)) for size in (64 << 10, 1 << 20, 8 << 20)]
    model, fits = fit_collective(topology_for, rows, CollectiveModel("fitted"))
    assert model.cost("nodes").startup_us == pytest.approx(30.0, rel=0.02)
    assert model.cost("nodes").rank_gbps == pytest.approx(0.02, rel=0.02)
    assert model.cost("node").startup_us == pytest.approx(8.0, rel=0.02)
    assert math.isinf(model.cost("node").rank_gbps)
    assert all(fit.max_rel_error < 0.01 for fit in fits)


def test_spans_of_groups_and_tapa_phases_priced_by_the_same_rule():
    topology = aurora_topology(2)
    tiles = spread_placement(topology, 24).tiles
    assert group_span(topology, tiles) == "nodes"
    assert group_span(topology, tiles[:12]) == "node"
    assert group_span(topology, (tiles[0], tiles[12])) == "pair"
    assert group_span(topology, tiles[:2]) == "pair"
    # TAPA on 2 nodes: its inter-node phase is a pair, its GPU phase a collective inside
    # the node: no transfer pays the several-node price, and it beats flat by far.
    flat = simulate_all_to_all(topology, 4 << 20, "flat", AURORA).time_s
    tapa = simulate_all_to_all(topology, 4 << 20, "tapa", AURORA).time_s
    assert tapa < flat / 3
    assert AURORA.cost("gpu") == AURORA.cost("node")  # a span without data falls back
