"""Run a multi-rank job and watch its processes: when each rank ended, and whether anything
outlived the launcher.

Every process of the job inherits a marker variable (``COCODIFF_TEST_JOB``), so the
processes it leaves behind are found by that even after they were re-parented (torchrun
starts each worker in a session of its own, so session ids would miss them).
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from launching import REPO, job_env

# Environment variables that carry a rank's global rank, per launcher.
_RANK_VARS = ("RANK", "PMI_RANK")
_FAULT_LINE = re.compile(r"cocodiff fault: rank (\d+): (\w+) at (\w+) (\d+) \(t=([0-9.]+)\)")
POLL_S = 0.05


@dataclass
class JobResult:
    """What a watched job did.

    Attributes:
        returncode: the launcher's exit status.
        stdout, stderr: everything the job printed.
        wall_s: launcher start to exit.
        rank_end: global rank -> wall-clock time (``time.time()``) its process was seen gone.
        rank_pid: global rank -> process id.
        leftovers: processes of the job alive after the launcher exited (then killed), as
            ``"pid cmdline"``.
        timed_out: the job ran past its limit and was killed.
    """

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    rank_end: dict[int, float] = field(default_factory=dict)
    rank_pid: dict[int, int] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)
    timed_out: bool = False

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def fault(self) -> tuple[int, float] | None:
        """(rank, wall-clock time) of the fault the job announced, if any."""
        found = _FAULT_LINE.search(self.stderr)
        return (int(found[1]), float(found[5])) if found else None


MARKER = "COCODIFF_TEST_JOB"


def _marked_processes(marker: str) -> list[psutil.Process]:
    """Every live process whose environment carries ``marker``."""
    found = []
    for process in psutil.process_iter(["pid"]):
        try:
            if process.environ().get(MARKER) == marker:
                found.append(process)
        except psutil.Error:
            continue
    return found


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _rank_of(process: psutil.Process) -> int | None:
    try:
        if "cocodiff" not in " ".join(process.cmdline()):
            return None
        env = process.environ()
    except psutil.Error:
        return None
    for name in _RANK_VARS:
        if name in env:
            return int(env[name])
    return None


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def watch_job(
    cmd: list[str],
    tmp_path: Path,
    *,
    timeout_s: float,
    extra_env: dict[str, str] | None = None,
    on_stderr_line: Callable[[str, subprocess.Popen], None] | None = None,
) -> JobResult:
    """Run ``cmd`` to its end (killing it after ``timeout_s``), tracking its rank processes.

    Args:
        cmd: launcher command line.
        tmp_path: the test's directory (rendezvous files).
        timeout_s: limit for the whole job.
        extra_env: variables added to the job's environment.
        on_stderr_line: called with each line the job writes on stderr, as it comes, and
            the launcher's Popen (e.g. to signal it at the right moment).
    """
    marker = uuid.uuid4().hex
    env = job_env(tmp_path) | (extra_env or {}) | {MARKER: marker}
    began = time.time()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL,
    )
    err_lines: list[str] = []
    out_chunks: list[str] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err_lines.append(line)
            if on_stderr_line is not None:
                on_stderr_line(line, proc)

    def read_stdout() -> None:
        assert proc.stdout is not None
        out_chunks.append(proc.stdout.read())

    readers = [threading.Thread(target=read_stderr, daemon=True),
               threading.Thread(target=read_stdout, daemon=True)]
    for reader in readers:
        reader.start()

    ranks: dict[int, psutil.Process] = {}
    rank_end: dict[int, float] = {}
    seen: set[int] = set()
    timed_out = False
    while proc.poll() is None:
        now = time.time()
        if now - began > timeout_s:
            timed_out = True
            _kill_all(_marked_processes(marker))
            proc.wait()
            break
        for process in _descendants(proc.pid):
            if process.pid not in seen:
                rank = _rank_of(process)
                if rank is not None:
                    seen.add(process.pid)
                    ranks[rank] = process
                elif process.create_time() < now - 1.0:
                    seen.add(process.pid)  # launcher helpers: no rank, stop looking at them
        for rank, process in ranks.items():
            if rank not in rank_end and not _alive(process):
                rank_end[rank] = time.time()
        time.sleep(POLL_S)
    ended = time.time()
    for rank in ranks:
        rank_end.setdefault(rank, ended)
    time.sleep(0.5)  # let the launcher's own teardown finish
    left = [process for process in _marked_processes(marker) if _alive(process)]
    leftovers = []
    for process in left:
        try:
            leftovers.append(f"{process.pid} {' '.join(process.cmdline())[:200]}")
        except psutil.Error:
            continue
    _kill_all(left)
    for reader in readers:
        reader.join(timeout=5)
    return JobResult(proc.returncode, "".join(out_chunks), "".join(err_lines), ended - began,
                     rank_end, {rank: p.pid for rank, p in ranks.items()}, leftovers, timed_out)


def _kill_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.Error:
            continue
