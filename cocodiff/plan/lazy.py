"""A plan's rank programs built when first asked for.

A hybrid layout's plan (``cocodiff.schedules.hybrid``) holds one program per rank, each
its Ulysses group's plan relabelled with a Ring spliced in: at a thousand Aurora nodes
that is 12,288 programs, each with Ring passes over hundreds of members, built for every
candidate the planner looks at. Yet the simulator runs only the ranks of one fold period
(``cocodiff.simulator.symmetry``), the planner's floor walks one node's ranks, and the
bounds sum one period's traffic. So a program is built only when someone asks for its
rank, and kept; asking for every rank (a plan file, an unfolded simulation) builds them
all and gives the same programs the eager plan held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from cocodiff.plan.steps import RankProgram

Build = Callable[[int], RankProgram]  # global rank -> its program (picklable: workers fork)


class LazyPrograms(Sequence[RankProgram]):
    """``programs[rank]``, built by ``build(rank)`` on first use and kept.

    Args:
        num_ranks: ranks of the plan.
        build: a rank's program.
        exemplars: ranks whose programs between them show every layer the plan holds, up
            to relabelling of ranks (a hybrid plan: one Ulysses group); questions about the
            plan's layers (do they repeat, does any exchange have phases) are answered
            from them without building the rest.
    """

    __slots__ = ("_build", "_built", "_num_ranks", "exemplars")

    def __init__(self, num_ranks: int, build: Build, exemplars: tuple[int, ...]) -> None:
        self._num_ranks = num_ranks
        self._build = build
        self._built: dict[int, RankProgram] = {}
        self.exemplars = exemplars

    def __len__(self) -> int:
        return self._num_ranks

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self._num_ranks)))
        rank = index + self._num_ranks if index < 0 else index
        if not 0 <= rank < self._num_ranks:
            raise IndexError(f"rank {index} of a plan of {self._num_ranks} ranks")
        program = self._built.get(rank)
        if program is None:
            program = self._built[rank] = self._build(rank)
        return program

    def __iter__(self) -> Iterator[RankProgram]:
        return (self[rank] for rank in range(self._num_ranks))

    # The same programs as the eager tuple they stand for: plans compare and hash alike.
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(other) == self._num_ranks and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"LazyPrograms({self._num_ranks} ranks, {len(self._built)} built)"

    def with_layers(self, num_layers: int) -> LazyPrograms:
        """The programs cut to their first ``num_layers`` layers, still built on use."""
        return LazyPrograms(self._num_ranks, _FirstLayers(self, num_layers), self.exemplars)


class _FirstLayers:
    """A rank's program of ``programs`` cut to its first layers (a picklable build)."""

    __slots__ = ("num_layers", "programs")

    def __init__(self, programs: Sequence[RankProgram], num_layers: int) -> None:
        self.programs, self.num_layers = programs, num_layers

    def __call__(self, rank: int) -> RankProgram:
        return RankProgram(rank, self.programs[rank].layers[:self.num_layers])


def with_layers(programs: Sequence[RankProgram], num_layers: int) -> Sequence[RankProgram]:
    """Every program cut to its first ``num_layers`` layers (lazily for lazy programs)."""
    if isinstance(programs, LazyPrograms):
        return programs.with_layers(num_layers)
    return tuple(RankProgram(p.rank, p.layers[:num_layers]) for p in programs)


def exemplar_programs(programs: Sequence[RankProgram]) -> Sequence[RankProgram]:
    """Programs that show every layer of the plan up to relabelling: all of them, or a
    lazy plan's exemplars."""
    if isinstance(programs, LazyPrograms):
        return [programs[rank] for rank in programs.exemplars]
    return programs


__all__ = ["Build", "LazyPrograms", "exemplar_programs", "with_layers"]
