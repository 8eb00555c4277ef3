"""Exactness of PipeFusion with every step synchronous (warm-up = all steps): each rank
holds only its stage's blocks, the stages pass the hidden states (and the text stream)
point to point, and stage 0 and the last stage end with the single-process transformer
output and pipeline latents (float32, atol = rtol = 1e-5), over torch.distributed (gloo,
torchrun) and mpi4py (mpiexec), on tiny FLUX, SD3 and PixArt built with more blocks (the
tiny models have one): 4 stages, and 2 stages x Ulysses 2 inside each.

The same launches run the pipelined steps (warm-up 1, then patches streamed with stale
K/V, 3 steps): the final latents equal the one-process serial emulation of the same
algorithm (tests/workers/pipefusion_reference.py) within 1e-5, and differ from the exact
run (the stale K/V was used).

One launch per launcher, every model and layout inside: each launch costs ~13 s of
imports."""

import argparse
import json
import re

import pytest
import torch
from launching import (
    WORKERS,
    launcher_prefix,
    needs_mpi,
    needs_torchrun,
    plan_simulate_run,
    run_job,
)

from cocodiff.commands.cli import main
from cocodiff.commands.run import pipeline_layout
from cocodiff.layout import PipelineLayout
from cocodiff.runtime.pipefusion import check_patches
from cocodiff.schedules.run_plan import load_run_plan
from cocodiff.util.errors import ScheduleError

# tiny-flux:2 has 2 double + 2 single blocks; the others 4 blocks.
MODELS = ["tiny-flux:2", "tiny-sd3:4", "tiny-pixart:4"]
# Synchronous: 4 stages, 2 stages x Ulysses 2; then both pipelined (w1: warm-up 1, N patches).
CASES = "4,2,4w1,2w1"


@pytest.mark.multiprocess
@needs_torchrun
def test_a_pipelined_stage_dispatches_the_tabled_ops(tmp_path):
    # cocodiff.kernels.PIPELINE_DISPATCHED_OPS, re-counted so the table cannot rot: every
    # rank's blocks per patch, 4 stages of one rank and 2 stages of Ulysses 2.
    from cocodiff import kernels as kn

    cmd = launcher_prefix("torchrun", 4) + [str(WORKERS / "pipefusion_ops.py"), "torch", "line",
                                            "4w1,2w1", "tiny-flux:2"]
    result = run_job(cmd, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    counted: dict[tuple[str, str], set[float]] = {}
    for line in result.stdout.splitlines():
        if line.startswith("ops "):
            _, case, _, kind, count = line.split()
            counted.setdefault((case, kind), set()).add(float(count))
    table = kn.PIPELINE_DISPATCHED_OPS["flux"]
    assert counted == {(case, kind): {table[kind][column]}
                       for case, column in (("4w1", 0), ("2w1", 1))
                       for kind in ("double", "single")}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("launcher", "transport"),
    [
        pytest.param("torchrun", "torch", marks=needs_torchrun),
        pytest.param("mpiexec", "mpi", marks=needs_mpi),
    ],
)
def test_synchronous_pipefusion_matches_single_process(launcher, transport, tmp_path):
    cmd = launcher_prefix(launcher, 4) + [
        str(WORKERS / "pipefusion_parity.py"), transport, "line", CASES, *MODELS
    ]
    result = run_job(cmd, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [line for line in result.stdout.splitlines() if line.startswith("pipefusion ")]
    assert len(reports) == len(CASES.split(",")) * len(MODELS), result.stdout[-3000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("launcher", "transport"),
    [
        pytest.param("torchrun", "torch", marks=needs_torchrun),
        pytest.param("mpiexec", "mpi", marks=needs_mpi),
    ],
)
def test_one_pipefusion_plan_file_moves_the_same_bytes_in_simulate_and_run(
        tmp_path, launcher, transport):
    """One plan, two executors: a pipefusion plan (2 stages x Ulysses 2 on 2 nodes x 2
    ranks, one synchronous step then two pipelined ones: the patches' transfers and the
    ring after both kinds of step) run by ``cocodiff run --plan`` has the simulator's
    sha256 and bytes per tier (the stage-to-stage transfers cross the nodes)."""
    plan, simulated, measured = plan_simulate_run(tmp_path, launcher, transport, [
        "--topology", "cluster", "--nodes", "2", "--model", "tiny-flux", "--resolution", "128",
        "--dtype", "float32", "--steps", "3", "--schedule", "pipefusion", "--pipefusion", "2",
        "--warmup", "1"])
    [predicted] = simulated["results"]
    assert measured["plan_sha256"] == simulated["plan_sha256"] == load_run_plan(plan).sha256
    assert measured["schedule"] == predicted["schedule"] == "pipefusion"
    assert measured["bytes_by_tier"] == pytest.approx(predicted["bytes_by_tier"])
    # The simulator reports the generation's mean (rounded), the runtime each step.
    steps = len(measured["exchanges_per_step"])
    assert round(sum(measured["exchanges_per_step"]) / steps) == predicted["exchanges_per_step"][0]
    assert predicted["bytes_by_tier"]["inter-node"] > 0


@pytest.mark.multiprocess
@needs_torchrun
def test_run_pipefusion_builds_the_plan_that_plan_writes_and_matches_one_process(tmp_path):
    """`run --schedule pipefusion --pipefusion 2` on 2 ranks hashes the plan `plan --out`
    writes for the same flags, and its final latents are one process's."""
    plan, ran = tmp_path / "p.json", tmp_path / "r.json"
    parallel, single = tmp_path / "parallel.pt", tmp_path / "single.pt"
    same = ["--model", "tiny-flux", "--resolution", "128", "--steps", "2", "--dtype", "float32",
            "--schedule", "pipefusion", "--pipefusion", "2", "--warmup", "2"]
    assert main(["plan", "--topology", "cluster", "--nodes", "1", *same, "--out", str(plan)]) == 0
    cmd = launcher_prefix("torchrun", 2) + ["-m", "cocodiff", "run", *same, "--transport",
                                            "torch", "--quiet", "--json", str(ran),
                                            "--save-latents", str(parallel)]
    result = run_job(cmd, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads(ran.read_text())["plan_sha256"] == load_run_plan(plan).sha256
    assert main(["run", "--model", "tiny-flux", "--steps", "2", "--quiet", "--save-latents",
                 str(single)]) == 0
    torch.testing.assert_close(torch.load(parallel), torch.load(single), atol=1e-5, rtol=1e-5)


@pytest.mark.multiprocess
@needs_torchrun
def test_a_pipelined_run_hashes_plans_plan_and_reports_its_quality(tmp_path):
    """`run --pipefusion 2` with the default warm-up (1) runs pipelined steps: it hashes
    the plan `plan --out` writes for the same flags, and `--reference` reports PSNR and
    SSIM against the same run with every step synchronous (lossy: not identical)."""
    plan, ran = tmp_path / "p.json", tmp_path / "r.json"
    same = ["--model", "tiny-flux", "--resolution", "128", "--steps", "3", "--dtype", "float32",
            "--schedule", "pipefusion", "--pipefusion", "2"]
    assert main(["plan", "--topology", "cluster", "--nodes", "1", *same, "--out", str(plan)]) == 0
    cmd = launcher_prefix("torchrun", 2) + ["-m", "cocodiff", "run", *same, "--transport",
                                            "torch", "--quiet", "--reference", "--json", str(ran)]
    result = run_job(cmd, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(ran.read_text())
    assert record["plan_sha256"] == load_run_plan(plan).sha256
    assert record["parallel"] == "P2xU1xM2/w1"
    quality = record["quality"]
    assert not quality["identical_image"] and quality["latent_max_abs_error"] > 0
    assert 20 < quality["psnr_db"] < float("inf") and 0.9 < quality["ssim"] <= 1
    assert "quality against the exact plan: PSNR" in result.stdout


@pytest.mark.multiprocess
@needs_torchrun
def test_more_stages_than_layers_is_one_line(tmp_path):
    cmd = launcher_prefix("torchrun", 4) + ["-m", "cocodiff", "run", "--model", "tiny-flux",
                                            "--schedule", "pipefusion", "--pipefusion", "4",
                                            "--steps", "1", "--transport", "torch", "--quiet"]
    result = run_job(cmd, tmp_path)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("cocodiff run")]
    assert lines == ["cocodiff run: error: 4 pipeline stages for 2 layers: every stage needs "
                     "at least one layer"], result.stderr[-3000:]


@pytest.mark.parametrize(("args", "message"), [
    (["--pipefusion", "2"], r"--pipefusion 2 does not divide the 1 ranks"),
    (["--pipefusion", "1", "--steps", "3", "--warmup", "4"],
     r"--warmup 4 > --steps 3: the warm-up is the first steps of the run"),
    (["--pipefusion", "1", "--steps", "3", "--warmup", "3", "--reference"],
     r"--reference: every pipefusion step is synchronous here .* which is exact"),
    (["--pipefusion", "1", "--ulysses", "2"], r"leaves Ulysses 1 inside each stage"),
    (["--pipefusion", "1", "--ring", "2"], r"--ring, --batch and --parallel-layout do not"),
    ([], r"--schedule pipefusion needs --pipefusion N"),
    (["--pipefusion", "1", "--chunks", "2"], r"--chunks pipelines the phases"),
])
def test_run_refuses_a_bad_pipefusion_in_one_line(capsys, args, message):
    assert main(["run", "--schedule", "pipefusion", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert re.search(message, err), err


def test_run_refuses_pipefusion_flags_without_the_schedule(capsys):
    assert main(["run", "--pipefusion", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("cocodiff run: error: --pipefusion, --patches and --warmup are "
                           "PipeFusion's: give --schedule pipefusion")


# Pipelined steps after one warm-up step (2 patches), or every step synchronous (1).
@pytest.mark.parametrize(("warmup", "layout"), [(1, PipelineLayout(2, 1, 2, 1)),
                                                (3, PipelineLayout(2, 1, 1, 3))])
def test_a_plan_file_gives_its_layout(tmp_path, warmup, layout):
    plan = tmp_path / "p.json"
    assert main(["plan", "--topology", "cluster", "--nodes", "1", "--model", "tiny-flux",
                 "--resolution", "128", "--dtype", "float32", "--steps", "3",
                 "--schedule", "pipefusion", "--pipefusion", "2", "--warmup", str(warmup),
                 "--out", str(plan)]) == 0
    args = argparse.Namespace(schedule="pipefusion", plan=plan)
    assert pipeline_layout(args, 2, load_run_plan(plan)) == layout


def test_patches_that_do_not_cut_the_image_evenly_are_one_line():
    check_patches(64, 2, 4)  # 8 tokens a patch on each Ulysses rank
    with pytest.raises(ScheduleError, match=r"^60 image tokens do not cut into 4 patches on "
                                            r"each of 2 Ulysses rank\(s\): .* a multiple of 8"):
        check_patches(60, 2, 4)
