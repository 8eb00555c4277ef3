"""The checks behind ``cocodiff doctor``: what a user needs to know before burning
allocation hours.

Every rank looks at itself (torch build, the devices it sees and the one it takes, the
collective backends built in, the launcher and the variables it found), then all ranks
run a tiny all-to-all through the transport ``cocodiff run`` would use, checking every
byte and timing it, and rank 0 gathers the facts and prints one table per node.

Launch facts it checks come from jobs others ran on Aurora (the argonne-lcf/DLcomm_benchmark
repository on GitHub, docs/fixes 23 and 24, and the ALCF Aurora user guide):

* PALS' ``mpiexec`` exports ``PALS_RANKID``/``PALS_LOCAL_RANKID``/``PALS_LOCAL_SIZE`` but
  no global size; a size silently defaulted to 1 builds one-rank jobs (DLcomm fix 23),
  so the size must come from MPI itself: a world of one rank under launcher variables that
  say otherwise is an error here.
* ``PMI_RANK``/``PMI_SIZE`` belong to MPICH's bootstrap; exporting them by hand made
  ``MPI_Init`` abort (DLcomm fix 24): ``PMI_RANK`` disagreeing with ``PALS_RANKID`` is
  an error here.
* A venv's own ``mpiexec`` (the ``mpich`` wheel) ahead of PALS' on ``PATH`` starts ranks
  outside PALS (DLcomm): on a machine with ``/opt/cray/pals`` the ``mpiexec`` found on
  ``PATH`` is shown, and a non-PALS one is an error inside a PBS job.
* The device is chosen by *local* rank (``transports.torch_dist.default_device``), and
  ``MASTER_ADDR`` must be the first node's address on every rank: a loopback address in a
  job of several nodes gives each node its own rendezvous and hangs (DLcomm); it is checked
  before the rendezvous.
* Ranks are compared by the device they hold, not by its index: under a per-rank
  ``ZE_AFFINITY_MASK`` (ALCF's ``gpu_tile_compact.sh``) every rank takes ``xpu:0``, each a
  different tile (``transports.torch_dist.device_identity``: the mask's entry, the index in
  FLAT mode, the device UUID where the runtime reports one).
* An XPU build of torch that sees no XPU is refused, never run on the CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cocodiff.util.errors import CocodiffError

# Launcher variables worth showing (which launcher, which rank, how many).
LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "PALS_RANKID", "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE", "PALS_NODEID", "PALS_PMI",
    "PMIX_RANK", "PBS_JOBID", "SLURM_JOB_ID",
)
# Variables that steer which devices a rank sees, and how oneCCL starts (ALCF's minimal set).
DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR",
               "ZE_FLAT_DEVICE_HIERARCHY", "CCL_ATL_TRANSPORT", "CCL_PROCESS_LAUNCHER",
               "CCL_KVS_MODE", "FI_MR_CACHE_MONITOR")
PALS_DIR = Path("/opt/cray/pals")


class DoctorProblem(CocodiffError):
    """Something about this launch would make a run fail or hang."""


@dataclass(frozen=True, slots=True)
class RankFacts:
    """What one rank found about itself."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str
    host: str
    node_key: int
    torch_version: str
    torch_build: str
    devices: str  # e.g. "cuda x4", "xpu x1", "none"
    device: str  # the one this rank takes (by local rank)
    backends: tuple[str, ...]  # collective backends built in / importable
    env: tuple[tuple[str, str], ...]  # launcher and device variables found
    # What the device is (mask entry or index, UUID): equal only for ranks sharing a device.
    device_identity: str = ""


def check_environment(env, launch) -> None:
    """This rank's launch variables, before any communication (raises DoctorProblem)."""
    from transports.launch import SINGLE, LaunchError, check_rendezvous_host

    try:
        check_rendezvous_host(launch, env)
    except LaunchError as error:
        raise DoctorProblem(str(error)) from None

    if ("RANK" in env) != ("WORLD_SIZE" in env):
        given, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
        raise DoctorProblem(f"{given} is set but {missing} is not: a torchrun-style launch "
                            "needs both (unset the stray one, or launch with torchrun)")
    if "PALS_RANKID" in env and "PMI_RANK" in env and env["PMI_RANK"] != env["PALS_RANKID"]:
        raise DoctorProblem(f"PMI_RANK={env['PMI_RANK']} disagrees with PALS_RANKID="
                            f"{env['PALS_RANKID']}: something exported PMI_* by hand, which "
                            "breaks MPICH's bootstrap (never export PMI_RANK/PMI_SIZE)")
    local_size = _int_or_none(env.get("PALS_LOCAL_SIZE") or env.get("MPI_LOCALNRANKS")
                              or env.get("LOCAL_WORLD_SIZE"))
    if local_size is not None and local_size > launch.world_size:
        found = ("no global size (PALS exports none) and mpi4py could not tell"
                 if launch.launcher == SINGLE else f"a world of {launch.world_size}")
        raise DoctorProblem(f"the launcher says {local_size} ranks on this node but this rank "
                            f"found {found}: each rank would run alone (install mpi4py, or "
                            "launch with mpiexec/torchrun so the size is known)")
    if "PBS_JOBID" in env and PALS_DIR.exists() and launch.launcher != SINGLE:
        mpiexec = shutil.which("mpiexec") or ""
        if "PALS_RANKID" not in env and not mpiexec.startswith(str(PALS_DIR)):
            raise DoctorProblem(f"ranks were not started by PALS: mpiexec on PATH is "
                                f"{mpiexec or 'missing'}, not under {PALS_DIR} (a venv's "
                                "mpich wheel shadows it: put PALS' mpiexec first)")


def check_job(every: list[RankFacts]) -> None:
    """What only the whole job shows (raises DoctorProblem on every rank alike)."""
    nodes = {f.node_key for f in every}
    master = dict(every[0].env).get("MASTER_ADDR", "")
    if len(nodes) > 1 and (master.startswith("127.") or master in ("localhost", "::1")):
        raise DoctorProblem(f"MASTER_ADDR={master} on a job of {len(nodes)} nodes: every node "
                            "would rendezvous with itself; set it to the first node's address")
    # Keyed by what the device is, not its index: under a per-rank affinity mask every
    # rank takes index 0 of a different tile.
    taken: dict[tuple[int, str], list[RankFacts]] = {}
    for f in every:
        if f.device != "cpu":
            taken.setdefault((f.node_key, f.device_identity or f.device), []).append(f)
    # Ranks sharing a CUDA device run: the torch transport gives them gloo, which stages
    # through host memory (nccl refuses them), and MPI stages through host memory anyway.
    shared = [(identity, group) for (_, identity), group in taken.items()
              if len(group) > 1 and not group[0].device.startswith("cuda")]
    if shared:
        identity, group = shared[0]
        device = group[0].device + (f" ({identity})" if identity != group[0].device else "")
        raise DoctorProblem(f"ranks {', '.join(str(f.rank) for f in group)} of one node all "
                            f"take {device}: one rank per device (tile) is the layout the "
                            "runtime assumes; bind each rank to its own device or start fewer "
                            "ranks")


def rank_facts(launch) -> RankFacts:
    import torch

    from cocodiff.runtime.nodes import node_key
    from transports.torch_dist import default_device, device_identity

    counts = {"cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    xpu = getattr(torch, "xpu", None)
    counts["xpu"] = xpu.device_count() if xpu is not None and xpu.is_available() else 0
    devices = ", ".join(f"{kind} x{n}" for kind, n in counts.items() if n) or "none"
    env = tuple((name, os.environ[name]) for name in (*LAUNCH_VARS, *DEVICE_VARS)
                if name in os.environ)
    device = default_device(launch.local_rank)  # LaunchError: an XPU build seeing no XPU
    return RankFacts(
        rank=launch.rank, world_size=launch.world_size, local_rank=launch.local_rank,
        launcher=launch.launcher, host=socket.gethostname(), node_key=node_key(),
        torch_version=torch.__version__, torch_build=_torch_build(torch),
        devices=devices, device=str(device), backends=_backends(launch), env=env,
        device_identity=device_identity(device),
    )


def _torch_build(torch) -> str:
    version = torch.version
    for name, label in (("cuda", "CUDA"), ("hip", "ROCm"), ("xpu", "XPU")):
        value = getattr(version, name, None)
        if value:
            return f"{label} {value}"
    return "CPU only"


def _backends(launch) -> tuple[str, ...]:
    """Collective backends this rank could use: torch.distributed's built-in ones, oneCCL's
    bindings, and MPI (its library, once MPI is initialised by an mpiexec launch)."""
    from importlib.util import find_spec

    import torch.distributed as dist

    from transports.launch import MPIEXEC

    found = [name for name, check in (("gloo", "is_gloo_available"),
                                      ("nccl", "is_nccl_available"),
                                      ("xccl", "is_xccl_available"))
             if getattr(dist, check, lambda: False)()]
    if find_spec("oneccl_bindings_for_pytorch") is not None:
        found.append("ccl")
    if find_spec("mpi4py") is not None:
        if launch.launcher == MPIEXEC:  # importing mpi4py.MPI initialises MPI
            from mpi4py import MPI

            library = " ".join(MPI.Get_library_version().split()[:3])  # "MPICH Version: 5.0.2"
            found.append(f"MPI ({library})")
        else:
            found.append("MPI (mpi4py)")
    return tuple(found)


def open_transport(name: str, timeout_s: int | None, launch):
    from transports.base import TransportError
    from transports.registry import create_transport

    try:
        if name == "mpi" or (name == "auto" and _auto_is_mpi()):
            return create_transport("mpi", timeout_s=timeout_s)
        return create_transport("torch", timeout_s=timeout_s, launch=launch)
    except (TransportError, ImportError) as error:
        raise DoctorProblem(f"transport {name} failed to start on rank {launch.rank} of "
                            f"{launch.world_size}: {error}") from None


def _auto_is_mpi() -> bool:
    from transports.registry import auto_transport_name

    return auto_transport_name() == "mpi"


def gather_facts(transport, facts: RankFacts) -> list[RankFacts]:
    """Every rank's facts, in rank order (two all-gathers through the transport)."""
    import torch

    from cocodiff.runtime.exchange import all_gather_rows

    data = json.dumps(asdict(facts)).encode()
    sizes = all_gather_rows(transport, torch.tensor([len(data)], dtype=torch.int64))
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = all_gather_rows(transport, padded)
    every = []
    for row, size in zip(rows, sizes.flatten().tolist(), strict=True):
        record = json.loads(bytes(row[:size].tolist()).decode())
        record["backends"] = tuple(record["backends"])
        record["env"] = tuple(tuple(pair) for pair in record["env"])
        every.append(RankFacts(**record))
    return every


def tiny_all_to_all(transport, num_bytes: int, repeats: int = 5) -> dict:
    """A world all-to-all of ``num_bytes`` per peer, every received byte checked; the
    median time over ``repeats`` (after one warm-up) of the slowest rank."""
    import torch

    from cocodiff.runtime.exchange import all_gather_rows

    size, rank = transport.world_size, transport.rank
    values = max(1, num_bytes // 8)
    # Row d goes to rank d: it holds rank * size + d; row s received must hold s * size + rank.
    send = (torch.arange(size, dtype=torch.int64) + rank * size).repeat_interleave(values)
    send = send.view(size, values)
    expected = (torch.arange(size, dtype=torch.int64) * size + rank).view(size, 1)
    times_s = []
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        received = transport.all_to_all(send, [1] * size, [1] * size).wait()
        elapsed = time.perf_counter() - start
        if not torch.equal(received.cpu(), expected.expand(size, values)):
            raise DoctorProblem(f"all-to-all delivered wrong data on rank {rank}")
        if attempt:
            times_s.append(elapsed)
    median_s = statistics.median(times_s)
    slowest = all_gather_rows(transport, torch.tensor([median_s], dtype=torch.float64))
    return {"ranks": size, "bytes_per_peer": values * 8, "repeats": repeats,
            "median_s_slowest_rank": float(slowest.max()), "correct": True}


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
