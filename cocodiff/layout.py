"""The parallel layout of a run: Ulysses x Ring x batch/CFG degrees, placed on the ranks.

Pure Ulysses cannot use more ranks than the model has heads. A layout splits the ranks
three ways (``ulysses * ring * batch == ranks``):

* **batch** groups each take ``batch_size / batch`` of the samples of a step (the two
  halves of a classifier-free-guidance batch): no communication at all inside the
  transformer;
* inside a batch group, the sequence is split over ``ulysses * ring`` ranks; each
  **Ulysses group** (``ulysses`` ranks) exchanges heads for tokens as before (flat, TAPA,
  V-First, V-Major all apply inside it), after which every member holds ``S / ring``
  tokens of its heads;
* the ``ring`` members holding the same heads form a **Ring**: K/V blocks travel around
  it while each member attends to the block in hand, and the partial results are merged
  by their log-sum-exp.

Placement: ``order`` lists the three axes from the outermost (consecutive members far
apart in rank order, i.e. across the slow tiers of a node-major placement) to the
innermost (consecutive ranks: the fast tiers). The default puts Ulysses innermost (its
all-to-alls on the fast tiers), Ring across the slower ones, and batch, which never
communicates inside the transformer, outermost. The planner also tries the other orders
and keeps one only where the simulator says it is faster.

Within a batch group, the member at ring index ``r`` and Ulysses index ``u`` holds the
sequence's chunk ``r * ulysses + u``: a Ring member's block (its Ulysses group's
chunks, gathered) is then a contiguous run of chunks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from cocodiff.util.errors import ScheduleError

AXES = ("batch", "ring", "ulysses")
DEFAULT_ORDER = AXES  # batch outermost, Ulysses innermost
# `--ring-inner`: Ring innermost, so its passes stay on the fastest links.
RING_INNER_ORDER = ("batch", "ulysses", "ring")


class LayoutError(ScheduleError):
    """A parallel layout that cannot run (one clear line)."""


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """How ``ulysses * ring * batch`` ranks split a step.

    Args:
        ulysses: ranks of one Ulysses group (heads split over them).
        ring: Ulysses groups that pass K/V blocks around a ring.
        batch: groups that each take a share of the step's samples.
        order: the axes from outermost (slowest tiers) to innermost (fastest).
    """

    ulysses: int
    ring: int = 1
    batch: int = 1
    order: tuple[str, str, str] = DEFAULT_ORDER

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{axis} degree must be a positive integer, got {value!r}")
        if sorted(self.order) != sorted(AXES):
            raise LayoutError(f"layout order {self.order} must name each of {', '.join(AXES)} "
                              "once")

    # -- what it is ------------------------------------------------------------------

    @property
    def num_ranks(self) -> int:
        return self.ulysses * self.ring * self.batch

    @property
    def sequence_ranks(self) -> int:
        """Ranks one sample's sequence is split over."""
        return self.ulysses * self.ring

    @property
    def is_pure_ulysses(self) -> bool:
        return self.ring == 1 and self.batch == 1

    @property
    def name(self) -> str:
        """``U4xR2xB1``, plus ``/ring-inner`` when the Ring sits inside the Ulysses groups
        (on the faster tiers), or the whole order (outermost first) when batch is not
        outermost."""
        text = f"U{self.ulysses}xR{self.ring}xB{self.batch}"
        active = [axis for axis in self.order if getattr(self, axis) > 1]
        default = [axis for axis in DEFAULT_ORDER if getattr(self, axis) > 1]
        if active == default:
            return text
        if active == [axis for axis in ("batch", "ulysses", "ring") if axis in active]:
            return text + "/ring-inner"
        return text + "/" + ">".join(active)

    def check(self, num_ranks: int, num_heads: int, batch_size: int = 1) -> None:
        """Refuse a layout that cannot run here, with one line naming the value.

        Raises:
            LayoutError: degrees that do not multiply to ``num_ranks``, a Ulysses degree
                above ``num_heads``, or a batch degree that does not divide ``batch_size``.
        """
        if self.num_ranks != num_ranks:
            raise LayoutError(
                f"layout ulysses {self.ulysses} x ring {self.ring} x batch {self.batch} = "
                f"{self.num_ranks} ranks, but the run has {num_ranks}")
        if self.ulysses > num_heads:
            raise LayoutError(
                f"ulysses degree {self.ulysses} is above the model's {num_heads} heads: every "
                "Ulysses rank needs at least one head (use a ring degree for the rest)")
        if batch_size % self.batch:
            raise LayoutError(
                f"batch degree {self.batch} does not divide the {batch_size} sample(s) of a "
                "step")

    # -- where the ranks sit -----------------------------------------------------------

    def _strides(self) -> dict[str, int]:
        """Distance in grid positions between consecutive members along each axis."""
        return _strides(self.order, self.ulysses, self.ring, self.batch)

    def stride(self, axis: str) -> int:
        """Distance in grid positions between consecutive members along ``axis``."""
        return self._strides()[axis]

    def position(self, batch_index: int, ring_index: int, ulysses_index: int) -> int:
        strides = self._strides()
        return (batch_index * strides["batch"] + ring_index * strides["ring"]
                + ulysses_index * strides["ulysses"])

    def coords(self, position: int) -> tuple[int, int, int]:
        """(batch index, ring index, Ulysses index) of a grid position."""
        strides = self._strides()
        return tuple((position // strides[axis]) % getattr(self, axis)  # type: ignore[return-value]
                     for axis in AXES)

    def ulysses_group(self, position: int) -> tuple[int, ...]:
        """Grid positions of the position's Ulysses group, in Ulysses order."""
        return _groups(self)[0][position]

    def ring_group(self, position: int) -> tuple[int, ...]:
        """Grid positions of the position's Ring, in ring order."""
        return _groups(self)[1][position]

    def sequence_group(self, position: int) -> tuple[int, ...]:
        """Grid positions sharing the position's samples, by sequence chunk index."""
        b, _, _ = self.coords(position)
        strides = self._strides()
        # Ring-major: (ring, ulysses) offsets from the share's first position.
        offsets = np.add.outer(np.arange(self.ring) * strides["ring"],
                               np.arange(self.ulysses) * strides["ulysses"])
        return tuple((b * strides["batch"] + offsets.ravel()).tolist())

    def batch_group(self, position: int) -> tuple[int, ...]:
        """Grid positions holding the same sequence chunk of the other batch shares."""
        _, r, u = self.coords(position)
        return tuple(self.position(b, r, u) for b in range(self.batch))

    def sequence_index(self, position: int) -> int:
        """The chunk of the sequence the position holds (ring-major, see module doc)."""
        _, r, u = self.coords(position)
        return r * self.ulysses + u

    def shift_period(self, heads: tuple[int, ...]) -> int:
        """The smallest shift s (dividing the rank count) that maps every group onto a
        group, every ring successor onto the shifted successor, and every rank onto a
        rank with as many heads: the plan repeats every s grid positions, so the
        simulator may fold node-symmetric traffic (``cocodiff.simulator.simulate``).

        Args:
            heads: heads of each Ulysses index.
        """
        return _shift_period(self, tuple(heads))

    def _search_shift_period(self, heads: tuple[int, ...]) -> int:
        # Over every grid position at once (numpy): its coordinates, heads, Ring successor
        # and Ulysses group (numbered by its batch and ring index).
        n, strides = self.num_ranks, self._strides()
        position = np.arange(n)
        batch, ring, ulysses = ((position // strides[axis]) % getattr(self, axis)
                                for axis in AXES)
        head = np.asarray(heads)[ulysses]
        ring_next = (batch * strides["batch"] + (ring + 1) % self.ring * strides["ring"]
                     + ulysses * strides["ulysses"])
        group = batch * self.ring + ring
        leader = position - ulysses * strides["ulysses"]  # the group's Ulysses index 0
        for shift in (s for s in range(1, n + 1) if n % s == 0):
            moved = (position + shift) % n
            if not ((head[moved] == head).all()
                    and (ring_next[moved] == (ring_next + shift) % n).all()):
                continue
            # Each group's members land in one group (as many members: a whole group).
            landed = group[moved]
            if (landed == landed[leader]).all():
                return shift
        return n


@functools.lru_cache(maxsize=64)
def _shift_period(layout: ParallelLayout, heads: tuple[int, ...]) -> int:
    # Cached: the planner, its resource guard and every plan of a layout ask, and the
    # search visits every rank (49,152 on 4,096 Aurora nodes).
    return layout._search_shift_period(heads)


@functools.cache
def _strides(order: tuple[str, ...], ulysses: int, ring: int, batch: int) -> dict[str, int]:
    # Cached: plans ask for every rank's groups, each through these strides.
    degrees = {"ulysses": ulysses, "ring": ring, "batch": batch}
    strides, stride = {}, 1
    for axis in reversed(order):
        strides[axis] = stride
        stride *= degrees[axis]
    return strides


@functools.lru_cache(maxsize=64)
def _groups(layout: ParallelLayout) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """(Ulysses group, Ring) of every grid position, each group built once and shared by
    its members: plans and the fold period ask for every rank's groups. Worked out over
    all positions at once (numpy: 49,152 positions on 4,096 Aurora nodes)."""
    strides = layout._strides()
    position = np.arange(layout.num_ranks)
    _, ring, ulysses = ((position // strides[axis]) % getattr(layout, axis) for axis in AXES)

    def along(axis: str, index: np.ndarray) -> list[tuple[int, ...]]:
        # A group is its first member (index 0 along ``axis``) plus k strides.
        first = position - index * strides[axis]
        firsts = position[index == 0]  # each group's first member, rising
        rows = firsts[:, None] + np.arange(getattr(layout, axis)) * strides[axis]
        groups = [tuple(row) for row in rows.tolist()]
        return [groups[i] for i in np.searchsorted(firsts, first).tolist()]

    return tuple(along("ulysses", ulysses)), tuple(along("ring", ring))


def parse_degrees(ulysses: int | None, ring: int | None, batch: int | None,
                  num_ranks: int) -> ParallelLayout:
    """A layout from explicit degrees, a missing one filled in so that they multiply to
    ``num_ranks`` (at most one may be missing; all missing means pure Ulysses).

    Raises:
        LayoutError: the given degrees do not divide the rank count.
    """
    given = {"ulysses": ulysses, "ring": ring, "batch": batch}
    missing = [axis for axis, value in given.items() if value is None]
    if len(missing) == 3:
        return ParallelLayout(num_ranks)
    known = math.prod(value for value in given.values() if value is not None)
    if len(missing) >= 1:
        if num_ranks % known:
            raise LayoutError(f"--ulysses/--ring/--batch multiply to {known}, which does not "
                              f"divide the {num_ranks} ranks")
        # Fill the first missing axis (Ulysses first) with what is left, the others with 1.
        for axis in missing:
            given[axis] = 1
        given[missing[0]] = num_ranks // known
    return ParallelLayout(int(given["ulysses"]), int(given["ring"]), int(given["batch"]))


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    """A PipeFusion layout (arXiv 2405.14430; xDiT's ``pipefusion_parallel_degree``):
    ``stages`` contiguous runs of layers, one per stage, each stage a Ulysses group of
    ``ulysses`` ranks; the image tokens cut into ``patches`` patches streamed through the
    stages after ``warmup`` synchronous steps.

    Placement: stage-major (the stage index is the outermost coordinate), so the Ulysses
    groups sit on the fast tiers and only the stages' point-to-point transfers cross the
    slow ones.

    Args:
        stages: pipeline stages (N).
        ulysses: ranks of one stage's Ulysses group.
        patches: patches a pipelined step streams (M; xDiT's default M = N).
        warmup: synchronous steps before the pipelined ones (xDiT's default 1).
        overlap: consecutive pipelined steps overlap: stage 0 starts patch m of a step
            as soon as the last stage has sent patch m of the step before (xDiT's engine,
            whose scheduler steps each patch, so the pipeline fills once per generation).
            False (the default): stage 0 waits for all of the step before's patches
            before its first, and the last stage sends them after its last patch, as
            ``cocodiff run`` does (diffusers' loop steps the scheduler on the whole
            latents between two transformer calls: the pipeline fills and drains every
            step).
    """

    stages: int
    ulysses: int = 1
    patches: int = 1
    warmup: int = 1
    overlap: bool = False

    def __post_init__(self) -> None:
        for name, least in (("stages", 1), ("ulysses", 1), ("patches", 1), ("warmup", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise LayoutError(f"pipefusion {name} must be an integer >= {least}, "
                                  f"got {value!r}")
        if not isinstance(self.overlap, bool):
            raise LayoutError(f"pipefusion overlap must be true or false, got {self.overlap!r}")

    @property
    def num_ranks(self) -> int:
        return self.stages * self.ulysses

    @property
    def name(self) -> str:
        """``P4xU4xM4/w1``: stages, Ulysses degree, patches, warm-up steps; then
        ``/overlap`` when consecutive steps overlap (the default, what ``run`` executes,
        keeps the names it always had)."""
        text = f"P{self.stages}xU{self.ulysses}xM{self.patches}/w{self.warmup}"
        return text + "/overlap" if self.overlap else text

    @property
    def gathers_output(self) -> bool:
        """Whether each step ends with every stage gathering its output in its Ulysses
        group (the runtime's gather hook): not with one rank per stage, nor with
        overlapping steps (xDiT's engine steps the scheduler on each patch where it is:
        no step ends with the whole latents on a rank)."""
        return self.ulysses > 1 and not self.overlap

    def stage_of(self, position: int) -> int:
        return position // self.ulysses

    def stage_group(self, stage: int) -> tuple[int, ...]:
        """Grid positions of a stage's Ulysses group, in Ulysses order."""
        return tuple(range(stage * self.ulysses, (stage + 1) * self.ulysses))

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """The first layer of every stage and, last, ``num_layers``: stage s runs layers
        ``[bounds[s], bounds[s+1])``, contiguous, counts differing by at most one (the
        larger shares last, so the first stage, which also embeds, is never the
        longest)."""
        n = self.stages
        return tuple(s * num_layers // n for s in range(n + 1))

    def check(self, num_ranks: int, num_heads: int, num_layers: int) -> None:
        """Refuse a layout that cannot run here, with one line naming the value.

        Raises:
            LayoutError: degrees that do not multiply to ``num_ranks``, a Ulysses degree
                above ``num_heads``, more stages than layers.
        """
        if self.num_ranks != num_ranks:
            raise LayoutError(f"pipefusion {self.stages} stages x ulysses {self.ulysses} = "
                              f"{self.num_ranks} ranks, but the run has {num_ranks}")
        if self.ulysses > num_heads:
            raise LayoutError(f"ulysses degree {self.ulysses} is above the model's "
                              f"{num_heads} heads")
        if self.stages > num_layers:
            raise LayoutError(f"{self.stages} pipeline stages for {num_layers} layers: every "
                              "stage needs at least one layer")
