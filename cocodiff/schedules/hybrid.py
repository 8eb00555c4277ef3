"""Hybrid plans: a Ulysses schedule inside every Ulysses group, Ring attention across them.

For a :class:`~cocodiff.layout.ParallelLayout` (``ulysses x ring x batch`` ranks):

1. every Ulysses group runs the named Ulysses schedule (``flat``, ``tapa``, ``vfirst``,
   ``cocodiff``) exactly as a pure-Ulysses plan over its ``ulysses`` ranks would, on its
   share of the sequence: each stream's ``ceil(T / (ulysses * ring))``-token chunk per
   rank, ``batch_size / batch`` samples. TAPA's phases follow the group's own box of
   (node, GPU, tile) coordinates. The plan is made once over local ranks 0..U-1 and
   relabelled onto each group's global ranks;
2. with ``ring > 1``, the attention compute step becomes the Ring: ``ring`` blocks of
   attention (this rank's Q against one K/V block of ``S / ring`` tokens each), with the
   pass of the block in hand to the next Ring member started before each block's
   attention and waited after it, so the pass hides behind the compute:

   ``[kv pass 0 ->] attention(block 0) [-> wait] ... attention(block ring-1)``

   A pass is an all-to-all over the Ring whose only non-zero entries are one row (the
   K and V block) to the next member and one from the previous: every transport already
   carries all-to-alls with uneven splits, so no point-to-point call is needed, and the
   simulator charges exactly one transfer per pass (zero-byte entries are no messages).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from cocodiff.cost import RingHostOps, ring_block_cost, ring_host_ops, scale_host_ops
from cocodiff.layout import LayoutError, ParallelLayout
from cocodiff.models import ModelSpec
from cocodiff.plan.lazy import LazyPrograms
from cocodiff.plan.steps import Compute, Exchange, LayerPlan, Plan, RankProgram, Step, Wait
from cocodiff.schedules.grid import RankGrid
from cocodiff.schedules.options import DEFAULT_OPTIONS, PlanOptions
from cocodiff.schedules.registry import get_schedule


def group_grid(grid: RankGrid, positions: Sequence[int]) -> RankGrid:
    """The Ulysses group at grid ``positions`` (Ulysses order) as a rank grid of its own
    global ranks: the box of (node, GPU, tile) coordinates its members fill, so TAPA's
    phases follow the tiers. Members that fill no box form a line (one flat level)."""
    ranks = tuple(grid.ranks[p] for p in positions)
    return RankGrid(_shape(_box_shapes(grid, np.array([positions]))[0]), ranks)


def _box_shapes(grid: RankGrid, positions: np.ndarray) -> np.ndarray:
    """The (nodes, GPUs, tiles) box each row of grid ``positions`` (groups x members, in
    Ulysses order) fills, or ``(1, members, 1)`` for a row that fills none: one row of
    three per group.

    A row fills a box when its members, in Ulysses order, run in (node, GPU, tile) order
    (positions rising: they are row-major) over as many coordinates as the box has
    places; numpy over all rows at once (49,152 groups on 4,096 Aurora nodes)."""
    members = positions.shape[1]
    coords = np.unravel_index(positions, grid.shape)
    values = np.stack([1 + (np.diff(np.sort(axis, axis=1), axis=1) != 0).sum(axis=1)
                       for axis in coords], axis=1)
    boxed = ((np.diff(positions, axis=1) > 0).all(axis=1) & (values.prod(axis=1) == members))
    return np.where(boxed[:, None], values, np.array([1, members, 1]))


def _shape(row: np.ndarray) -> tuple[int, int, int]:
    nodes, gpus, tiles = row.tolist()
    return nodes, gpus, tiles


# Every candidate layout of a planner run (17 for FLUX.1-dev on Aurora, asked for by each
# schedule in turn: fewer places than layouts would evict each before its next use).
@functools.lru_cache(maxsize=64)
def ulysses_grids(grid: RankGrid, parallel: ParallelLayout) -> UlyssesGrids:
    """Every Ulysses group's rank grid (:func:`group_grid`), by the grid position of its
    Ulysses index 0.

    Worked out for all groups at once and each grid built when first asked for (a plan
    builds only the programs the simulator runs), and cached, so shared by every caller
    (none changes it): the planner builds a plan of each layout per schedule and chunk
    count, and a layout of 4,096 Aurora nodes has up to 49,152 groups."""
    # The members' grid positions, one row per group (its leader + k * the Ulysses stride).
    ulysses, stride = parallel.ulysses, parallel.stride("ulysses")
    everyone = np.arange(grid.num_ranks)
    leaders = everyone[(everyone // stride) % ulysses == 0]
    positions = leaders[:, None] + np.arange(ulysses) * stride  # (groups, ulysses)
    shapes = _box_shapes(grid, positions)
    # Groups that straddle node or GPU boundaries differently (8 of a 12-rank node) must
    # fit one plan: then every group exchanges as one flat level.
    shape = _shape(shapes[0]) if (shapes == shapes[0]).all() else (1, ulysses, 1)
    return UlyssesGrids(shape, leaders.tolist(), np.asarray(grid.ranks)[positions])


class UlyssesGrids(Mapping[int, RankGrid]):
    """Group leader's grid position -> the group's :class:`RankGrid`, built on first use;
    ``shape``: the (nodes, GPUs, tiles) box every group fills (``(1, members, 1)``: a
    line)."""

    __slots__ = ("_built", "_members", "_row", "shape")

    def __init__(self, shape: tuple[int, int, int], leaders: list[int],
                 members: np.ndarray) -> None:
        self.shape, self._members = shape, members  # members: (groups, ulysses) ranks
        self._row = {leader: row for row, leader in enumerate(leaders)}
        self._built: dict[int, RankGrid] = {}

    def __getitem__(self, leader: int) -> RankGrid:
        grid = self._built.get(leader)
        if grid is None:
            members = tuple(self._members[self._row[leader]].tolist())
            grid = self._built[leader] = RankGrid(self.shape, members)
        return grid

    def __iter__(self):
        return iter(self._row)

    def __len__(self) -> int:
        return len(self._row)


def relabel_layer(layer: LayerPlan, ranks: tuple[int, ...]) -> LayerPlan:
    """``layer`` with the local rank i of its exchanges' groups replaced by ``ranks[i]``."""

    def step(s: Step) -> Step:
        if not isinstance(s, Exchange):
            return s
        phases = tuple(replace(p, group=tuple(ranks[r] for r in p.group)) for p in s.phases)
        return replace(s, group=tuple(ranks[r] for r in s.group), phases=phases)

    return replace(layer, attention=tuple(step(s) for s in layer.attention))


def ring_pass(ring: tuple[int, ...], index: int, row_bytes: int) -> Exchange:
    """Member ``index`` of ``ring`` sends its K/V block (one row) to the next member and
    receives one from the previous."""
    size = len(ring)
    # Built by tuple repetition (a Ring may have thousands of members: every rank holds one).
    send, recv = (_one_hot(size, (index + 1) % size), _one_hot(size, (index - 1) % size))
    return Exchange("kv", ring, send, recv, row_bytes, "ring")


def _one_hot(size: int, at: int) -> tuple[int, ...]:
    return (0,) * at + (1,) + (0,) * (size - at - 1)


def ring_attention(attention: Compute, kv_pass: Exchange, ring: int,
                   dtype_bytes: int = 2, host: RingHostOps | None = None
                   ) -> tuple[Step, ...]:
    """The Ring's steps in place of one attention step: ``ring`` blocks, each pass
    started before the block in hand is attended to and waited after. Each block is the
    attention at the block's shape plus the merge of its output into the running one,
    with the host ops the Ring's blocks dispatch (``host``,
    :func:`cocodiff.cost.ring_block_cost`)."""
    first, later = (Compute(attention.op, ring_block_cost(attention.cost, 0, dtype_bytes, host)),
                    Compute(attention.op, ring_block_cost(attention.cost, 1, dtype_bytes, host)))
    if ring == 1:
        return (first,)
    wait = Wait("kv")
    # [pass, block 0, wait] [pass, block k, wait] x (ring - 2) [block ring-1], by tuple
    # repetition: a long Ring repeats the same three steps thousands of times per rank.
    return ((kv_pass, first, wait) + (kv_pass, later, wait) * (ring - 2) + (later,))


def scale_layer_host_ops(layer: LayerPlan, factor: float) -> LayerPlan:
    """``layer`` with every compute step's counted host ops multiplied by ``factor``
    (:func:`cocodiff.cost.scale_host_ops`): a rank whose code dispatches more ops than its
    layer's shape is counted at."""
    if factor == 1.0:
        return layer

    def scaled(step: Compute) -> Compute:
        return replace(step, cost=scale_host_ops(step.cost, factor))

    return replace(layer, before=tuple(map(scaled, layer.before)),
                   attention=tuple(scaled(step) if isinstance(step, Compute) else step
                                   for step in layer.attention),
                   after=tuple(map(scaled, layer.after)))


def splice_ring(layer: LayerPlan, kv_pass: Exchange, ring: int,
                dtype_bytes: int = 2, host: RingHostOps | None = None) -> LayerPlan:
    """``layer`` with its attention step made the Ring's blocks (:func:`ring_attention`);
    with ``host``, every compute step's host ops scaled by ``host.layer_scale`` (a Ring
    rank runs the runtime's processors even where its Ulysses group is one rank)."""
    layer = scale_layer_host_ops(layer, 1.0 if host is None else host.layer_scale)
    attention: list[Step] = []
    for step in layer.attention:
        if isinstance(step, Compute) and step.op == "attention":
            attention += ring_attention(step, kv_pass, ring, dtype_bytes, host)
        else:
            attention.append(step)
    return replace(layer, attention=tuple(attention))


def plan_hybrid(name: str, spec: ModelSpec, grid: RankGrid, stream_tokens: Sequence[int],
                parallel: ParallelLayout, options: PlanOptions = DEFAULT_OPTIONS,
                cache_ratio: float = 0.0) -> Plan:
    """Schedule ``name`` inside every Ulysses group of ``parallel``, Ring across them.

    Args:
        name: a Ulysses schedule (``cocodiff.schedules.SCHEDULES``).
        spec: the model.
        grid: every rank of the run, where it sits; the layout's grid positions index it.
        stream_tokens: tokens of each stream of one sample (image, joint text).
        parallel: the layout; checked against the grid, the heads and ``options.batch``.
        options: the schedule's options; ``batch`` counts the samples of all batch
            groups together.
        cache_ratio: V-Major's cached fraction (step-dependent schedules).

    Raises:
        LayoutError: the layout does not fit the ranks, the heads or the batch.
    """
    schedule = get_schedule(name)
    parallel.check(grid.num_ranks, spec.num_heads, options.batch)
    if parallel.is_pure_ulysses:
        return replace(schedule.plan(spec, grid, stream_tokens, options, cache_ratio),
                       parallel=parallel)
    ulysses = parallel.ulysses
    streams = tuple(int(t) for t in stream_tokens if t > 0)
    if not streams:
        raise LayoutError("a plan needs at least one token")
    # One Ulysses group's share of each stream: its members' padded chunks together.
    group_streams = tuple(-(-t // parallel.sequence_ranks) * ulysses for t in streams)
    groups = ulysses_grids(grid, parallel)
    local = RankGrid(groups[0].shape, tuple(range(ulysses)))
    sub = schedule.plan(spec, local, group_streams,
                        replace(options, batch=options.batch // parallel.batch), cache_ratio)
    split = sub.head_split
    # Every rank's program is built when first asked for (cocodiff.plan.lazy): the
    # simulator runs one fold period's ranks and the planner's floor one node's.
    programs = LazyPrograms(grid.num_ranks,
                            _HybridBuild(sub, grid, parallel, groups, options.dtype_bytes,
                                         ring_host_ops(spec, ulysses)),
                            exemplars=tuple(groups[0].ranks))
    in_order = grid.ranks == tuple(range(grid.num_ranks))
    period = parallel.shift_period(split.heads) if in_order else None
    return Plan(name, spec.name, split, programs, period,  # type: ignore[arg-type]
                parallel)


class _HybridBuild:
    """One rank's program of a hybrid plan: its Ulysses group's program relabelled onto
    the group's global ranks, the Ring spliced in (a picklable build for
    :class:`~cocodiff.plan.lazy.LazyPrograms`)."""

    __slots__ = ("dtype_bytes", "grid", "groups", "host", "parallel", "relabelled",
                 "ring_ranks", "sub")

    def __init__(self, sub: Plan, grid: RankGrid, parallel: ParallelLayout,
                 groups: Mapping[int, RankGrid], dtype_bytes: int,
                 host: RingHostOps | None = None) -> None:
        self.sub, self.parallel, self.groups, self.dtype_bytes = sub, parallel, groups, \
            dtype_bytes
        self.host = host  # the Ring's counted host ops (cocodiff.cost.ring_host_ops)
        self.grid = grid
        # Per group leader: its relabelled layers by the local layer's id, shared by the
        # group's members (as the eager plan shared them).
        self.relabelled: dict[int, dict[int, LayerPlan]] = {}
        self.ring_ranks: dict[int, tuple[int, ...]] = {}  # by the Ring's first position

    def __getstate__(self) -> tuple:
        # The relabelled layers are keyed by object ids, which do not survive a pickle.
        return self.sub, self.parallel, self.groups, self.dtype_bytes, self.grid, self.host

    def __setstate__(self, state: tuple) -> None:
        (self.sub, self.parallel, self.groups, self.dtype_bytes, self.grid,
         self.host) = state
        self.relabelled, self.ring_ranks = {}, {}

    def __call__(self, rank: int) -> RankProgram:
        parallel, split = self.parallel, self.sub.head_split
        position = self.grid.position(rank)
        positions = parallel.ulysses_group(position)
        leader, u = positions[0], positions.index(position)
        members = self.groups[leader]
        relabelled = self.relabelled.setdefault(leader, {})
        ring = parallel.ring
        ring_positions = parallel.ring_group(position)  # shared by the Ring's members
        ring_ranks = self.ring_ranks.get(ring_positions[0])
        if ring_ranks is None:  # one tuple per Ring (2,048 ranks long on 4,096 nodes)
            ring_ranks = self.ring_ranks[ring_positions[0]] = tuple(
                self.grid.ranks[p] for p in ring_positions)
        # One row = this rank's K and V for one block: (2, batch, S/ring, heads, d).
        row_bytes = 2 * split.batch * split.padded_tokens * split.heads[u] \
            * split.head_dim * self.dtype_bytes
        kv_pass = ring_pass(ring_ranks, parallel.coords(position)[1], row_bytes)
        done: dict[int, LayerPlan] = {}
        layers = []
        for layer in self.sub.program(u).layers:
            key = id(layer)
            if key not in done:
                if key not in relabelled:
                    relabelled[key] = relabel_layer(layer, members.ranks)
                done[key] = (splice_ring(relabelled[key], kv_pass, ring, self.dtype_bytes,
                                         self.host)
                             if ring > 1 else relabelled[key])
            layers.append(done[key])
        return RankProgram(rank, tuple(layers))
