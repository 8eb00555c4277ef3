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


@pytest.mark.parametrize(("args", "message"), [
    (["--schedule", "flat,pipefusion"], "simulate runs pipefusion from its plan file"),
    (["--sweep", "--pipefusion-overlap"], "--pipefusion-overlap needs --sweep with pipefusion"),
])
def test_pipefusion_outside_a_sweep_is_one_line_exit_2(args, message, tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["simulate", *args, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()


def test_a_row_sets_the_fastest_pipeline_beside_the_sequence_family():
    """The row's PipeFusion entry is the fastest of every pipeline layout simulated in
    full (floors prune, never the best), with its memory per rank and its speedup over
    the row's flat step."""
    from cocodiff.memory import sequence_memory
    from cocodiff.models import load_model_spec
    from cocodiff.schedules import DEFAULT_OPTIONS
    from cocodiff.simulator.pipelines import rank_pipelines
    from cocodiff.simulator.sweep import SweepOptions, run_configuration
    from topology import build_topology, get_preset

    options = SweepOptions(("flat", "vfirst"), 4, DEFAULT_OPTIONS, None, pipefusion=True)
    row = run_configuration(options, ("flux1-dev", 768, 1))
    model = load_model_spec("flux1-dev")
    streams = (model.image_tokens(768, 768), model.text_tokens)
    topology = build_topology(get_preset("aurora", 1))
    every, refused = rank_pipelines(model, topology, streams, 4)
    assert not refused and len(every) == 5  # 2, 3, 4, 6 and 12 stages of 12 tiles
    best, pipeline = every[0], row["pipefusion"]
    assert pipeline["layout"] == best.layout.name
    assert pipeline["step_time_s"] == pytest.approx(best.step_time_s, rel=1e-9)
    assert pipeline["memory_gb"] == pytest.approx(best.memory.total_bytes / 1e9)
    assert pipeline["simulated"] + pipeline["pruned"] == 5
    flat_s = next(r["step_time_s"] for r in row["results"] if r["schedule"] == "flat")
    assert pipeline["speedup"] == pytest.approx(flat_s / best.step_time_s)
    whole = sequence_memory(model, streams, 12, None, DEFAULT_OPTIONS.dtype_bytes, 1)
    assert row["memory_gb"]["flat"] == pytest.approx(whole.total_bytes / 1e9)
    assert row["tile_memory_gb"] == 64.0
