"""Who am I in this job? Launcher detection and torch.distributed rendezvous.

A CoCoDiff job is one OS process per rank, started by ``torchrun`` or by an MPI
``mpiexec`` (MPICH/hydra, Intel MPI, Open MPI, Cray PALS on Aurora). :func:`detect_launch`
reads the launcher's environment variables; nothing here imports torch or mpi4py at import
time.

torch.distributed under mpiexec has no ``MASTER_ADDR``/``MASTER_PORT``, so
:func:`torch_store` builds the rendezvous store itself:

1. ``MASTER_ADDR`` and ``MASTER_PORT`` both set: torch's ``env://`` rendezvous (torchrun's
   way), nothing to build.
2. mpi4py importable: rank 0 opens a ``TCPStore`` on a port the OS picks (port 0, so no race
   for a "free" port), and broadcasts ``(host, port)`` over ``MPI.COMM_WORLD``; the other
   ranks connect to it. The host is ``MASTER_ADDR`` when set, else rank 0's hostname.
3. Otherwise: a ``FileStore`` on ``<dir>/cocodiff-rdzv-<job id>``, where ``<dir>`` is
   ``$COCODIFF_RENDEZVOUS_DIR`` (must be shared by all nodes for a multi-node job) or the
   system temp dir, and the job id is ``$COCODIFF_JOB_ID``, else the scheduler's or
   launcher's id (Slurm, PBS, PALS, PMIx), else the parent process id, which is correct for
   a single-node hydra job (all ranks are children of one ``hydra_pmi_proxy``). Set
   ``COCODIFF_JOB_ID`` when two jobs could share the parent and the directory. torch removes
   the file when the last rank closes it.

Under Aurora's PALS ``mpiexec`` a rank sees ``PALS_RANKID``, ``PALS_LOCAL_RANKID`` and
``PALS_LOCAL_SIZE`` but no global size (argonne-lcf/DLcomm_benchmark, docs/fixes/23): the size
must come from MPI itself, through mpi4py. When mpi4py is missing, or links an MPI that PALS
did not start (it then sees a world of one), every rank would run alone; :func:`detect_launch`
refuses that with :class:`LaunchError` instead.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from importlib.util import find_spec
from pathlib import Path
from typing import Any

TORCHRUN = "torchrun"
MPIEXEC = "mpiexec"
SINGLE = "single"

# (rank variable, size variables, local-rank variables, local-size variables), most specific
# launcher first.
_MPI_ENV_VARS: tuple[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...] = (
    ("OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",),
     ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    # Cray PALS (Aurora) exports ranks; the size comes from Cray PMI's PMI_SIZE.
    ("PALS_RANKID", ("PALS_SIZE", "PMI_SIZE"), ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"),
     ("PALS_LOCAL_SIZE",)),
    # MPICH's hydra (also Intel MPI); MPI_LOCALRANKID and MPI_LOCALNRANKS are hydra's.
    ("PMI_RANK", ("PMI_SIZE",), ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
     ("MPI_LOCALNRANKS",)),
)

# Variables that say "an MPI launcher started me" without giving rank and size in a form
# read above: then ask mpi4py (which calls MPI_Init).
_MPI_HINT_VARS = ("PMIX_RANK", "PALS_RANKID", "PMI_FD", "MPI_LOCALRANKID", "HYDRA_CONTROL_FD")

# Job ids, in order of preference, for the FileStore fallback.
_JOB_ID_VARS = (
    "COCODIFF_JOB_ID",
    "PMIX_NAMESPACE",
    "OMPI_MCA_ess_base_jobid",
    "PALS_APID",
    "SLURM_JOB_ID",
    "PBS_JOBID",
    "LSB_JOBID",
)


class LaunchError(ValueError):
    """The launch cannot give this rank a correct place in the job (a one-rank world under a
    launcher that started several, an accelerator build of torch that sees no accelerator);
    its message is one line that names the cause."""


@dataclass(frozen=True, slots=True)
class LaunchInfo:
    """Where this process sits in the job.

    Args:
        rank: global rank.
        world_size: number of ranks in the job.
        local_rank: rank among the processes on this node (selects the device).
        launcher: ``"torchrun"``, ``"mpiexec"`` or ``"single"`` (no launcher).
        local_size: processes on this node, when the launcher says (None: unknown). More
            of them than the node has accelerators means ranks share a device.
    """

    rank: int
    world_size: int
    local_rank: int
    launcher: str
    local_size: int | None = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        if name in env:
            return env[name]
    return None


def _as_int(env: Mapping[str, str], name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"launcher variable {name}={value!r} is not an integer") from None


def detect_launch(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read rank, world size and local rank from the launcher's environment.

    Order: torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``), then MPI launchers (Open MPI
    ``OMPI_COMM_WORLD_*``, Cray PALS ``PALS_RANKID``/``PALS_LOCAL_RANKID``, MPICH hydra
    ``PMI_RANK``/``PMI_SIZE``), then mpi4py's ``COMM_WORLD`` when the environment hints at
    an MPI launch without readable rank variables (e.g. PMIx only) or the program has already
    imported ``mpi4py.MPI``; else a single process.

    Args:
        environ: the environment to read; ``os.environ`` if None.

    Returns:
        The :class:`LaunchInfo` of this process.

    Raises:
        ValueError: a launcher variable is not an integer, or rank is outside the world.
        LaunchError: PALS started several ranks (its variables say so) but this one found a
            world of one: mpi4py is missing or links an MPI that PALS did not start.
    """
    env = os.environ if environ is None else environ
    info = _from_torchrun(env) or _from_mpi_env(env) or _from_mpi4py(env)
    if info is None:
        _refuse_lone_pals_rank(env, None)
        return LaunchInfo(rank=0, world_size=1, local_rank=0, launcher=SINGLE, local_size=1)
    if not 0 <= info.rank < info.world_size:
        raise ValueError(f"rank {info.rank} outside world of {info.world_size} ({info.launcher})")
    return info


def _from_torchrun(env: Mapping[str, str]) -> LaunchInfo | None:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank = _as_int(env, "RANK", env["RANK"])
    local = env.get("LOCAL_RANK", env["RANK"])
    local_size = env.get("LOCAL_WORLD_SIZE")
    return LaunchInfo(
        rank=rank,
        world_size=_as_int(env, "WORLD_SIZE", env["WORLD_SIZE"]),
        local_rank=_as_int(env, "LOCAL_RANK", local),
        launcher=TORCHRUN,
        local_size=None if local_size is None else _as_int(env, "LOCAL_WORLD_SIZE", local_size),
    )


def _from_mpi_env(env: Mapping[str, str]) -> LaunchInfo | None:
    for rank_var, size_vars, local_vars, local_size_vars in _MPI_ENV_VARS:
        if rank_var not in env:
            continue
        size = _first(env, size_vars)
        if size is None:
            continue  # e.g. PALS without PMI_SIZE: left to mpi4py
        rank = _as_int(env, rank_var, env[rank_var])
        local = _first(env, local_vars)
        local_size = _first(env, local_size_vars)
        return LaunchInfo(
            rank=rank,
            world_size=_as_int(env, size_vars[0], size),
            local_rank=rank if local is None else _as_int(env, local_vars[0], local),
            launcher=MPIEXEC,
            local_size=None if local_size is None else _as_int(env, local_size_vars[0],
                                                                local_size),
        )
    return None


def _from_mpi4py(env: Mapping[str, str]) -> LaunchInfo | None:
    hinted = any(name in env for name in _MPI_HINT_VARS)
    if not (hinted or "mpi4py.MPI" in sys.modules):
        return None
    if not mpi4py_available():
        return None
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        _refuse_lone_pals_rank(env, MPI)
        return None
    local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = local_comm.Get_rank(), local_comm.Get_size()
    local_comm.Free()
    return LaunchInfo(rank=comm.Get_rank(), world_size=comm.Get_size(), local_rank=local_rank,
                      launcher=MPIEXEC, local_size=local_size)


def mpi4py_available() -> bool:
    """Whether mpi4py can be imported. Imports the package, not ``mpi4py.MPI``: that is
    cheap and does not initialise MPI (a stale or blocked install fails here, not later)."""
    if find_spec("mpi4py") is None:
        return False
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def pals_ranks_evidence(environ: Mapping[str, str]) -> str | None:
    """What in PALS' variables proves that this job has more than one rank (None: nothing
    does, or PALS did not start this process). PALS exports no global size, so the proof is
    a rank, node or local size other than the first/one."""
    if "PALS_RANKID" not in environ:
        return None
    for name, alone in (("PALS_LOCAL_SIZE", "1"), ("PALS_RANKID", "0"), ("PALS_NODEID", "0")):
        value = environ.get(name)
        if value is not None and value.strip() != alone:
            return f"{name}={value}"
    return None


def _refuse_lone_pals_rank(env: Mapping[str, str], mpi: Any) -> None:
    """Raise :class:`LaunchError` when PALS started several ranks but this one found a world
    of one (DLcomm fix 23: twelve one-rank jobs per node, their XCCL bootstrap crashing).

    Args:
        env: the launcher's environment.
        mpi: the imported ``mpi4py.MPI`` that saw one rank, or None when mpi4py is missing.
    """
    evidence = pals_ranks_evidence(env)
    if evidence is None:
        return
    if mpi is None:
        cause = ("mpi4py is not installed, so the size cannot be read; install the mpi4py "
                 "built against the MPI that PALS launches (Aurora: the frameworks module's, "
                 "Cray MPICH)")
    else:
        import mpi4py

        lines = mpi.Get_library_version().strip().splitlines() or ["an unknown MPI"]
        library = " ".join(lines[0].split())[:80]  # "MPICH Version: 4.3.1"
        cause = (f"mpi4py ({Path(mpi4py.__file__).parent}) links {library}, which sees a world "
                 "of 1: that MPI is not the one PALS launched (a venv's mpich wheel?); use the "
                 "mpi4py built against Cray MPICH (Aurora: the frameworks module's)")
    raise LaunchError(f"PALS started this rank among several ({evidence}) but exports no "
                      f"global size, and {cause}: each rank would run alone")


def in_job(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs inside a launcher or a batch job (any launcher's rank
    variable, or a scheduler's job id): where falling back to the CPU is a mistake."""
    env = os.environ if environ is None else environ
    names = ("RANK", *(entry[0] for entry in _MPI_ENV_VARS), *_MPI_HINT_VARS, "PBS_JOBID",
             "SLURM_JOB_ID", "LSB_JOBID")
    return any(name in env for name in names)


def job_id(environ: Mapping[str, str] | None = None) -> str:
    """An id shared by the ranks of one job: see the module docstring, step 3."""
    env = os.environ if environ is None else environ
    found = _first(env, _JOB_ID_VARS)
    if found is None:
        found = f"{socket.gethostname()}-ppid{os.getppid()}"
    # Keep it a safe file name: job ids may hold '.', '@' or '/'.
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in found)


def torch_store(info: LaunchInfo, timeout: timedelta, *, use_mpi4py: bool | None = None) -> Any:
    """Build the torch.distributed rendezvous store for this job.

    Args:
        info: this process's place in the job.
        timeout: how long to wait for the other ranks.
        use_mpi4py: share rank 0's address with mpi4py; None means "if importable".

    Returns:
        A ``torch.distributed.Store``, or None when torch's ``env://`` rendezvous applies
        (``MASTER_ADDR`` and ``MASTER_PORT`` set, as torchrun does).
    """
    import torch.distributed as dist

    check_rendezvous_host(info)
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return None
    if not info.is_distributed:
        return dist.HashStore()
    if use_mpi4py is None:
        use_mpi4py = mpi4py_available()
    if use_mpi4py:
        return _tcp_store_over_mpi(info, timeout)
    directory = Path(os.environ.get("COCODIFF_RENDEZVOUS_DIR", tempfile.gettempdir()))
    path = directory / f"cocodiff-rdzv-{job_id()}"
    store = dist.FileStore(str(path), info.world_size)
    store.set_timeout(timeout)
    return store


LOOPBACK_HOSTS = ("localhost", "::1", "ip6-localhost")


def check_rendezvous_host(info: LaunchInfo, environ: Mapping[str, str] | None = None) -> None:
    """Refuse a loopback ``MASTER_ADDR`` in a job of several nodes, before any rank waits on
    it: each node would rendezvous with itself and hang instead of failing (DLcomm).

    A job spans several hosts when PALS numbers this node past the first, or when the
    launcher says this node holds fewer ranks than the world and the scheduler gave the job
    several hosts (``PBS_NODEFILE``, ``SLURM_JOB_NUM_NODES``). Ranks of one host split into
    "nodes" by hand (torchrun ``--nnodes 2`` on one machine) may use loopback.

    Raises:
        LaunchError: the address is a loopback one and the job spans several nodes.
    """
    env = os.environ if environ is None else environ
    host = env.get("MASTER_ADDR", "")
    if not (host.startswith("127.") or host in LOOPBACK_HOSTS):
        return
    several = (env.get("PALS_NODEID", "0").strip() != "0"
               or (info.local_size is not None and info.local_size < info.world_size
                   and _scheduler_hosts(env) > 1))
    if several:
        raise LaunchError(f"MASTER_ADDR={host} in a job of {info.world_size} ranks over several "
                          "nodes: every node would rendezvous with itself and hang; set it to "
                          "the first node's address (Aurora: its .hsn name)")


def _scheduler_hosts(env: Mapping[str, str]) -> int:
    """How many hosts the batch scheduler gave the job (1 when it does not say)."""
    nodefile = env.get("PBS_NODEFILE")
    if nodefile:
        try:
            return len({line.strip() for line in Path(nodefile).read_text().splitlines()
                        if line.strip()})
        except OSError:
            pass
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if env.get(name, "").strip().isdecimal():
            return int(env[name])
    return 1


def _tcp_store_over_mpi(info: LaunchInfo, timeout: timedelta) -> Any:
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if info.rank == 0:
        host = os.environ.get("MASTER_ADDR", socket.gethostname())
        # Port 0: the OS picks a free port as the server binds, so there is no window in
        # which another process can take it.
        store = dist.TCPStore(
            host, 0, info.world_size, True, timeout=timeout, wait_for_workers=False
        )
        comm.bcast((host, store.port), root=0)
        return store
    host, port = comm.bcast(None, root=0)
    return dist.TCPStore(host, port, info.world_size, False, timeout=timeout)
