"""The test workers' early exit (tests/workers/ending.py): the exit code and the flushed
output survive; without MPI the teardown is skipped, with MPI it runs."""

import os
import subprocess
import sys

import pytest
from launching import LAUNCH_VARS, REPO, WORKERS, needs_mpi


@pytest.mark.parametrize("use_mpi", [False, pytest.param(True, marks=needs_mpi)])
def test_exit_rank_flushes_and_exits_with_the_code(use_mpi: bool) -> None:
    code = (
        "import atexit, sys\n"
        + ("from mpi4py import MPI\n" if use_mpi else "")
        + "from ending import exit_rank\n"
        "atexit.register(lambda: print('teardown', flush=True))\n"
        "print('out', end='')\n"
        "print('err', end='', file=sys.stderr)\n"
        "exit_rank(3)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(WORKERS), str(REPO)])
    done = subprocess.run([sys.executable, "-c", code], cwd=WORKERS, capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 3, done.stderr
    assert done.stdout == ("outteardown\n" if use_mpi else "out")
    assert done.stderr == "err"
