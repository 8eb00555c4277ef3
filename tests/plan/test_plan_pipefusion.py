"""PipeFusion's plans in the plan file: written, read and written again byte-identical;
the simulator executes the file's plans as it executes the ones built in memory."""

from __future__ import annotations

import pytest

from cocodiff.layout import ParallelLayout, PipelineLayout
from cocodiff.models import REGISTRY
from cocodiff.plan.steps import Exchange
from cocodiff.schedules import PlanOptions, RankGrid
from cocodiff.schedules.run_plan import PlanFileError, RunPlan, build_run_plan
from cocodiff.simulator.simulate import simulate_run_plan
from topology import build_topology
from topology.presets import cluster

FLUX = REGISTRY["flux1-dev"]
GRID = RankGrid((2, 2, 1), tuple(range(4)))
STREAMS = (1024, 512)


def test_a_pipefusion_plan_round_trips_and_simulates_the_same():
    layout = PipelineLayout(2, 2, 4, warmup=1)
    run_plan = build_run_plan("pipefusion", FLUX, GRID, STREAMS, 6, PlanOptions(),
                              pipeline=layout)
    # Warm-up (first step), first pipelined, pipelined, last: four distinct plans.
    assert run_plan.step_plans == (0, 1, 2, 2, 2, 3)
    assert [p.pipeline.patches for p in run_plan.plans] == [1, 4, 4, 4]
    text = run_plan.to_json()
    again = RunPlan.from_json(text)
    assert again.to_json() == text
    assert again.sha256 == run_plan.sha256
    topology = build_topology(cluster(num_nodes=2, ranks_per_node=2))
    built, read = (simulate_run_plan(p, topology) for p in (run_plan, again))
    assert read.step_time_s == built.step_time_s
    assert read.bytes_by_tier == built.bytes_by_tier
    assert read.bytes_by_tier["inter-node"] > 0  # the stages' transfers cross the nodes
    # Transfers per step: every rank sends each patch on (the last stage back to stage
    # 0), but the last step sends nothing back.
    transfers = sum(1 for p in (run_plan.plans[2],) for prog in p.programs
                    for layer in prog.layers for s in layer.attention
                    if isinstance(s, Exchange) and s.tensor == "send")
    assert transfers == 4 * 4


def test_a_pipeline_layout_goes_with_pipefusion_only():
    with pytest.raises(PlanFileError, match="goes with schedule pipefusion alone"):
        build_run_plan("flat", FLUX, GRID, STREAMS, 2, PlanOptions(),
                       pipeline=PipelineLayout(2, 2))
    with pytest.raises(PlanFileError, match="goes with schedule pipefusion alone"):
        build_run_plan("pipefusion", FLUX, GRID, STREAMS, 2, PlanOptions(),
                       parallel=ParallelLayout(2, 2), pipeline=PipelineLayout(2, 2))


def test_plan_out_writes_a_pipefusion_plan_that_simulate_plan_executes(tmp_path, capsys):
    import json

    from cocodiff.commands.cli import main

    out, record = tmp_path / "p.json", tmp_path / "sim.json"
    assert main(["plan", "--topology", "cluster", "--nodes", "2", "--model", "flux1-dev",
                 "--resolution", "256", "--steps", "5", "--schedule", "pipefusion",
                 "--pipefusion", "2", "--patches", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "best: --schedule pipefusion --pipefusion 2 --patches 3" in printed
    # A pick with pipelined (stale K/V) steps says it is lossy and how to measure it.
    assert "note: P2xU2xM3/w1 is lossy" in printed and "run --reference" in printed
    run_plan = RunPlan.from_json(out.read_text())
    assert run_plan.plans[-1].pipeline == PipelineLayout(2, 2, 3, 1)
    assert main(["simulate", "--plan", str(out), "--json", str(record)]) == 0
    result = json.loads(record.read_text())
    assert result["plan_sha256"] == run_plan.sha256
    row = result["results"][0]
    assert row["layout"]["name"] == "P2xU2xM3/w1"
    assert row["bytes_by_tier"]["inter-node"] > 0
    assert row["exchanges_per_step"][0] > 0
    # The larger stage holds 29 of the 57 layers of 24 GB of weights.
    assert row["memory_per_rank"]["weights_gb"] == pytest.approx(24 * 29 / 57)


def test_the_planner_ranks_pipeline_and_sequence_layouts_together(tmp_path):
    import json

    from cocodiff.commands.cli import main

    out = tmp_path / "ranked.json"
    assert main(["plan", "--topology", "cluster", "--nodes", "2", "--model", "flux1-dev",
                 "--resolution", "256", "--steps", "6", "--schedule", "flat,pipefusion",
                 "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    candidates = record["candidates"]
    assert [c["step_time_s"] for c in candidates] == sorted(c["step_time_s"] for c in candidates)
    # the top 5 are simulated; the rest pruned, each with a floor above the 5th best
    ranked = candidates + record["pruned"]
    assert len(candidates) == min(5, len(ranked))
    assert all(p["floor_s"] > candidates[-1]["step_time_s"] for p in record["pruned"])
    assert {c["schedule"] for c in ranked} == {"flat", "pipefusion"}
    pipelines = {c["layout"] for c in ranked if c["schedule"] == "pipefusion"}
    assert pipelines == {"P2xU2xM2/w1", "P4xU1xM4/w1"}  # every stage count from 2
    assert all("memory_per_rank" in c for c in ranked)
