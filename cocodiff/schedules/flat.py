"""The Ulysses schedules, from the flat baseline to CoCoDiff.

Per layer and rank, every schedule runs the same steps: Q/K/V projections, Q/K norm
and RoPE, the Q, K and V all-to-alls, attention on the local heads over the whole
sequence, the output all-to-all and the output projection; the block's norms, MLP
and cross-attention run outside attention. They differ in order and in how an
all-to-all is carried:

* ``flat``: the three input all-to-alls over all ranks one after another, each waited
  before the next starts (DeepSpeed-Ulysses, yunchang, diffusers' context parallelism).
* ``tapa``: the same order; every all-to-all as topology-aligned phases
  (:mod:`cocodiff.schedules.tapa`).
* ``vfirst``: TAPA, and V first: V is projected and its exchange started before the
  Q/K projections, norm and RoPE, which hide it; Q's and K's exchanges then run
  together.
* ``cocodiff``: V-First TAPA plus V-Major: on the inter-node tier only the active
  fraction of V's rows is sent (:mod:`cocodiff.schedules.vmajor`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from cocodiff.models import ModelSpec
from cocodiff.plan.steps import (
    Exchange,
    HeadSplit,
    LayerPlan,
    Plan,
    RankProgram,
    Step,
    Tensor,
    Wait,
)
from cocodiff.plan.vblocks import blocks_per_row
from cocodiff.schedules.grid import RankGrid
from cocodiff.schedules.options import DEFAULT_OPTIONS, PlanOptions
from cocodiff.schedules.tapa import TapaRows
from cocodiff.schedules.ulysses import (
    compute,
    head_exchange,
    head_split,
    layer_shape,
    post_attention_ops,
    qk_ops,
    smallest_period,
)
from cocodiff.util.errors import ScheduleError

ExchangeFor = Callable[[Tensor, int], Exchange]
"""(tensor, global rank) -> that rank's exchange of the tensor."""


def plan_flat(spec: ModelSpec, grid: RankGrid, stream_tokens: Sequence[int],
              options: PlanOptions = DEFAULT_OPTIONS) -> Plan:
    """Flat Ulysses over every rank of ``grid``.

    Args:
        spec: the model.
        grid: the ranks (only their number matters here).
        stream_tokens: tokens of each stream one sample attends over jointly (image,
            joint-attention text); each is split over the ranks separately.
        options: dtype and batch (flat has no phases: ``chunks`` does not apply).
    """
    split = head_split(spec, grid.num_ranks, stream_tokens, options.batch)
    dtype_bytes = options.dtype_bytes

    def exchange(tensor: Tensor, rank: int) -> Exchange:
        return head_exchange(tensor, split, grid.ranks, grid.position(rank), dtype_bytes)

    return build_plan("flat", spec, split, grid, dtype_bytes, exchange, v_first=False,
                      share_key=lambda rank: split.heads[grid.position(rank)])


def plan_tapa(spec: ModelSpec, grid: RankGrid, stream_tokens: Sequence[int],
              options: PlanOptions = DEFAULT_OPTIONS) -> Plan:
    """Flat Ulysses order, every all-to-all as TAPA phases."""
    return plan_phased("tapa", spec, grid, stream_tokens, options, v_first=False)


def plan_vfirst(spec: ModelSpec, grid: RankGrid, stream_tokens: Sequence[int],
                options: PlanOptions = DEFAULT_OPTIONS) -> Plan:
    """TAPA phases with V's exchange started first."""
    return plan_phased("vfirst", spec, grid, stream_tokens, options, v_first=True)


def plan_cocodiff(spec: ModelSpec, grid: RankGrid, stream_tokens: Sequence[int],
                  options: PlanOptions = DEFAULT_OPTIONS, cache_ratio: float = 0.0) -> Plan:
    """TAPA + V-First + V-Major at one step's cache ratio: V's phases on
    ``options.vmajor.slow_levels`` send ``1 - cache_ratio`` of their blocks. With
    ``options.vmajor`` None no phase is selective (the exact plan)."""
    if not 0.0 <= cache_ratio <= 1.0:
        raise ScheduleError(f"V-Major ratio {cache_ratio} is outside [0, 1]")
    levels = options.vmajor.slow_levels if options.vmajor is not None else ()
    fraction = {"v": {level: 1.0 - cache_ratio for level in levels}}
    return plan_phased("cocodiff", spec, grid, stream_tokens, options, v_first=True,
                       sent_fraction=fraction)


def plan_phased(name: str, spec: ModelSpec, grid: RankGrid, stream_tokens: Sequence[int],
                options: PlanOptions, v_first: bool,
                sent_fraction: dict[Tensor, dict[str, float]] | None = None) -> Plan:
    """A TAPA plan; ``sent_fraction[tensor][level]`` makes a phase partial (V-Major)."""
    split = head_split(spec, grid.num_ranks, stream_tokens, options.batch)
    dtype_bytes = options.dtype_bytes
    rows = {tensor: TapaRows(grid, split.heads, "gather_heads" if tensor == "out"
                             else "scatter_heads") for tensor in ("q", "k", "v", "out")}

    def exchange(tensor: Tensor, rank: int) -> Exchange:
        flat = head_exchange(tensor, split, grid.ranks, grid.position(rank), dtype_bytes)
        return rows[tensor].exchange(flat, rank, options.chunks,
                                     (sent_fraction or {}).get(tensor), blocks_per_row(split),
                                     split.local_tokens)

    return build_plan(name, spec, split, grid, dtype_bytes, exchange, v_first,
                      share_key=None)


def build_plan(name: str, spec: ModelSpec, split: HeadSplit, grid: RankGrid,
               dtype_bytes: int, exchange: ExchangeFor, v_first: bool,
               share_key: Callable[[int], Hashable] | None) -> Plan:
    """One program per rank. Ranks with equal ``share_key`` get the same layer object
    (flat Ulysses: ranks with equal head counts do exactly the same thing)."""
    shared: dict[Hashable, LayerPlan] = {}
    programs = []
    for rank in range(grid.num_ranks):
        key = share_key(rank) if share_key else None
        layer = shared.get(key) if key is not None else None
        if layer is None:
            layer = ulysses_layer(spec, split, grid.position(rank), dtype_bytes,
                                  lambda tensor, rank=rank: exchange(tensor, rank), v_first)
            if key is not None:
                shared[key] = layer
        programs.append(RankProgram(rank, (layer,) * spec.num_layers))
    # The plan repeats every `period` ranks when heads do and ranks sit in grid order.
    in_order = grid.ranks == tuple(range(grid.num_ranks))
    return Plan(name, spec.name, split, tuple(programs),
                smallest_period(split.heads) if in_order else None)


def ulysses_layer(spec: ModelSpec, split: HeadSplit, index: int, dtype_bytes: int,
                  exchange: Callable[[Tensor], Exchange], v_first: bool) -> LayerPlan:
    """One layer on the rank at ``index`` of the Ulysses group."""
    shape = layer_shape(split, index, dtype_bytes)
    batch = split.batch

    def op(name: str):
        return compute(spec, name, shape, batch)

    attention: list[Step] = []
    if v_first:
        attention += [op("proj_v"), exchange("v")]
        attention += [op(name) for name in ("proj_q", "proj_k", *qk_ops(spec))]
        attention += [exchange("q"), exchange("k"), Wait("q"), Wait("k"), Wait("v")]
    else:
        attention += [op(name) for name in ("proj_q", "proj_k", "proj_v", *qk_ops(spec))]
        for tensor in ("q", "k", "v"):
            attention += [exchange(tensor), Wait(tensor)]
    attention += [op("attention"), exchange("out"), Wait("out"), op("proj_out")]
    return LayerPlan(
        before=(op("norm"),),
        attention=tuple(attention),
        after=tuple(op(name) for name in post_attention_ops(spec)),
    )
