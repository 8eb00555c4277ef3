"""Hybrid layouts' attention pieces (cocodiff.runtime.hybrid).

In one process: partial attentions over disjoint key blocks, merged by their
log-sum-exp, equal attention over all keys (flash-for-CPU path and masked path).

On real CPU ranks: tests/runtime/test_runtime_parity.py, whose jobs carry the hybrid
layouts' cases (tests/workers/hybrid_parity.py) beside the plain schedules'.
"""

from __future__ import annotations

import pytest
import torch

from cocodiff.runtime.hybrid import _FLASH_CPU, merge_partial, partial_attention


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
