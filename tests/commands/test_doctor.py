"""`cocodiff doctor`: one table per node and a checked all-to-all under every launcher;
one line and a non-zero exit on a launch environment broken on purpose."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from launching import REPO, job_env, launcher_prefix, needs_mpi, needs_torchrun, run_job

from cocodiff.runtime.doctor import DoctorProblem, RankFacts, check_environment, check_job
from transports.launch import LaunchInfo

SINGLE = LaunchInfo(0, 1, 0, "single")


def _doctor(prefix, tmp_path, *args, env=None):
    job_environment = {**job_env(tmp_path), **(env or {})}
    return subprocess.run([*prefix, "-m", "cocodiff", "doctor", "--timeout", "30", *args],
                          cwd=REPO, env=job_environment, capture_output=True, text=True,
                          timeout=240, stdin=subprocess.DEVNULL)


def test_plain_prints_one_table_and_writes_json(tmp_path):
    out = tmp_path / "doctor.json"
    job = _doctor([sys.executable], tmp_path, "--json", str(out))
    assert job.returncode == 0, job.stderr
    assert job.stdout.count("node 0 (") == 1 and "doctor: all checks passed" in job.stdout
    record = json.loads(out.read_text())
    assert [r["rank"] for r in record["ranks"]] == [0]
    assert record["all_to_all"]["correct"] and record["all_to_all"]["ranks"] == 1


@needs_mpi
@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["auto", "torch"])
def test_mpiexec_4_ranks_one_table_exit_0(tmp_path, transport):
    job = run_job(launcher_prefix("mpiexec", 4) + ["-m", "cocodiff", "doctor", "--transport",
                                                    transport, "--timeout", "60"], tmp_path)
    assert job.returncode == 0, job.stderr
    assert job.stdout.count("node 0 (") == 1  # one node, one table, printed by rank 0 alone
    assert "rank grid: 1 node(s) x 4 rank(s) per node = 4 ranks" in job.stdout
    assert "all-to-all over 4 rank(s) through " + ("mpi" if transport == "auto" else "torch") \
        in job.stdout
    assert "MPI (MPICH" in job.stdout


@needs_torchrun
@pytest.mark.multiprocess
def test_torchrun_2_ranks(tmp_path):
    job = run_job(launcher_prefix("torchrun", 2) + ["-m", "cocodiff", "doctor"], tmp_path)
    assert job.returncode == 0, job.stderr
    assert "launcher: torchrun; rank grid: 1 node(s) x 2 rank(s) per node" in job.stdout


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "4", "RANK": "7"}, "rank 7 outside world of 4"),
    ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two' is not an integer"),
])
def test_a_broken_launcher_environment_is_one_line_exit_1(tmp_path, env, message):
    job = _doctor([sys.executable], tmp_path, env=env)
    assert job.returncode == 1
    err = job.stderr.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err
    assert job.stdout == ""


def test_pals_without_a_size_is_refused():
    # DLcomm fix 23: PALS exports no global size; a size of 1 makes one-rank jobs.
    env = {"PALS_RANKID": "3", "PALS_LOCAL_RANKID": "3", "PALS_LOCAL_SIZE": "12"}
    with pytest.raises(DoctorProblem, match="12 ranks on this node"):
        check_environment(env, SINGLE)


def test_hand_exported_pmi_rank_is_refused():
    # DLcomm fix 24: PMI_* is MPICH's own bootstrap namespace.
    env = {"PALS_RANKID": "3", "PMI_RANK": "0"}
    with pytest.raises(DoctorProblem, match="never export PMI_RANK"):
        check_environment(env, LaunchInfo(3, 24, 3, "mpiexec"))


def _facts(rank, node, device="cpu", master="10.0.0.1"):
    return RankFacts(rank, 4, rank % 2, "mpiexec", f"h{node}", node, "2.13", "CPU only",
                     "none", device, ("gloo",), (("MASTER_ADDR", master),))


def test_job_checks_loopback_master_and_shared_devices():
    check_job([_facts(r, r // 2) for r in range(4)])
    with pytest.raises(DoctorProblem, match="MASTER_ADDR=127.0.0.1 on a job of 2 nodes"):
        check_job([_facts(r, r // 2, master="127.0.0.1") for r in range(4)])
    with pytest.raises(DoctorProblem, match="ranks 0, 1 of one node all take xpu:0"):
        check_job([_facts(r, r // 2, device="xpu:0") for r in range(4)])
    # ranks sharing a GPU run through gloo (nccl refuses them): not a problem
    check_job([_facts(r, r // 2, device="cuda:0") for r in range(4)])


def test_bad_flags_exit_2(tmp_path):
    job = _doctor([sys.executable], tmp_path, "--transport", "nope")
    assert job.returncode == 2 and "unknown transport 'nope'" in job.stderr
