"""Exactness: the Ulysses-parallel transformer equals the single-process diffusers
transformer (float32, atol = rtol = 1e-5) on 2 and 4 real CPU ranks, over
torch.distributed (gloo, launched by torchrun) and mpi4py (launched by mpiexec)."""

import pytest

from launching import WORKERS, launcher_prefix, needs_mpi, needs_torchrun, run_job
from cocodiff.runtime.families import FAMILIES
from cocodiff.runtime.tiny import TINY_MODELS

pytestmark = pytest.mark.multiprocess

SUPPORTED = [name for name in TINY_MODELS if name in ("tiny-flux",)]


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize(
    ("launcher", "transport"),
    [
        pytest.param("torchrun", "torch", marks=needs_torchrun),
        pytest.param("mpiexec", "mpi", marks=needs_mpi),
    ],
)
def test_flat_plan_matches_single_process(launcher, transport, num_ranks, tmp_path):
    cmd = launcher_prefix(launcher, num_ranks) + [
        str(WORKERS / "parity.py"), transport, "flat", *SUPPORTED
    ]
    result = run_job(cmd, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_every_tiny_model_has_a_family():
    assert len(FAMILIES) >= 1
