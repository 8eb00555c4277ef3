"""The simulated backend: a full :class:`~transports.base.Transport` whose bytes are
flows in a :class:`sim.Simulation`.

Every simulated rank is a SimPy process holding a :class:`SimTransport`. An
all-to-all starts when every (simulated) member of its group has posted its part, as
real all-to-alls effectively do; each rank's handle completes when everything it
sends and everything it receives has arrived. On a host whose late peers go first
(``[host] late_peer_first``, gloo over TCP) a member that posts late sends first and
hears back after (:meth:`SimWorld._launch_late_first`).

Symmetry. On a machine whose nodes are identical, a plan that repeats every m nodes
(every rank does what the rank m nodes earlier does, shifted) moves traffic that is
invariant under that shift. Then only the ranks of nodes 0..m-1 need simulating: a
flow to node k crosses node k's links, which carry the same load as node (k mod m)'s
corresponding links by symmetry, so routes are *folded* onto nodes 0..m-1, and
identical folded flows are bundled. With m = 1 an all-to-all over P ranks costs
O(ranks per node^2) flows instead of O(P^2), exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from sim import Simulation
from sim.network import FlowBatch
from topology import TIERS, HostSpec, Placement
from transports.base import Group, TransportError, VirtualBuffer

# A "ready to receive" notice takes at least this long to reach the other end, even on a
# route of no latency: a member posting later than that had the early member's notice.
_NOTICE_S = 1e-6

# How far a collective reaches, the key of its costs: a two-member exchange
# ("pair"), members on one GPU ("gpu"), on one node ("node"), on several ("nodes").
SPANS = ("pair", "gpu", "node", "nodes")
# A span without costs of its own takes those of the next one listed here.
_SPAN_FALLBACK = {"gpu": "node", "pair": None, "node": None, "nodes": None}


@dataclass(frozen=True, slots=True)
class SpanCost:
    """What a collective of one span costs beyond the wire.

    Args:
        startup_us: set-up of one transfer (one message to one peer).
        engines: transfers a rank sets up at once (the rest wait their turn).
        rank_gbps: GB/s that a rank's transfers of one collective reach together (the
            algorithm's own limit: staging, ordering, a slow path); inf: links only.
    """

    startup_us: float = 0.0
    engines: int = 1
    rank_gbps: float = float("inf")

    def setup_s(self, num_messages: int) -> float:
        return self.startup_us * 1e-6 * -(-num_messages // self.engines)

    def to_json(self) -> dict[str, Any]:
        return {"startup_us": self.startup_us, "engines": self.engines,
                "rank_gbps": None if math.isinf(self.rank_gbps) else self.rank_gbps}


@dataclass(frozen=True, slots=True)
class CollectiveModel:
    """How a collective is carried out, beyond the wire (DESIGN.md section 8).

    Real all-to-alls run far below link rates, and how far depends on how far they
    reach: Aurora's measured all-to-all collapses once it spans two nodes, while a
    point-to-point transfer does not. So every collective is priced by its *span*
    (:data:`SPANS`: a two-member exchange, one GPU, one node, several nodes), by one
    rule: a rank's ``m`` transfers are set up ``engines`` at a time, ``startup_us``
    each, before its data moves; its transfers then share ``rank_gbps`` evenly (each
    capped at ``rank_gbps / m``), and each is also capped at its tier's single-transfer
    rate (``transfer_cap_gbps``); the links share what is left max-min fairly. A flat
    all-to-all over P ranks pays P-1 set-ups at its span's price; TAPA's phases are
    smaller collectives (or pairs) over one tier and pay theirs by the same rule.

    Args:
        name: for reports.
        startup_us: set-up of one transfer, for spans without costs of their own.
        engines: transfers set up at once, for the same.
        transfer_cap_gbps: per tier, the most one transfer achieves (GB/s).
        spans: ``(span, SpanCost)`` pairs overriding the default cost
            (``cocodiff.simulator.collective_fit`` fits them from microbenchmarks).
    """

    name: str
    startup_us: float = 0.0
    engines: int = 1
    transfer_cap_gbps: tuple[tuple[str, float], ...] = ()
    spans: tuple[tuple[str, SpanCost], ...] = ()

    def cost(self, span: str) -> SpanCost:
        """The cost of a collective of ``span``."""
        own = dict(self.spans)
        name: str | None = span
        while name is not None:
            if name in own:
                return own[name]
            name = _SPAN_FALLBACK[name]
        return SpanCost(self.startup_us, self.engines)

    def cap_bytes_per_s(self, tier: str) -> float:
        return dict(self.transfer_cap_gbps).get(tier, float("inf")) * 1e9

    def describe(self) -> str:
        """One line for reports."""
        if not self.spans:
            return (f"{self.name} (per-transfer set-up {self.startup_us:g} us, "
                    f"{self.engines} engine(s))")
        parts = []
        for span, cost in self.spans:
            if cost == SpanCost():
                parts.append(f"{span}: links only")
                continue
            rate = "" if math.isinf(cost.rank_gbps) else f", {cost.rank_gbps:.3g} GB/s per rank"
            parts.append(f"{span}: {cost.startup_us:.3g} us per transfer{rate}")
        parts += [f"one {tier} transfer at most {gbps:.3g} GB/s"
                  for tier, gbps in self.transfer_cap_gbps]
        return f"{self.name} ({'; '.join(parts)})"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "startup_us": self.startup_us, "engines": self.engines,
                "transfer_cap_gbps": [list(pair) for pair in self.transfer_cap_gbps],
                "spans": {span: cost.to_json() for span, cost in self.spans}}

    @staticmethod
    def from_json(data: dict[str, Any], name: str | None = None) -> CollectiveModel:
        """The inverse of :meth:`to_json` (missing keys take their defaults)."""
        spans = tuple(
            (span, SpanCost(cost.get("startup_us", 0.0), cost.get("engines", 1),
                            float("inf") if cost.get("rank_gbps") is None
                            else cost["rank_gbps"]))
            for span, cost in (data.get("spans") or {}).items()
        )
        return CollectiveModel(
            name or data.get("name", "calibrated"), data.get("startup_us", 0.0),
            data.get("engines", 1),
            tuple((tier, gbps) for tier, gbps in data.get("transfer_cap_gbps", ())), spans)


def group_span(topology, tiles: Iterable[str]) -> str:
    """The span of a collective over ``tiles``: see :data:`SPANS`.

    Reads the tiles only as far as it must (an output gather's group is every rank of
    thousands of nodes, in node order: the thirteenth tile of an Aurora group settles it).
    """
    members = iter(tiles)
    first = next(members, None)
    if first is None:
        return "gpu"
    node, gpu = topology.node_of(first), topology.gpu_of(first)
    span, count = "gpu", 1
    for tile in members:
        count += 1
        if span != "nodes":
            if topology.node_of(tile) != node:
                span = "nodes"
            elif span == "gpu" and topology.gpu_of(tile) != gpu:
                span = "node"
        if span == "nodes" and count > 2:
            return span
    return "pair" if count == 2 else span


# Aurora's span costs, as cocodiff.simulator.collective_fit gives them (see COLLECTIVE_MODELS).
# A two-member exchange: links only (the point-to-point control, 26.2 GB/s across the
# node boundary, is faster than the links' 25 GB/s: nothing left to charge).
AURORA_SPANS: tuple[tuple[str, SpanCost], ...] = (
    ("node", SpanCost(startup_us=14.55)),
    ("nodes", SpanCost(startup_us=45.56, rank_gbps=6.524)),
    ("pair", SpanCost()),
)

# Collective models by topology preset. Every number is an assumption or a
# measurement named beside it; `cocodiff calibrate` measures them on a real machine.
COLLECTIVE_MODELS: dict[str, CollectiveModel] = {
    # Links only: the physical lower bound of any schedule on these routes.
    "ideal": CollectiveModel("ideal"),
    # Aurora (Intel Max 1550 + Slingshot-11). Single-transfer rates from ALCF's
    # node-performance overview (158.5 GB/s to the sibling tile, 18.9 GB/s to another
    # GPU; a NIC's 25 GB/s). The span costs are fitted by cocodiff.simulator.collective_fit on the
    # published all-to-all microbenchmarks (cocodiff/data/aurora_alltoall.toml:
    # torch.distributed levels, torchcomms trend over size, the point-to-point control);
    # tests/simulator/test_collective_fit.py re-runs the fit and checks these numbers.
    "aurora": CollectiveModel(
        "aurora",
        transfer_cap_gbps=(("intra-gpu", 158.5), ("intra-node", 18.9), ("inter-node", 25.0)),
        spans=AURORA_SPANS,
    ),
    # DGX-H100: NCCL over NVLink 4. A rank's transfers together reach ~370 GB/s, NCCL's
    # effective NVLink rate (450 GB/s line rate less ~20% protocol overhead), seen as busBw
    # of non-allreduce collectives in nccl-tests (NCCL's maintainer, NVIDIA/nccl-tests
    # issue 212). Set-up ~5 us per peer, 4 at once (channels): assumptions.
    "dgx-h100": CollectiveModel("dgx-h100", startup_us=5.0, engines=4, spans=(
        ("node", SpanCost(startup_us=5.0, engines=4, rank_gbps=370.0)),
        ("pair", SpanCost(startup_us=5.0, engines=1, rank_gbps=370.0)),
    )),
    # A CPU cluster over TCP (gloo / MPI): ~50 us per message, one at a time
    # (assumption; `cocodiff calibrate` measures it).
    "cluster": CollectiveModel("cluster", startup_us=50.0, engines=1),
}


def collective_model_for(topology_name: str) -> CollectiveModel:
    """The model of a preset's machine; links only (``ideal``) for other machines."""
    return COLLECTIVE_MODELS.get(topology_name, COLLECTIVE_MODELS["ideal"])


class IdentityMemo:
    """``make(obj)`` worked out once per object and found again by the object's ``id``:
    for objects a simulation meets again and again whose hash is not cached (tuples of
    thousands of ranks; a plan's steps). Each object is kept alive with its value, so
    its id stays its own."""

    __slots__ = ("_make", "_entries")

    def __init__(self, make: Callable[[Any], Any]) -> None:
        self._make = make
        self._entries: dict[int, tuple[Any, Any]] = {}

    def __call__(self, obj: Any) -> Any:
        entry = self._entries.get(id(obj))
        if entry is None:
            entry = self._entries[id(obj)] = (obj, self._make(obj))
        return entry[1]


class _Interner(IdentityMemo):
    """Small integer keys for tuples, found by identity, equal tuples sharing one key.

    A Ring pass is an all-to-all over the whole Ring (thousands of members at Aurora
    scale) that a rank makes ``ring - 1`` times per layer with the same group and split
    objects; keyed by the tuples themselves, the simulator's matching and caches hashed
    them on every pass, O(ring^2) per layer. Keyed by identity a pass costs O(1); equal
    tuples still share one key (matching across ranks needs it)."""

    __slots__ = ()

    def __init__(self) -> None:
        by_value: dict[tuple, int] = {}
        super().__init__(lambda values: by_value.setdefault(values, len(by_value)))


@dataclass(frozen=True, slots=True)
class _SenderFlows:
    """One rank's part of an all-to-all as a flow batch, cached by (rank, group, bytes).

    Owner slots in ``batch`` are simulated rank ids (sender and receiver class).
    """

    batch: FlowBatch
    bytes_by_tier: tuple[tuple[str, float], ...]


@dataclass(slots=True)
class _PendingCollective:
    posted: dict[int, tuple[int, ...]] = field(default_factory=dict)  # rank -> bytes per member
    events: dict[int, simpy.Event] = field(default_factory=dict)
    times: dict[int, float] = field(default_factory=dict)  # rank -> when it posted


class FlowCache:
    """What simulations work out about collectives that depends only on the machine, the
    placement, the fold and the collective model, never on time: the interned group and
    byte keys, each sender's flows and each launch's batch, the spans. Simulations of
    one plan's variants (one and two layers, Ring passes cut to 1, 2 and 3 repeats,
    V-Major's steps) share one, so an output gather to every rank of 4,096 nodes is
    bundled once, not once per simulation. A cache serves one (topology, placement,
    fold, collective model); :class:`SimWorld` starts a cache of its own for another."""

    __slots__ = ("array", "bytes_key", "expected", "group_key", "groups", "launches", "owner",
                 "senders", "send_bytes", "spans", "splits", "world_size")

    def __init__(self) -> None:
        self.owner: tuple | None = None  # (topology, placement, fold_nodes, collective)
        # Groups and per-member byte tuples by small keys (_Interner: O(1) per call).
        self.group_key = _Interner()
        self.bytes_key = _Interner()
        self.expected: dict[int, int] = {}
        self.senders: dict[tuple, _SenderFlows] = {}
        self.send_bytes: dict[tuple, tuple[int, ...]] = {}
        self.splits: dict[tuple, tuple[tuple[int, ...], int, int, tuple, tuple]] = {}
        self.launches: dict[tuple, tuple[FlowBatch, dict[str, float]]] = {}
        self.spans: dict[int, str] = {}
        # Rank and byte tuples as arrays, once per tuple: every sender of an output gather
        # passes the same tuples of every rank of the machine.
        self.array = IdentityMemo(lambda values: np.asarray(values, dtype=np.int64))
        # Groups made of a plan's rank tuples, checked once (an output gather's is every
        # rank of the machine; every simulated rank makes it, in every simulation) against
        # the world size the first simulation binds.
        self.world_size = 0
        self.groups = IdentityMemo(lambda ranks: _checked_group(ranks, self.world_size))

    def serves(self, topology, placement: Placement, fold_nodes: int | None,
               collective: CollectiveModel) -> bool:
        """Whether this cache may serve a simulation of these (the first one binds it)."""
        owner = (topology, placement, fold_nodes, collective)
        if self.owner is None:
            self.owner, self.world_size = owner, placement.num_ranks
        return self.owner[0] is topology and self.owner[1:] == owner[1:]


def _checked_group(ranks: tuple[int, ...], world_size: int) -> Group:
    # min/max, not a loop: the output gather's group is every rank of the machine.
    if len(set(ranks)) != len(ranks) or (ranks and (min(ranks) < 0
                                                    or max(ranks) >= world_size)):
        raise ValueError(f"invalid group {ranks} for {world_size} ranks")
    return Group(ranks)


class SimWorld:
    """State shared by all simulated ranks of one run.

    Args:
        simulation: the simulation the flows run in.
        placement: global rank -> tile.
        fold_nodes: simulate only the ranks of nodes ``0..fold_nodes-1`` and fold routes
            onto them (see module doc); None simulates every rank. Requires a
            node-symmetric placement and a node count divisible by ``fold_nodes``; the
            caller guarantees the plan repeats every ``fold_nodes`` nodes too.
        collective: the collective model (default: ideal).
        cache: a :class:`FlowCache` shared with other simulations of the same machine,
            placement, fold and model; a new one by default or when it serves others.
    """

    def __init__(
        self, simulation: Simulation, placement: Placement, fold_nodes: int | None = None,
        collective: CollectiveModel | None = None, cache: FlowCache | None = None,
    ) -> None:
        topology = simulation.topology
        num_nodes_used = placement.num_ranks // placement.ranks_per_node
        if fold_nodes is not None and (
            not placement.is_node_symmetric(topology) or num_nodes_used % fold_nodes
        ):
            raise ValueError(
                f"cannot fold {num_nodes_used} nodes onto {fold_nodes}: folding needs ranks "
                "that fill whole, identical nodes, in a whole number of periods"
            )
        self.simulation = simulation
        self.placement = placement
        self.fold_nodes = fold_nodes
        self.collective = collective or COLLECTIVE_MODELS["ideal"]
        if fold_nodes is None:
            self.multiplicity = 1  # each simulated flow stands for this many real ones
            self.simulated_ranks = tuple(range(placement.num_ranks))
        else:
            self.multiplicity = num_nodes_used // fold_nodes
            self.simulated_ranks = tuple(range(fold_nodes * placement.ranks_per_node))
        self._num_simulated = len(self.simulated_ranks)
        # Collectives match by (group, tag, n-th call with that tag on that group).
        self._pending: dict[tuple, _PendingCollective] = {}
        self._sequence: dict[tuple, int] = defaultdict(int)
        if cache is None or not cache.serves(topology, placement, fold_nodes, self.collective):
            cache = FlowCache()
            cache.serves(topology, placement, fold_nodes, self.collective)
        self._group_key, self._bytes_key = cache.group_key, cache.bytes_key
        self._expected, self._sender_cache = cache.expected, cache.senders
        self._send_bytes, self._splits = cache.send_bytes, cache.splits
        self._launch_cache, self._spans, self._array = cache.launches, cache.spans, cache.array
        self.groups = cache.groups
        self.world_group = Group(tuple(range(placement.num_ranks)))
        self.bytes_by_tier: dict[str, float] = dict.fromkeys(TIERS, 0.0)
        self.num_collectives = 0
        # Folded, a flow's far end is a class of ranks, not one rank that may post late.
        host = simulation.host
        self._late_peer_first = bool(host and host.late_peer_first and not self.folded)
        # The posters whose data crosses nodes in a collective (their hosts lose
        # [host] transfer_cores meanwhile), by launch signature; folded, a flow's far end
        # is a class of ranks, so it is not applied.
        self._in_flight = bool(host and host.transfer_cores and not self.folded)
        self._crossing_ranks: dict[tuple, tuple[int, ...]] = {}

    @property
    def folded(self) -> bool:
        return self.fold_nodes is not None and self.multiplicity > 1

    def transport(self, rank: int) -> SimTransport:
        if not 0 <= rank < self._num_simulated:
            last = self._num_simulated - 1
            raise ValueError(f"rank {rank} is not simulated (simulated: 0..{last})")
        return SimTransport(self, rank)

    # -- collectives ------------------------------------------------------------------

    def post_all_to_all(
        self, rank: int, group: Group, send_bytes: tuple[int, ...], tag: Hashable = None,
        sequence: int | None = None,
    ) -> simpy.Event:
        """Post ``rank``'s part; ``sequence`` (from :meth:`reserve`) when the call was made
        earlier than it is posted (its CPU work came first)."""
        group_key = self._group_key(group.ranks)
        if sequence is None:
            sequence = self.reserve(rank, group, tag)
        pending = self._pending.setdefault((group_key, tag, sequence), _PendingCollective())
        pending.posted[rank] = send_bytes
        pending.events[rank] = self.simulation.env.event()
        if self._late_peer_first:
            pending.times[rank] = self.simulation.env.now
        expected = self._expected.get(group_key)
        if expected is None:  # the group's simulated members, counted once per group
            expected = self._expected[group_key] = sum(
                1 for r in group.ranks if r < self._num_simulated)
        if len(pending.posted) == expected:
            del self._pending[(group_key, tag, sequence)]
            self._launch(group.ranks, group_key, pending)
        return pending.events[rank]

    def splits(self, send_splits: Sequence[int], recv_splits: Sequence[int], row_bytes: int
               ) -> tuple[tuple[int, ...], int, int]:
        """(bytes to each member, rows sent, rows received) of a call's splits; tuples
        (a plan's, reused call after call) are looked up by identity (_Interner's
        reason), each pair summed once."""
        if type(send_splits) is not tuple or type(recv_splits) is not tuple:
            return (self.send_bytes(send_splits, row_bytes), sum(send_splits),
                    sum(recv_splits))
        key = (id(send_splits), id(recv_splits), row_bytes)
        cached = self._splits.get(key)
        if cached is None:  # the splits are kept alive with it: their ids stay theirs
            cached = self._splits[key] = (self.send_bytes(send_splits, row_bytes),
                                          sum(send_splits), sum(recv_splits), send_splits,
                                          recv_splits)
        return cached[0], cached[1], cached[2]

    def send_bytes(self, send_splits: Sequence[int], row_bytes: int) -> tuple[int, ...]:
        """Bytes to each member of rows ``send_splits`` of ``row_bytes`` each. Plans repeat
        the same splits (a Ring pass: one row to the next of hundreds of members, once
        per block), so each distinct one is multiplied out once, in Python, and then
        found by its hash, in C."""
        key = (tuple(send_splits), row_bytes)
        cached = self._send_bytes.get(key)
        if cached is None:
            cached = self._send_bytes[key] = tuple(rows * row_bytes for rows in key[0])
        return cached

    def reserve(self, rank: int, group: Group, tag: Hashable = None) -> int:
        """The number of ``rank``'s call on ``(group, tag)``: calls match by it, in the
        order the ranks make them, whenever they are posted."""
        key = (rank, self._group_key(group.ranks), tag)
        sequence = self._sequence[key]
        self._sequence[key] = sequence + 1
        return sequence

    def _launch(self, group_ranks: tuple[int, ...], group_key: int,
                pending: _PendingCollective) -> None:
        self.num_collectives += 1
        ranks = sorted(pending.posted)
        key = (group_key, tuple((rank, self._bytes_key(pending.posted[rank])) for rank in ranks))
        if self._in_flight:
            self._mark_crossing(key, group_ranks, ranks, pending)
        if self._late_peer_first and self._launch_late_first(group_ranks, group_key, ranks,
                                                             pending):
            return
        launch = self._launch_cache.get(key)
        if launch is None:
            launch = self._launch_cache[key] = self._combine(group_ranks, group_key, ranks,
                                                             pending)
        batch, tier_bytes = launch
        for tier, num_bytes in tier_bytes.items():
            self.bytes_by_tier[tier] += num_bytes
        done = self.simulation.network.start(batch)
        for slot, rank in enumerate(ranks):
            event = pending.events[rank]
            done[slot].callbacks.append(lambda _done, event=event: event.succeed())

    def _mark_crossing(self, key: tuple, group_ranks: tuple[int, ...], ranks: list[int],
                       pending: _PendingCollective) -> None:
        """Tell the simulation which posters have data crossing nodes in this collective
        (sent or received), from now until their part completes (:meth:`sim.engine.
        Simulation.crossing`: their hosts lose cores meanwhile); ``key``: the launch's
        signature (:meth:`_launch`'s), under which the posters are worked out once."""
        crossing = self._crossing_ranks.get(key)
        if crossing is None:
            node = self.placement.node_of
            found: set[int] = set()
            for src in ranks:
                for dst, num_bytes in zip(group_ranks, pending.posted[src], strict=True):
                    if num_bytes and node(dst) != node(src):
                        found.update((src, dst))
            crossing = self._crossing_ranks[key] = tuple(sorted(found.intersection(ranks)))
        simulation = self.simulation
        for rank in crossing:
            simulation.crossing(rank, 1)
            pending.events[rank].callbacks.append(
                lambda _done, rank=rank: simulation.crossing(rank, -1))

    def _launch_late_first(self, group_ranks: tuple[int, ...], group_key: int,
                           ranks: list[int], pending: _PendingCollective) -> bool:
        """Launch under the host's late-peer rule (:attr:`HostSpec.late_peer_first`):
        of two members that send to each other, one having posted later than the
        other by more than their route's latency (the early one's "ready" had reached
        it) and sending to it before it posts its receive from it (in gloo's order:
        always in a pair, for some pairs of a larger group), the late one's flow to
        the early one goes first and the early one's flow back starts when it has
        arrived. The early member is done without waiting for that flow back (its data
        sits in the transport's buffers), the late one once it is in. Every other flow
        starts now, as in :meth:`_launch`. False, launching nothing, when no such pair
        posted out of step (``bench/pair_lateness.py`` measures both cases)."""
        times = pending.times
        if max(times.values()) - min(times.values()) <= _NOTICE_S:
            return False  # in step (the common case): no pair to look at
        senders = {rank: self._sender_flows(rank, group_ranks, group_key,
                                            pending.posted[rank]) for rank in ranks}
        rows: dict[tuple[int, int], list[int]] = defaultdict(list)  # (src, dst) -> rows
        for rank, flows in senders.items():
            for row, dst in enumerate(flows.batch.owners[:, 1].tolist()):
                rows[rank, dst].append(row)
        topology, tiles = self.simulation.topology, self.placement.tiles
        position = {rank: index for index, rank in enumerate(group_ranks)}
        size = len(group_ranks)
        late_first = [  # (late, early)
            (src, dst) for src, dst in rows
            if (dst, src) in rows and times[src] - times[dst] > max(
                topology.route_latency_us(topology.route(tiles[src], tiles[dst])) * 1e-6,
                _NOTICE_S)
            # gloo's all-to-all posts, at its i-th turn, the send to member (me + i) and
            # then the receive from member (me - i): the late member's "ready" to dst
            # follows its data to dst unless its receive from dst comes at an earlier turn.
            and 2 * ((position[dst] - position[src]) % size) <= size]
        if not late_first:
            return False
        for tier, num_bytes in self._tier_bytes(senders.values()).items():
            self.bytes_by_tier[tier] += num_bytes
        left = dict.fromkeys(ranks, 1)  # pieces each rank waits for; the first: the rest

        def count_down(*done_ranks: int) -> None:
            for rank in done_ranks:
                left[rank] -= 1
                if not left[rank]:
                    pending.events[rank].succeed()

        def start(src: int, dst: int, then: Callable[[], None]) -> None:
            one_owner = np.tile([0, -1], (len(rows[src, dst]), 1))
            (done,) = self.simulation.network.start(
                senders[src].batch.select(rows[src, dst], one_owner, 1))
            done.callbacks.append(lambda _done: then())

        paired = set(late_first) | {(early, late) for late, early in late_first}
        slot_of = self._slots(ranks)
        rest = []
        for rank, flows in senders.items():
            kept = [row for (src, dst), found in rows.items() if src == rank
                    and (src, dst) not in paired for row in found]
            rest.append(flows.batch.select(kept, _in_slots(flows.batch.owners[kept], slot_of),
                                           len(ranks)))
        for slot, done in enumerate(self.simulation.network.start(
                FlowBatch.concatenate(rest, [0] * len(rest), len(ranks)))):
            done.callbacks.append(lambda _done, rank=ranks[slot]: count_down(rank))

        def late_then_early(late: int, early: int) -> None:
            def back() -> None:
                count_down(late, early)
                start(early, late, lambda: count_down(late))
            left[late] += 2
            left[early] += 1
            start(late, early, back)

        for late, early in late_first:
            late_then_early(late, early)
        return True

    def _combine(self, group_ranks: tuple[int, ...], group_key: int, ranks: list[int],
                 pending: _PendingCollective) -> tuple[FlowBatch, dict[str, float]]:
        """Every poster's flows as one batch whose owner slots are positions in ``ranks``,
        and the bytes it moves per tier (real ranks, not just simulated ones)."""
        senders = [self._sender_flows(rank, group_ranks, group_key, pending.posted[rank])
                   for rank in ranks]
        batch = FlowBatch.concatenate([f.batch for f in senders], [0] * len(senders),
                                      self._num_simulated)
        return (dataclasses.replace(batch, owners=_in_slots(batch.owners, self._slots(ranks)),
                                    num_owners=len(ranks)),
                self._tier_bytes(senders))

    def _tier_bytes(self, senders: Iterable[_SenderFlows]) -> dict[str, float]:
        """The bytes ``senders``' flows move per tier, for the real ranks (a folded flow
        stands for ``multiplicity`` of them)."""
        tier_bytes: dict[str, float] = defaultdict(float)
        for flows in senders:
            for tier, num_bytes in flows.bytes_by_tier:
                tier_bytes[tier] += num_bytes * self.multiplicity
        return tier_bytes

    def _slots(self, ranks: list[int]) -> np.ndarray:
        """Each simulated rank's slot in a launch of ``ranks`` (its position), -1 if not
        in it."""
        slot_of = np.full(self._num_simulated, -1, dtype=np.int64)
        slot_of[ranks] = np.arange(len(ranks))
        return slot_of

    def _sender_flows(
        self, src_rank: int, group_ranks: tuple[int, ...], group_key: int,
        send_bytes: tuple[int, ...]
    ) -> _SenderFlows:
        key = (src_rank, group_key, self._bytes_key(send_bytes))
        cached = self._sender_cache.get(key)
        if cached is not None:
            return cached
        topology = self.simulation.topology
        placement = self.placement
        network = self.simulation.network
        src_tile = placement.tile_of(src_rank)
        grouped: dict[tuple, list] = {}
        tier_bytes: dict[str, float] = defaultdict(float)
        model = self.collective
        destinations = self._destinations(src_rank, group_ranks, send_bytes)
        messages = sum(count for _, _, count in destinations)
        cost = model.cost(self._span(group_ranks, group_key))
        setup_s = cost.setup_s(messages)
        share_cap = cost.rank_gbps * 1e9 / max(messages, 1)  # the rank's rate, shared evenly
        # Folded, a destination's folded route, tier and latency depend only on its
        # class (rank modulo the simulated ranks) and on whether it shares the sender's
        # node (node-symmetric placement: rank r sits on node r // ranks_per_node), so
        # they are worked out once per (class, same node), not once per destination:
        # the output gather sends to every rank of the machine.
        for dst_rank, num_bytes, count in destinations:
            dst_tile = placement.tile_of(dst_rank)
            route = topology.route(src_tile, dst_tile)
            if self.fold_nodes is not None:
                links = topology.folded_route(src_tile, dst_tile, self.fold_nodes)
                dst_class = dst_rank % self._num_simulated
            else:
                links, dst_class = route, dst_rank
            tier = topology.tier(src_tile, dst_tile)
            tier_bytes[tier] += num_bytes * count
            bundle_key = (links, num_bytes, dst_class)
            if bundle_key in grouped:
                grouped[bundle_key][0] += count
            else:
                latency_s = topology.route_latency_us(route) * 1e-6 + setup_s
                grouped[bundle_key] = [count, latency_s,
                                       min(share_cap, model.cap_bytes_per_s(tier))]
        flows = [
            ([network.link_index(link) for link in links], num_bytes, count, latency_s,
             (src_rank, dst_class))
            for (links, num_bytes, dst_class), (count, latency_s, _) in grouped.items()
        ]
        caps = [cap for count, latency_s, cap in grouped.values()]
        sender = _SenderFlows(FlowBatch.build(flows, self._num_simulated, caps),
                              tuple(tier_bytes.items()))
        self._sender_cache[key] = sender
        return sender

    def _destinations(self, src_rank: int, group_ranks: tuple[int, ...],
                      send_bytes: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """``(destination, bytes, count)`` of every message ``src_rank`` sends, each the
        first of ``count`` that share its fate, in order of first appearance.

        Unfolded, every message is its own. Folded, a destination's folded route, tier,
        latency and class depend only on its rank modulo the simulated ranks and on
        whether it shares the sender's node (a node-symmetric placement puts rank ``r``
        on node ``r // ranks_per_node``): messages alike in those and in bytes are one
        bundle, found with numpy (the output gather sends to every rank of the machine,
        so a Python loop over destinations would cost O(ranks) per sender)."""
        if self.fold_nodes is None or len(group_ranks) < 64:
            return [(dst, num_bytes, 1)
                    for dst, num_bytes in zip(group_ranks, send_bytes, strict=True)
                    if num_bytes and dst != src_rank]
        dst, sizes = self._array(group_ranks), self._array(send_bytes)
        keep = (sizes != 0) & (dst != src_rank)
        dst, sizes = dst[keep], sizes[keep]
        per_node = self.placement.ranks_per_node
        same_node = (dst // per_node == src_rank // per_node).astype(np.int64)
        # One integer per (class, same node, size): a 1-D unique sorts far faster than
        # rows of a 2-D one (axis=0), and groups the same messages.
        _, size_index = np.unique(sizes, return_inverse=True)
        keys = (size_index * self._num_simulated + dst % self._num_simulated) * 2 + same_node
        _, first, counts = np.unique(keys, return_index=True, return_counts=True)
        order = np.argsort(first, kind="stable")
        return [(int(dst[first[i]]), int(sizes[first[i]]), int(counts[i])) for i in order]

    def _span(self, group_ranks: tuple[int, ...], group_key: int) -> str:
        span = self._spans.get(group_key)
        if span is None:
            tiles = self.placement.tiles
            span = self._spans[group_key] = group_span(self.simulation.topology,
                                                       (tiles[rank] for rank in group_ranks))
        return span


def _in_slots(owners: np.ndarray, slot_of: np.ndarray) -> np.ndarray:
    """Flow owners as rank ids (the cached batches') mapped to a launch's slots
    (:meth:`SimWorld._slots`); -1 stays -1."""
    return np.where(owners >= 0, slot_of[np.maximum(owners, 0)], -1)


def _messages(bytes_per_member: Sequence[int], me: int) -> tuple[int, int]:
    """(messages, bytes) to or from the other members (a rank's own part is not sent)."""
    others = [b for member, b in enumerate(bytes_per_member) if member != me and b]
    return len(others), sum(others)


@dataclass(frozen=True, slots=True)
class _ExchangeCpu:
    """One rank's CPU for one exchange call (core-seconds), split where it falls: before
    the first byte leaves, while the bytes are on the wire, after the last arrives; and
    the wake-up (``[host] wake_cpu_us``), after the last arrives too, spent only when the
    rank is blocked on the call then."""

    before_s: float
    during_s: float
    after_s: float
    wake_s: float = 0.0

    @staticmethod
    def of(host: HostSpec, sent: tuple[int, int], received: tuple[int, int],
           routing_s: float = 0.0, wire_s: float = 0.0) -> _ExchangeCpu:
        """From ``(messages, bytes)`` sent and received (:func:`_messages`): the call, its
        rows' routing (``routing_s``) and the first message sent before, the last message
        received after (a message of the mean size each), the rest during, with
        ``wire_s`` more. Its sum is what ``host`` charges the call, so a wire that takes
        no time gives the call its whole CPU in a row."""
        total = routing_s + wire_s + host.exchange_cpu_s(
            sent[0] + received[0], sent[1] + received[1], calls=1)
        before = routing_s + host.exchange_cpu_s(min(sent[0], 1), sent[1] / max(sent[0], 1),
                                                 calls=1)
        after = host.exchange_cpu_s(min(received[0], 1), received[1] / max(received[0], 1))
        wake = min(host.wake_cpu_us * 1e-6, before)  # a part of the call's own price
        return _ExchangeCpu(before - wake, max(0.0, total - before - after), after, wake)


def blocked_at_once() -> bool:
    """:attr:`SimHandle.awaited` of an operation its rank blocks on as it starts it."""
    return True


def not_blocked() -> bool:
    """:attr:`SimHandle.awaited` of an operation its rank has not begun to wait for."""
    return False


class SimHandle:
    """A simulated operation. A SimPy process yields ``handle.event``; ``wait()`` then
    returns the result (it cannot block: simulated time only moves by yielding).

    ``awaited()`` says whether the rank is blocked on the operation now, asked as its data
    arrives: only a rank asleep in the wait has to be woken (the host's call wait). One
    that started the call and went on computing (V-First's V) finds it done when it
    waits. By default the rank blocks on a call as it makes it; an executor that starts
    calls ahead sets it (:class:`cocodiff.simulator.backend.SimBackend`)."""

    __slots__ = ("event", "_result", "_waited", "awaited")

    def __init__(self, event: simpy.Event, result: Any = None) -> None:
        self.event = event
        self._result = result
        self._waited = False
        self.awaited: Callable[[], bool] = blocked_at_once

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
        self._world_group = world.world_group
        self._last_call_done_s: float | None = None  # when this rank's last call finished

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
        # A plan's tuple is checked once per simulation cache (FlowCache.groups).
        if type(ranks) is tuple:
            return self._world.groups(ranks)
        return _checked_group(tuple(ranks), self.world_size)

    def all_to_all(
        self,
        send: VirtualBuffer,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        group: Group | None = None,
        tag: Hashable = None,
        routing_cpu_s: float = 0.0,
        wire_cpu_s: float = 0.0,
    ) -> SimHandle:
        """As :meth:`Transport.all_to_all`; ``tag`` (simulator only) matches calls that
        several concurrent exchanges make on one group, whatever order they post in;
        ``routing_cpu_s`` (simulator only) is the CPU the caller spends readying the call's
        rows (V-Major's sender packing a phase's blocks), charged with the call's own
        before any byte leaves: it does not part the call from the one before it;
        ``wire_cpu_s`` (simulator only) is CPU the call spends while its bytes travel
        beyond its messages' (a TAPA phase's, ``[host] phase_cpu_us``)."""
        group = group or self._world_group
        if len(send_splits) != group.size or len(recv_splits) != group.size:
            raise TransportError(
                f"all_to_all over {group.size} ranks got {len(send_splits)} send and "
                f"{len(recv_splits)} receive splits"
            )
        send_bytes, send_rows, recv_rows = self._world.splits(send_splits, recv_splits,
                                                              send.row_bytes)
        if send_rows != send.num_rows:
            raise TransportError(f"send splits sum to {send_rows}, buffer has "
                                 f"{send.num_rows} rows")
        received = VirtualBuffer(recv_rows, send.row_bytes)
        host = self.simulation.host
        if host is None or not (host.charges_exchanges or routing_cpu_s or wire_cpu_s):
            event = self._world.post_all_to_all(self._rank, group, send_bytes, tag)
            return SimHandle(event, received)
        me = group.group_rank(self._rank)
        recv_bytes = [rows * send.row_bytes for rows in recv_splits]
        cpu = _ExchangeCpu.of(host, _messages(send_bytes, me), _messages(recv_bytes, me),
                              routing_cpu_s, wire_cpu_s)
        sequence = self._world.reserve(self._rank, group, tag)
        follows_call = self._last_call_done_s == self.simulation.env.now
        made: list[SimHandle] = []  # the call's handle, once made: its rank may wait on it
        process = self.simulation.env.process(
            self._with_cpu(group, send_bytes, tag, sequence, cpu, follows_call, made))
        made.append(SimHandle(process, received))
        return made[0]

    def _with_cpu(self, group: Group, send_bytes: tuple[int, ...], tag: Hashable,
                  sequence: int, cpu: _ExchangeCpu, follows_call: bool,
                  made: list[SimHandle]):
        """An exchange on a host, its CPU work on the rank's host's cores as LogGP lays a
        message train out: the call and the first message's sending before any byte
        leaves; the other messages' sending and receiving while the bytes are on the wire
        (the exchange ends when both are done); the last message's receiving after the
        bytes arrived. Before that last part, when the host's cores are all taken as the
        data arrives and the rank is blocked on the call (its handle's ``awaited()``), the
        call waits for the rank to be scheduled again (``[host] call_wait_us``). A call made the
        moment the rank's previous call finished (``follows_call``) waits
        ``follow_wait_us`` whenever its rank is blocked on it, busy cores or not. Only a
        call its rank is blocked on spends the wake-up's CPU (``cpu.wake_s``)."""
        host = self.simulation.host
        env = self.simulation.env
        yield self.simulation.cpu_task(self._rank, cpu.before_s)
        wire = self._world.post_all_to_all(self._rank, group, send_bytes, tag, sequence)
        if cpu.during_s > 0:
            yield env.all_of([wire, self.simulation.cpu_task(self._rank, cpu.during_s)])
        else:
            yield wire
        blocked = made[0].awaited()  # is its rank asleep in the call as its data arrives?
        if (host is not None and host.call_wait_us > 0 and not follows_call and blocked
                and self.simulation.host_busy(self._rank)):
            # Its data arrived while every core of the host was taken: the rank waits to be
            # scheduled again before it can finish the call (no CPU spent).
            yield env.timeout(host.call_wait_us * 1e-6)
        elif host is not None and host.follow_wait_us > 0 and follows_call and blocked:
            # A call made straight after another (flat's K and V after Q, TAPA's second
            # phase) finds its members just woken by the call before: it does not wait for
            # the cores its peers compute on (calibrate's loops of TAPA's two phases, 4
            # ranks on 2 cores, were simulated 27-58% slow when each phase waited that:
            # docs/changelog.md, 2026-11-25, night). Its rank still sleeps in it and is
            # woken when the data is in: under gloo a hand-off from the transport's thread,
            # fitted as a wait of its own on calibrate's loops with and without such calls
            # (result.Loops.fitted_waits_us), whatever the simulated cores are doing. A
            # call started ahead (V-First's V) has no one to wake.
            yield env.timeout(host.follow_wait_us * 1e-6)
        yield self.simulation.cpu_task(self._rank, cpu.after_s + (cpu.wake_s if blocked else 0.0))
        self._last_call_done_s = env.now

    def barrier(self) -> None:
        """A no-op: simulated ranks only synchronise through their collectives."""

    def close(self) -> None:
        """Nothing to release."""
