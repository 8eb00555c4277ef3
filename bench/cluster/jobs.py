"""Starting one multi-rank job across the nodes of an :class:`EmulatedCluster`.

Ranks are placed node-major (ranks ``k*R .. k*R+R-1`` on node ``k``), as
``topology.Placement.node_major`` assumes.

- ``torch`` (gloo): one process per rank, each ``ip netns exec <node> <command>`` with
  torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``GROUP_RANK``), ``MASTER_ADDR`` = node 0's address and a fixed ``MASTER_PORT`` (node 0's
  namespace is new and private, so the port is free), and ``GLOO_SOCKET_IFNAME=fabric``:
  gloo binds the node's address, so peers on the same node talk over ``lo`` and peers on
  other nodes over the shaped veth. The job is supervised here: the first rank to fail
  stops it.
- ``mpi`` (MPICH hydra): one ``mpiexec`` inside node 0 with ``-hosts <ns0>:R,<ns1>:R``,
  ``-launcher ssh -launcher-exec <wrapper>`` where the wrapper, written for this job, runs
  hydra's proxy with ``ip netns exec <host>`` (and refuses any host that is not a node of
  this cluster), and ``-iface fabric`` so the proxies reach ``mpiexec`` over the fabric.
  MPICH keeps ranks of one host on shared memory; between hosts it uses its netmod, which
  on its own would also pick shared memory (every "host" is this machine), so the job
  selects the OFI netmod with libfabric's TCP provider on ``fabric``
  (``MPIR_CVAR_CH4_NETMOD=ofi``, ``FI_PROVIDER=tcp``, ``FI_TCP_IFACE=fabric``). Any of
  these set by the caller wins.

Every process runs in a process group of its own; on failure, timeout or interrupt the
cluster kills the groups and then anything left in its namespaces.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.cluster.netns import NODE_INTERFACE, ClusterError, EmulatedCluster

REPO = Path(__file__).resolve().parents[2]
MASTER_PORT = 29500
POLL_S = 0.05
# After the first rank fails, how long the others get to notice and print their own error.
FAILURE_GRACE_S = 5.0

# Variables a surrounding launcher may have set; a job started here must not inherit them.
LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_LOCAL_RANK", "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "PALS_RANKID", "PALS_LOCAL_RANKID", "PALS_SIZE", "PMIX_RANK",
)

MPI_FABRIC_ENV = {
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "FI_TCP_IFACE": NODE_INTERFACE,
    "UCX_NET_DEVICES": NODE_INTERFACE,  # in case a user selects the UCX netmod instead
}


class JobFailed(ClusterError):
    """A job's rank failed or the job timed out; the message is one line naming the rank,
    its node and the last line it printed. ``log_dir`` holds every rank's output."""

    def __init__(self, message: str, log_dir: Path) -> None:
        super().__init__(message)
        self.log_dir = log_dir


@dataclass(frozen=True, slots=True)
class JobResult:
    """A job that finished with every rank exiting 0.

    Attributes:
        transport: ``"torch"`` or ``"mpi"``.
        num_ranks: ranks in the job.
        wall_s: seconds from the first process start to the last exit.
        log_dir: where each process's output is (``rank<r>.out`` / ``.err`` for torch,
            ``mpiexec.out`` / ``.err`` for mpi).
    """

    transport: str
    num_ranks: int
    wall_s: float
    log_dir: Path

    def output(self, rank: int = 0) -> str:
        """What rank ``rank`` printed on stdout (for mpi: all ranks, as hydra merged it)."""
        name = f"rank{rank}.out" if self.transport == "torch" else "mpiexec.out"
        return (self.log_dir / name).read_text(errors="replace")


def job_environment(cluster: EmulatedCluster, env: Mapping[str, str] | None = None,
                    threads_per_rank: int | None = None) -> dict[str, str]:
    """The environment every rank starts from: the caller's, minus launcher variables,
    with this interpreter's directory first on ``PATH`` (so ``python`` and ``cocodiff``
    are this venv's), the repository on ``PYTHONPATH``, and ``OMP_NUM_THREADS`` set to
    share the machine's cores among the ranks unless the caller set it."""
    base = dict(os.environ if env is None else env)
    out = {key: value for key, value in base.items() if key not in LAUNCH_VARS}
    out["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent),
                                                out.get("PATH")]))
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), out.get("PYTHONPATH")]))
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // cluster.spec.num_ranks)
    out.setdefault("OMP_NUM_THREADS", str(threads_per_rank))
    out.setdefault("HF_HUB_OFFLINE", "1")
    return out


def run_torch_job(cluster: EmulatedCluster, command: Sequence[str], *, timeout_s: float = 300.0,
                  env: Mapping[str, str] | None = None, log_dir: str | Path | None = None,
                  cwd: str | Path | None = None) -> JobResult:
    """Run ``command`` once per rank, torchrun-style, across the cluster's nodes.

    Args:
        cluster: an open cluster.
        command: the program and its arguments (e.g. ``["python", "-m", "cocodiff", "run"]``).
        timeout_s: the whole job's limit; past it every rank is killed.
        env: the base environment (default ``os.environ``); see :func:`job_environment`.
        log_dir: where outputs go (default: a new temporary directory).
        cwd: working directory of the ranks.

    Raises:
        JobFailed: a rank exited non-zero, or the job ran past ``timeout_s``.
    """
    logs = _log_dir(log_dir)
    base = job_environment(cluster, env)
    spec = cluster.spec
    started = time.monotonic()
    processes: list[subprocess.Popen] = []
    files = []

    def label(rank: int) -> str:
        return f"rank {rank} (node {cluster.node_of_rank(rank).index})"

    def find_failure(codes: list[int | None]) -> tuple[str, int, str] | None:
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                return label(rank), code, _last_line(logs / f"rank{rank}.err")
        return None

    try:
        for rank in range(spec.num_ranks):
            node = cluster.node_of_rank(rank)
            rank_env = dict(base)
            rank_env.update({
                "RANK": str(rank),
                "WORLD_SIZE": str(spec.num_ranks),
                "LOCAL_RANK": str(rank % spec.ranks_per_node),
                "LOCAL_WORLD_SIZE": str(spec.ranks_per_node),
                "GROUP_RANK": str(node.index),
                "MASTER_ADDR": cluster.nodes[0].address,
                "MASTER_PORT": str(MASTER_PORT),
            })
            rank_env.setdefault("GLOO_SOCKET_IFNAME", NODE_INTERFACE)
            out = open(logs / f"rank{rank}.out", "wb")  # noqa: SIM115 - closed below
            err = open(logs / f"rank{rank}.err", "wb")  # noqa: SIM115
            files += [out, err]
            processes.append(cluster.spawn(node, list(command), env=rank_env, stdout=out,
                                           stderr=err, cwd=cwd))
        _supervise(processes, timeout_s, started, logs, find_failure,
                   lambda codes: [label(r) for r, code in enumerate(codes) if code is None])
    finally:
        for handle in files:
            handle.close()
    return JobResult("torch", spec.num_ranks, time.monotonic() - started, logs)


def run_mpi_job(cluster: EmulatedCluster, command: Sequence[str], *, timeout_s: float = 300.0,
                env: Mapping[str, str] | None = None, log_dir: str | Path | None = None,
                cwd: str | Path | None = None, mpiexec: str | None = None) -> JobResult:
    """Run ``command`` on every rank with MPICH's ``mpiexec`` (hydra) across the nodes.

    Arguments as :func:`run_torch_job`; ``mpiexec`` defaults to the one beside this
    interpreter, else the first on ``PATH``. Hydra does not stop the other ranks when one
    exits with an error, so each rank runs under a small wrapper that records a non-zero
    exit code, and the job is stopped here on the first one (as for torch).

    Raises:
        JobFailed: a rank exited non-zero, ``mpiexec`` failed, or the job ran past
            ``timeout_s``.
        ClusterError: no ``mpiexec`` found.
    """
    logs = _log_dir(log_dir)
    base = job_environment(cluster, env)
    for key, value in MPI_FABRIC_ENV.items():
        base.setdefault(key, value)
    launcher = mpiexec or _find_mpiexec(base)
    wrapper = _write_netns_wrapper(cluster, logs)
    rank_wrapper = _write_rank_wrapper(logs)
    spec = cluster.spec
    hosts = ",".join(f"{node.namespace}:{spec.ranks_per_node}" for node in cluster.nodes)
    argv = [launcher, "-launcher", "ssh", "-launcher-exec", str(wrapper), "-hosts", hosts,
            "-n", str(spec.num_ranks), "-iface", NODE_INTERFACE, "-prepend-rank",
            str(rank_wrapper), *command]

    def find_failure(codes: list[int | None]) -> tuple[str, int, str] | None:
        exits = []
        for path in logs.glob("exit.*"):
            try:
                exits.append((path.stat().st_mtime, path, int(path.read_text().strip() or "1")))
            except (OSError, ValueError):
                continue  # gone or being written: the next poll sees it
        for _, path, code in sorted(exits, key=lambda entry: entry[0]):
            rank_text = path.name.split(".", 1)[1]
            if rank_text.isdigit():
                rank = int(rank_text)
                where = f"rank {rank} (node {cluster.node_of_rank(rank).index})"
                return where, code, _last_line(logs / "mpiexec.err", prefix=f"[{rank}] ")
            return f"rank {rank_text}", code, _last_line(logs / "mpiexec.err")
        if codes[0] not in (None, 0):
            return "mpiexec", codes[0], _last_line(logs / "mpiexec.err")
        return None

    started = time.monotonic()
    with open(logs / "mpiexec.out", "wb") as out, open(logs / "mpiexec.err", "wb") as err:
        process = cluster.spawn(cluster.nodes[0], argv, env=base, stdout=out, stderr=err,
                                cwd=cwd)
        _supervise([process], timeout_s, started, logs, find_failure,
                   lambda codes: ["mpiexec"] if codes[0] is None else [],
                   cluster=cluster)
    return JobResult("mpi", spec.num_ranks, time.monotonic() - started, logs)


JOB_RUNNERS: dict[str, Callable[..., JobResult]] = {
    "torch": run_torch_job,
    "mpi": run_mpi_job,
}
"""Transport name -> the function that launches a job for it."""


def run_job(cluster: EmulatedCluster, command: Sequence[str], transport: str = "torch",
            **kwargs) -> JobResult:
    """:func:`run_torch_job` or :func:`run_mpi_job` by transport name.

    Raises:
        ClusterError: an unknown transport (the message lists the valid ones).
    """
    runner = JOB_RUNNERS.get(transport)
    if runner is None:
        raise ClusterError(
            f"unknown transport {transport!r}; valid: {', '.join(JOB_RUNNERS)}"
        )
    return runner(cluster, command, **kwargs)


def _log_dir(log_dir: str | Path | None) -> Path:
    if log_dir is None:
        return Path(tempfile.mkdtemp(prefix="cocodiff-cluster-job-"))
    path = Path(log_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _find_mpiexec(env: Mapping[str, str]) -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    import shutil

    found = shutil.which("mpiexec", path=env.get("PATH"))
    if found is None:
        raise ClusterError("no mpiexec beside this Python or on PATH (pip install mpich)")
    return found


def _write_netns_wrapper(cluster: EmulatedCluster, directory: Path) -> Path:
    """The ``-launcher-exec`` program: hydra calls it as ``ssh`` would be called
    (``wrapper [-x] HOST COMMAND...``); it runs COMMAND in HOST's namespace."""
    allowed = " | ".join(shlex.quote(node.namespace) for node in cluster.nodes)
    script = f"""#!/bin/sh
# Written by bench.cluster for one MPI job: hydra's ssh launcher, but into a namespace.
while [ $# -gt 0 ]; do
    case "$1" in
        -*) shift ;;
        *) break ;;
    esac
done
host="$1"
shift
case "$host" in
    {allowed}) ;;
    *) echo "netns launcher: $host is not a node of cluster {cluster.name}" >&2; exit 1 ;;
esac
exec ip netns exec "$host" sh -c "$*"
"""
    path = directory / "netns-launcher.sh"
    path.write_text(script)
    path.chmod(0o755)
    return path


def _write_rank_wrapper(directory: Path) -> Path:
    """Runs one MPI rank and, if it fails, leaves ``exit.<rank>`` holding its exit code."""
    script = f"""#!/bin/sh
# Written by bench.cluster for one MPI job: records a rank's failure for the supervisor.
"$@"
code=$?
if [ "$code" -ne 0 ]; then
    dir={shlex.quote(str(directory))}
    # Written under a name the supervisor's "exit.*" does not match, then renamed
    # into place, so the supervisor never reads a half-written or vanishing file.
    echo "$code" > "$dir/.partial-exit.$$"
    mv "$dir/.partial-exit.$$" "$dir/exit.${{PMI_RANK:-unknown}}"
fi
exit "$code"
"""
    path = directory / "rank-wrapper.sh"
    path.write_text(script)
    path.chmod(0o755)
    return path


def _supervise(processes: list[subprocess.Popen], timeout_s: float, started: float, logs: Path,
               find_failure: Callable[[list[int | None]], tuple[str, int, str] | None],
               still_running: Callable[[list[int | None]], list[str]],
               cluster: EmulatedCluster | None = None) -> None:
    """Wait for every process; on the first failure or at the deadline, stop the rest.

    Args:
        find_failure: given the exit codes so far (None: running), the first failure as
            ``(who, exit code, its last line)``, or None.
        still_running: who is still running, for the timeout message.
        cluster: if given, a failure also kills everything left in its namespaces (for MPI,
            whose ranks are not children of this process).

    Raises:
        JobFailed: naming the first rank to fail (or those still running at timeout).
    """
    deadline = started + timeout_s
    while True:
        codes = [process.poll() for process in processes]
        failure = find_failure(codes)
        if failure is not None:
            who, code, reason = failure
            _wait_all(processes, FAILURE_GRACE_S)
            stopped = any(process.poll() is None for process in processes)
            _kill_all(processes, cluster)
            raise JobFailed(
                f"{who} {_describe_exit(code)}: {reason or 'no output'}"
                + (" (stopped the other ranks)" if stopped else "")
                + f"; logs in {logs}",
                logs,
            )
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            running = still_running(codes)
            _kill_all(processes, cluster)
            raise JobFailed(
                f"job did not finish in {timeout_s:g} s; still running: "
                + ", ".join(running) + f"; logs in {logs}",
                logs,
            )
        time.sleep(POLL_S)


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _wait_all(processes: list[subprocess.Popen], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


def _kill_all(processes: list[subprocess.Popen], cluster: EmulatedCluster | None) -> None:
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
    if cluster is not None:
        cluster.kill_stragglers()


_NOISE = re.compile(r"^\s*(=+|\s*)$")


def _last_line(path: Path, prefix: str = "", max_bytes: int = 65536) -> str:
    """The last line of a log that is not decoration (of the lines starting with
    ``prefix``, with it removed, when given; any line if none does)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - max_bytes))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if not _NOISE.match(line)]
    if prefix:
        # hydra's -prepend-rank writes "[r] " before each chunk a rank writes, which can
        # leave a stray "[r]" at the end of a line too.
        mine = [re.sub(r"\[\d+\]\s*$", "", line[len(prefix.strip()):]).strip()
                for line in lines if line.startswith(prefix.strip())]
        lines = [line for line in mine if line] or lines
    line = lines[-1] if lines else ""
    return line if len(line) <= 300 else line[:297] + "..."
