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


def test_overlap_goes_into_the_plan_file_and_its_hash():
    """Whether consecutive steps overlap is part of the plan (its stage 0 waits
    differently), so it is written, read back and hashed; a file written before the
    field (no ``overlap``) was made by the overlapping planner and reads so."""
    import json

    made = {overlap: build_run_plan("pipefusion", FLUX, GRID, STREAMS, 5, PlanOptions(),
                                    pipeline=PipelineLayout(2, 2, 2, 1, overlap))
            for overlap in (False, True)}
    assert made[False].sha256 != made[True].sha256
    for overlap, run_plan in made.items():
        again = RunPlan.from_json(run_plan.to_json())
        assert again.sha256 == run_plan.sha256
        assert all(plan.pipeline.overlap is overlap for plan in again.plans)
    data = json.loads(made[True].to_json())
    for plan in data["plans"]:
        del plan["pipeline"]["overlap"]
    old = RunPlan.from_json(json.dumps(data))
    assert all(plan.pipeline.overlap for plan in old.plans)
    assert [p.programs for p in old.plans] == [p.programs for p in made[True].plans]
    data["plans"][0]["pipeline"]["overlap"] = "yes"
    with pytest.raises(PlanFileError, match="overlap must be true or false"):
        RunPlan.from_json(json.dumps(data))


def test_an_overlapping_plan_simulates_and_run_refuses_it(tmp_path, capsys):
    """`plan --pipefusion-overlap --out` writes xDiT's order, `simulate --plan` runs it
    (and says so in the layout's name); `run` refuses it, and the flag, in one line."""
    import json

    from clicheck import call

    from cocodiff.commands.cli import main

    out, record = tmp_path / "p.json", tmp_path / "sim.json"
    common = ["plan", "--topology", "cluster", "--nodes", "2", "--model", "flux1-dev",
              "--resolution", "256", "--steps", "5", "--schedule", "pipefusion",
              "--pipefusion", "2"]
    assert main([*common, "--pipefusion-overlap", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "P2xU2xM2/w1/overlap" in printed and "which `run` refuses" in printed
    assert main(["simulate", "--plan", str(out), "--json", str(record)]) == 0
    row = json.loads(record.read_text())["results"][0]
    assert row["layout"]["name"] == "P2xU2xM2/w1/overlap" and row["layout"]["overlap"]
    for argv in (["run", "--plan", str(out)],
                 ["run", "--schedule", "pipefusion", "--pipefusion", "2",
                  "--pipefusion-overlap"]):
        result = call(argv, limit_s=60)
        assert result.code == 2, result
        assert result.err.count("\n") == 1 and "Traceback" not in result.err
        assert "overlap" in result.err and "fills and drains" in result.err
        assert not result.out
