"""Hybrid layouts on real ranks (cocodiff.runtime.hybrid).

In one process: partial attentions over disjoint key blocks, merged by their
log-sum-exp, equal attention over all keys (flash-for-CPU path and masked path).

On real CPU ranks (torchrun/gloo; MPI on 4 ranks): every layout equals single-process
diffusers (float32, atol = rtol = 1e-5), transformer output and pipeline latents, for
tiny FLUX (joint attention, 2D RoPE, padded text) and tiny Wan (video, 3D RoPE,
cross-attention):

* 4 ranks as 2 nodes x 2 GPUs: Ulysses 2 x Ring 2 (flat; TAPA with the Ring on the fast
  tier), and batch 2 with Ring 2 or Ulysses 2;
* 8 ranks as 2 x 2 x 2: Ulysses 4 x Ring 2 and Ulysses 2 x Ring 4, flat and TAPA (with
  Ulysses 4 inside a node, TAPA carries each exchange as GPU and tile phases).
"""

from __future__ import annotations

import pytest
import torch
from launching import WORKERS, launcher_prefix, needs_mpi, needs_torchrun, run_job

from cocodiff.runtime.hybrid import _FLASH_CPU, merge_partial, partial_attention

# (ranks, rank grid, cases, models); a case is UxRxB[i]/schedule (i: Ring inner)
CONFIGURATIONS = {
    "4-2x2x1": (4, "2x2x1", "2x2x1/flat,2x2x1i/tapa,1x2x2/flat,2x1x2/vfirst",
                ["tiny-flux", "tiny-wan"]),
    "8-2x2x2": (8, "2x2x2", "4x2x1/flat,4x2x1/tapa,2x4x1/flat,2x4x1/tapa",
                ["tiny-flux", "tiny-wan"]),
}


def test_flash_attention_for_cpu_returns_the_log_sum_exp():
    assert _FLASH_CPU is not None
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    out, lse = _FLASH_CPU(q, k, v)
    scores = q @ k.transpose(-1, -2) / 8**0.5
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v)


@pytest.mark.parametrize("masked", [False, True])
def test_merged_blocks_equal_attention_over_all_keys(masked):
    generator = torch.Generator().manual_seed(0)
    # (B, S, h, D)
    q = torch.randn(2, 6, 3, 8, generator=generator)
    k = torch.randn(2, 11, 3, 8, generator=generator)
    v = torch.randn(2, 11, 3, 8, generator=generator)
    mask = torch.rand(2, 1, 6, 11, generator=generator) > 0.3 if masked else None
    if mask is not None:
        mask[..., 0] = True  # every query sees a key
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    merged = None
    for keys in (slice(0, 4), slice(4, 5), slice(5, 11)):
        part_mask = None if mask is None else mask[..., keys]
        merged = merge_partial(merged, partial_attention(q, k[:, keys], v[:, keys], part_mask))
    torch.testing.assert_close(merged[0], expected, atol=1e-6, rtol=1e-5)


# Every configuration over torch/gloo; MPI on 4 ranks only (8-rank jobs are heavy on a
# 2-core machine, and the MPI path is the same code past the transport).
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("launcher", "transport", "configuration"),
    [pytest.param("torchrun", "torch", name, marks=needs_torchrun) for name in CONFIGURATIONS]
    + [pytest.param("mpiexec", "mpi", "4-2x2x1", marks=needs_mpi)],
)
def test_hybrid_layouts_match_single_process(launcher, transport, configuration, tmp_path):
    num_ranks, grid, cases, models = CONFIGURATIONS[configuration]
    cmd = launcher_prefix(launcher, num_ranks) + [
        str(WORKERS / "hybrid_parity.py"), transport, grid, cases, *models
    ]
    result = run_job(cmd, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [line for line in result.stdout.splitlines() if line.startswith("hybrid ")]
    assert len(reports) == len(cases.split(",")) * len(models), result.stdout[-3000:]
