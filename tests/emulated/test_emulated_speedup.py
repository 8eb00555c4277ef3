"""The emulated-cluster benchmark (bench/emulated_speedup.py) end to end, at a tiny size:
one 2 x 2 cluster at 1 Gbit/s, calibrated, then `cocodiff validate` across it (every
schedule and diffusers' context parallelism, the float32 equality check and the
simulator's predictions).

Needs root with ``ip`` and ``tc`` (skipped otherwise, as tests/emulated/test_emulated_cluster.py).
Asserts what the report contains, never a time or a speedup."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from test_emulated_cluster import _REASON  # noqa: E402

from bench import emulated_report, emulated_speedup, resimulate  # noqa: E402

SCHEDULES = ["flat", "tapa", "vfirst", "cocodiff", "diffusers"]
PIPELINE = "pipefusion@P2xU2xM2/w1"  # 2 stages of one layer, Ulysses 2 inside each


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(_REASON is not None, reason=f"emulated cluster: {_REASON}")
def test_the_benchmark_measures_checks_and_predicts_every_schedule(tmp_path, capsys):
    report_path = tmp_path / "report.json"
    code = emulated_speedup.main([
        "--configs", "2x2@1", "--schedules", ",".join([*SCHEDULES, "pipefusion"]),
        "--layouts", "pure,P2xU2xM2/w1", "--repeats", "1",
        "--max-repeats", "1", "--steps", "2", "--quick-calibration", "--heads", "4",
        "--head-dim", "16", "--layers", "1", "--single-layers", "1", "--resolution", "128",
        "--json", str(report_path), "--plot", str(tmp_path / "plot.png"),
        "--work", str(tmp_path / "work"),
    ])
    assert code == 0, capsys.readouterr().err[-3000:]
    report = json.loads(report_path.read_text())
    (config,) = report["configs"]
    assert config["config"]["model"]["heads"] * config["config"]["model"]["head_dim"] == 64
    summary, skipped = config["summary"], config["validate"]["skipped"]
    assert not skipped
    assert set(summary) == {*SCHEDULES, PIPELINE}
    for name, row in summary.items():
        assert row["measured_step_s"] > 0 and row["min_step_s"] > 0, name
        assert row["predicted_step_s"] > 0, name
        assert row["error"] == pytest.approx(row["predicted_step_s"] / row["measured_step_s"] - 1)
    assert summary["diffusers"]["predicted_with_plan"] == "flat"
    equality = config["equality"]
    assert equality["passed"], equality
    assert set(equality["checked"]) == {"flat@pure", "tapa@pure", "vfirst@pure",
                                        "diffusers@pure"}
    assert all(row["max_abs_diff"] <= 1e-5 for row in summary.values() if row["exact"])
    assert report["rows"] == len(SCHEDULES) + 1
    # The pipeline against the sequence family: each side's fastest row, measured and
    # predicted.
    families = config["families"]
    for basis in ("measured", "predicted"):
        assert families[basis]["pipeline"]["row"] == PIPELINE
        assert families[basis]["sequence"]["row"] in SCHEDULES
        key = f"{basis}_step_s"
        assert families[basis]["sequence_over_pipeline"] == pytest.approx(
            min(summary[name][key] for name in SCHEDULES if summary[name].get(key))
            / summary[PIPELINE][key])
    assert PIPELINE in capsys.readouterr().out
    # A step's exchange patterns are timed and checked, not fitted (no --fit-patterns).
    measured = config["calibration"]["measured"]
    assert {row["pattern"] for row in measured["patterns"]} == {"world", "column+sync"}
    assert all(row["simulated_s"] > 0 for row in measured["patterns"])
    assert not [row for row in measured["collective"]["fit"] if "step issues" in row["label"]]
    assert (tmp_path / "plot.png").stat().st_size > 0
    # docs/validate.md's table: the configuration's row, with what calibrate wrote to
    # [host] and every pure-Ulysses schedule measured / predicted.
    header, _rule, row = emulated_report.calibrations_table(report).splitlines()
    assert all(f" {name} |" in header for name in SCHEDULES)
    assert row.startswith(f"| {config['label']} |") and row.count("%)") == len(SCHEDULES)

    # bench/resimulate.py simulates the report's rows again: on the topology as calibrated
    # it gives validate's predictions; without the calls' wait, none slower.
    again = tmp_path / "again.json"
    assert resimulate.main([str(report_path), "--set", "call_wait_us=0",
                            "--json", str(again)]) == 0
    (resimulated,) = json.loads(again.read_text())["configs"]
    for row in resimulated["rows"]:
        assert row["calibrated_error"] == pytest.approx(row["report_error"], rel=1e-6), row
        assert row["replaced_step_s"] <= row["calibrated_step_s"] * (1 + 1e-9), row
    # Refitting the call wait on the report's own loops, with the simulator that
    # calibrated them, gives calibrate's wait again.
    refitted = tmp_path / "refitted.json"
    assert resimulate.main([str(report_path), "--refit-call-wait",
                            "--json", str(refitted)]) == 0
    (refit,) = json.loads(refitted.read_text())["configs"]
    calibrated_wait = config["calibration"]["measured"]["host"]["call_wait_us"]
    assert refit["loops"]["call_wait_us"] == pytest.approx(calibrated_wait, abs=1.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--configs", "2x2"], "--configs item '2x2' is not NODESxRANKS@GBIT"),
        (["--configs", "2x0@1"], "--configs item '2x0@1' is not NODESxRANKS@GBIT"),
        (["--schedules", "flat,nope"], "unknown schedule"),
        (["--configs", "missing.json"], "--configs missing.json"),
        (["--steps", "1"], "--steps must be at least 2"),
        (["--repeats", "4", "--max-repeats", "3"], "--max-repeats (3) is below --repeats (4)"),
        (["--single-host", "--configs", "2x2@1"], "--single-host runs its own configurations"),
        (["--layouts", "pure,P2"], "not a layout name"),
    ],
)
def test_bad_input_is_one_line(argv, message, capsys):
    assert emulated_speedup.main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def _validated(label, slower, within, interval, resolved):
    pick = {"schedule": "vfirst", "layout": "pure", "measured_step_s": 1.0 + slower,
            "predicted_step_s": 0.9}
    best = {"schedule": "flat", "layout": "pure", "measured_step_s": 1.0,
            "predicted_step_s": 1.0}
    return {"label": label, "summary": {},
            "validate": {"rounds": 10, "planner_pick": pick, "measured_best": best,
                         "pick_slower_than_best": slower, "pick_within_5pct": within,
                         "pick_slower_95": interval, "pick_resolved": resolved}}


def test_the_summary_names_the_missed_picks_the_rounds_could_not_tell():
    configs = [_validated("a", 0.02, True, [0.01, 0.03], True),
               _validated("b", 0.09, False, [0.07, 0.11], True),
               _validated("c", 0.07, False, [-0.01, 0.15], False)]
    summary = emulated_speedup.overall(configs)
    assert summary["pick_within_5pct"] == "1 of 3"
    assert summary["picks_missed_unresolved"] == ["c"]
    table = emulated_speedup.picks_table({"configs": configs})
    assert "| c | 10 |" in table and "-1.0% to +15.0%, unresolved" in table
    assert "+7.0% to +11.0%)" in table


def _row(schedule, measured_ms, predicted_ms):
    return {"schedule": schedule, "measured_step_s": measured_ms / 1e3,
            "predicted_step_s": None if predicted_ms is None else predicted_ms / 1e3}


def test_the_fastest_pipeline_row_is_set_against_the_fastest_sequence_row():
    summary = {"flat": _row("flat", 300, 250), "vfirst@U2xR2xB1": _row("vfirst", 240, 260),
               "diffusers": _row("diffusers", 260, None),
               "pipefusion@P2xU2xM2/w1": _row("pipefusion", 200, 180),
               "pipefusion@P4xU1xM4/w1": _row("pipefusion", 220, 170)}
    families = emulated_speedup.pipeline_against_sequence(summary)
    # Measured: each family's fastest measured row; predicted: each family's fastest
    # predicted row (a row without a prediction left out), as the planner would choose.
    assert families["measured"]["pipeline"]["row"] == "pipefusion@P2xU2xM2/w1"
    assert families["measured"]["sequence"]["row"] == "vfirst@U2xR2xB1"
    assert families["measured"]["sequence_over_pipeline"] == pytest.approx(1.2)
    assert families["predicted"]["pipeline"]["row"] == "pipefusion@P4xU1xM4/w1"
    assert families["predicted"]["sequence"]["row"] == "flat"
    assert families["predicted"]["sequence_over_pipeline"] == pytest.approx(250 / 170)
    line = emulated_speedup.families_text({"label": "2x2@0.2", "families": families})
    assert "measured pipefusion@P2xU2xM2/w1 200.0 ms vs vfirst@U2xR2xB1 240.0 ms " \
        "(pipeline 1.20x faster)" in line
    summary["flat"] = _row("flat", 150, 100)
    assert "(sequence 1.33x faster)" in emulated_speedup.families_text(
        {"label": "x", "families": emulated_speedup.pipeline_against_sequence(summary)})
    assert emulated_speedup.pipeline_against_sequence({"flat": summary["flat"]}) is None


def test_the_plots_error_bars_are_the_rows_interval_else_the_rounds_min_max():
    from bench.emulated_report import error_bar

    row = {"measured_step_s": 0.1, "min_step_s": 0.09, "max_step_s": 0.12}
    assert error_bar(row) == pytest.approx((10.0, 20.0))
    # +-10%: a ratio either side of the measured 100 ms
    assert error_bar({**row, "precision_95": 0.1}) == pytest.approx((100 - 100 / 1.1, 10.0))


def test_single_host_configurations_are_the_readmes_runs_under_both_launchers():
    # 1 x 4 and 1 x 2 ranks, mpiexec and torchrun, the built-in tiny-flux and the enlarged
    # model (issue 38); run with the plain launcher, no emulated cluster.
    configs = emulated_speedup.SINGLE_HOST_CONFIGS
    assert all(config.single_host and config.nodes == 1 for config in configs)
    assert {(c.ranks_per_node, c.transport, c.model) for c in configs} == {
        (ranks, transport, model) for ranks in (4, 2) for transport in ("mpi", "torch")
        for model in (None, emulated_speedup.ENLARGED)}
    labels = [config.label for config in configs]
    assert "1x4host mpiexec tiny-flux" in labels and "1x2host torchrun h256l6r512" in labels
    assert emulated_speedup.launcher_prefix("mpi", 4)[1:3] == ["-n", "4"]
    assert emulated_speedup.launcher_prefix("torch", 2)[1:3] == ["--nproc-per-node", "2"]
    assert configs[0].to_json()["model"] is None and configs[0].to_json()["single_host"]


def test_the_compact_report_keeps_the_rows_and_picks_of_every_run(tmp_path):
    from bench.emulated_report import main as report_main

    def run(label, measured):
        validated = _validated(label, 0.0, True, [0.0, 0.0], True)
        validated["summary"] = {"flat": {**_row("flat", measured, 90), "error": -0.1,
                                         "min_step_s": 0.09, "max_step_s": 0.2,
                                         "precision_95": 0.031234, "round_medians_s": [1]}}
        validated["validate"]["runs"] = [{"a large": "record"}]
        validated["calibration"] = {"topology": "...", "measured": {"a large": "record"}}
        return {"steps": 6, "configs": [validated]}

    paths = []
    for label, measured in (("a", 100.0), ("b", 123.456789)):
        paths.append(tmp_path / f"{label}.json")
        paths[-1].write_text(json.dumps(run(label, measured)))
    out = tmp_path / "compact.json"
    assert report_main([*map(str, paths), "--compact", str(out)]) == 0
    compact = json.loads(out.read_text())
    assert [config["label"] for config in compact["configs"]] == ["a", "b"]
    assert compact["runs"] == [{"steps": 6}, {"steps": 6}]
    b = compact["configs"][1]
    # Four significant digits; no calibration, rounds or per-round medians.
    assert b["rows"]["flat"] == {"measured_step_s": 0.1235, "precision_95": 0.03123,
                                 "predicted_step_s": 0.09, "error": -0.1}
    assert b["planner_pick"]["schedule"] == "vfirst" and b["pick_within_5pct"] is True
    assert "calibration" not in b and "runs" not in json.dumps(b)


def test_calibrate_gets_the_flags_the_command_line_chose():
    import argparse

    def flags(**chosen):
        return emulated_speedup.calibrate_flags(argparse.Namespace(
            **{"quick_calibration": False, "fit_patterns": False, **chosen}))

    assert flags() == []
    assert flags(quick_calibration=True, fit_patterns=True) == ["--quick", "--fit-patterns"]
