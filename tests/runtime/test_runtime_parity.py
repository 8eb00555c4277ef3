"""Exactness: the Ulysses-parallel transformer equals the single-process diffusers
transformer (float32, atol = rtol = 1e-5) on real CPU ranks, over torch.distributed
(gloo, launched by torchrun) and mpi4py (launched by mpiexec):

* flat on 2 ranks, every tiny model;
* flat, TAPA and V-First (also in 2 pipelined chunks) on 4 ranks as 2 nodes x 2 GPUs,
  every tiny model;
* TAPA in 2 and 3 chunks and V-First in 3 on the same 4 ranks with one head per rank
  (chunks cut tokens: ``cocodiff.plan.chunking``), tiny FLUX and tiny Wan;
* TAPA and V-First on 8 ranks as 2 x 2 x 2 (every level a phase), on tiny FLUX and
  tiny Wan built with 8 heads (the tiny models have 4; 8-rank jobs are heavy on a small
  machine, so two families only: joint attention with 2D RoPE, video with 3D RoPE and
  cross-attention).

One launch per configuration, all models and schedules inside: each launch costs ~13 s
of imports."""

import pytest
from launching import WORKERS, launcher_prefix, needs_mpi, needs_torchrun, run_job

from cocodiff.runtime.families import runtime_family
from cocodiff.runtime.tiny import TINY_MODELS, build_tiny

# Every built-in tiny model (test_every_tiny_model_has_a_family keeps it so).
SUPPORTED = list(TINY_MODELS)

# (ranks, layout, schedules, models)
CONFIGURATIONS = {
    "2-line": (2, "line", "flat", SUPPORTED),
    # 8 heads over 4 ranks: blocks of 2 rows, which 2 pipeline chunks split
    "4-2x2x1": (4, "2x2x1", "flat,tapa,vfirst,vfirst/2", [*SUPPORTED, "tiny-flux:8"]),
    "8-2x2x2": (8, "2x2x2", "tapa,vfirst", ["tiny-flux:8", "tiny-wan:8"]),
    # One head per rank: every block is one row, so 2 and 3 chunks cut each row's tokens
    # (vfirst/2 above, on the 4-head models, too); two families keep the launch short.
    "4-2x2x1-tokens": (4, "2x2x1", "tapa/2,tapa/3,vfirst/3", ["tiny-flux", "tiny-wan"]),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
@pytest.mark.parametrize(
    ("launcher", "transport"),
    [
        pytest.param("torchrun", "torch", marks=needs_torchrun),
        pytest.param("mpiexec", "mpi", marks=needs_mpi),
    ],
)
def test_plans_match_single_process(launcher, transport, configuration, tmp_path):
    num_ranks, layout, schedules, models = CONFIGURATIONS[configuration]
    cmd = launcher_prefix(launcher, num_ranks) + [
        str(WORKERS / "parity.py"), transport, layout, schedules, *models
    ]
    result = run_job(cmd, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [line for line in result.stdout.splitlines() if line.startswith("parity ")]
    assert len(reports) == len(schedules.split(",")) * len(models), result.stdout[-3000:]


@pytest.mark.parametrize("model", list(TINY_MODELS))
def test_every_tiny_model_has_a_family(model):
    transformer_class = type(build_tiny(model).transformer).__name__
    runtime_family(transformer_class)  # raises when the runtime has no family for it
