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

Hybrid layouts (cocodiff.runtime.hybrid, cases of tests/workers/hybrid_parity.py) ride in
the same jobs: on 4 ranks Ulysses 2 x Ring 2 (flat; TAPA with the Ring on the fast tier)
and batch 2 with Ring 2 or Ulysses 2; on 8 ranks Ulysses 4 x Ring 2 and Ulysses 2 x Ring 4,
flat and TAPA, on tiny FLUX and tiny Wan (torchrun only at 8 ranks: the MPI path is the
same code past the transport).

One launch per rank count and launcher, every group of models and cases inside: each
launch costs every rank ~6 CPU-s of imports, paid 8 times over on the same 2 cores."""

import pytest
from launching import WORKERS, launcher_prefix, needs_mpi, needs_torchrun, run_job

from cocodiff.runtime.families import runtime_family
from cocodiff.runtime.tiny import TINY_MODELS, build_tiny

# Every built-in tiny model (test_every_tiny_model_has_a_family keeps it so).
SUPPORTED = list(TINY_MODELS)
FLUX_WAN = ["tiny-flux", "tiny-wan"]

# job -> (ranks, layout, [(cases, models), ...]); a case is SCHEDULE[/CHUNKS] or, for a
# hybrid layout, UxRxB[i]/SCHEDULE (i: the Ring inside the Ulysses groups).
JOBS = {
    "2-line": (2, "line", [("flat", SUPPORTED)]),
    "4-2x2x1": (4, "2x2x1", [
        # 8 heads over 4 ranks: blocks of 2 rows, which 2 pipeline chunks split
        ("flat,tapa,vfirst,vfirst/2", [*SUPPORTED, "tiny-flux:8"]),
        # One head per rank: every block is one row, so 2 and 3 chunks cut each row's
        # tokens (vfirst/2 above, on the 4-head models, too).
        ("tapa/2,tapa/3,vfirst/3", FLUX_WAN),
        ("2x2x1/flat,2x2x1i/tapa,1x2x2/flat,2x1x2/vfirst", FLUX_WAN),
    ]),
    "8-2x2x2": (8, "2x2x2", [
        ("tapa,vfirst", ["tiny-flux:8", "tiny-wan:8"]),
        ("4x2x1/flat,4x2x1/tapa,2x4x1/flat,2x4x1/tapa", FLUX_WAN),
    ]),
}
# 8-rank jobs are heavy on a 2-core machine: MPI runs the Ulysses cases only there.
MPI_JOBS = {**JOBS, "8-2x2x2": (8, "2x2x2", JOBS["8-2x2x2"][2][:1])}


def worker_args(groups: list[tuple[str, list[str]]]) -> list[str]:
    args: list[str] = []
    for cases, models in groups:
        args += (["+"] if args else []) + [cases, *models]
    return args


@pytest.mark.multiprocess
@pytest.mark.parametrize("job", list(JOBS))
@pytest.mark.parametrize(
    ("launcher", "transport"),
    [
        pytest.param("torchrun", "torch", marks=needs_torchrun),
        pytest.param("mpiexec", "mpi", marks=needs_mpi),
    ],
)
def test_plans_match_single_process(launcher, transport, job, tmp_path):
    num_ranks, layout, groups = (MPI_JOBS if transport == "mpi" else JOBS)[job]
    cmd = launcher_prefix(launcher, num_ranks) + [
        str(WORKERS / "parity.py"), transport, layout, *worker_args(groups)
    ]
    result = run_job(cmd, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [line for line in result.stdout.splitlines()
               if line.startswith(("parity ", "hybrid "))]
    expected = sum(len(cases.split(",")) * len(models) for cases, models in groups)
    assert len(reports) == expected, result.stdout[-3000:]


@pytest.mark.parametrize("model", list(TINY_MODELS))
def test_every_tiny_model_has_a_family(model):
    transformer_class = type(build_tiny(model).transformer).__name__
    runtime_family(transformer_class)  # raises when the runtime has no family for it
