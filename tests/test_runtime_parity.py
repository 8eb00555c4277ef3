"""Exactness: the Ulysses-parallel transformer equals the single-process diffusers
transformer (float32, atol = rtol = 1e-5) on 2 and 4 real CPU ranks, over
torch.distributed (gloo, launched by torchrun) and mpi4py (launched by mpiexec)."""

import pytest
from launching import WORKERS, launcher_prefix, needs_mpi, needs_torchrun, run_job

from cocodiff.runtime.families import FAMILIES
from cocodiff.runtime.tiny import TINY_MODELS, build_tiny

# Every built-in tiny model (test_every_tiny_model_has_a_family keeps it so), all in one
# launch per configuration: each launch costs ~13 s of imports.
SUPPORTED = list(TINY_MODELS)


@pytest.mark.multiprocess
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


@pytest.mark.parametrize("model", list(TINY_MODELS))
def test_every_tiny_model_has_a_family(model):
    transformer_class = type(build_tiny(model).transformer).__name__
    assert transformer_class in FAMILIES, f"{model}: no runtime family for {transformer_class}"
    assert FAMILIES[transformer_class].transformer_class == transformer_class
