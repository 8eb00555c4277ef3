"""The diffusers baseline (``cocodiff run --schedule diffusers``): diffusers' own Ulysses
context parallelism on the same model, weights and inputs as our schedules.

* on 2 ranks over gloo it gives the single-process pipeline's latents (float32, atol = rtol
  = 1e-5) for every tiny model diffusers has a context-parallel plan for, and really runs
  its all-to-alls;
* what it cannot run (the MPI transport, a model without a plan, heads or tokens that do
  not split evenly) is refused with one line."""

import pytest
import torch
from diffusers.models._modeling_parallel import ContextParallelInput
from launching import WORKERS, launcher_prefix, needs_mpi, needs_torchrun, run_job

from cocodiff.models import FAMILIES
from cocodiff.runtime.baseline import _even_split_check, enable_diffusers_ulysses
from cocodiff.runtime.tiny import build_tiny
from cocodiff.util.errors import CocodiffError
from transports.base import Group

# The tiny models whose transformer class diffusers has a _cp_plan for.
WITH_CP_PLAN = [tiny.name for family in FAMILIES.values() if family.diffusers_context_parallel
                for tiny in family.tiny_models]


@needs_torchrun
@pytest.mark.multiprocess
def test_diffusers_baseline_matches_single_process(tmp_path):
    cmd = launcher_prefix("torchrun", 2) + [str(WORKERS / "baseline_parity.py"), *WITH_CP_PLAN]
    result = run_job(cmd, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [line for line in result.stdout.splitlines() if line.startswith("baseline-parity")]
    assert len(reports) == len(WITH_CP_PLAN), result.stdout[-3000:]


@needs_mpi
@pytest.mark.multiprocess
def test_the_mpi_transport_is_refused_in_one_line(tmp_path):
    cmd = launcher_prefix("mpiexec", 2) + [
        "-m", "cocodiff", "run", "--quiet", "--steps", "1", "--schedule", "diffusers",
    ]
    result = run_job(cmd, tmp_path, timeout_s=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "cocodiff run" in line]
    assert lines == ["cocodiff run: error: --schedule diffusers runs diffusers' own context "
                     "parallelism, which works over torch.distributed only: use --transport "
                     "torch (got mpi)"]
    assert "Traceback" not in result.stderr


class _Transport:
    """Just enough of a transport for the checks made before diffusers is touched."""

    def __init__(self, name: str, world_size: int) -> None:
        self.name, self.rank, self.world_size = name, 0, world_size
        self.world = Group(tuple(range(world_size)))


@pytest.mark.parametrize(
    ("model", "transport", "message"),
    [
        ("tiny-flux", _Transport("mpi", 2), r"torch\.distributed only: use --transport torch"),
        ("tiny-sd3", _Transport("torch", 2), "no context-parallel plan for SD3Transformer2DModel"),
        ("tiny-pixart", _Transport("torch", 2),
         "no context-parallel plan for PixArtTransformer2DModel"),
        ("tiny-flux", _Transport("torch", 3), "splits the 4 heads .* 3 ranks do not divide"),
    ],
)
def test_what_diffusers_cannot_run_is_refused(model, transport, message):
    pipe = build_tiny(model)
    with pytest.raises(CocodiffError, match=message):
        enable_diffusers_ulysses(pipe, transport)
    assert pipe.transformer._parallel_config is None  # left untouched


def test_a_stream_that_does_not_split_evenly_is_refused_before_diffusers_splits_it():
    check = _even_split_check(
        {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
        world_size=2,
    )
    module = torch.nn.Identity()
    module.forward = lambda hidden_states: hidden_states  # the hook reads the signature
    check(module, (), {"hidden_states": torch.zeros(1, 64, 8)})  # 64 tokens split evenly
    with pytest.raises(CocodiffError, match=r"hidden_states \(81 tokens\) .* 2 ranks do not "
                       "divide 81"):
        check(module, (), {"hidden_states": torch.zeros(1, 81, 8)})
