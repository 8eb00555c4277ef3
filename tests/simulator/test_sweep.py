"""`cocodiff simulate --sweep` (cocodiff.simulator.sweep): rows spread over local processes, or over
the ranks of an mpiexec launch, are the rows of a serial run."""

from __future__ import annotations

import json

import pytest
from launching import launcher_prefix, needs_mpi, run_job

from cocodiff.commands.cli import main

# FLUX.1-dev's 24 heads: 1 node runs pure Ulysses, 4 nodes (48 ranks) the planner's layouts.
GRID = ["--sweep", "--sweep-models", "flux1-dev", "--sweep-resolutions", "768",
        "--sweep-nodes", "1,4", "--schedule", "vfirst,cocodiff", "--steps", "4"]


def _rows(path):
    """The rows without the simulator's own wall time (the one thing that may differ)."""
    rows = json.loads(path.read_text())["rows"]
    for row in rows:
        for result in row["results"]:
            del result["sim_wall_s"]
    return rows


@pytest.fixture(scope="module")
def serial_rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("serial") / "serial.json"
    assert main(["simulate", *GRID, "--workers", "1", "--json", str(path)]) == 0
    return _rows(path)


def test_local_processes_give_the_serial_rows(serial_rows, tmp_path, capsys):
    path = tmp_path / "parallel.json"
    assert main(["simulate", *GRID, "--workers", "2", "--json", str(path)]) == 0
    assert _rows(path) == serial_rows
    assert [(row["nodes"], row["layouts"]["flat"] != "pure") for row in serial_rows] == [
        (1, False), (4, True)]
    assert "2/2" in capsys.readouterr().out  # the progress bar's count


@needs_mpi
@pytest.mark.multiprocess
def test_mpiexec_ranks_give_the_serial_rows(serial_rows, tmp_path):
    path = tmp_path / "mpi.json"
    cmd = launcher_prefix("mpiexec", 2) + ["-m", "cocodiff", "simulate", *GRID,
                                            "--json", str(path)]
    job = run_job(cmd, tmp_path)
    assert job.returncode == 0, job.stderr
    assert _rows(path) == serial_rows
    assert job.stdout.count("cocodiff over flat: mean") == 1  # rank 0 reports alone


@pytest.mark.parametrize(("args", "message"), [
    (["--sweep-models", "nope"], "unknown sweep model 'nope'"),
    (["--sweep-nodes", "0"], "sweep node counts must be positive"),
    (["--sweep-resolutions", "1000"], "1000"),
    (["--workers", "0"], "positive integer"),
])
def test_bad_sweep_input_is_one_line_exit_2(args, message, tmp_path, capsys):
    out = tmp_path / "out.json"
    try:
        code = main(["simulate", "--sweep", *args, "--json", str(out)])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()
