"""Real multi-rank jobs that fail on purpose: a rank is killed, exits, raises or hangs
(``COCODIFF_FAULT``), or the launcher is interrupted; and jobs that must agree bit for bit.

A failed job must end on every rank within ``--timeout`` plus a margin, exit non-zero, say
which rank failed (or what timed out), leave no process behind and no output file. The
survivors' stop times are measured from the fault's own timestamp and reported.
"""

from __future__ import annotations

import re
import signal
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from jobwatch import JobResult, watch_job
from launching import MPIEXEC, REPO, TORCHRUN, launcher_prefix, needs_mpi, needs_torchrun

pytestmark = pytest.mark.multiprocess

NUM_RANKS = 2
HAVE = {"torchrun": TORCHRUN.exists(), "mpiexec": MPIEXEC.exists() and bool(find_spec("mpi4py"))}
STEPS = 2
# Slack on top of --timeout for a survivor to notice, print and exit (interpreter teardown
# alone takes ~1.5 s here) on a loaded 2-core machine.
MARGIN_S = 15.0
# tiny-flux on 2 ranks: exchange 1 is the start-up argument check, then 9 per step
# (Q, K, V and output of 2 attention layers, and the final gather): 3 is inside step 1,
# 14 inside step 2.
FAULTS = [
    # (launcher, transport, COCODIFF_FAULT, --timeout)
    ("torchrun", "torch", "rank:1,point:exchange,count:3,action:kill", 20),
    ("torchrun", "torch", "rank:1,point:step,count:1,action:exit", 20),
    ("torchrun", "torch", "rank:0,point:step,count:1,action:raise", 20),
    ("torchrun", "torch", "rank:1,point:exchange,count:14,action:hang", 6),
    ("mpiexec", "mpi", "rank:1,point:exchange,count:3,action:kill", 20),
    ("mpiexec", "mpi", "rank:1,point:step,count:1,action:raise", 20),
    ("mpiexec", "mpi", "rank:0,point:exchange,count:14,action:hang", 6),
    ("mpiexec", "torch", "rank:1,point:exchange,count:14,action:kill", 20),
]

_stop_times: list[tuple[str, float]] = []


@pytest.fixture(scope="module", autouse=True)
def report_stop_times(request):
    """Print the measured stop times in the normal pytest output (no -s needed)."""
    yield
    if not _stop_times:
        return
    worst_case, worst = max(_stop_times, key=lambda item: item[1])
    lines = ["", "reliability: kill points tested"]
    lines += [f"  {case}: survivors stopped {seconds:.2f} s after the fault"
              for case, seconds in _stop_times]
    lines.append(f"worst time a surviving rank took to stop: {worst:.2f} s ({worst_case})")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n".join(lines))


def _cocodiff_run(launcher: str, transport: str, out: Path, timeout_s: float,
                  steps: int = STEPS, extra: tuple[str, ...] = ()) -> list[str]:
    return launcher_prefix(launcher, NUM_RANKS) + [
        "-m", "cocodiff", "run", "--model", "tiny-flux", "--steps", str(steps), "--quiet",
        "--transport", transport, "--timeout", str(timeout_s), "--output", str(out / "a.png"),
        "--json", str(out / "a.json"), "--save-latents", str(out / "a.pt"), *extra,
    ]


def _without_fault_lines(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if "cocodiff fault:" not in line)


def _assert_no_cocodiff_traceback(result: JobResult) -> None:
    # torchrun prints its own traceback (ChildFailedError) when a worker fails: only the
    # ranks' own code must never show one.
    assert f'File "{REPO / "cocodiff"}' not in result.output, result.output[-4000:]
    assert f'File "{REPO / "transports"}' not in result.output, result.output[-4000:]


def _assert_ended_cleanly(result: JobResult, out: Path) -> None:
    assert not result.timed_out, f"job hung:\n{result.output[-4000:]}"
    assert result.returncode != 0, result.output[-4000:]
    assert not result.leftovers, f"processes left behind: {result.leftovers}"
    assert sorted(result.rank_end) == list(range(NUM_RANKS)), result.rank_end
    assert not list(out.iterdir()), f"files written: {sorted(out.iterdir())}"
    _assert_no_cocodiff_traceback(result)


def _names_failed_rank(result: JobResult, rank: int) -> bool:
    text = _without_fault_lines(result.output)
    patterns = [
        rf"\brank:? {rank}\b",  # ours ("waiting for rank 1", "on rank 1"), torchrun's
        rf"\branks [\d, ]*\b{rank}\b",
        "(?i)timed out",
    ]
    pid = result.rank_pid.get(rank)
    if pid is not None:  # mpiexec's "BAD TERMINATION ... PID 1234 ... KILLED BY SIGNAL"
        patterns.append(rf"\bPID {pid}\b")
    return any(re.search(pattern, text) for pattern in patterns)


@pytest.mark.parametrize(
    ("launcher", "transport", "fault", "timeout_s"),
    [pytest.param(*case, marks=needs_torchrun if case[0] == "torchrun" else needs_mpi,
                  id=f"{case[0]}-{case[1]}-{case[2].replace('rank:', 'r').replace(',', '-')}")
     for case in FAULTS],
)
def test_a_failed_rank_stops_the_job(launcher, transport, fault, timeout_s, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = watch_job(_cocodiff_run(launcher, transport, out, timeout_s), tmp_path,
                       timeout_s=180, extra_env={"COCODIFF_FAULT": fault})
    struck = result.fault()
    assert struck is not None, f"the fault never struck:\n{result.output[-4000:]}"
    failed_rank, fault_time = struck
    _assert_ended_cleanly(result, out)
    survivors = [rank for rank in range(NUM_RANKS) if rank != failed_rank]
    stop_s = max(result.rank_end[rank] - fault_time for rank in survivors)
    action = re.search(r"action:(\w+)", fault)[1]
    # A hung rank is found by the others' timeout; any other failure much sooner.
    assert stop_s < timeout_s + MARGIN_S, f"survivors stopped {stop_s:.1f} s after the fault"
    assert _names_failed_rank(result, failed_rank), result.output[-4000:]
    if action == "hang":
        assert "timed out" in result.output.lower(), result.output[-4000:]
    case = f"{launcher}/{transport} {fault} --timeout {timeout_s}"
    _stop_times.append((case, stop_s))


@pytest.mark.parametrize(
    ("launcher", "signum"),
    [
        pytest.param("torchrun", signal.SIGTERM, marks=needs_torchrun, id="torchrun-SIGTERM"),
        pytest.param("mpiexec", signal.SIGINT, marks=needs_mpi, id="mpiexec-SIGINT"),
    ],
)
def test_interrupting_the_launcher_ends_every_rank_and_writes_nothing(launcher, signum,
                                                                       tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    sent: list[float] = []

    def interrupt_when_running(line: str, launcher_process) -> None:
        if "cocodiff fault:" in line and not sent:
            sent.append(time.time())
            launcher_process.send_signal(signum)

    # "mark" only announces step 2 on rank 0, so the signal lands mid-run; 40 steps keep
    # the job busy well past it.
    transport = "torch" if launcher == "torchrun" else "mpi"
    result = watch_job(
        _cocodiff_run(launcher, transport, out, 30, steps=40), tmp_path, timeout_s=180,
        extra_env={"COCODIFF_FAULT": "rank:0,point:step,count:2,action:mark"},
        on_stderr_line=interrupt_when_running,
    )
    assert sent, f"the job never reached step 2:\n{result.output[-4000:]}"
    _assert_ended_cleanly(result, out)
    stop_s = max(result.rank_end.values()) - sent[0]
    assert stop_s < MARGIN_S, f"ranks stopped {stop_s:.1f} s after {signum.name}"
    name = signal.Signals(signum).name
    interrupted = re.findall(rf"cocodiff run: rank (\d+): interrupted by {name}", result.stderr)
    assert sorted(map(int, interrupted)) == list(range(NUM_RANKS)), result.output[-4000:]


def test_same_seed_same_latents_across_runs_and_transports(tmp_path):
    """flat, 2 ranks, seed 7: the torch transport twice (under torchrun, then mpiexec) and the
    mpi transport give bit-identical latents."""
    jobs = [("torchrun", "torch"), ("mpiexec", "mpi"), ("mpiexec", "torch")]
    latents = {}
    for index, (launcher, transport) in enumerate(jobs):
        if not HAVE[launcher]:
            continue
        out = tmp_path / f"{index}-{launcher}-{transport}"
        out.mkdir()
        result = watch_job(_cocodiff_run(launcher, transport, out, 60, extra=("--seed", "7")),
                           tmp_path, timeout_s=180)
        assert result.returncode == 0, result.output[-4000:]
        latents[out.name] = torch.load(out / "a.pt", weights_only=True)
    assert len(latents) >= 2, "needs torchrun or mpiexec"
    (first_name, first), *others = latents.items()
    for name, other in others:
        assert torch.equal(first, other), f"{name} differs from {first_name}"
    assert torch.isfinite(first).all()


def test_same_seed_same_latents_in_one_process(tmp_path):
    from cocodiff.commands.cli import main

    paths = [tmp_path / "1.pt", tmp_path / "2.pt"]
    for path in paths:
        assert main(["run", "--steps", str(STEPS), "--seed", "7", "--quiet",
                     "--save-latents", str(path)]) == 0
    first, second = (torch.load(path, weights_only=True) for path in paths)
    assert torch.equal(first, second)


@needs_mpi
def test_mpi_waits_are_bounded(tmp_path):
    """MpiTransport's own deadline: all_to_all, barrier and new_group with a silent peer."""
    # Both ranks leave without MPI_Finalize (see the worker). Hydra kills the whole job when
    # it reads a rank's PMI socket closing unfinalized, a race with its reaping of that rank
    # that CI lost once (rank 1 SIGKILLed as rank 0 left): the rank that is still sleeping
    # must end on its own here.
    mpiexec, *rest = launcher_prefix("mpiexec", NUM_RANKS)
    result = watch_job(
        [mpiexec, "-disable-auto-cleanup", *rest,
         str(REPO / "tests" / "workers" / "mpi_deadline.py"), "1.5"],
        tmp_path, timeout_s=60,
    )
    assert result.returncode == 0, result.output[-4000:]
    assert result.output.count("deadline ok:") == 3, result.output[-4000:]
    assert not result.leftovers, result.leftovers
