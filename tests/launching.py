"""Starting real multi-rank jobs from tests: torchrun or mpiexec over a script, with a
clean environment and a bounded time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"
BIN = Path(sys.executable).parent
TORCHRUN = BIN / "torchrun"
MPIEXEC = BIN / "mpiexec"

# Variables a surrounding launcher may have set; the jobs started here must not inherit them.
LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_LOCAL_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    "HYDRA_CONTROL_FD", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "PALS_RANKID", "PALS_LOCAL_RANKID", "PALS_SIZE", "PMIX_RANK",
)

needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no {TORCHRUN}")
needs_mpi = pytest.mark.skipif(
    not MPIEXEC.exists() or find_spec("mpi4py") is None, reason="no mpiexec or mpi4py"
)


def job_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env["COCODIFF_RENDEZVOUS_DIR"] = str(tmp_path)
    env["HF_HUB_OFFLINE"] = "1"
    # A rank that aborts in C++ ("terminate called without an active exception", a rare
    # CI failure of calibrate's ranks) then prints every thread's Python stack: where it was.
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def launcher_prefix(launcher: str, num_ranks: int) -> list[str]:
    """The command that starts ``num_ranks`` copies of a Python program."""
    if launcher == "torchrun":
        return [str(TORCHRUN), "--nproc-per-node", str(num_ranks), "--no-python",
                sys.executable]
    if launcher == "mpiexec":
        return [str(MPIEXEC), "-n", str(num_ranks), sys.executable]
    raise ValueError(f"unknown launcher {launcher}")


def run_job(cmd: list[str], tmp_path: Path, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """Run a job to the end (or kill it at ``timeout_s``) and return what it printed."""
    return subprocess.run(
        cmd, cwd=REPO, env=job_env(tmp_path), capture_output=True, text=True,
        timeout=timeout_s, stdin=subprocess.DEVNULL,
    )


def plan_simulate_run(tmp_path: Path, launcher: str, transport: str, plan_args: list[str],
                      num_ranks: int = 4) -> tuple[Path, dict, dict]:
    """One plan, two executors: ``cocodiff plan PLAN_ARGS --out`` a file, ``simulate
    --plan`` it here and ``run --plan`` it on ``num_ranks`` ranks. Returns the file, the
    simulator's JSON and the run's JSON (the job must succeed)."""
    from cocodiff.commands.cli import main

    plan, sim, ran = tmp_path / "p.json", tmp_path / "s.json", tmp_path / "r.json"
    assert main(["plan", *plan_args, "--out", str(plan)]) == 0
    assert main(["simulate", "--plan", str(plan), "--json", str(sim)]) == 0
    cmd = launcher_prefix(launcher, num_ranks) + [
        "-m", "cocodiff", "run", "--plan", str(plan), "--transport", transport, "--quiet",
        "--json", str(ran)]
    result = run_job(cmd, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return plan, json.loads(sim.read_text()), json.loads(ran.read_text())
