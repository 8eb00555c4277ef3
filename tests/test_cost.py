"""Cost model: the GEMM convention, the per-layer FLOP identities, and the roofline."""

from __future__ import annotations

import dataclasses

import pytest

from cocodiff.cost import (
    MATMUL_OPS,
    OPS,
    ZERO,
    Cost,
    LayerShape,
    gemm_cost,
    op_cost,
    roofline_seconds,
    step_flops,
)
from cocodiff.models import REGISTRY, ModelSpec

LINEAR_OPS = ("proj_q", "proj_k", "proj_v", "proj_out", "mlp")


def _ulysses_shape(spec: ModelSpec, tokens: int, num_ranks: int) -> LayerShape:
    """One rank's shape for an even split (tokens and heads divisible by num_ranks)."""
    assert tokens % num_ranks == 0 and spec.num_heads % num_ranks == 0
    return LayerShape(
        local_tokens=tokens // num_ranks,
        total_tokens=tokens,
        local_heads=spec.num_heads // num_ranks,
    )


def test_ops_vocabulary() -> None:
    assert OPS == (
        "norm",
        "proj_q",
        "proj_k",
        "proj_v",
        "qk_norm",
        "rope",
        "attention",
        "proj_out",
        "cross_attention",
        "mlp",
    )
    assert set(MATMUL_OPS) <= set(OPS)


def test_unknown_op_lists_valid_ones() -> None:
    shape = LayerShape(local_tokens=8, total_tokens=16, local_heads=1)
    with pytest.raises(ValueError, match=r"unknown operation 'softmax'; valid: norm, proj_q, "):
        op_cost(REGISTRY["flux1-dev"], "softmax", shape)


def test_gemm_convention() -> None:
    assert gemm_cost(3, 5, 7, 2) == Cost(2 * 3 * 5 * 7, (3 * 5 + 5 * 7 + 3 * 7) * 2)


def test_projection_is_a_d_by_d_gemm_on_local_tokens() -> None:
    spec = REGISTRY["flux1-dev"]
    d, s_loc = spec.hidden_size, 576
    shape = LayerShape(local_tokens=s_loc, total_tokens=4608, local_heads=3)
    for op in ("proj_q", "proj_k", "proj_v", "proj_out"):
        cost = op_cost(spec, op, shape)
        assert cost.flops == 2 * s_loc * d * d
        assert cost.memory_bytes == (s_loc * d + d * d + s_loc * d) * 2


@pytest.mark.parametrize("name", ["flux1-dev", "sd35-large", "qwen-image", "pixart-sigma"])
@pytest.mark.parametrize("num_ranks", [1, 2, 8])
def test_linear_flops_are_24_s_d_squared(name: str, num_ranks: int) -> None:
    spec = REGISTRY[name]
    assert spec.mlp_ratio == 4.0
    tokens = 1024 * 8
    shape = LayerShape(local_tokens=tokens // num_ranks, total_tokens=tokens, local_heads=1)
    linear = sum(op_cost(spec, op, shape).flops for op in LINEAR_OPS)
    assert linear == 24 * shape.local_tokens * spec.hidden_size**2
    assert op_cost(spec, "mlp", shape).flops == 16 * shape.local_tokens * spec.hidden_size**2


@pytest.mark.parametrize("name", ["flux2-dev", "wan21-14b"])
def test_mlp_uses_the_spec_ratio(name: str) -> None:
    spec = REGISTRY[name]
    shape = LayerShape(local_tokens=4096, total_tokens=4096, local_heads=spec.num_heads)
    expected = 4 * spec.mlp_ratio * shape.local_tokens * spec.hidden_size**2
    assert op_cost(spec, "mlp", shape).flops == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("name", "num_ranks"),
    [
        ("flux1-dev", 1),
        ("flux1-dev", 8),
        ("flux1-dev", 24),
        ("sd35-large", 2),
        ("sd35-large", 19),
        ("flux2-dev", 48),
        ("wan21-14b", 4),
        ("wan21-14b", 40),
    ],
)
def test_attention_over_ranks_is_4_s_squared_d(name: str, num_ranks: int) -> None:
    spec = REGISTRY[name]
    tokens = 960 * num_ranks
    shape = _ulysses_shape(spec, tokens, num_ranks)
    per_rank = op_cost(spec, "attention", shape)
    assert per_rank.flops * num_ranks == 4 * tokens**2 * spec.hidden_size
    # Flash-style: Q, K, V and O of the rank's heads over the whole sequence, no S x S matrix.
    assert per_rank.memory_bytes == 4 * tokens * shape.local_heads * spec.head_dim * 2


def test_cross_attention_only_for_cross_attention_models() -> None:
    shape = LayerShape(local_tokens=1024, total_tokens=4096, local_heads=4)
    for name in ("flux1-dev", "sd35-large", "qwen-image", "flux2-dev", "dit-xl-2"):
        assert op_cost(REGISTRY[name], "cross_attention", shape) == ZERO


@pytest.mark.parametrize("name", ["wan21-14b", "pixart-sigma"])
def test_cross_attention_flops(name: str) -> None:
    spec = REGISTRY[name]
    d, text = spec.hidden_size, spec.cross_attention_tokens
    shape = LayerShape(local_tokens=4095, total_tokens=32_760, local_heads=5)
    s_loc = shape.local_tokens
    expected = (
        2 * 2 * s_loc * d * d  # Q and output projections of the local tokens
        + 2 * 2 * text * d * d  # K and V projections of the (replicated) text
        + 4 * s_loc * text * d  # all heads, local tokens against the text
    )
    assert op_cost(spec, "cross_attention", shape).flops == expected


@pytest.mark.parametrize(
    ("name", "qk_norm", "rope"),
    [
        ("flux1-dev", True, True),
        ("wan21-14b", True, True),
        ("sd35-large", True, False),
        ("pixart-sigma", False, False),
        ("dit-xl-2", False, False),
    ],
)
def test_qk_norm_and_rope_only_where_the_model_has_them(
    name: str, qk_norm: bool, rope: bool
) -> None:
    spec = REGISTRY[name]
    shape = LayerShape(local_tokens=512, total_tokens=4096, local_heads=2)
    q_and_k_bytes = 2 * 2 * shape.local_tokens * spec.hidden_size * 2  # read + write each
    for op, present in (("qk_norm", qk_norm), ("rope", rope)):
        cost = op_cost(spec, op, shape)
        if present:
            assert cost.memory_bytes == q_and_k_bytes
            assert 0 < cost.flops < 10 * 2 * shape.local_tokens * spec.hidden_size
        else:
            assert cost == ZERO


def test_norm_is_elementwise_and_memory_bound() -> None:
    spec = REGISTRY["qwen-image"]
    shape = LayerShape(local_tokens=2048, total_tokens=16_384, local_heads=3)
    norm = op_cost(spec, "norm", shape)
    elements = shape.local_tokens * spec.hidden_size
    assert norm.memory_bytes == 2 * 2 * elements * 2  # two passes, read + write
    # A few FLOPs per byte at most: far below any device's ridge point.
    assert norm.flops / norm.memory_bytes < 4


def test_dtype_bytes_scales_memory_not_flops() -> None:
    spec = REGISTRY["sd35-large"]
    bf16 = LayerShape(local_tokens=1024, total_tokens=2048, local_heads=19)
    fp32 = dataclasses.replace(bf16, dtype_bytes=4)
    for op in OPS:
        half, full = op_cost(spec, op, bf16), op_cost(spec, op, fp32)
        assert full.flops == half.flops
        assert full.memory_bytes == 2 * half.memory_bytes


def test_step_flops_textbook_formula() -> None:
    flux = REGISTRY["flux1-dev"]
    s, d = flux.sequence_tokens(1024, 1024), flux.hidden_size
    assert step_flops(flux, s) == 57 * (24 * s * d**2 + 4 * s**2 * d)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_step_flops_is_the_sum_of_matmul_ops_on_one_device(name: str) -> None:
    spec = REGISTRY[name]
    tokens = 4096
    shape = LayerShape(local_tokens=tokens, total_tokens=tokens, local_heads=spec.num_heads)
    per_layer = sum(op_cost(spec, op, shape).flops for op in MATMUL_OPS)
    assert step_flops(spec, tokens) == pytest.approx(spec.num_layers * per_layer, rel=1e-12)


def test_roofline_compute_bound() -> None:
    cost = Cost(flops=256e12, memory_bytes=1e9)  # 1 s of compute, 1 ms of memory
    assert roofline_seconds(cost, tflops=256, memory_gbps=1000) == pytest.approx(1.0)


def test_roofline_memory_bound() -> None:
    cost = Cost(flops=256e9, memory_bytes=2e12)  # 1 ms of compute, 2 s of memory
    assert roofline_seconds(cost, tflops=256, memory_gbps=1000) == pytest.approx(2.0)


def test_big_gemm_is_compute_bound_and_norm_memory_bound() -> None:
    # Aurora tile figures: ~256 TF/s BF16 GEMM, ~1 TB/s HBM.
    spec = REGISTRY["flux1-dev"]
    shape = LayerShape(local_tokens=4608 // 12 + 1, total_tokens=4620, local_heads=2)
    mlp = op_cost(spec, "mlp", shape)
    norm = op_cost(spec, "norm", shape)
    assert roofline_seconds(mlp, 256, 1000) == pytest.approx(mlp.flops / 256e12)
    assert roofline_seconds(norm, 256, 1000) == pytest.approx(norm.memory_bytes / 1000e9)


@pytest.mark.parametrize(("tflops", "gbps"), [(0, 1000), (256, 0), (-1, 1000)])
def test_roofline_rejects_non_positive_rates(tflops: float, gbps: float) -> None:
    with pytest.raises(ValueError, match="device rates must be positive"):
        roofline_seconds(Cost(1.0, 1.0), tflops, gbps)


def test_cost_addition() -> None:
    assert Cost(1.0, 2.0) + Cost(3.0, 4.0) == Cost(4.0, 6.0)
    assert sum([Cost(1.0, 1.0)] * 3, ZERO) == Cost(3.0, 3.0)
    with pytest.raises(TypeError):
        Cost(1.0, 2.0) + 1  # type: ignore[operator]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"local_tokens": 0, "total_tokens": 8, "local_heads": 1}, "local_tokens must be"),
        ({"local_tokens": 4, "total_tokens": 8, "local_heads": -1}, "local_heads must be"),
        (
            {"local_tokens": 4, "total_tokens": 8, "local_heads": 1, "dtype_bytes": 0},
            "dtype_bytes must be",
        ),
        (
            {"local_tokens": 9, "total_tokens": 8, "local_heads": 1},
            "local_tokens 9 exceeds total_tokens 8",
        ),
    ],
)
def test_layer_shape_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LayerShape(**kwargs)
