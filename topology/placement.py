"""Which tile each global rank runs on."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from topology.errors import TopologyError

if TYPE_CHECKING:
    from topology.graph import Topology

_TILE_NAME = re.compile(r"n(\d+)\.g(\d+)\.t(\d+)")


@dataclass(frozen=True, slots=True)
class Placement:
    """Global rank -> tile.

    Attributes:
        tiles: ``tiles[rank]`` is the tile global rank ``rank`` runs on; no tile twice.

    Raises:
        TopologyError: empty, a repeated tile, or a name that is not ``n<n>.g<g>.t<t>``.
    """

    tiles: tuple[str, ...]
    _rank_of: dict[str, int] = field(init=False, repr=False, compare=False)
    _nodes: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _ranks_on_node: dict[int, int] = field(init=False, repr=False, compare=False)
    # is_node_symmetric by topology spec: every simulation asks, and it visits every rank.
    _symmetric: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tiles = tuple(self.tiles)
        if not tiles:
            raise TopologyError("a placement needs at least one rank")
        nodes = []
        for tile in tiles:
            match = _TILE_NAME.fullmatch(tile) if isinstance(tile, str) else None
            if match is None:
                raise TopologyError(f"bad tile name {tile!r} in placement (want n<n>.g<g>.t<t>)")
            nodes.append(int(match.group(1)))
        rank_of = {tile: rank for rank, tile in enumerate(tiles)}
        if len(rank_of) != len(tiles):
            repeated = next(tile for tile, count in Counter(tiles).items() if count > 1)
            raise TopologyError(f"tile {repeated} holds more than one rank in placement")
        object.__setattr__(self, "tiles", tiles)
        object.__setattr__(self, "_rank_of", rank_of)
        object.__setattr__(self, "_nodes", tuple(nodes))
        object.__setattr__(self, "_ranks_on_node", dict(Counter(nodes)))
        object.__setattr__(self, "_symmetric", {})

    @classmethod
    def node_major(cls, topology: Topology, num_ranks: int | None = None) -> Placement:
        """Ranks fill node 0's tiles first (GPU-major within a node), then node 1's, ...

        Args:
            topology: the machine.
            num_ranks: ranks to place; ``None`` uses every tile.

        Raises:
            TopologyError: ``num_ranks`` outside ``1..len(topology.tiles)``.
        """
        available = len(topology.tiles)
        if num_ranks is None:
            num_ranks = available
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int):
            raise TopologyError(f"number of ranks must be an integer, got {num_ranks!r}")
        if not 1 <= num_ranks <= available:
            raise TopologyError(
                f"cannot place {num_ranks} ranks on topology {topology.spec.name!r}: it has "
                f"{available} tiles ({topology.num_nodes} nodes x {topology.tiles_per_node})"
            )
        return cls(topology.tiles[:num_ranks])

    @property
    def num_ranks(self) -> int:
        return len(self.tiles)

    @property
    def ranks_per_node(self) -> int:
        """Ranks on each used node: the most on any node (when the last node is only
        partly used, it holds fewer; see :meth:`ranks_on_node`)."""
        return max(self._ranks_on_node.values())

    @property
    def nodes(self) -> tuple[int, ...]:
        """The nodes that hold at least one rank, ascending."""
        return tuple(sorted(self._ranks_on_node))

    def ranks_on_node(self, node: int) -> int:
        """How many ranks run on ``node`` (0 for an unused node)."""
        return self._ranks_on_node.get(node, 0)

    def tile_of(self, rank: int) -> str:
        """The tile of global rank ``rank``."""
        self._check_rank(rank)
        return self.tiles[rank]

    def rank_of(self, tile: str) -> int:
        """The global rank on ``tile``.

        Raises:
            TopologyError: no rank runs on ``tile``.
        """
        rank = self._rank_of.get(tile)
        if rank is None:
            raise TopologyError(f"no rank runs on tile {tile!r}")
        return rank

    def node_of(self, rank: int) -> int:
        """The node global rank ``rank`` runs on."""
        self._check_rank(rank)
        return self._nodes[rank]

    def is_node_symmetric(self, topology: Topology) -> bool:
        """Whether shifting every rank by whole nodes maps the placement onto itself.

        True iff the ranks fill whole nodes, i.e. used nodes ``0..K-1`` each hold the same
        number ``R = ranks_per_node`` of ranks (not necessarily all of a node's tiles),
        and rank ``r + k * R`` (``r < R``) sits on node ``k`` at the same local tile index
        as rank ``r`` on node 0. Then only node 0's ranks need simulating.

        Raises:
            TopologyError: a tile that is not in ``topology``.
        """
        known = self._symmetric.get(topology.spec)
        if known is None:
            known = self._symmetric[topology.spec] = self._node_symmetric(topology)
        return known

    def _node_symmetric(self, topology: Topology) -> bool:
        per_node = self.ranks_per_node
        if self.num_ranks % per_node:
            return False
        for rank, tile in enumerate(self.tiles):
            if topology.node_of(tile) != rank // per_node:
                return False
            if topology.local_index(tile) != topology.local_index(self.tiles[rank % per_node]):
                return False
        return True

    def representative(self, rank: int) -> int:
        """The rank on node 0 with the same local tile index as ``rank``.

        Only meaningful when :meth:`is_node_symmetric` holds: then it is
        ``rank % ranks_per_node``.
        """
        self._check_rank(rank)
        return rank % self.ranks_per_node

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < len(self.tiles):
            raise TopologyError(f"rank {rank} out of range for {len(self.tiles)} ranks")
