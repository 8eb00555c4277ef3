"""``bench/call_wait_burst.py`` and ``bench/call_ahead.py``: loops of compute and
all-to-alls on 2 ranks under mpiexec, simulated on a calibrated topology (with the wait per
call and without; flat's shape and V-First's). Times are only checked to exist and to be
told apart, never compared."""

import json
from pathlib import Path

import pytest
from launching import launcher_prefix, needs_mpi, run_job

REPO = Path(__file__).resolve().parents[1]
CALIBRATION = REPO / "results" / "measured" / "regime_search" / "gloo.toml"


@needs_mpi
@pytest.mark.multiprocess
def test_every_burst_is_measured_and_simulated_with_and_without_the_wait(tmp_path):
    out = tmp_path / "wait.json"
    cmd = launcher_prefix("mpiexec", 2) + [
        str(REPO / "bench" / "call_wait_burst.py"), "--topology", str(CALIBRATION),
        "--bursts", "0.1,0.5", "--iterations", "5", "--rounds", "1", "--json", str(out)]
    job = run_job(cmd, tmp_path)
    assert job.returncode == 0, job.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["world"] == 2 and record["call_wait_us"] > 0
    assert [row["burst_ms"] for row in record["rows"]] == [0.1, 0.5]
    for row in record["rows"]:
        assert row["measured_s"] > 0 and row["burst_cpu_s"] > 0
        # The calibrated wait is charged on busy cores only, never taken off.
        assert row["simulated_s"] >= row["simulated_no_wait_s"] > 0
        assert row["leftover_per_call_s"] == pytest.approx(
            row["measured_s"] - row["simulated_no_wait_s"])  # one call per iteration
    assert "left per call ~" in job.stdout


@needs_mpi
@pytest.mark.multiprocess
def test_flat_and_vfirst_calls_are_timed_one_by_one_and_simulated(tmp_path):
    out = tmp_path / "ahead.json"
    cmd = launcher_prefix("mpiexec", 2) + [
        str(REPO / "bench" / "call_ahead.py"), "--topology", str(CALIBRATION),
        "--layers", "0.2:0.1:0.05", "--tail", "0.05", "--iterations", "3", "--rounds", "1",
        "--json", str(out)]
    job = run_job(cmd, tmp_path)
    assert job.returncode == 0, job.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["world"] == 2 and record["layers_ms"] == [[0.2, 0.1, 0.05]]
    flat, first = record["calls"]["flat"], record["calls"]["vfirst"]
    assert {"L0 q", "L0 k", "L0 v", "L0 out", "gather"} <= set(flat)
    assert {"L0 v start", "L0 after v", "L0 v wait", "L0 q", "L0 k"} <= set(first)
    assert "L0 v" not in first and "L0 v start" not in flat
    assert all(call["wall_s"] > 0 for calls in (flat, first) for call in calls.values())
    for schedule in ("flat", "vfirst"):
        assert record["measured_s"][schedule] > 0 and record["simulated_s"][schedule] > 0
    assert "vfirst / flat" in job.stdout and "simulated on" in job.stdout
