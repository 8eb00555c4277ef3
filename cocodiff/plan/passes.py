"""A Ring's repeated passes in a layer's plan, and the plan with fewer of them.

A hybrid layout's Ring (:func:`cocodiff.schedules.hybrid.ring_attention`) makes a layer's
attention ``[pass, block 0, wait] [pass, block k, wait] x (ring - 2) [block ring-1]``, the
middle three steps the very same objects every time. At 4,096 Aurora nodes that is 2,046
repeats per layer and rank, and the simulator's time goes into them; yet each repeat
does the same thing as the one before. The simulator
(:func:`cocodiff.simulator.simulate.simulate_layers`) simulates the plan with one, two
and three repeats and extrapolates, which needs the plan cut to a given number of repeats:
:func:`with_passes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from cocodiff.plan.lazy import LazyPrograms, exemplar_programs
from cocodiff.plan.steps import Compute, Exchange, LayerPlan, RankProgram, Wait

# The repeated block: the pass, the block's attention, the wait for the pass.
PASS_STEPS = 3


def repeated_passes(layer: LayerPlan) -> tuple[int, int] | None:
    """Where the Ring's repeated block of a layer's attention starts and how many times
    in a row it stands there (at least twice), or None: a layer without a Ring, or with
    fewer than two repeats.

    The block is a pass, a compute step and the wait for that pass, so each repeat waits
    for what it starts and for nothing else: what follows it depends on when it starts,
    never on what came before (the simulator's extrapolation and the planner's floor
    walk rely on it)."""
    steps = layer.attention
    for start in range(len(steps) - 2 * PASS_STEPS + 1):
        kv_pass, block, wait = steps[start:start + PASS_STEPS]
        if not (isinstance(kv_pass, Exchange) and kv_pass.tensor == "kv"
                and isinstance(block, Compute) and isinstance(wait, Wait)
                and wait.tensor == "kv"
                and all(steps[start + PASS_STEPS + i] is steps[start + i]
                        for i in range(PASS_STEPS))):
            continue
        # The run's length from the steps' identities, block by block, in numpy (a Ring
        # of 4,096 nodes repeats its block 2,046 times, and plans of every rank ask).
        blocks = (len(steps) - start) // PASS_STEPS
        ids = np.fromiter(map(id, steps[start:start + blocks * PASS_STEPS]), dtype=np.uint64,
                          count=blocks * PASS_STEPS).reshape(blocks, PASS_STEPS)
        other = np.flatnonzero((ids != ids[0]).any(axis=1))
        return start, int(other[0]) if other.size else blocks
    return None


def plan_passes(programs: Sequence[RankProgram]) -> int | None:
    """The repeats of the Ring's block in every layer of the plan (the exemplars of a
    lazy plan), or None when some layer has none or the layers disagree."""
    counts = set()
    for program in exemplar_programs(programs):
        for layer in {id(layer): layer for layer in program.layers}.values():
            found = repeated_passes(layer)
            counts.add(None if found is None else found[1])
    return counts.pop() if len(counts) == 1 else None


def with_passes(programs: Sequence[RankProgram], count: int) -> Sequence[RankProgram]:
    """Every program with its layers' repeated Ring block cut to ``count`` repeats
    (lazily for lazy programs); layers shared before stay shared."""
    if isinstance(programs, LazyPrograms):
        return LazyPrograms(len(programs), _FewerPasses(programs, count), programs.exemplars)
    cut = _FewerPasses(programs, count)
    return tuple(cut.program(p) for p in programs)


class _FewerPasses:
    """A rank's program of ``programs`` with ``count`` repeats (a picklable build)."""

    __slots__ = ("count", "programs")

    def __init__(self, programs: Sequence[RankProgram], count: int) -> None:
        self.programs, self.count = programs, count

    def __call__(self, rank: int) -> RankProgram:
        return self.program(self.programs[rank])

    def program(self, program: RankProgram) -> RankProgram:
        cut: dict[int, LayerPlan] = {}
        for layer in program.layers:
            if id(layer) not in cut:
                cut[id(layer)] = self.layer(layer)
        return RankProgram(program.rank, tuple(cut[id(layer)] for layer in program.layers))

    def layer(self, layer: LayerPlan) -> LayerPlan:
        found = repeated_passes(layer)
        if found is None:
            return layer
        start, count = found
        steps = layer.attention
        block = steps[start:start + PASS_STEPS]
        return replace(layer, attention=steps[:start] + block * self.count
                       + steps[start + count * PASS_STEPS:])


__all__ = ["PASS_STEPS", "plan_passes", "repeated_passes", "with_passes"]
