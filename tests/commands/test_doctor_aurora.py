"""``cocodiff doctor`` (and ``run``, ``calibrate``) under a faked Aurora
(tests/aurora_fakes.py).

* Every rank of a 2-node job, as the shipped job script binds it (FLAT mode, its exported
  variables, its rendezvous host), passes doctor's checks; so does ALCF's
  ``gpu_tile_compact.sh`` binding (each rank sees its tile as ``xpu:0``). Two ranks truly on
  one tile fail in one line.
* A world of one under PALS (mpi4py missing, or seeing one rank) and an XPU build of torch
  that sees no XPU are refused in one line by ``run``, ``doctor`` and ``calibrate``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from aurora_fakes import (
    FakeXpu,
    fake_mpi_module,
    flat_tiles,
    install_fake_mpi4py,
    install_fake_torch_xpu,
    pals_env,
    parse_mask,
    tile_uuid,
    write_site,
)
from launching import REPO, job_env, launcher_prefix, needs_mpi

from cocodiff.runtime.doctor import DoctorProblem, check_environment, check_job, rank_facts
from transports.launch import detect_launch

SCRIPT = REPO / "examples" / "aurora" / "cocodiff.pbs"
NODES = ("x4117c4s5b0n0.hostmgmt2000.cm.aurora.alcf.anl.gov",
         "x4117c4s6b0n0.hostmgmt2000.cm.aurora.alcf.anl.gov")
RANKS_PER_NODE = 12
_CLEARED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_LOCAL_RANK",
            "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD", "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PALS_RANKID",
            "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE", "PALS_NODEID", "PALS_SIZE", "PMIX_RANK",
            "PBS_JOBID", "SLURM_JOB_ID", "ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY",
            "CUDA_VISIBLE_DEVICES")


def _script_exports(tmp_path: Path) -> dict[str, str]:
    """The variables the job script exports to every rank (its dry run prints them)."""
    nodefile = tmp_path / "nodes"
    nodefile.write_text("\n".join(NODES) + "\n")
    job = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env={**os.environ, "DRY_RUN": "1",
                                            "PBS_NODEFILE": str(nodefile)})
    assert job.returncode == 0, job.stderr
    return dict(re.findall(r"^export (\w+)=(\S+)$", job.stdout, re.MULTILINE))


def _doctor_every_rank(monkeypatch, exports, ranks_per_node, binding, uuid=True):
    """What doctor finds on each rank of a 2-node job, before and after gathering: every
    rank's own checks, then the job's checks over all of them."""
    world = len(NODES) * ranks_per_node
    every = []
    for rank in range(world):
        node, local = divmod(rank, ranks_per_node)
        for name in _CLEARED:
            monkeypatch.delenv(name, raising=False)
        env = {**exports, **pals_env(rank, ranks_per_node)}
        if binding == "flat":
            tiles = flat_tiles()
        else:  # gpu_tile_compact.sh: ZE_AFFINITY_MASK=gpu.tile from the local rank
            env["ZE_AFFINITY_MASK"] = binding(local)
            env["ZE_FLAT_DEVICE_HIERARCHY"] = "COMPOSITE"
            tiles = parse_mask(env["ZE_AFFINITY_MASK"])
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        install_fake_torch_xpu(monkeypatch, FakeXpu(tiles, node=node, uuid=uuid))
        install_fake_mpi4py(monkeypatch, *fake_mpi_module(world, rank, ranks_per_node))
        launch = detect_launch()
        assert (launch.rank, launch.world_size, launch.local_rank) == (rank, world, local)
        check_environment(os.environ, launch)
        # One process plays every rank: give each the node its PALS_NODEID says.
        every.append(dataclasses.replace(rank_facts(launch), node_key=node))
    check_job(every)
    return every


def _compact(local: int) -> str:
    return f"{local // 2}.{local % 2}"


@pytest.mark.parametrize("uuid", [True, False], ids=["uuid", "no-uuid"])
@pytest.mark.parametrize("binding", ["flat", _compact], ids=["script-flat", "gpu-tile-compact"])
def test_doctor_passes_under_the_scripts_binding(tmp_path, monkeypatch, binding, uuid):
    exports = _script_exports(tmp_path)
    assert exports["ZE_FLAT_DEVICE_HIERARCHY"] == "FLAT"
    every = _doctor_every_rank(monkeypatch, exports, RANKS_PER_NODE, binding, uuid)
    on_node0 = [f for f in every if f.node_key == 0]
    assert len({f.device_identity for f in on_node0}) == RANKS_PER_NODE
    if binding == "flat":
        assert [f.device for f in on_node0] == [f"xpu:{i}" for i in range(RANKS_PER_NODE)]
    else:
        assert {f.device for f in on_node0} == {"xpu:0"}  # what the old check refused
    assert all(f.torch_build.startswith("XPU") for f in every)
    assert all("MPI (MPICH Version: 4.1.2)" in f.backends for f in every)


@pytest.mark.parametrize("uuid", [True, False], ids=["uuid", "no-uuid"])
def test_two_ranks_on_one_tile_fail_in_one_line(tmp_path, monkeypatch, uuid):
    exports = _script_exports(tmp_path)

    def one_tile_twice(local: int) -> str:
        return "0.0" if local == 1 else _compact(local)  # local ranks 0 and 1: GPU 0 tile 0

    with pytest.raises(DoctorProblem) as refused:
        _doctor_every_rank(monkeypatch, exports, RANKS_PER_NODE, one_tile_twice, uuid)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("ranks 0, 1 of one node all take xpu:0 (xpu ZE_AFFINITY_MASK[0]=0.0")


def test_flat_mode_with_more_ranks_than_tiles_fails_in_one_line(tmp_path, monkeypatch):
    exports = _script_exports(tmp_path)
    with pytest.raises(DoctorProblem, match=r"^ranks 0, 12 of one node all take xpu:0"):
        _doctor_every_rank(monkeypatch, exports, 2 * RANKS_PER_NODE, "flat")


@needs_mpi
@pytest.mark.multiprocess
def test_the_doctor_command_passes_on_flat_tiles_with_the_scripts_environment(tmp_path):
    """The whole command, 4 ranks under this machine's mpiexec, each seeing a node's 12
    (fake) tiles in FLAT mode with the script's exports: it takes its local rank's tile,
    and the table says which. (No xccl here: auto falls back to MPI for the all-to-all.)"""
    site = write_site(tmp_path / "site", xpu="flat")
    env = job_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    env.update(_script_exports(tmp_path))
    env["MASTER_ADDR"] = "127.0.0.1"  # this machine is the one node
    env["PBS_JOBID"] = "1234.aurora"
    record = tmp_path / "doctor.json"
    job = subprocess.run([*launcher_prefix("mpiexec", 4), "-m", "cocodiff", "doctor",
                          "--timeout", "60", "--json", str(record)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert job.returncode == 0, job.stderr
    assert "doctor: all checks passed" in job.stdout
    assert "devices seen: xpu x12" in job.stdout and "(XPU 20250101)" in job.stdout
    assert "CCL_KVS_MODE=mpi" in job.stdout and "ZE_FLAT_DEVICE_HIERARCHY=FLAT" in job.stdout
    ranks = json.loads(record.read_text())["ranks"]
    assert [r["device"] for r in ranks] == ["xpu:0", "xpu:1", "xpu:2", "xpu:3"]
    assert [r["device_identity"] for r in ranks] == [
        f"xpu:{local} uuid {tile_uuid(0, local // 2, local % 2)}" for local in range(4)]


@needs_mpi
@pytest.mark.multiprocess
@pytest.mark.parametrize("shared", [False, True], ids=["tile-per-rank", "one-tile-shared"])
def test_the_doctor_command_under_a_per_rank_mask(tmp_path, shared):
    """gpu_tile_compact.sh's binding: every rank sees one tile as xpu:0 and passes; the
    same mask on every rank (two ranks truly on one tile) fails in one line."""
    site = write_site(tmp_path / "site", xpu="mask")
    env = job_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    env["PBS_JOBID"] = "1234.aurora"
    env.pop("ZE_AFFINITY_MASK", None)
    if shared:
        env["ZE_AFFINITY_MASK"] = "0.0"
    job = subprocess.run([*launcher_prefix("mpiexec", 2), "-m", "cocodiff", "doctor",
                          "--timeout", "60"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=240, stdin=subprocess.DEVNULL)
    if not shared:
        assert job.returncode == 0, job.stderr
        assert "doctor: all checks passed" in job.stdout
        return
    assert job.returncode == 1 and job.stdout == ""
    err = job.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("cocodiff doctor: error: ranks 0, 1 of one node all take xpu:0 "
                          f"(xpu ZE_AFFINITY_MASK[0]=0.0 uuid {tile_uuid(0, 0, 0)})"), err


# ---- refused in one line by run, doctor and calibrate ------------------------------------

COMMANDS = {
    "run": ["run", "--quiet"],
    "doctor": ["doctor", "--timeout", "5"],
    "calibrate": ["calibrate", "--quick"],
}
CASES = {
    # PALS started 12 ranks on this node; mpi4py is missing.
    "pals-no-mpi4py": ({"mpi4py": "absent"}, pals_env(3, 12),
                       ("PALS_LOCAL_SIZE=12", "mpi4py is not installed",
                        "each rank would run alone")),
    # mpi4py links the pip mpich wheel's MPICH, which PALS did not start: a world of one.
    "pals-one-rank-mpi4py": ({"mpi4py": "one-rank"}, pals_env(3, 12),
                             ("links MPICH Version: 4.3.1", "sees a world of 1",
                              "each rank would run alone")),
    # An XPU build of torch, in a batch job, that sees no XPU.
    "no-xpu": ({"xpu": "none"}, {"PBS_JOBID": "1234.aurora", "ZE_AFFINITY_MASK": "9.9"},
               ("XPU build but this rank sees no XPU", "ZE_AFFINITY_MASK=9.9",
                "refusing to fall back to the CPU")),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_refused_in_one_line(tmp_path, command, case):
    fakes, launcher_env, phrases = CASES[case]
    site = write_site(tmp_path / "site", **fakes)
    env = job_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    env.update(launcher_env)
    job = subprocess.run([sys.executable, "-m", "cocodiff", *COMMANDS[command]], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=240,
                         stdin=subprocess.DEVNULL)
    err = job.stderr.strip()
    assert job.returncode in (1, 2), (job.returncode, job.stdout, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"cocodiff {command}: "), err
    for phrase in phrases:
        assert phrase in err, err
    assert not (tmp_path / "cluster.toml").exists()  # nothing half-written
