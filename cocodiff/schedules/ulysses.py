"""Building blocks shared by the Ulysses schedules: the head/token split, the layer's
compute steps with their costs, and the four head exchanges."""

from __future__ import annotations

from collections.abc import Sequence

from cocodiff.cost import LayerShape, op_cost
from cocodiff.models import ModelSpec
from cocodiff.plan.steps import Compute, Exchange, HeadSplit, Tensor
from cocodiff.util.errors import ScheduleError


def split_heads(num_heads: int, num_ranks: int) -> tuple[int, ...]:
    """Heads per rank when they may not divide evenly.

    Rank r owns the contiguous heads ``[floor(r*H/P), floor((r+1)*H/P))``: counts differ
    by at most one (uneven splits, as DeepSpeed-Ulysses allows), and the larger shares
    are spread evenly over the ranks, so the split repeats every ``P / gcd(P, H)`` ranks
    and stays node-symmetric wherever that divides the ranks per node.

    With more ranks than heads some ranks hold no head during attention: they still
    project and exchange their tokens, but attention runs on ``H`` ranks only. That is
    the pure-Ulysses limit made visible, not hidden.
    """
    if num_ranks < 1:
        raise ScheduleError(f"need at least one rank, got {num_ranks}")
    bounds = [rank * num_heads // num_ranks for rank in range(num_ranks + 1)]
    return tuple(bounds[rank + 1] - bounds[rank] for rank in range(num_ranks))


def head_split(
    spec: ModelSpec, num_ranks: int, stream_tokens: Sequence[int], batch: int = 1
) -> HeadSplit:
    """Split the token streams (image, joint text) and the heads over ``num_ranks``.

    Each stream is cut into equal chunks, one per rank, padded when it does not divide
    (the runtime does the same: ``cocodiff.runtime.sharding``).
    """
    streams = tuple(int(tokens) for tokens in stream_tokens if tokens > 0)
    if not streams:
        raise ScheduleError("a plan needs at least one token")
    padded = sum(-(-tokens // num_ranks) for tokens in streams) * num_ranks
    return HeadSplit(sum(streams), padded, split_heads(spec.num_heads, num_ranks),
                     spec.head_dim, batch)




def layer_shape(split: HeadSplit, rank_in_group: int, dtype_bytes: int) -> LayerShape:
    return LayerShape(
        local_tokens=split.local_tokens,
        total_tokens=split.padded_tokens,
        local_heads=split.heads[rank_in_group],
        dtype_bytes=dtype_bytes,
    )


def qk_ops(spec: ModelSpec) -> tuple[str, ...]:
    """What Q and K go through after projection (and V does not): V-First hides V's
    exchange behind these."""
    return (("qk_norm",) if spec.has_qk_norm else ()) + (("rope",) if spec.has_rope else ())


def post_attention_ops(spec: ModelSpec) -> tuple[str, ...]:
    """What the block does after self/joint attention, outside the attention processor."""
    return (("cross_attention",) if spec.cross_attention_tokens else ()) + ("mlp",)


def compute(spec: ModelSpec, op: str, shape: LayerShape, batch: int = 1) -> Compute:
    """A compute step; costs are per sample, so a batch multiplies them."""
    cost = op_cost(spec, op, shape)
    return Compute(op, cost.times(batch))


def head_exchange(
    tensor: Tensor,
    split: HeadSplit,
    group: tuple[int, ...],
    rank_in_group: int,
    dtype_bytes: int,
) -> Exchange:
    """The all-to-all of one attention tensor over a Ulysses group.

    Rows are (head, local token block) pairs of ``local_tokens x head_dim`` values:
    Q/K/V go (S/P tokens, all heads) -> (S tokens, my heads): I send member j its
    heads' rows and receive my heads' rows from everyone; the output goes back.
    """
    heads = split.heads
    row_bytes = split.batch * split.local_tokens * split.head_dim * dtype_bytes
    mine = heads[rank_in_group]
    if tensor == "out":
        # (S, H/P, d) -> (S/P, H, d): my heads of every member's tokens go back to it.
        return Exchange(tensor, group, (mine,) * len(group), heads, row_bytes, "gather_heads")
    # (S/P, H, d) -> (S, H/P, d)
    return Exchange(tensor, group, heads, (mine,) * len(group), row_bytes, "scatter_heads")


def smallest_period(values: tuple[int, ...]) -> int:
    """The smallest p dividing len(values) with values[i] == values[i % p]."""
    n = len(values)
    for period in range(1, n + 1):
        if n % period == 0 and all(values[i] == values[i % period] for i in range(n)):
            return period
    return n
