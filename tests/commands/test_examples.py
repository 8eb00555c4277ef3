"""examples/: the Aurora PBS job script and the CUDA torchrun script parse, carry the
launch settings their comments cite, and their dry runs print commands that cocodiff's
own argument parser accepts, with a rank grid that matches the launch."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from cocodiff.commands.cli import build_parser

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
AURORA = EXAMPLES / "aurora" / "cocodiff.pbs"
CUDA = EXAMPLES / "cuda" / "torchrun.sh"


def _dry_run(script: Path, env: dict[str, str]) -> list[list[str]]:
    """The commands the script would launch, split into words."""
    job = subprocess.run(["bash", str(script)], env={**os.environ, **env, "DRY_RUN": "1"},
                         capture_output=True, text=True, timeout=60)
    assert job.returncode == 0, job.stderr
    return [shlex.split(line) for line in job.stdout.splitlines() if line.strip()]


def _cocodiff_args(command: list[str]):
    """What cocodiff's parser makes of the words after ``-m cocodiff``."""
    start = command.index("-m")
    assert command[start + 1] == "cocodiff"
    return build_parser().parse_args(command[start + 2:])


@pytest.mark.parametrize("script", [AURORA, CUDA])
def test_scripts_are_valid_bash(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_aurora_job_script_settings():
    text = AURORA.read_text()
    directives = dict(re.findall(r"^#PBS -l (\w+)=(\S+)$", text, re.MULTILINE))
    assert {"select", "walltime", "filesystems", "place"} <= directives.keys()
    assert "RANKS_PER_NODE=12" in text  # one rank per tile
    assert "export CCL_ATL_TRANSPORT=mpi" in text
    assert "export ONEAPI_DEVICE_SELECTOR=level_zero:gpu" in text
    assert 'MASTER_ADDR=$(head -n 1 "${PBS_NODEFILE}")' in text
    assert not re.search(r"^\s*export PMI_", text, re.MULTILINE)  # never export PMI_*
    assert "/opt/cray/pals/" in text and "DLcomm" in text and "ALCF user guide" in text


def test_aurora_dry_run_launches_12_ranks_per_node_bound_to_tiles(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x1000c0s0b0n0\nx1000c0s0b0n1\nx1000c0s1b0n0\n")
    doctor, run = _dry_run(AURORA, {"PBS_NODEFILE": str(nodefile), "PATH": os.environ["PATH"]})
    for command in (doctor, run):
        assert command[command.index("-n") + 1] == "36"
        assert command[command.index("--ppn") + 1] == "12"
        assert any(word.endswith("gpu_tile_compact.sh") for word in command)
    assert _cocodiff_args(doctor).command == "doctor"
    args = _cocodiff_args(run)
    assert args.command == "run" and args.grid == "3x6x2" and args.transport == "torch"


def test_cuda_dry_run_matches_its_rank_grid():
    doctor, run = _dry_run(CUDA, {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0",
                                  "GPUS_PER_NODE": "8"})
    for command in (doctor, run):
        assert command[0] == "torchrun"
        assert command[command.index("--nproc-per-node") + 1] == "8"
        assert command[command.index("--master-addr") + 1] == "node0"
    assert _cocodiff_args(doctor).command == "doctor"
    args = _cocodiff_args(run)
    assert args.grid == "2x8x1" and args.dtype == "bfloat16"


def test_cuda_script_refuses_a_missing_setting():
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK")}
    job = subprocess.run(["bash", str(CUDA)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert job.returncode != 0 and "set NNODES" in job.stderr
