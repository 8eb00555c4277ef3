"""The simulated backend: a full :class:`~transports.base.Transport` whose bytes are
flows in a :class:`sim.Simulation`.

Every simulated rank is a SimPy process holding a :class:`SimTransport`. An
all-to-all starts when every (simulated) member of its group has posted its part, as
real all-to-alls effectively do; each rank's handle completes when everything it
sends and everything it receives has arrived.

Symmetry. On a machine whose nodes are identical, a plan in which every rank does
what the rank with the same local index on node 0 does (shifted by whole nodes)
moves traffic that is invariant under that shift. Then only node 0's ranks need to
be simulated: a flow from node 0 to node k crosses node k's links, which carry the
same load as node 0's corresponding links by symmetry, so routes are *folded* onto
node 0's links, and identical folded flows are bundled. An all-to-all over P ranks
then costs O(ranks per node^2) flows instead of O(P^2), exactly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import simpy

from sim import Simulation
from topology import TIERS, Placement
from transports.base import Group, TransportError, VirtualBuffer


@dataclass(frozen=True, slots=True)
class _Bundle:
    """Identical flows from one source rank: same links, same bytes."""

    links: tuple
    num_bytes: int
    count: int
    latency_s: float
    dst_class: int  # the receiving rank, or its node-0 representative when folding
    tier: str


@dataclass(slots=True)
class _PendingCollective:
    posted: dict[int, tuple[int, ...]] = field(default_factory=dict)  # rank -> bytes per member
    events: dict[int, simpy.Event] = field(default_factory=dict)


class SimWorld:
    """State shared by all simulated ranks of one run.

    Args:
        simulation: the simulation the flows run in.
        placement: global rank -> tile.
        fold_by_node: simulate node 0's ranks only and fold routes (see module doc).
            Requires a node-symmetric placement; the caller guarantees the plan is
            node-symmetric too.
    """

    def __init__(
        self, simulation: Simulation, placement: Placement, fold_by_node: bool = False
    ) -> None:
        topology = simulation.topology
        if fold_by_node and not placement.is_node_symmetric(topology):
            raise ValueError("folding by node needs ranks that fill whole, identical nodes")
        self.simulation = simulation
        self.placement = placement
        self.fold_by_node = fold_by_node
        num_nodes_used = placement.num_ranks // placement.ranks_per_node
        # Each simulated flow stands for this many real ones.
        self.multiplicity = num_nodes_used if fold_by_node else 1
        if fold_by_node:
            self.simulated_ranks = tuple(range(placement.ranks_per_node))
        else:
            self.simulated_ranks = tuple(range(placement.num_ranks))
        self._simulated = set(self.simulated_ranks)
        self._pending: dict[tuple[tuple[int, ...], int], _PendingCollective] = {}
        self._sequence: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)
        self._bundle_cache: dict[tuple, tuple[_Bundle, ...]] = {}
        self.bytes_by_tier: dict[str, float] = dict.fromkeys(TIERS, 0.0)
        self.num_collectives = 0

    def transport(self, rank: int) -> SimTransport:
        if rank not in self._simulated:
            raise ValueError(f"rank {rank} is not simulated (simulated: {self.simulated_ranks})")
        return SimTransport(self, rank)

    # -- collectives ------------------------------------------------------------------

    def post_all_to_all(
        self, rank: int, group: Group, send_bytes: tuple[int, ...]
    ) -> simpy.Event:
        key_group = group.ranks
        sequence = self._sequence[(rank, key_group)]
        self._sequence[(rank, key_group)] = sequence + 1
        pending = self._pending.setdefault((key_group, sequence), _PendingCollective())
        pending.posted[rank] = send_bytes
        pending.events[rank] = self.simulation.env.event()
        expected = [r for r in key_group if r in self._simulated]
        if len(pending.posted) == len(expected):
            del self._pending[(key_group, sequence)]
            self._launch(key_group, pending)
        return pending.events[rank]

    def _launch(self, group_ranks: tuple[int, ...], pending: _PendingCollective) -> None:
        self.num_collectives += 1
        involved: dict[int, list[simpy.Event]] = {rank: [] for rank in pending.posted}
        for src_rank, send_bytes in pending.posted.items():
            for bundle in self._bundles(src_rank, group_ranks, send_bytes):
                done = self.simulation.transfer(
                    bundle.links, bundle.num_bytes, bundle.latency_s, count=bundle.count
                )
                involved[src_rank].append(done)
                involved.setdefault(bundle.dst_class, []).append(done)
                self.bytes_by_tier[bundle.tier] += (
                    bundle.num_bytes * bundle.count * self.multiplicity
                )
        env = self.simulation.env
        for rank, event in pending.events.items():
            simpy.AllOf(env, involved[rank]).callbacks.append(
                lambda _all, event=event: event.succeed()
            )

    def _bundles(
        self, src_rank: int, group_ranks: tuple[int, ...], send_bytes: tuple[int, ...]
    ) -> tuple[_Bundle, ...]:
        key = (src_rank, group_ranks, send_bytes)
        cached = self._bundle_cache.get(key)
        if cached is not None:
            return cached
        topology = self.simulation.topology
        placement = self.placement
        src_tile = placement.tile_of(src_rank)
        grouped: dict[tuple, list] = {}
        for dst_rank, num_bytes in zip(group_ranks, send_bytes):
            if dst_rank == src_rank or num_bytes == 0:
                continue
            dst_tile = placement.tile_of(dst_rank)
            route = topology.route(src_tile, dst_tile)
            if self.fold_by_node:
                links = tuple(topology.fold_link(link) for link in route)
                dst_class = placement.representative(dst_rank)
            else:
                links = route
                dst_class = dst_rank
            bundle_key = (links, num_bytes, dst_class)
            if bundle_key in grouped:
                grouped[bundle_key][0] += 1
            else:
                latency_s = topology.route_latency_us(route) * 1e-6
                grouped[bundle_key] = [1, latency_s, topology.tier(src_tile, dst_tile)]
        bundles = tuple(
            _Bundle(links, num_bytes, count, latency_s, dst_class, tier)
            for (links, num_bytes, dst_class), (count, latency_s, tier) in grouped.items()
        )
        self._bundle_cache[key] = bundles
        return bundles


class SimHandle:
    """A simulated operation. A SimPy process yields ``handle.event``; ``wait()`` then
    returns the result (it cannot block: simulated time only moves by yielding)."""

    __slots__ = ("event", "_result", "_waited")

    def __init__(self, event: simpy.Event, result: Any = None) -> None:
        self.event = event
        self._result = result
        self._waited = False

    def is_completed(self) -> bool:
        return self.event.processed

    def wait(self) -> Any:
        if self._waited:
            raise TransportError("wait() called twice on the same handle")
        if not self.event.processed:
            raise TransportError(
                "wait() on a simulated handle before its event fired: yield handle.event first"
            )
        self._waited = True
        return self._result


class SimTransport:
    """One simulated rank's view of a :class:`SimWorld`."""

    def __init__(self, world: SimWorld, rank: int) -> None:
        self._world = world
        self._rank = rank
        self._world_group = Group(tuple(range(world.placement.num_ranks)))

    @property
    def name(self) -> str:
        return "sim"

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world.placement.num_ranks

    @property
    def world(self) -> Group:
        return self._world_group

    @property
    def simulation(self) -> Simulation:
        return self._world.simulation

    def new_group(self, ranks: Sequence[int]) -> Group:
        ranks = tuple(ranks)
        if len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"invalid group {ranks} for {self.world_size} ranks")
        return Group(ranks)

    def all_to_all(
        self,
        send: VirtualBuffer,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        group: Group | None = None,
    ) -> SimHandle:
        group = group or self._world_group
        if len(send_splits) != group.size or len(recv_splits) != group.size:
            raise TransportError(
                f"all_to_all over {group.size} ranks got {len(send_splits)} send and "
                f"{len(recv_splits)} receive splits"
            )
        if sum(send_splits) != send.num_rows:
            raise TransportError(f"send splits sum to {sum(send_splits)}, buffer has "
                                 f"{send.num_rows} rows")
        send_bytes = tuple(rows * send.row_bytes for rows in send_splits)
        event = self._world.post_all_to_all(self._rank, group, send_bytes)
        return SimHandle(event, VirtualBuffer(sum(recv_splits), send.row_bytes))

    def barrier(self) -> None:
        """A no-op: simulated ranks only synchronise through their collectives."""

    def close(self) -> None:
        """Nothing to release."""
