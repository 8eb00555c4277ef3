"""The launch path under a faked Aurora (tests/aurora_fakes.py): rank and size under PALS
(which exports no global size), the refusals of a one-rank world and of an XPU build that
sees no XPU, devices told apart by what they are, ``auto`` preferring xccl over host-staged
MPI, the rendezvous host checked before the rendezvous, and what ``init_process_group`` is
given."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from aurora_fakes import (
    FakeXpu,
    fake_mpi_module,
    flat_tiles,
    install_fake_mpi4py,
    install_fake_torch_xpu,
    pals_env,
    parse_mask,
)

from transports.base import TransportError
from transports.launch import (
    MPIEXEC,
    SINGLE,
    LaunchError,
    LaunchInfo,
    check_rendezvous_host,
    detect_launch,
)
from transports.registry import auto_transport_name
from transports.torch_dist import (
    TorchTransport,
    default_device,
    device_backend,
    device_identity,
    ranks_per_device,
)

# Everything a launcher or the scheduler may have set in the environment running the tests.
_CLEARED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_LOCAL_RANK",
            "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD", "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PALS_RANKID",
            "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE", "PALS_NODEID", "PALS_SIZE", "PMIX_RANK",
            "PBS_JOBID", "SLURM_JOB_ID", "LSB_JOBID", "ZE_AFFINITY_MASK",
            "CUDA_VISIBLE_DEVICES")


@pytest.fixture
def clean_env(monkeypatch):
    for name in _CLEARED:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _as_rank(monkeypatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)


# ---- rank and size under PALS -------------------------------------------------------------


def test_pals_size_comes_from_mpi4py(clean_env):
    install_fake_mpi4py(clean_env, *fake_mpi_module(24, 13, 12))
    info = detect_launch(pals_env(13, 12))
    assert info == LaunchInfo(13, 24, 1, MPIEXEC, local_size=12)


def test_pals_without_mpi4py_is_refused_in_one_line(clean_env):
    clean_env.setitem(sys.modules, "mpi4py", None)  # not importable
    with pytest.raises(LaunchError) as refused:
        detect_launch(pals_env(3, 12))
    message = str(refused.value)
    assert "\n" not in message
    assert "PALS_LOCAL_SIZE=12" in message and "mpi4py is not installed" in message
    assert "each rank would run alone" in message


def test_pals_with_an_mpi4py_seeing_one_rank_is_refused_naming_its_mpi(clean_env):
    install_fake_mpi4py(clean_env, *fake_mpi_module(1, 0, 1))
    with pytest.raises(LaunchError) as refused:
        detect_launch(pals_env(5, 12))
    message = str(refused.value)
    assert "\n" not in message
    assert "links MPICH Version: 4.1.2" in message and "/site-packages/mpi4py" in message
    assert "sees a world of 1" in message


@pytest.mark.parametrize("env", [
    {"PALS_RANKID": "0", "PALS_LOCAL_RANKID": "0", "PALS_LOCAL_SIZE": "1", "PALS_NODEID": "0"},
    {},  # no launcher at all
])
def test_a_true_single_rank_still_runs(clean_env, env):
    install_fake_mpi4py(clean_env, *fake_mpi_module(1, 0, 1))
    assert detect_launch(env).launcher == SINGLE


# ---- the device: refused when an XPU build sees none, told apart by what it is -----------


def test_an_xpu_build_seeing_no_xpu_is_refused_in_a_job(clean_env):
    install_fake_torch_xpu(clean_env, FakeXpu([]))
    assert default_device(0) == torch.device("cpu")  # a login node: no job, the CPU is fine
    _as_rank(clean_env, {**pals_env(0, 12), "ZE_AFFINITY_MASK": "7.1"})
    with pytest.raises(LaunchError) as refused:
        default_device(0)
    message = str(refused.value)
    assert "\n" not in message
    assert "XPU build but this rank sees no XPU" in message and "ZE_AFFINITY_MASK=7.1" in message


@pytest.mark.parametrize("uuid", [True, False], ids=["uuid", "no-uuid"])
def test_flat_mode_devices_are_the_local_ranks_tiles(clean_env, uuid):
    install_fake_torch_xpu(clean_env, FakeXpu(flat_tiles(), uuid=uuid))
    devices = [default_device(local) for local in range(12)]
    assert [d.index for d in devices] == list(range(12))
    assert len({device_identity(d) for d in devices}) == 12


@pytest.mark.parametrize("uuid", [True, False], ids=["uuid", "no-uuid"])
def test_under_a_per_rank_mask_every_rank_takes_xpu0_of_its_own_tile(clean_env, uuid):
    identities = []
    for local in range(12):
        mask = f"{local // 2}.{local % 2}"  # what gpu_tile_compact.sh sets
        clean_env.setenv("ZE_AFFINITY_MASK", mask)
        install_fake_torch_xpu(clean_env, FakeXpu(parse_mask(mask), uuid=uuid))
        device = default_device(local)
        assert device == torch.device("xpu", 0)
        identities.append(device_identity(device))
        assert f"ZE_AFFINITY_MASK[0]={mask}" in identities[-1]
    assert len(set(identities)) == 12
    # Two ranks given the same tile hold the same device, and say so.
    clean_env.setenv("ZE_AFFINITY_MASK", "0.0")
    install_fake_torch_xpu(clean_env, FakeXpu(parse_mask("0.0"), uuid=uuid))
    assert device_identity(default_device(1)) == identities[0]


def test_flat_mode_deals_one_tile_per_rank_and_xccl_either_way(clean_env):
    install_fake_torch_xpu(clean_env, FakeXpu(flat_tiles()))
    clean_env.setattr(dist, "is_xccl_available", lambda: True, raising=False)
    twelve = LaunchInfo(3, 24, 3, MPIEXEC, local_size=12)
    assert ranks_per_device(twelve, torch.device("xpu", 3)) == 1
    crowded = LaunchInfo(3, 48, 3, MPIEXEC, local_size=24)
    assert ranks_per_device(crowded, torch.device("xpu", 3)) == 2
    assert device_backend(twelve) == "xccl"
    clean_env.setenv("ZE_AFFINITY_MASK", "1.1")  # gpu_tile_compact.sh bound this rank
    install_fake_torch_xpu(clean_env, FakeXpu(parse_mask("1.1")))
    assert device_backend(twelve) == "xccl"  # the count matters to CUDA only


# ---- auto: the device's own collective before host-staged MPI ----------------------------


def test_auto_prefers_xccl_over_mpi(clean_env):
    install_fake_mpi4py(clean_env, *fake_mpi_module(24, 13, 12))
    _as_rank(clean_env, pals_env(13, 12))
    install_fake_torch_xpu(clean_env, FakeXpu(flat_tiles()))
    clean_env.setattr(dist, "is_xccl_available", lambda: True, raising=False)
    assert auto_transport_name() == "torch"
    # The same launch without a device backend in torch: MPI, as before.
    clean_env.setattr(dist, "is_xccl_available", lambda: False, raising=False)
    assert auto_transport_name() == "mpi"


def test_auto_on_the_cpu_under_mpiexec_stays_mpi(clean_env):
    install_fake_mpi4py(clean_env, *fake_mpi_module(24, 13, 12))
    _as_rank(clean_env, pals_env(13, 12))
    assert auto_transport_name() == "mpi"


# ---- the rendezvous ---------------------------------------------------------------------


def test_loopback_master_addr_over_several_nodes_is_refused_before_the_rendezvous(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x4117c4s5b0n0\nx4117c4s6b0n0\n")
    several = LaunchInfo(1, 24, 1, MPIEXEC, local_size=12)  # node 0's rank 1 of 2 nodes
    with pytest.raises(LaunchError, match="MASTER_ADDR=127.0.0.1 in a job of 24 ranks"):
        check_rendezvous_host(several, {"MASTER_ADDR": "127.0.0.1",
                                        "PBS_NODEFILE": str(nodefile)})
    with pytest.raises(LaunchError, match="MASTER_ADDR=localhost"):
        check_rendezvous_host(LaunchInfo(13, 24, 1, MPIEXEC), {"MASTER_ADDR": "localhost",
                                                                "PALS_NODEID": "1"})
    # One host: loopback is right, even split into "nodes" by hand (torchrun --nnodes 2).
    check_rendezvous_host(LaunchInfo(3, 12, 3, MPIEXEC, local_size=12),
                          {"MASTER_ADDR": "127.0.0.1"})
    check_rendezvous_host(several, {"MASTER_ADDR": "127.0.0.1"})
    check_rendezvous_host(several, {"MASTER_ADDR": "x4117c4s5b0n0.hsn.cm.aurora.alcf.anl.gov",
                                    "PBS_NODEFILE": str(nodefile)})


def test_init_process_group_gets_the_device_and_xccls_longer_timeout(clean_env):
    """What TorchTransport hands torch on a FLAT-mode Aurora rank (no group is formed)."""
    _as_rank(clean_env, {**pals_env(15, 12), "MASTER_ADDR": "x1.hsn.cm.aurora.alcf.anl.gov",
                         "MASTER_PORT": "2345"})
    fake = FakeXpu(flat_tiles())
    install_fake_torch_xpu(clean_env, fake)
    clean_env.setattr(dist, "is_xccl_available", lambda: True, raising=False)
    clean_env.setattr(dist, "is_initialized", lambda: False)
    given = {}

    def init_process_group(backend, **kwargs):
        given.update(kwargs, backend=backend)
        raise RuntimeError("stop here: no xccl on this machine")

    clean_env.setattr(dist, "init_process_group", init_process_group)
    launch = LaunchInfo(15, 24, 3, MPIEXEC, local_size=12)
    with pytest.raises(TransportError, match=r"torch.distributed \(xccl\) init failed"):
        TorchTransport(launch=launch)
    assert given["backend"] == "xccl" and given["device_id"] == torch.device("xpu", 3)
    assert given["timeout"].total_seconds() == 600 and fake.current == 3
    assert given["rank"] == 15 and given["world_size"] == 24


def test_gloo_gets_no_device_and_the_short_timeout(clean_env):
    given = {}

    def init_process_group(backend, **kwargs):
        given.update(kwargs, backend=backend)
        raise RuntimeError("stop here")

    clean_env.setattr(dist, "is_initialized", lambda: False)
    clean_env.setattr(dist, "init_process_group", init_process_group)
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(os.getpid() % 20000 + 20000))
    with pytest.raises(TransportError):
        TorchTransport(launch=LaunchInfo(0, 2, 0, MPIEXEC, local_size=2))
    assert given["backend"] == "gloo" and given["device_id"] is None
    assert given["timeout"].total_seconds() == 60
