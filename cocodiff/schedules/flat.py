"""Flat Ulysses: the baseline every other schedule is measured against.

Per layer and rank: projections, Q/K norm and RoPE, then the Q, K and V all-to-alls
over all ranks one after another (each waited before the next starts, as
DeepSpeed-Ulysses, yunchang and diffusers' context parallelism do), attention on the
local heads over the whole sequence, the output all-to-all, the output projection,
then whatever the block does outside attention (cross-attention, MLP).
"""

from __future__ import annotations

from collections.abc import Sequence

from cocodiff.models import ModelSpec
from cocodiff.plan import Exchange, LayerPlan, Plan, RankProgram, Step, UlyssesLayout, Wait
from cocodiff.schedules.ulysses import (
    compute,
    head_exchange,
    layer_shape,
    post_attention_ops,
    qk_ops,
    smallest_period,
    ulysses_layout,
)


def plan_flat(
    spec: ModelSpec,
    num_ranks: int,
    stream_tokens: Sequence[int],
    dtype_bytes: int = 2,
    batch: int = 1,
) -> Plan:
    """The flat Ulysses plan for one denoising step.

    Args:
        spec: the model.
        num_ranks: ranks in the (single, world) Ulysses group.
        stream_tokens: tokens of each stream one sample attends over jointly (image,
            joint-attention text); each is split over the ranks separately.
        dtype_bytes: bytes per activation value (bf16: 2).
        batch: samples per step.
    """
    layout = ulysses_layout(spec, num_ranks, stream_tokens, batch)
    world = tuple(range(num_ranks))
    layers_by_heads: dict[int, LayerPlan] = {}
    programs = []
    for rank in range(num_ranks):
        local_heads = layout.heads[rank]
        if local_heads not in layers_by_heads:
            layers_by_heads[local_heads] = flat_layer(spec, layout, world, rank, dtype_bytes)
        programs.append(RankProgram(rank, (layers_by_heads[local_heads],) * spec.num_layers))
    return Plan("flat", spec.name, layout, tuple(programs), smallest_period(layout.heads))


def flat_layer(
    spec: ModelSpec,
    layout: UlyssesLayout,
    group: tuple[int, ...],
    rank_in_group: int,
    dtype_bytes: int,
) -> LayerPlan:
    shape = layer_shape(layout, rank_in_group, dtype_bytes)
    batch = layout.batch
    attention: list[Step] = [
        compute(spec, op, shape, batch) for op in ("proj_q", "proj_k", "proj_v", *qk_ops(spec))
    ]
    for tensor in ("q", "k", "v"):
        exchange: Exchange = head_exchange(tensor, layout, group, rank_in_group, dtype_bytes)
        attention += [exchange, Wait(tensor)]
    attention.append(compute(spec, "attention", shape, batch))
    attention += [head_exchange("out", layout, group, rank_in_group, dtype_bytes), Wait("out")]
    attention.append(compute(spec, "proj_out", shape, batch))
    after = [compute(spec, op, shape, batch) for op in post_attention_ops(spec)]
    return LayerPlan(
        before=(compute(spec, "norm", shape, batch),),
        attention=tuple(attention),
        after=tuple(after),
    )
