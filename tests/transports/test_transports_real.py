"""The real transports (torch.distributed, mpi4py) against one conformance suite.

The multi-process tests start real jobs (``torchrun``, ``mpiexec``) of
``tests/transports/transport_worker.py`` and pass when every rank passes its checks. They are marked
``multiprocess`` (deselect with ``-m "not multiprocess"``) but run by default.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
from launching import (
    LAUNCH_VARS,
    MPIEXEC,
    REPO,
    TORCHRUN,
    job_env,
    needs_mpi,
    needs_torchrun,
)

from transports import (
    TRANSPORTS,
    LaunchInfo,
    Transport,
    TransportError,
    create_transport,
    detect_launch,
)
from transports.launch import job_id
from transports.registry import auto_transport_name

WORKER = REPO / "tests" / "transports" / "transport_worker.py"
JOB_TIMEOUT_S = 60


def _run_job(cmd: list[str], tmp_path: Path) -> str:
    began = time.monotonic()
    result = subprocess.run(
        cmd,
        cwd=REPO,
        env=job_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, (
        f"{' '.join(cmd)} exited {result.returncode} after {time.monotonic() - began:.1f} s:\n"
        f"{output[-6000:]}"
    )
    return output


def _torchrun(num_ranks: int, *worker_args: str) -> list[str]:
    return [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node",
        str(num_ranks),
        str(WORKER),
        *worker_args,
    ]


def _mpiexec(num_ranks: int, *worker_args: str) -> list[str]:
    return [str(MPIEXEC), "-n", str(num_ranks), sys.executable, str(WORKER), *worker_args]


JOBS = [
    pytest.param(launcher, backend, extra, num_ranks, id=f"{name}-{num_ranks}", marks=marks)
    for name, launcher, backend, extra, marks, rank_counts in [
        ("torchrun-torch", "torchrun", "torch", (), needs_torchrun, (2, 4)),
        ("mpiexec-torch-tcpstore", "mpiexec", "torch", (), needs_mpi, (2, 4)),
        ("mpiexec-mpi", "mpiexec", "mpi", (), needs_mpi, (2, 4)),
        # the FileStore rendezvous (no mpi4py) differs from the above only at start-up
        ("mpiexec-torch-filestore", "mpiexec", "torch", ("--no-mpi4py",), needs_mpi, (2,)),
    ]
    for num_ranks in rank_counts
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("launcher", "backend", "extra", "num_ranks"), JOBS)
def test_conformance(
    launcher: str, backend: str, extra: tuple[str, ...], num_ranks: int, tmp_path: Path
) -> None:
    worker_args = ("--backend", backend, "--world", str(num_ranks), "--launcher", launcher)
    build = _torchrun if launcher == "torchrun" else _mpiexec
    output = _run_job(build(num_ranks, *worker_args, *extra), tmp_path)
    # ranks' lines may interleave: find each rank's report anywhere in the output
    passed = {int(rank) for rank in re.findall(r"conformance passed on rank (\d+)", output)}
    assert passed == set(range(num_ranks)), output[-3000:]
    assert not list(tmp_path.iterdir()), "FileStore rendezvous file left behind"


@pytest.mark.multiprocess
@needs_torchrun
def test_torch_hung_peer_times_out(tmp_path: Path) -> None:
    """A rank that never joins makes the collective fail after timeout_s, not hang."""
    args = ("--backend", "torch", "--world", "2", "--launcher", "torchrun", "--hung-peer", "2")
    output = _run_job(_torchrun(2, *args), tmp_path)
    assert "hung peer: TransportError after" in output


# ---- in-process: launcher detection, registry, single-process torch ----


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, LaunchInfo(0, 1, 0, "single", local_size=1)),
        (
            {
                "RANK": "3",
                "WORLD_SIZE": "4",
                "LOCAL_RANK": "1",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "1",
            },
            LaunchInfo(3, 4, 1, "torchrun", local_size=2),
        ),
        ({"RANK": "2", "WORLD_SIZE": "4"}, LaunchInfo(2, 4, 2, "torchrun")),
        (
            {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
             "PMI_FD": "9"},
            LaunchInfo(1, 2, 1, "mpiexec", local_size=2),
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "5",
                "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            },
            LaunchInfo(5, 8, 1, "mpiexec", local_size=4),
        ),
        (
            {"PALS_RANKID": "13", "PALS_LOCAL_RANKID": "1", "PALS_LOCAL_SIZE": "12",
             "PMI_SIZE": "24", "PMI_RANK": "13"},
            LaunchInfo(13, 24, 1, "mpiexec", local_size=12),
        ),
        (  # torchrun's variables win over an MPI launcher's
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "PMI_RANK": "1", "PMI_SIZE": "2"},
            LaunchInfo(0, 2, 0, "torchrun"),
        ),
    ],
    ids=["none", "torchrun", "torchrun-no-local", "hydra", "openmpi", "pals", "torchrun-first"],
)
def test_detect_launch(env: dict[str, str], expected: LaunchInfo) -> None:
    assert detect_launch(env) == expected


def test_detect_launch_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "4")
    info = detect_launch()
    assert (info.rank, info.world_size, info.launcher, info.is_distributed) == (
        1,
        4,
        "mpiexec",
        True,
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, r"RANK='x' is not an integer"),
        ({"PMI_RANK": "4", "PMI_SIZE": "4"}, r"rank 4 outside world of 4 \(mpiexec\)"),
    ],
)
def test_detect_launch_rejects_bad_values(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        detect_launch(env)


def test_job_id_is_a_file_name() -> None:
    assert job_id({"SLURM_JOB_ID": "123.pbs/x@y"}) == "123.pbs_x_y"
    assert job_id({"COCODIFF_JOB_ID": "mine", "SLURM_JOB_ID": "1"}) == "mine"
    assert f"-ppid{os.getppid()}" in job_id({})


def test_unknown_transport_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"^unknown transport 'nope'; valid: .*") as info:
        create_transport("nope")
    message = str(info.value)
    assert "\n" not in message
    for name in (*TRANSPORTS, "auto"):
        assert name in message


def test_registry_has_real_backends() -> None:
    assert {"torch", "mpi"} <= set(TRANSPORTS)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "torch"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "torch"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "mpi" if find_spec("mpi4py") else "torch"),
    ],
)
def test_auto_transport_name(
    env: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert auto_transport_name() == expected


def test_import_transports_does_not_import_torch_or_mpi4py() -> None:
    code = (
        "import sys, transports\n"
        "heavy = [m for m in ('torch', 'mpi4py') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=JOB_TIMEOUT_S)


def test_single_process_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a launcher, "auto" is torch over gloo in a world of one."""
    torch = pytest.importorskip("torch")
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    t = create_transport("auto", timeout_s=10)
    try:
        assert isinstance(t, Transport)
        assert (t.name, t.rank, t.world_size, t.world.ranks) == ("torch", 0, 1, (0,))
        send = torch.arange(12, dtype=torch.bfloat16).reshape(3, 2, 2)  # (rows, 2, 2)
        handle = t.all_to_all(send, [3], [3])
        torch.testing.assert_close(handle.wait(), send, rtol=0, atol=0)
        assert handle.is_completed()
        with pytest.raises(TransportError, match="twice"):
            handle.wait()
        with pytest.raises(ValueError, match=r"send_splits \[2\] sum to 2, not 3"):
            t.all_to_all(send, [2], [2])
        with pytest.raises(ValueError, match="outside world of 1"):
            t.new_group([0, 1])
    finally:
        t.close()
    t.close()
    with pytest.raises(TransportError, match="closed"):
        t.barrier()


@pytest.mark.parametrize(
    ("local_size", "gpus", "device", "sharing", "backend"),
    [
        (None, 1, "cuda:0", 1, "nccl"),  # the launcher does not say: as before
        (1, 1, "cuda:0", 1, "nccl"),
        (4, 4, "cuda:3", 1, "nccl"),  # one rank per GPU
        (2, 1, "cuda:0", 2, "gloo"),  # two ranks on one GPU: nccl refuses them
        (6, 4, "cuda:1", 2, "gloo"),  # local ranks 1 and 5
        (6, 4, "cuda:2", 1, "nccl"),  # local rank 2 alone
        (8, 1, "cpu", 1, "gloo"),
    ],
)
def test_ranks_sharing_a_gpu_get_gloo(monkeypatch, local_size, gpus, device, sharing, backend):
    import torch

    from transports.torch_dist import backend_for_device, ranks_per_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    launch = LaunchInfo(0, 8, 0, "torchrun", local_size=local_size)
    assert ranks_per_device(launch, torch.device(device)) == sharing
    assert backend_for_device(torch.device(device), sharing) == backend


def test_a_rank_computes_on_its_transports_device_else_its_local_accelerator(monkeypatch):
    import torch

    from transports.torch_dist import rank_device

    class OnDevice:
        device = torch.device("cuda", 1)

    assert rank_device(OnDevice(), 0) == torch.device("cuda", 1)
    # MPI (no device of its own) and a single process: the accelerator of the local rank
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rank_device(object(), 3) == torch.device("cuda", 1)
    assert rank_device(None, 2) == torch.device("cuda", 0)
