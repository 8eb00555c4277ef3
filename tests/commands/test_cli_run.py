"""`cocodiff run` and `cocodiff export-tiny` in one process: outputs, the JSON record,
loading an exported directory, and one-line errors with no partial output."""

import json
import re
import sys

import pytest
import torch
from launching import MPIEXEC, launcher_prefix, needs_mpi, run_job

from cocodiff.commands.cli import main
from cocodiff.runtime.parallel import UnsupportedModelError, parallelize
from cocodiff.runtime.tiny import build_tiny
from cocodiff.schedules import RankGrid
from cocodiff.util.errors import ScheduleError
from transports.base import Group

RUN_KEYS = {
    "model",
    "num_ranks",
    "schedule",
    "grid",
    "parallel",
    "transport",
    "steps",
    "step_times_s",
    "total_s",
    "comm_s",
    "output",
}


def exit_code(argv):
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_run_writes_image_json_and_latents(tmp_path):
    image, record, latents = tmp_path / "a.png", tmp_path / "a.json", tmp_path / "a.pt"
    assert (
        main(
            [
                "run",
                "--model",
                "tiny-flux",
                "--steps",
                "2",
                "--quiet",
                "--output",
                str(image),
                "--json",
                str(record),
                "--save-latents",
                str(latents),
            ]
        )
        == 0
    )
    assert image.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(record.read_text())
    assert RUN_KEYS <= data.keys()
    assert "layout" not in data  # the rank grid is "grid", as in validate --json
    assert data["num_ranks"] == 1 and data["steps"] == 2 and len(data["step_times_s"]) == 2
    assert torch.isfinite(torch.load(latents, weights_only=True)).all()


def test_an_exported_tiny_model_loads_back_identically(tmp_path):
    directory = tmp_path / "tiny-sd3"
    assert main(["export-tiny", "tiny-sd3", str(directory)]) == 0
    assert (directory / "model_index.json").exists()
    assert not list(directory.rglob("*.bin"))
    paths = []
    for model in ("tiny-sd3", str(directory)):
        paths.append(tmp_path / f"{len(paths)}.pt")
        assert (
            main(
                [
                    "run",
                    "--model",
                    model,
                    "--steps",
                    "2",
                    "--quiet",
                    "--save-latents",
                    str(paths[-1]),
                ]
            )
            == 0
        )
    first, second = (torch.load(p, weights_only=True) for p in paths)
    torch.testing.assert_close(first, second, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        (None, ["--model", "/no/such/dir"], "/no/such/dir"),
        ("empty", ["--model", "{dir}"], "model_index.json"),
        ("unet", ["--model", "{dir}"], "names no transformer"),
        (None, ["--transport", "carrier-pigeon"], "unknown transport 'carrier-pigeon'"),
        (None, ["--schedule", "nope"], "unknown schedule 'nope'"),
        (None, ["--output", "/no/such/dir/x.png"], "does not exist"),
        (None, ["--dtype", "float8"], "invalid choice"),
        (None, ["--grid", "2x2"], "--grid must be NODESxGPUSxTILES"),
        (None, ["--grid", "2x0x1"], "--grid must be NODESxGPUSxTILES"),
        (None, ["--grid", "2x2x1"], "--grid 2x2x1 holds 4 ranks, the launch has 1"),
        # --layout: the old name of --grid (and of --parallel-layout auto) for one release
        (None, ["--layout", "2x2x1"], "--grid 2x2x1 holds 4 ranks, the launch has 1"),
        (None, ["--layout", "1x1x1", "--grid", "1x1x1"], "--layout is the old name of --grid"),
        (None, ["--parallel-layout", "pure", "--ulysses", "1"],
         "--parallel-layout pure and --ulysses/--ring/--batch both choose the layout"),
        (None, ["--chunks", "2"], "--chunks pipelines the phases .* flat has none"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, setup, args, message):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    if setup == "unet":
        (model_dir / "model_index.json").write_text(
            json.dumps(
                {
                    "_class_name": "StableDiffusionPipeline",
                    "unet": ["diffusers", "UNet2DConditionModel"],
                }
            )
        )
    args = [a.replace("{dir}", str(model_dir)) for a in args]
    record = tmp_path / "r.json"
    assert exit_code(["run", "--quiet", "--json", str(record), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(message, err), err
    assert not record.exists()


def test_export_refuses_unknown_names_and_non_empty_directories(tmp_path, capsys):
    assert main(["export-tiny", "tiny-nope", str(tmp_path / "x")]) == 2
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert main(["export-tiny", "tiny-flux", str(tmp_path / "full")]) == 2
    assert capsys.readouterr().err.count("\n") == 2


class _WideTransport:
    """Just enough of a transport to ask for more ranks than heads."""

    name, rank, world_size = "fake", 0, 8
    world = Group(tuple(range(8)))


def test_more_ranks_than_heads_is_refused():
    with pytest.raises(UnsupportedModelError, match="8 ranks cannot split the 4 attention heads"):
        parallelize(build_tiny("tiny-flux"), _WideTransport())


class _FourRanks:
    name, rank, world_size = "fake", 0, 4
    world = Group(tuple(range(4)))


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        (RankGrid((2, 2, 2), tuple(range(8))), "grid 2x2x2 holds 8 ranks, the job has 4"),
        (RankGrid((2, 2, 1), (1, 0, 2, 3)), r"needs ranks 0\.\.3 in \(node, gpu, tile\) order"),
    ],
)
def test_a_grid_that_does_not_hold_the_ranks_in_order_is_refused(grid, message):
    with pytest.raises(ScheduleError, match=message):
        parallelize(build_tiny("tiny-flux"), _FourRanks(), "tapa", grid)


@needs_mpi
@pytest.mark.multiprocess
@pytest.mark.parametrize(("args", "message"), [
    (["--schedule", "tapa", "--grid", "2x2x1"], "--grid 2x2x1 holds 4 ranks, the launch has 2"),
    (["--schedule", "cocodiff", "--grid", "2x1x1", "--vmajor-ratio-schedule", "linear:2"],
     "V-Major ratio 2.0 is outside [0, 1]"),
])
def test_a_bad_layout_or_vmajor_option_stops_every_rank(tmp_path, args, message):
    # mpiexec only: torchrun ends the other ranks as soon as one exits, so rank 0 may be
    # stopped by SIGTERM before it prints the error that every rank found.
    cmd = launcher_prefix("mpiexec", 2) + ["-m", "cocodiff", "run", "--quiet", *args]
    result = run_job(cmd, tmp_path, timeout_s=60)  # every rank stops before any collective
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "cocodiff run" in line]
    assert lines == [f"cocodiff run: error: {message}"]


@needs_mpi
@pytest.mark.multiprocess
def test_ranks_that_disagree_on_arguments_all_fail_with_one_message(tmp_path):
    base = [
        sys.executable,
        "-m",
        "cocodiff",
        "run",
        "--model",
        "tiny-flux",
        "--steps",
        "1",
        "--quiet",
        "--transport",
        "mpi",
    ]
    cmd = [str(MPIEXEC), "-n", "1", *base, "--seed", "1", ":", "-n", "1", *base, "--seed", "2"]
    result = run_job(cmd, tmp_path, timeout_s=120)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "disagree" in line]
    assert lines == [
        "cocodiff run: error: ranks disagree on arguments: ranks [1] differ from rank 0"
    ]


@pytest.mark.parametrize(
    ("node_of", "shape"),
    [([0, 0, 0, 0], None), ([0, 0, 1, 1], (2, 2, 1)), ([0, 1, 2, 3], (4, 1, 1))],
)
def test_the_launch_grid_is_the_nodes_the_ranks_found(monkeypatch, node_of, shape):
    import cocodiff.runtime.nodes as nodes
    from cocodiff.runtime.nodes import launched_grid

    monkeypatch.setattr(nodes, "detect_nodes", lambda transport: node_of)
    grid = launched_grid(_FourRanks())
    assert (grid.shape if grid else None) == shape
    assert grid is None or grid.ranks == (0, 1, 2, 3)


def test_ranks_not_node_major_are_refused():
    from cocodiff.runtime.nodes import PlacementError, node_major_shape

    with pytest.raises(PlacementError, match=r"not placed node-major .* \[0, 1, 0, 1\]"):
        node_major_shape([0, 1, 0, 1])
