"""``bench/call_wait_burst.py``: loops of a compute burst and a world all-to-all on 2 ranks
under mpiexec, each simulated on a calibrated topology with its wait per call and with
none. Times are only checked to exist and to be told apart, never compared."""

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
