"""Ranks as a box of (node, gpu, tile) coordinates: what a topology-aligned schedule
needs to know about where ranks sit."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from cocodiff.util.errors import ScheduleError

LEVELS = ("node", "gpu", "tile")


@dataclass(frozen=True, slots=True)
class RankGrid:
    """Global ranks arranged as ``nodes x gpus x tiles``.

    Args:
        shape: (nodes, GPUs per node, tiles per GPU) holding ranks.
        ranks: the global rank at each coordinate, in (node, gpu, tile) row-major order.
    """

    shape: tuple[int, int, int]
    ranks: tuple[int, ...]
    _position: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_position", {rank: i for i, rank in enumerate(self.ranks)})

    @staticmethod
    def line(num_ranks: int) -> RankGrid:
        """No topology known: every rank its own GPU on one node."""
        return RankGrid((1, num_ranks, 1), tuple(range(num_ranks)))

    @staticmethod
    def from_placement(topology, placement) -> RankGrid:
        """The box the placement's ranks fill on the topology (worked out once per
        topology and placement: every plan and simulation of a run asks, and it reads
        every rank, 49,152 of them on 4,096 Aurora nodes).

        Raises:
            ScheduleError: the ranks do not fill whole GPUs of whole, equal nodes.
        """
        return _grid_of(topology, placement)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def position(self, rank: int) -> int:
        """The rank's index in (node, gpu, tile) row-major order."""
        return self._position[rank]

    def coords(self, rank: int) -> tuple[int, int, int]:
        flat = self._position[rank]
        nodes, gpus, tiles = self.shape
        return (flat // (gpus * tiles), (flat // tiles) % gpus, flat % tiles)

    def rank_at(self, coords: tuple[int, int, int]) -> int:
        _, gpus, tiles = self.shape
        return self.ranks[(coords[0] * gpus + coords[1]) * tiles + coords[2]]

    def peers(self, rank: int, level: str) -> tuple[int, ...]:
        """The ranks that differ from ``rank`` only in ``level``, in coordinate order."""
        axis = LEVELS.index(level)
        base = list(self.coords(rank))
        members = []
        for value in range(self.shape[axis]):
            base[axis] = value
            members.append(self.rank_at(tuple(base)))
        return tuple(members)


# A few machines at once (a run has one; a sweep or a test suite goes through them).
@lru_cache(maxsize=4)
def _grid_of(topology, placement) -> RankGrid:
    coords = {}
    for rank in range(placement.num_ranks):
        tile = placement.tile_of(rank)
        node = topology.node_of(tile)
        gpu, _, tile_index = tile.rpartition(".t")
        coords[rank] = (node, int(gpu.rpartition(".g")[2]), int(tile_index))
    nodes = sorted({c[0] for c in coords.values()})
    gpus = sorted({c[1] for c in coords.values()})
    tiles = sorted({c[2] for c in coords.values()})
    shape = (len(nodes), len(gpus), len(tiles))
    if shape[0] * shape[1] * shape[2] != placement.num_ranks:
        raise ScheduleError(
            f"{placement.num_ranks} ranks do not fill whole GPUs and nodes "
            f"({shape[0]} nodes x {shape[1]} GPUs x {shape[2]} tiles): a topology-aligned "
            "schedule needs a full box"
        )
    index = {(n, g, t): i for i, (n, g, t) in enumerate(
        (n, g, t) for n in nodes for g in gpus for t in tiles)}
    ranks = [0] * placement.num_ranks
    for rank, coord in coords.items():
        ranks[index[coord]] = rank
    return RankGrid(shape, tuple(ranks))
