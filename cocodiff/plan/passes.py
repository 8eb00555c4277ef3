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

from collections.abc import Callable, Sequence
from dataclasses import replace

from cocodiff.plan.lazy import LazyPrograms, exemplar_programs
from cocodiff.plan.steps import Compute, Exchange, LayerPlan, RankProgram, Step, Wait

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
        return start, _run_length(steps, start, (len(steps) - start) // PASS_STEPS)
    return None


def _run_length(steps: tuple[Step, ...], start: int, most: int) -> int:
    """The most repeats ``k <= most`` of the block at ``start`` (repeated at least twice)
    with ``steps[start:start + 3k] == block * k``.

    Tuples compare in C and identical items at once, where a loop over 6,000 steps (a
    Ring of 4,096 nodes) cost more than the floor walk that asks; an item that is not the
    block's own object is compared by value, and an equal step is walked and simulated
    alike. A Ring's run ends just before its last block, so that is tried first, then
    bisection."""
    block = steps[start:start + PASS_STEPS]
    low, high = 2, most
    guesses = [most, most - 1]
    while low < high:
        guess = guesses.pop(0) if guesses else (low + high + 1) // 2
        if not low < guess <= high:
            continue
        if steps[start:start + guess * PASS_STEPS] == block * guess:
            low = guess
        else:
            high = guess - 1
    return low


# How a caller finds a layer's repeats: :func:`repeated_passes`, or a memo of it shared
# by the calls that meet the same layers (the simulator's cuts of one plan).
Finder = Callable[[LayerPlan], "tuple[int, int] | None"]


def plan_passes(programs: Sequence[RankProgram], find: Finder = repeated_passes
                ) -> int | None:
    """The repeats of the Ring's block in every layer of the plan (the exemplars of a
    lazy plan), or None when some layer has none or the layers disagree."""
    counts = set()
    for program in exemplar_programs(programs):
        for layer in {id(layer): layer for layer in program.layers}.values():
            found = find(layer)
            counts.add(None if found is None else found[1])
    return counts.pop() if len(counts) == 1 else None


def with_passes(programs: Sequence[RankProgram], count: int,
                find: Finder = repeated_passes) -> Sequence[RankProgram]:
    """Every program with its layers' repeated Ring block cut to ``count`` repeats
    (lazily for lazy programs); layers shared before stay shared."""
    if isinstance(programs, LazyPrograms):
        return LazyPrograms(len(programs), _FewerPasses(programs, count, find),
                            programs.exemplars)
    cut = _FewerPasses(programs, count, find)
    return tuple(cut.program(p) for p in programs)


class _FewerPasses:
    """A rank's program of ``programs`` with ``count`` repeats (a picklable build)."""

    __slots__ = ("count", "find", "programs")

    def __init__(self, programs: Sequence[RankProgram], count: int,
                 find: Finder = repeated_passes) -> None:
        self.programs, self.count, self.find = programs, count, find

    def __call__(self, rank: int) -> RankProgram:
        return self.program(self.programs[rank])

    def program(self, program: RankProgram) -> RankProgram:
        cut: dict[int, LayerPlan] = {}
        for layer in program.layers:
            if id(layer) not in cut:
                cut[id(layer)] = self.layer(layer)
        return RankProgram(program.rank, tuple(cut[id(layer)] for layer in program.layers))

    def layer(self, layer: LayerPlan) -> LayerPlan:
        found = self.find(layer)
        if found is None:
            return layer
        start, count = found
        steps = layer.attention
        block = steps[start:start + PASS_STEPS]
        return replace(layer, attention=steps[:start] + block * self.count
                       + steps[start + count * PASS_STEPS:])


__all__ = ["PASS_STEPS", "plan_passes", "repeated_passes", "with_passes"]
