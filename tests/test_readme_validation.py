"""The README's "Validating the simulator on your machine", as a new user runs it:
``mpiexec -n 4 cocodiff calibrate ...`` then ``mpiexec -n 4 cocodiff validate ...``, taken
from the README's own code block (so the test follows the page), on 2 ranks of tiny-flux
with the commands' fast settings (``calibrate --quick``; ``validate --steps 2``, 2 rounds,
no extra one: the rule that adds rounds has its own tests in test_validate.py). It checks
the report's shape: calibrate's verdict, every row with its measured and predicted step,
error, 95% interval and whether it resolves the error, why the rounds stopped, the
pick's verdict. It never asserts a time."""

import json
import math
import re
import shlex
import sys

import pytest
from launching import MPIEXEC, REPO, needs_mpi, run_job


def readme_commands() -> dict[str, list[str]]:
    """The README's ``mpiexec -n 4 cocodiff calibrate|validate`` lines, as argument lists
    after the command's name."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Validating the simulator on your machine", 1)[1]
    block = section.split("```sh", 1)[1].split("```", 1)[0]
    commands = {}
    for line in block.splitlines():
        match = re.match(r"mpiexec -n \d+ cocodiff (calibrate|validate) (.*)", line.strip())
        if match:
            commands[match.group(1)] = shlex.split(match.group(2))
    return commands


def _as_here(argv: list[str], tmp_path, renames: dict[str, str]) -> list[str]:
    """The README's arguments with its placeholders made real: its model directory (DIR)
    the built-in tiny model, its file names in ``tmp_path``."""
    return [renames.get(arg, str(tmp_path / arg) if arg.endswith((".toml", ".json")) else arg)
            for arg in argv]


@pytest.mark.multiprocess
@needs_mpi
def test_the_readmes_calibrate_then_validate_give_a_report_of_every_row(tmp_path):
    commands = readme_commands()
    assert set(commands) == {"calibrate", "validate"}, commands
    launch = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "cocodiff"]
    renames = {"DIR": "tiny-flux"}
    calibrate = _as_here(commands["calibrate"], tmp_path, renames)
    job = run_job([*launch, "calibrate", *calibrate, "--quick"], tmp_path, timeout_s=180)
    assert job.returncode == 0, job.stderr[-3000:]
    topology = tmp_path / calibrate[calibrate.index("--output") + 1]
    measured = json.loads((tmp_path / calibrate[calibrate.index("--json") + 1]).read_text())
    # calibrate's verdict: in its JSON, in the topology's header, and one line when the
    # predictions will not hold (on a busy machine they may not: either is a valid answer)
    verdict = measured["verdict"]
    assert verdict["holds"] in (True, False, None)
    assert "# verdict: " in topology.read_text()
    if verdict["holds"] is False:
        assert verdict["reasons"]
        assert "warning: predictions from this topology will not hold" in job.stdout
    assert [row["shape"] for row in measured["loops_check"]]  # the loops it judges on

    validate = _as_here(commands["validate"], tmp_path, renames)
    job = run_job([*launch, "validate", *validate, "--steps", "2", "--rounds", "2",
                   "--max-rounds", "2", "--quiet"], tmp_path, timeout_s=240)
    assert job.returncode == 0, job.stderr[-3000:]
    report = json.loads((tmp_path / validate[validate.index("--json") + 1]).read_text())
    rows = report["rows"]
    assert [row["schedule"] for row in rows] == ["flat", "tapa", "vfirst", "cocodiff"]
    assert set(report["skipped"]) == {"diffusers"}  # over MPI: refused, reported
    for row in rows:
        assert row["measured_step_s"] > 0 and row["predicted_step_s"] > 0
        assert row["error"] == pytest.approx(row["predicted_step_s"] / row["measured_step_s"]
                                             - 1)
        assert len(row["round_medians_s"]) == report["rounds"]
        assert row["precision_95"] > 0
        assert row["error_resolved"] == (abs(math.log1p(row["error"]))
                                         > math.log1p(row["precision_95"]))
    assert report["rounds"] == 2 and report["max_rounds"] == 2
    stop = report["rounds_stop"]
    assert stop["reason"] in ("resolved", "no_extra_rounds")
    assert (stop["reason"] == "resolved") == (not stop["unresolved"])
    assert f"rounds: {report['rounds']} (stopped: " in " ".join(job.stdout.split())
    if any(row["error_resolved"] is False for row in rows):
        assert "(unresolved)" in job.stdout
    assert report["planner_pick"]["schedule"] in {row["schedule"] for row in rows}
    assert isinstance(report["pick_within_5pct"], bool)
    assert {"median_abs_error", "within_15pct", "within_20pct"} <= set(report)
    assert report["exactness"]["passed"]
    assert report["calibration"]["collective_source"].endswith(".json")
    assert report["machine"]["calibrated_layer_s"] > 0  # the blocks calibrate timed
    share = report["machine"]["foreign_share"]  # other work on the host (Linux accounts it)
    assert share is not None and 0 <= share <= 1
    assert f"other processes used {share:.0%} of the cores" in " ".join(job.stdout.split())
