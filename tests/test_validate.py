"""``cocodiff validate``: real runs against the simulator's prediction of the same plans.

The multi-process tests launch 2 ranks (torchrun/gloo and mpiexec/MPI) of tiny-flux, 2
steps, 1 round and a second added (--max-rounds), on a hand-written topology file, and
check what the JSON holds; they never assert a time."""

import json
import math
import statistics
from types import SimpleNamespace

import pytest
from jobwatch import watch_job
from launching import launcher_prefix, needs_mpi, needs_torchrun, run_job

from cocodiff.commands.cli import main
from cocodiff.layout import ParallelLayout
from cocodiff.schedules.run_plan import load_run_plan
from cocodiff.util.errors import CocodiffError
from cocodiff.validation import (
    Case,
    Measurements,
    RunResult,
    error_summary,
    log_interval_95,
    machine_drift,
    make_cases,
    parse_layout_name,
    pick_against_best,
    precision_95,
    round_order,
    topology_of,
    widest_precision,
)

SCHEDULES = ["flat", "tapa", "vfirst", "cocodiff", "diffusers"]
TWO_RANKS_TOML = """\
preset = "cluster"
name = "two-ranks"

[nodes]
count = 1
gpus = 2
"""


def _topology(tmp_path):
    """A hand-written topology of 2 ranks, and beside it a calibrate-like JSON whose
    collective model validate picks up (--collective auto)."""
    path = tmp_path / "two-ranks.toml"
    path.write_text(TWO_RANKS_TOML)
    path.with_suffix(".json").write_text(json.dumps(
        {"collective": {"name": "calibrated", "startup_us": 40.0}}))
    return path


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", [
    pytest.param("torchrun", marks=needs_torchrun),
    pytest.param("mpiexec", marks=needs_mpi),
])
def test_validate_measures_predicts_and_compares_every_schedule(launcher, tmp_path):
    topology = _topology(tmp_path)
    report_path = tmp_path / "validate.json"
    job = run_job([*launcher_prefix(launcher, 2), "-m", "cocodiff", "validate",
                   "--topology", str(topology), "--steps", "2", "--rounds", "1",
                   # one round gives no interval: a second is always added (rank 0's word)
                   "--max-rounds", "2", "--precision", "0.5",
                   "--schedules", ",".join(SCHEDULES), "--json", str(report_path)],
                  tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "planner's pick" in job.stdout
    report = json.loads(report_path.read_text())
    rows = {row["schedule"]: row for row in report["rows"]}
    # diffusers' context parallelism runs over torch.distributed only: under MPI it is
    # refused alike on every rank and reported as skipped.
    expected = SCHEDULES if launcher == "torchrun" else SCHEDULES[:-1]
    assert list(rows) == expected
    assert set(report["skipped"]) == set(SCHEDULES) - set(expected)
    for name, row in rows.items():
        assert {"schedule", "layout", "measured_step_s", "predicted_step_s", "error"} <= set(row)
        assert row["layout"] == "pure"
        assert row["measured_step_s"] > 0 and row["predicted_step_s"] > 0, name
        assert row["min_step_s"] <= row["measured_step_s"] <= row["max_step_s"]
        assert row["error"] == pytest.approx(row["predicted_step_s"] / row["measured_step_s"]
                                             - 1)
        assert len(row["plan_sha256"]) == 64
        assert len(row["round_medians_s"]) == 2 and row["precision_95"] > 0
    if "diffusers" in rows:
        assert rows["diffusers"]["predicted_with_plan"] == "flat"
        assert rows["diffusers"]["plan_sha256"] == rows["flat"]["plan_sha256"]
    # Each run executes the plan `plan --out` writes for the same flags: one sha256.
    planned = tmp_path / "tapa.json"
    assert main(["plan", "--topology", "cluster", "--nodes", "1", "--model", "tiny-flux",
                 "--steps", "2", "--dtype", "float32", "--schedule", "tapa", "--ulysses", "2",
                 "--out", str(planned)]) == 0
    assert rows["tapa"]["plan_sha256"] == load_run_plan(planned).sha256
    # 2 rounds x (steps) per row, all recorded
    assert report["rounds"] == 2 and len(report["runs"]) == 2 * len(expected)
    assert all(len(run["step_times_s"]) == 2 for run in report["runs"])
    pick, best = report["planner_pick"], report["measured_best"]
    assert pick["schedule"] in expected and pick["schedule"] != "diffusers"
    assert pick["predicted_step_s"] == min(row["predicted_step_s"] for name, row in rows.items()
                                           if name != "diffusers")
    assert best["measured_step_s"] == min(row["measured_step_s"] for row in rows.values())
    assert report["pick_within_5pct"] == (pick["measured_step_s"]
                                          <= 1.05 * best["measured_step_s"])
    assert report["pick_slower_95"] is not None and isinstance(report["pick_resolved"], bool)
    # The model's blocks timed at the start and the end (no blocks in this calibration JSON)
    machine = report["machine"]
    assert len(machine["layer_s"]) == 2 and all(value > 0 for value in machine["layer_s"])
    assert machine["calibrated_layer_s"] is None and machine["drift"] is None
    assert "ms of CPU per layer" in " ".join(job.stdout.split())  # the console wraps lines
    assert report["calibration"]["collective_source"] == str(topology.with_suffix(".json"))
    assert report["calibration"]["collective"]["startup_us"] == 40.0
    assert report["num_ranks"] == 2 and report["grid"] == [1, 2, 1]
    # float32: every exact schedule's final latents equal one single-process run
    assert report["exactness"]["passed"]
    assert {row["schedule"] for row in report["rows"] if row["exact_schedule"]} \
        == set(expected) - {"cocodiff"}


@pytest.mark.multiprocess
@needs_mpi
def test_validate_has_pipefusion_rows_that_predict_the_plan_the_runtime_executed(tmp_path):
    """``--schedules flat,pipefusion --layouts auto`` on 2 ranks: a pipefusion row on
    P2xU1xM2/w1 beside flat's, measured per step (steps 2..T) and predicted from the plan
    the runtime executed, which is `plan --out`'s for the same flags (one sha256) and
    fills and drains the pipeline every step (no overlap); lossy (warm-up 1 < steps), so
    not held to the exact reference."""
    topology = _topology(tmp_path)
    report_path = tmp_path / "validate.json"
    job = run_job([*launcher_prefix("mpiexec", 2), "-m", "cocodiff", "validate",
                   "--topology", str(topology), "--steps", "3", "--rounds", "1",
                   "--max-rounds", "2", "--precision", "0.5",
                   "--schedules", "flat,pipefusion", "--json", str(report_path)], tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    report = json.loads(report_path.read_text())
    rows = {f"{row['schedule']}@{row['layout']}": row for row in report["rows"]}
    assert list(rows) == ["flat@pure", "pipefusion@P2xU1xM2/w1"]
    for row in rows.values():
        assert row["measured_step_s"] > 0 and row["predicted_step_s"] > 0
        assert row["error"] == pytest.approx(row["predicted_step_s"] / row["measured_step_s"]
                                             - 1)
        assert len(row["round_medians_s"]) == 2
    row = rows["pipefusion@P2xU1xM2/w1"]
    assert row["exact_schedule"] is False and row["exact"] is None
    planned = tmp_path / "pipefusion.json"
    assert main(["plan", "--topology", str(topology), "--model", "tiny-flux", "--steps", "3",
                 "--dtype", "float32", "--schedule", "pipefusion", "--pipefusion", "2",
                 "--out", str(planned)]) == 0
    run_plan = load_run_plan(planned)
    assert row["plan_sha256"] == run_plan.sha256
    assert not any(plan.pipeline.overlap for plan in run_plan.plans)
    assert report["exactness"]["passed"]  # flat's


@pytest.mark.multiprocess
@needs_torchrun
def test_a_rank_that_dies_mid_validation_stops_the_job(tmp_path):
    report_path = tmp_path / "validate.json"
    fault = "rank:1,point:step,count:3,action:kill"  # step 3: the second run's first
    result = watch_job([*launcher_prefix("torchrun", 2), "-m", "cocodiff", "validate",
                        "--steps", "2", "--rounds", "1", "--schedules", "flat,vfirst",
                        "--no-reference", "--timeout", "10", "--json", str(report_path)],
                       tmp_path, timeout_s=180, extra_env={"COCODIFF_FAULT": fault})
    assert result.fault() is not None, result.output[-3000:]
    assert not result.timed_out, f"job hung:\n{result.output[-3000:]}"
    assert result.returncode != 0 and not result.leftovers, result.output[-3000:]
    assert "cocodiff validate: rank 0:" in result.stderr, result.output[-3000:]
    assert not report_path.exists()


@pytest.mark.parametrize(("argv", "message"), [
    ([], "launch it on 2 or more ranks"),
    (["--schedules", "flat,nope"], "unknown schedule 'nope'"),
    (["--schedules", "flat,flat"], "names a schedule twice"),
    (["--layouts", "U2R2"], "not a layout name"),
    (["--steps", "1"], "--steps must be at least 2"),
    (["--collective", "nope"], "unknown collective model 'nope'"),
    (["--rounds", "3", "--max-rounds", "2"], "--max-rounds (2) is below --rounds (3)"),
    (["--precision", "0"], "--precision must be in (0, 1)"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(["validate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_topology_of_another_rank_count_is_refused_before_any_collective(
        tmp_path, monkeypatch, capsys):
    topology = _topology(tmp_path)
    # a launcher's variables, no launcher: the check runs before a transport is made
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["validate", "--topology", str(topology)]) == 2
    err = capsys.readouterr().err
    assert "has 2 ranks (1 node(s)), the launch 4" in err and len(err.splitlines()) == 1


def test_cases_pure_when_heads_split_else_every_layout():
    assert make_cases(SCHEDULES, ["auto"], 4, 8) == [Case(name) for name in SCHEDULES]
    cases = make_cases(["flat", "vfirst", "diffusers"], ["auto"], 8, 4)
    names = [case.name for case in cases]
    # Ulysses 1 (pure Ring) runs one schedule; baselines run pure Ulysses only
    assert names.count("flat@U1xR8xB1") == 1 and "vfirst@U1xR8xB1" not in names
    assert "vfirst@U4xR2xB1/ring-inner" in names
    assert not any(name.startswith("diffusers") for name in names)
    with pytest.raises(CocodiffError, match="cannot split the model's 4 heads"):
        make_cases(["flat"], ["pure"], 8, 4)
    with pytest.raises(CocodiffError, match="holds 4 ranks, the launch has 8"):
        make_cases(["flat"], ["U2xR2xB1"], 8, 4)


def test_pipefusion_runs_on_pipeline_layouts_and_auto_gives_every_stage_count():
    from cocodiff.layout import PipelineLayout

    # 4 ranks, 4 heads, 2 layers (tiny-flux): P2xU2 only; 4 layers: P4 too.
    cases = make_cases(["flat", "pipefusion"], ["auto"], 4, 4, 2)
    assert [case.name for case in cases] == ["flat", "pipefusion@P2xU2xM2/w1"]
    cases = make_cases(["pipefusion"], ["auto"], 4, 4, 4)
    assert [case.layout for case in cases] == [PipelineLayout(2, 2, 2, 1),
                                               PipelineLayout(4, 1, 4, 1)]
    cases = make_cases(["flat", "pipefusion"], ["pure", "P2xU2xM4/w1"], 4, 4, 2)
    assert [case.name for case in cases] == ["flat", "pipefusion@P2xU2xM4/w1"]
    with pytest.raises(CocodiffError, match="add pipefusion to --schedules"):
        make_cases(["flat"], ["P2xU2xM2/w1"], 4, 4, 2)
    with pytest.raises(CocodiffError, match="--layouts names none"):
        make_cases(["flat", "pipefusion"], ["pure"], 4, 4, 2)
    with pytest.raises(CocodiffError, match="4 pipeline stages for 2 layers"):
        make_cases(["pipefusion"], ["P4xU1xM4/w1"], 4, 4, 2)
    with pytest.raises(CocodiffError, match="but the run has 8"):
        make_cases(["pipefusion"], ["P2xU2xM2/w1"], 8, 4, 2)


def test_rounds_rotate_the_order():
    cases = [Case(name) for name in ("a", "b", "c")]
    assert [case.schedule for case in round_order(cases, 1)] == ["b", "c", "a"]
    assert round_order(cases, 3) == cases


def test_layout_names_read_back():
    layout = ParallelLayout(2, 2, 1, ("batch", "ulysses", "ring"))
    assert parse_layout_name(layout.name) == layout
    assert parse_layout_name("U4xR2xB1") == ParallelLayout(4, 2, 1)
    from cocodiff.layout import PipelineLayout

    pipeline = PipelineLayout(2, 2, 4, 1)
    assert parse_layout_name(pipeline.name) == pipeline
    # `run` executes no overlapping steps: validate has no such row
    with pytest.raises(CocodiffError, match="not a layout name"):
        parse_layout_name("P2xU2xM4/w1/overlap")


def _row(schedule, measured, predicted):
    return {"schedule": schedule, "layout": "pure", "measured_step_s": measured,
            "predicted_step_s": predicted, "error": predicted / measured - 1}


def test_the_pick_is_the_least_predicted_plan_schedule_against_the_least_measured_row():
    rows = [_row("flat", 1.00, 0.90), _row("vfirst", 1.03, 0.80), _row("diffusers", 0.99, 0.90)]
    result = pick_against_best(rows)
    assert result["planner_pick"]["schedule"] == "vfirst"
    assert result["measured_best"]["schedule"] == "diffusers"
    assert result["pick_slower_than_best"] == pytest.approx(1.03 / 0.99 - 1)
    assert result["pick_within_5pct"] is True
    summary = error_summary(rows)
    assert summary["median_abs_error"] == pytest.approx(0.1)
    assert summary["within_15pct"] == pytest.approx(2 / 3)


def test_a_rows_95pct_interval_is_students_t_over_its_rounds_logs():
    assert log_interval_95([2.0]) is None
    assert log_interval_95([2.0, 2.0, 2.0]) == (1.0, 1.0)
    # logs 0, 0.1, 0, 0.1: sd 0.0577, t(3) = 3.182 -> half-width 0.0919 in log
    values = [1.0, math.exp(0.1), 1.0, math.exp(0.1)]
    low, high = log_interval_95(values)
    assert math.log(high) == pytest.approx(3.182 * statistics.stdev([0, 0.1, 0, 0.1]) / 2)
    assert low == pytest.approx(1 / high)
    assert precision_95(values) == pytest.approx(high - 1)


def _rounds(schedule, medians, predicted):
    return {**_row(schedule, statistics.median(medians), predicted),
            "round_medians_s": medians}


def test_the_picks_gap_is_paired_by_round_and_says_when_the_rounds_cannot_tell():
    # The machine's load drifts from round to round; the pick runs 8% slower than the best
    # in every round: each row alone varies by 20%, their ratio not at all.
    load = [1.0, 1.2, 0.9, 1.1]
    rows = [_rounds("flat", [1.08 * x for x in load], 0.9),
            _rounds("vfirst", load, 1.0)]
    result = pick_against_best(rows)
    assert result["planner_pick"]["schedule"] == "flat"
    assert result["pick_slower_95"] == pytest.approx([0.08, 0.08])
    assert result["pick_within_5pct"] is False and result["pick_resolved"] is True
    # Ratios 0.98 and 1.10 in two rounds: the interval straddles 5%, unresolved.
    rows = [_rounds("flat", [0.98, 1.10], 0.9), _rounds("vfirst", [1.0, 1.0], 1.0)]
    result = pick_against_best(rows)
    low, high = result["pick_slower_95"]
    assert low < 0.05 < high and result["pick_resolved"] is False
    # The pick is the best: nothing to resolve.
    result = pick_against_best([_rounds("flat", [1.0, 1.3], 0.9),
                                _rounds("vfirst", [1.1, 1.4], 1.0)])
    assert result["pick_slower_95"] == [0.0, 0.0] and result["pick_resolved"] is True


class _OneRank:
    """A transport of one rank: enough for rank 0's word to reach every rank."""

    world = SimpleNamespace(size=1)

    def all_to_all(self, send, send_splits, recv_splits, group=None):
        return SimpleNamespace(wait=lambda: send)


def test_extra_rounds_run_while_the_least_precise_row_is_wider_than_asked():
    from cocodiff.commands.validate import _another_round

    cases = [Case("flat"), Case("vfirst")]
    measurements = Measurements()

    def add_round(index, flat, vfirst):
        for case, step in zip(cases, (flat, vfirst), strict=True):
            measurements.add(case, index, RunResult([9.0, step, step], None, None, None))

    args = SimpleNamespace(rounds=2, max_rounds=4, precision=0.05)
    add_round(0, 1.0, 2.0)
    assert _another_round(_OneRank(), args, measurements, cases, 1)  # below --rounds
    add_round(1, 1.2, 2.0)  # flat +-116% after 2 rounds
    assert widest_precision(measurements, cases) > 0.05
    assert _another_round(_OneRank(), args, measurements, cases, 2)
    add_round(2, 1.1, 2.0)
    add_round(3, 1.1, 2.0)
    assert not _another_round(_OneRank(), args, measurements, cases, 4)  # --max-rounds
    steady = Measurements()
    for index in range(2):
        for case in cases:
            steady.add(case, index, RunResult([9.0, 1.0, 1.0], None, None, None))
    assert not _another_round(_OneRank(), args, steady, cases, 2)  # precise: stop


def test_the_machines_drift_is_the_blocks_time_now_against_the_calibrations():
    from cocodiff.commands.validate import machine_text

    machine = machine_drift([0.012, 0.014], 0.010)
    assert machine["drift"] == pytest.approx(0.3)
    text = machine_text(machine)
    assert "12.00 ms of CPU per layer at the start, 14.00 at the end" in text
    assert "calibrate measured 10.00: +30%" in text
    assert "calibrate again" in text
    assert "calibrate again" not in machine_text(machine_drift([0.0105], 0.010))
    assert machine_drift([0.012, 0.014], None)["drift"] is None
    assert "not timed here" in machine_text(machine_drift([None, None], 0.010))


def test_the_calibrations_blocks_come_from_calibrates_json_beside_the_topology(tmp_path):
    from cocodiff.commands.validate import _calibrated_layer_s

    topology = _topology(tmp_path)  # its JSON holds a collective, no blocks
    assert _calibrated_layer_s(str(topology)) is None
    topology.with_suffix(".json").write_text(json.dumps(
        {"compute": {"block": {"layer_s": 0.0125}}}))
    assert _calibrated_layer_s(str(topology)) == 0.0125
    assert _calibrated_layer_s("cluster") is None and _calibrated_layer_s(None) is None


def test_diffusers_is_simulated_with_its_own_call_price_where_calibrate_measured_one():
    import dataclasses

    from topology import HostSpec, build_topology, get_preset

    host = HostSpec(cores=2.0, call_cpu_us=400.0, diffusers_call_cpu_us=650.0)
    topology = build_topology(dataclasses.replace(get_preset("cluster"), host=host))
    priced = topology_of("diffusers", topology)
    assert priced.spec.host == dataclasses.replace(host, call_cpu_us=650.0)
    assert topology_of("flat", topology) is topology  # our schedules pay our call
    # No price measured (an older calibration, MPI, no host): flat's machine as before.
    unpriced = build_topology(dataclasses.replace(get_preset("cluster"), host=HostSpec(2.0)))
    assert topology_of("diffusers", unpriced) is unpriced
    bare = build_topology(get_preset("cluster"))
    assert topology_of("diffusers", bare) is bare
    # A wake-up above diffusers' cheaper call is no more than that call.
    waking = dataclasses.replace(host, call_cpu_us=800.0, wake_cpu_us=700.0)
    cheaper = topology_of("diffusers", build_topology(dataclasses.replace(
        get_preset("cluster"), host=waking)))
    assert (cheaper.spec.host.call_cpu_us, cheaper.spec.host.wake_cpu_us) == (650.0, 650.0)


@pytest.mark.parametrize("num_steps", [2, 7])
def test_a_pipefusion_rows_prediction_is_the_mean_of_steps_2_to_t_in_closed_form(num_steps):
    """On free links and a compute-bound device (as tests/simulator/test_pipeline.py's
    closed forms) every pipelined step of `run`'s order takes M + N - 1 patch slots: so
    does the predicted mean of steps 2..T."""
    import dataclasses

    from cocodiff.layout import PipelineLayout
    from cocodiff.models import ModelSpec
    from cocodiff.schedules import PlanOptions, RankGrid
    from cocodiff.schedules.run_plan import build_run_plan
    from cocodiff.validation import predict_step_s
    from topology import build_topology
    from topology.presets import cluster
    from transports.sim import COLLECTIVE_MODELS

    tokens, stages, patches = 64, 4, 4
    spec = ModelSpec(name="tiny", family="pixart", num_layers=8, num_heads=4, head_dim=16,
                     text_tokens=0, cross_attention_tokens=0, patch_size=2, output_channels=8)
    topology = build_topology(dataclasses.replace(cluster(
        num_nodes=1, ranks_per_node=stages, intra_gbps=1e8, intra_latency_us=0.0,
        tile_tflops=1.0, tile_memory_gbps=1e8), name="free"))
    run_plan = build_run_plan("pipefusion", spec, RankGrid.line(stages), (tokens,), num_steps,
                              PlanOptions(), pipeline=PipelineLayout(stages, 1, patches, 1))
    d, q = spec.hidden_size, tokens // patches  # a layer of q tokens over a buffer of all
    slot_s = spec.num_layers // stages * (q * (24 * d * d + 28 * d) + 4 * q * tokens * d) / 1e12
    predicted = predict_step_s(run_plan, topology,
                               COLLECTIVE_MODELS["ideal"])["predicted_step_s"]
    assert predicted == pytest.approx((patches + stages - 1) * slot_s, rel=1e-6)


def test_diffusers_takes_a_pure_ulysses_peers_plan_not_a_pipelines():
    from cocodiff.layout import PipelineLayout
    from cocodiff.models import REGISTRY
    from cocodiff.schedules import PlanOptions, RankGrid
    from cocodiff.schedules.run_plan import build_run_plan
    from cocodiff.validation import predicted_plan

    spec, grid, streams = REGISTRY["flux1-dev"], RankGrid.line(4), (256, 64)
    pipeline = PipelineLayout(2, 2, 2, 1)
    measurements = Measurements()
    for case, layout in ((Case("pipefusion", pipeline), pipeline), (Case("flat"), None)):
        measurements.plans[case] = build_run_plan(case.schedule, spec, grid, streams, 3,
                                                  PlanOptions(), pipeline=layout)
    predicted = predicted_plan(Case("diffusers"), measurements)
    assert predicted.schedule == "flat"
    assert predicted.sha256 == measurements.plans[Case("flat")].sha256


def test_a_rows_error_is_resolved_only_when_the_prediction_lies_outside_its_interval():
    from cocodiff.validation import error_resolved

    assert error_resolved(-0.30, 0.10)  # measured 10 +-10%, predicted 7: outside
    assert not error_resolved(-0.05, 0.10)  # predicted 9.5: inside the interval
    assert not error_resolved(0.09, 0.10) and error_resolved(0.11, 0.10)
    # the interval is [m / 1.1, m x 1.1]: -9.1% is its edge below
    assert not error_resolved(-0.09, 0.10) and error_resolved(-0.092, 0.10)
    assert error_resolved(None, 0.1) is None and error_resolved(0.2, None) is None


def test_rounds_are_added_while_a_rows_interval_neither_resolves_its_error_nor_is_precise():
    from cocodiff.commands.validate import _another_round, rounds_stop
    from cocodiff.validation import PICK, rows_to_resolve

    cases = [Case("flat"), Case("vfirst")]
    measurements = Measurements()
    for index, (flat, vfirst) in enumerate(((1.0, 2.0), (1.2, 2.02))):
        for case, step in zip(cases, (flat, vfirst), strict=True):
            measurements.add(case, index, RunResult([9.0, step, step], None, None, None))
    # flat +-116%: a prediction of 1.5 (+36%) lies inside; vfirst +-6%: 1.0 (-50%) outside;
    # the pick (vfirst, 68-100% slower than flat by round) has two rounds' interval
    predicted = {"flat": 1.5, "vfirst": 1.0}
    assert rows_to_resolve(measurements, cases, lambda case: predicted[case.schedule],
                           0.03) == ["flat", PICK]
    # flat predicted at 10 x: resolved however wide; vfirst within a loose precision
    assert rows_to_resolve(measurements, cases, lambda case: 10.0, 0.07) == []
    args = SimpleNamespace(rounds=2, max_rounds=5, precision=0.03)
    assert _another_round(_OneRank(), args, measurements, cases, 2,
                          lambda case: predicted[case.schedule])
    assert not _another_round(_OneRank(), args, measurements, cases, 2, lambda case: 10.0)
    assert not _another_round(_OneRank(), args, measurements, cases, 5,
                              lambda case: predicted[case.schedule])  # the cap
    # the stop's reason, from the rows as reported
    rows = [{"schedule": "flat", "layout": "pure", "precision_95": 1.16, "error_resolved": False},
            {"schedule": "vfirst", "layout": "pure", "precision_95": 0.06,
             "error_resolved": True}]
    stop = rounds_stop(args, 5, rows)
    assert stop["reason"] == "max_rounds" and stop["unresolved"] == ["flat@pure"]
    assert "--max-rounds 5" in stop["text"] and "flat@pure" in stop["text"]
    assert rounds_stop(args, 3, rows[1:])["reason"] == "resolved"
    no_extra = SimpleNamespace(rounds=2, max_rounds=2, precision=0.03)
    assert rounds_stop(no_extra, 2, rows)["reason"] == "no_extra_rounds"


def test_the_rounds_cap_defaults_to_ten_or_rounds_when_more():
    from cocodiff.commands.validate import DEFAULT_MAX_ROUNDS, max_rounds

    assert max_rounds(SimpleNamespace(rounds=3, max_rounds=None)) == DEFAULT_MAX_ROUNDS == 10
    assert max_rounds(SimpleNamespace(rounds=12, max_rounds=None)) == 12
    assert max_rounds(SimpleNamespace(rounds=3, max_rounds=3)) == 3


def test_short_rounds_go_past_the_default_cap_until_the_time_budget():
    # One host's rounds take seconds: with no --max-rounds, rounds past 10 are added while
    # the rounds so far took under the budget (up to the ceiling); an explicit cap holds.
    from cocodiff.commands.validate import (
        DEFAULT_MAX_ROUNDS,
        ROUND_BUDGET_S,
        ROUND_CEILING,
        rounds_stop,
        within_budget,
    )

    default = SimpleNamespace(rounds=3, max_rounds=None, precision=0.03)
    assert within_budget(default, DEFAULT_MAX_ROUNDS - 1, 10 * ROUND_BUDGET_S)
    assert within_budget(default, DEFAULT_MAX_ROUNDS, ROUND_BUDGET_S / 2)
    assert not within_budget(default, DEFAULT_MAX_ROUNDS, ROUND_BUDGET_S)
    assert not within_budget(default, ROUND_CEILING, 0.0)
    explicit = SimpleNamespace(rounds=3, max_rounds=DEFAULT_MAX_ROUNDS, precision=0.03)
    assert not within_budget(explicit, DEFAULT_MAX_ROUNDS, 0.0)
    rows = [{"schedule": "flat", "layout": "pure", "precision_95": 0.2, "error_resolved": False}]
    stop = rounds_stop(default, 30, rows, elapsed_s=ROUND_BUDGET_S + 3)
    assert stop["reason"] == "max_rounds" and stop["elapsed_s"] == ROUND_BUDGET_S + 3
    assert f"{ROUND_BUDGET_S:.0f} s of rounds" in stop["text"] and "flat@pure" in stop["text"]


def test_rank_zeros_clock_decides_a_round_past_the_default_cap():
    from cocodiff.commands.validate import DEFAULT_MAX_ROUNDS, ROUND_BUDGET_S, _another_round

    cases = [Case("flat"), Case("vfirst")]
    measurements = Measurements()
    for index in range(DEFAULT_MAX_ROUNDS):  # flat's rounds alternate: never precise
        for case in cases:
            step = 1.0 + 0.5 * (index % 2) if case.schedule == "flat" else 2.0
            measurements.add(case, index, RunResult([9.0, step, step], None, None, None))
    args = SimpleNamespace(rounds=3, max_rounds=None, precision=0.03)
    assert _another_round(_OneRank(), args, measurements, cases, DEFAULT_MAX_ROUNDS,
                          elapsed_s=ROUND_BUDGET_S / 2)
    assert not _another_round(_OneRank(), args, measurements, cases, DEFAULT_MAX_ROUNDS,
                              elapsed_s=ROUND_BUDGET_S + 1)


def test_a_row_whose_interval_is_wider_than_its_error_says_so():
    from cocodiff.commands.validate import error_text

    assert error_text(-0.052, False) == "-5.2% (unresolved)"
    assert error_text(-0.30, True) == "-30.0%"
    assert error_text(0.1, None) == "+10.0%" and error_text(None, None) == "-"


def test_calibrates_verdict_beside_the_topology_is_a_note_when_it_will_not_hold(tmp_path):
    from cocodiff.commands.validate import _calibration_verdict

    topology = tmp_path / "m.toml"
    topology.write_text(TWO_RANKS_TOML)
    assert _calibration_verdict(str(topology)) is None  # no JSON beside it
    beside = topology.with_suffix(".json")
    beside.write_text(json.dumps({"verdict": {"holds": True, "reasons": []}}))
    assert _calibration_verdict(str(topology)) is None
    beside.write_text(json.dumps({"verdict": {"holds": False, "reasons": ["load 9 on 2 cores"]}}))
    assert _calibration_verdict(str(topology)) == "predictions will not hold: load 9 on 2 cores"
    beside.write_text("[1, 2]")
    assert _calibration_verdict(str(topology)) is None and _calibration_verdict("aurora") is None


def test_rounds_are_added_while_the_picks_verdict_straddles_five_percent():
    """The pick (least predicted) against the measured best, paired by round: a gap whose
    interval straddles the 5% tolerance wants another round; one clearly past it, or the
    pick being the best, does not."""
    from cocodiff.commands.validate import rounds_stop
    from cocodiff.validation import PICK, rows_to_resolve

    cases = [Case("flat"), Case("vfirst")]

    def measured(pairs):
        measurements = Measurements()
        for index, (flat, vfirst) in enumerate(pairs):
            for case, step in zip(cases, (flat, vfirst), strict=True):
                measurements.add(case, index, RunResult([9.0, step, step], None, None, None))
        return measurements

    # vfirst predicted fastest, measured 0-12% slower than flat round by round: unresolved
    noisy = measured(((1.0, 1.0), (1.0, 1.12), (1.0, 1.05)))
    predicted = {"flat": 1.04, "vfirst": 1.0}
    assert PICK in rows_to_resolve(noisy, cases, lambda case: predicted[case.schedule], 1.0)
    # 20% slower every round: a resolved miss
    steady = measured(((1.0, 1.2), (1.0, 1.2), (1.0, 1.2)))
    assert PICK not in rows_to_resolve(steady, cases, lambda case: predicted[case.schedule],
                                       1.0)
    # the pick is the best: nothing to resolve
    assert PICK not in rows_to_resolve(noisy, cases, lambda case: {"flat": 1.0,
                                                                   "vfirst": 2.0}[case.schedule],
                                       1.0)
    args = SimpleNamespace(rounds=3, max_rounds=3, precision=1.0)
    stop = rounds_stop(args, 3, [], pick_resolved=False)
    assert stop["unresolved"] == [PICK] and PICK in stop["text"]
    assert rounds_stop(args, 3, [])["reason"] == "resolved"
