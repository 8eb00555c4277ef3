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
    """The commands the script would launch, split into words (the Aurora script also
    prints its module load, exports, venv and XPU check first: the last two lines are the
    launches)."""
    job = subprocess.run(["bash", str(script)], env={**os.environ, **env, "DRY_RUN": "1"},
                         capture_output=True, text=True, timeout=60)
    assert job.returncode == 0, job.stderr
    return [shlex.split(line) for line in job.stdout.splitlines() if line.strip()]


# ALCF's launch line for 12 ranks per node, one per tile, with the frameworks module:
# `mpiexec --pmi=pmix --envall -n N --ppn 12 --cpu-bind=...` (Running Jobs on Aurora,
# https://docs.alcf.anl.gov/aurora/running-jobs-aurora/) with the 12-tile binding of "PyTorch
# on Aurora" (https://docs.alcf.anl.gov/aurora/data-science/frameworks/pytorch/, "CPU
# bindings for best performance on Aurora": 6 ranks per socket, 4 cores each).
ALCF_CPU_BIND = "list:4-7:8-11:12-15:16-19:20-23:24-27:56-59:60-63:64-67:68-71:72-75:76-79"
# oneCCL's minimal set (https://docs.alcf.anl.gov/aurora/data-science/frameworks/oneCCL/).
ALCF_ONECCL = {"CCL_PROCESS_LAUNCHER": "pmix", "CCL_ATL_TRANSPORT": "mpi",
               "FI_MR_CACHE_MONITOR": "userfaultfd", "CCL_KVS_MODE": "mpi"}


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
    for name, value in ALCF_ONECCL.items():
        assert f"export {name}={value}" in text
    assert "export ONEAPI_DEVICE_SELECTOR=level_zero:gpu" in text
    assert 'MASTER_ADDR="$(head -n 1 "${PBS_NODEFILE}" | cut -d. -f1).hsn.' in text
    assert not re.search(r"^\s*export PMI_", text, re.MULTILINE)  # never export PMI_*
    assert "/opt/cray/pals/" in text and "DLcomm" in text
    # No tile-binding helper: ALCF advises against gpu_tile_compact.sh with the frameworks
    # module (FLAT mode); no --depth/--cpu-bind depth, which splits a rank over two sockets.
    assert not re.search(r"^[^#]*gpu_tile_compact", text, re.MULTILINE)
    assert not re.search(r"^[^#]*--cpu-bind depth", text, re.MULTILINE)
    # -u only after `module load` (module scripts read unset variables).
    assert text.index("set -eo pipefail") < text.index("module load frameworks") \
        < text.index("\nset -u\n")


def test_aurora_script_cites_a_public_source_for_every_setting():
    text = AURORA.read_text()
    sources = dict(re.findall(r"^#\s+\[(\w+)\]\s+.*?(https://\S+)", text, re.MULTILINE))
    for url in sources.values():
        assert url.startswith(("https://docs.alcf.anl.gov/", "https://github.com/argonne-lcf/"))
    assert {"jobs", "pytorch", "oneccl", "python", "dlcomm"} <= sources.keys()
    lines = text.splitlines()
    settings = [i for i, line in enumerate(lines)
                if re.match(r"^(export \w+=|CPU_BIND=|RANKS_PER_NODE=|TIMEOUT_S=|MASTER_ADDR=)",
                            line)]
    assert len(settings) >= 10
    for i in settings:
        # the setting's own line, or the comment block right above it, names a source
        block = [lines[i]]
        j = i - 1
        while j >= 0 and (lines[j].startswith("#") or lines[j].startswith("export ")):
            block.append(lines[j])
            j -= 1
        cited = set(re.findall(r"\[(\w+)\]", " ".join(block)))
        assert cited & sources.keys(), f"no source for: {lines[i]}"


def test_aurora_dry_run_prints_alcfs_launch_line_for_12_ranks_per_node(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x1000c0s0b0n0.hostmgmt\nx1000c0s0b0n1.hostmgmt\nx1000c0s1b0n0.hostmgmt\n")
    lines = _dry_run(AURORA, {"PBS_NODEFILE": str(nodefile), "PATH": os.environ["PATH"],
                              "VENV": str(tmp_path / "venv")})
    assert lines[0] == ["module", "load", "frameworks"]
    exports = dict(line[1].split("=", 1) for line in lines if line[0] == "export")
    assert ALCF_ONECCL.items() <= exports.items()
    assert exports["ZE_FLAT_DEVICE_HIERARCHY"] == "FLAT"
    assert exports["MASTER_ADDR"] == "x1000c0s0b0n0.hsn.cm.aurora.alcf.anl.gov"
    python = str(tmp_path / "venv" / "bin" / "python")
    # the venv sees the module's packages, so `pip install -e .` keeps its torch
    assert ["python3", "-m", "venv", "--system-site-packages", str(tmp_path / "venv")] in lines
    assert [python, "-m", "pip", "install", "-e", "."] in lines
    check = next(line for line in lines if line[:2] == [python, "-c"])
    assert "torch.xpu.is_available()" in check[2]
    doctor, run = lines[-2:]
    assert lines.index(check) < lines.index(doctor)  # checked before any rank starts
    for command in (doctor, run):
        start = command.index(python)
        assert command[1:start] == ["--pmi=pmix", "--envall", "-n", "36", "--ppn", "12",
                                    f"--cpu-bind={ALCF_CPU_BIND}"]
        assert command[start + 1:start + 3] == ["-m", "cocodiff"]
    assert _cocodiff_args(doctor).command == "doctor"
    args = _cocodiff_args(run)
    assert args.command == "run" and args.grid == "3x6x2" and args.transport == "torch"
    assert args.timeout == 600 == int(exports["CCL_KVS_CONNECTION_TIMEOUT"])


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
