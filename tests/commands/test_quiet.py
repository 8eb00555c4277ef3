"""Quiet by default: a command's stderr carries nothing from the libraries underneath
(transformers' "requires torchvision" notes, deprecations inside diffusers) unless the user
asks with ``--verbose``. A user reads anything on stderr as a problem."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from importlib.util import find_spec

import pytest
from launching import REPO, job_env, launcher_prefix, needs_mpi, run_job

from cocodiff.runtime.quiet import THIRD_PARTY_MODULES

# What the libraries print as they load and run: their loggers' "[transformers] ..." lines
# and Python warnings ("...: FutureWarning: ...").
CHATTER = re.compile(r"^\[(transformers|diffusers)\]|torchvision|Warning: ", flags=re.M)


def _chatter(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if CHATTER.search(line)]


def test_verbose_in_process_undoes_only_what_quiet_set(monkeypatch) -> None:
    """Commands run in one process (tests, a notebook): a quiet one sets the libraries'
    variables, a later ``--verbose`` one takes back those, never a user's own."""
    from cocodiff.runtime import quiet

    monkeypatch.setenv("DIFFUSERS_VERBOSITY", "info")  # the user's
    for name in ("TRANSFORMERS_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS",
                 quiet._QUIETED_ENV, quiet.VERBOSE_ENV):
        monkeypatch.setenv(name, "")  # records the caller's value, restored after the test
        monkeypatch.delenv(name)
    with warnings.catch_warnings():
        quiet.quiet_third_party()
        assert os.environ["TRANSFORMERS_VERBOSITY"] == "error" and not quiet.verbose()
        assert os.environ["DIFFUSERS_VERBOSITY"] == "info"
        quiet.quiet_third_party(show=True)
    assert "TRANSFORMERS_VERBOSITY" not in os.environ and quiet.verbose()
    assert os.environ["DIFFUSERS_VERBOSITY"] == "info"


def test_the_libraries_are_matched_by_package_not_by_prefix() -> None:
    pattern = re.compile(THIRD_PARTY_MODULES)
    assert all(pattern.match(name) for name in (
        "transformers", "transformers.utils.import_utils", "diffusers.models", "torch.nn"))
    assert not any(pattern.match(name) for name in (
        "torchvision_like", "cocodiff.runtime", "transports.torch_dist", "topology"))


@pytest.mark.skipif(find_spec("torchvision") is not None,
                    reason="torchvision is installed: transformers has nothing to say")
@pytest.mark.multiprocess
def test_verbose_shows_what_the_default_silences(tmp_path) -> None:
    """Where torchvision is missing, transformers writes a note per image processor as
    diffusers' pipelines load: ``--verbose`` lets them through, so the silence the test
    below checks is the default's doing, not an environment with nothing to say."""
    # Run from a clean environment: an earlier in-process command (or the caller's shell)
    # may have set the libraries' own verbosity variables.
    env = {name: value for name, value in job_env(tmp_path).items()
           if name not in ("TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY",
                           "TRANSFORMERS_NO_ADVISORY_WARNINGS", "COCODIFF_QUIETED")}
    job = subprocess.run([sys.executable, "-m", "cocodiff", "export-tiny", "tiny-flux",
                          str(tmp_path / "tiny"), "--verbose"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert job.returncode == 0, job.stderr
    assert job.stdout.startswith("saved tiny-flux to")
    assert _chatter(job.stderr), "expected transformers' notes under --verbose"


@needs_mpi
@pytest.mark.multiprocess
def test_calibrate_under_mpiexec_prints_its_report_and_nothing_else(tmp_path) -> None:
    """Issue 40's case: ``mpiexec -n 4 cocodiff calibrate --model tiny-flux`` printed
    eight ``[transformers] ... requires torchvision`` lines before its report (here 2
    ranks and --quick, the same code path)."""
    job = run_job([*launcher_prefix("mpiexec", 2), "-m", "cocodiff", "calibrate",
                   "--model", "tiny-flux", "--quick", "--output", str(tmp_path / "c.toml")],
                  tmp_path)
    assert job.returncode == 0, job.stderr
    assert not _chatter(job.stderr), job.stderr
    assert job.stdout.startswith("calibrated 1 node(s) x 2 ranks over mpi")
