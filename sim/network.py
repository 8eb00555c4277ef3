"""Flows on links with max-min fair bandwidth sharing (SimGrid's fluid model).

A *flow* moves ``num_bytes`` over a fixed list of links. Every link's capacity is
shared max-min fairly among the flows crossing it (progressive filling / water
filling), and the allocation is recomputed whenever flows start or end. A flow first
pays its path latency, then transfers at its allocated rate.

A flow may stand for ``count`` identical flows on the same links (a *bundle*): it
receives one member's rate and loads every link with ``count`` times that rate.

Flows arrive in batches (:class:`FlowBatch`, one per collective) and are tracked in
numpy arrays, so an all-to-all of thousands of flows costs a few vectorised passes per
event instead of thousands of SimPy events. Completion is reported per *owner*: each
flow names up to two owners (its sender and its receiver, for a collective), and an
owner's event fires when the last of its flows has arrived.

Invariant after every reallocation: for each link, sum(count * rate) over its flows
<= capacity (up to float rounding), and every flow is limited by at least one
saturated link on its path on which no flow is faster (max-min fairness).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import simpy

from topology.graph import LinkTable

LinkId = tuple[Hashable, Hashable]  # a topology edge (u, v)

# A flow is finished when less than this fraction of its bytes is left: rates times
# durations accumulate float rounding, and a completion timer must not fire twice.
_REL_EPS = 1e-9
# Fair shares within this relative distance saturate together (one filling round).
_SHARE_EPS = 1e-12
# Up to this many links a pass over all of them costs less than finding those in use
# (a sort); past it (a folded thousand-node machine holds hundreds of thousands, its
# flows cross a few hundred) only the links in use are touched.
_DENSE_LINKS = 4096


@dataclass(frozen=True, slots=True, eq=False)
class FlowBatch:
    """Flows that start together, as arrays (build once, start many times).

    Args:
        link_ptr: flow i crosses links ``link_idx[link_ptr[i]:link_ptr[i+1]]``.
        link_idx: network link indices (:meth:`Network.link_index`).
        num_bytes: bytes of each flow (per bundle member).
        count: bundle size of each flow.
        latency_s: path latency of each flow.
        owners: (flows, 2) owner slots in ``0..num_owners-1``, -1 for none.
        num_owners: how many completion events :meth:`Network.start` returns.
        max_rate: bytes/s one flow can reach whatever the links allow (a single
            transfer's achievable rate); None for no cap.
    """

    link_ptr: np.ndarray
    link_idx: np.ndarray
    num_bytes: np.ndarray
    count: np.ndarray
    latency_s: np.ndarray
    owners: np.ndarray
    num_owners: int
    max_rate: np.ndarray | None = None

    @property
    def num_flows(self) -> int:
        return len(self.num_bytes)

    @staticmethod
    def build(
        flows: Sequence[tuple[Sequence[int], float, int, float, Sequence[int]]],
        num_owners: int,
        max_rate: Sequence[float] | None = None,
    ) -> FlowBatch:
        """From (link indices, bytes, count, latency_s, owner slots) per flow."""
        lengths = [len(links) for links, *_ in flows]
        link_ptr = np.zeros(len(flows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=link_ptr[1:])
        link_idx = np.fromiter(
            (link for links, *_ in flows for link in links), dtype=np.int64, count=sum(lengths)
        )
        owners = np.full((len(flows), 2), -1, dtype=np.int64)
        for row, (*_, flow_owners) in enumerate(flows):
            owners[row, : len(flow_owners)] = flow_owners
        return FlowBatch(
            link_ptr,
            link_idx,
            np.array([f[1] for f in flows], dtype=np.float64),
            np.array([f[2] for f in flows], dtype=np.float64),
            np.array([f[3] for f in flows], dtype=np.float64),
            owners,
            num_owners,
            None if max_rate is None else np.array(max_rate, dtype=np.float64),
        )

    def select(self, rows: Sequence[int], owners: np.ndarray, num_owners: int) -> FlowBatch:
        """Flows ``rows`` of this batch, owned by ``owners`` ((len(rows), 2) slots) out of
        ``num_owners``."""
        index = np.asarray(rows, dtype=np.int64)
        lengths = self.link_ptr[index + 1] - self.link_ptr[index]
        link_ptr = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lengths, out=link_ptr[1:])
        links = [self.link_idx[self.link_ptr[row]:self.link_ptr[row + 1]] for row in index]
        return FlowBatch(
            link_ptr,
            np.concatenate(links) if links else np.zeros(0, dtype=np.int64),
            self.num_bytes[index],
            self.count[index],
            self.latency_s[index],
            np.asarray(owners, dtype=np.int64).reshape(len(index), 2),
            num_owners,
            None if self.max_rate is None else self.max_rate[index],
        )

    @staticmethod
    def concatenate(
        batches: Sequence[FlowBatch], owner_offsets: Sequence[int], num_owners: int
    ) -> FlowBatch:
        """Join batches; batch k's owner slots are shifted by ``owner_offsets[k]``."""
        ptrs, offset = [np.zeros(1, dtype=np.int64)], 0
        for batch in batches:
            ptrs.append(batch.link_ptr[1:] + offset)
            offset += len(batch.link_idx)
        owners = [
            np.where(batch.owners >= 0, batch.owners + shift, -1)
            for batch, shift in zip(batches, owner_offsets, strict=True)
        ]
        return FlowBatch(
            np.concatenate(ptrs),
            np.concatenate([b.link_idx for b in batches]),
            np.concatenate([b.num_bytes for b in batches]),
            np.concatenate([b.count for b in batches]),
            np.concatenate([b.latency_s for b in batches]),
            np.concatenate(owners),
            num_owners,
            np.concatenate([_caps(b) for b in batches]),
        )


def _caps(batch: FlowBatch) -> np.ndarray:
    return np.full(batch.num_flows, np.inf) if batch.max_rate is None else batch.max_rate


@dataclass(frozen=True, slots=True, eq=False)
class _Admission:
    """The flows of a batch that share one latency, ready to append to the network."""

    latency_s: float
    sizes: np.ndarray
    count: np.ndarray
    cap: np.ndarray
    owners: np.ndarray  # (flows, 2), batch-relative slots
    nnz_link: np.ndarray
    nnz_flow: np.ndarray  # flow index within this admission
    instant_owners: np.ndarray  # owners of zero-byte / linkless flows (done on arrival)


@dataclass(frozen=True, slots=True, eq=False)
class _Prepared:
    batch: FlowBatch
    owner_flows: np.ndarray  # flows per owner slot
    idle_owners: np.ndarray  # slots with no flow at all
    groups: tuple[_Admission, ...]

    @staticmethod
    def of(batch: FlowBatch) -> _Prepared:
        if batch.num_flows and (batch.num_bytes.min() < 0 or batch.latency_s.min() < 0
                                or batch.count.min() < 1):
            raise ValueError("flows need bytes >= 0, latency >= 0 and count >= 1")
        owner_flows = np.zeros(batch.num_owners, dtype=np.int64)
        np.add.at(owner_flows, batch.owners[batch.owners >= 0], 1)
        lengths_all = batch.link_ptr[1:] - batch.link_ptr[:-1]
        caps = _caps(batch)
        groups = []
        for latency in np.unique(batch.latency_s):
            chosen = np.flatnonzero(batch.latency_s == latency)
            instant = (batch.num_bytes[chosen] == 0) | (lengths_all[chosen] == 0)
            moving = chosen[~instant]
            lengths = lengths_all[moving]
            starts = batch.link_ptr[moving]
            # The links of the moving flows, flattened: flow k's are starts[k] .. +lengths[k].
            within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            groups.append(_Admission(
                float(latency),
                batch.num_bytes[moving],
                batch.count[moving],
                caps[moving],
                batch.owners[moving],
                batch.link_idx[np.repeat(starts, lengths) + within],
                np.repeat(np.arange(len(moving)), lengths),
                batch.owners[chosen[instant]].ravel(),
            ))
        return _Prepared(batch, owner_flows, np.flatnonzero(owner_flows == 0), tuple(groups))


@dataclass(slots=True)
class LinkStats:
    """What one link carried during a simulation."""

    capacity_bytes_per_s: float
    bytes_carried: float = 0.0
    busy_s: float = 0.0
    peak_flows: int = 0
    busy_intervals: list[tuple[float, float]] = field(default_factory=list)


class Network:
    """The links of a topology and the flows currently crossing them.

    Args:
        env: the SimPy environment all processes share.
        capacities: bytes/s of each directed link, or a topology's
            :class:`~topology.graph.LinkTable` (``Topology.link_table()``, built once
            for all its simulations).
        record_intervals: keep each link's busy intervals (for traces).
    """

    def __init__(
        self,
        env: simpy.Environment,
        capacities: Mapping[LinkId, float] | LinkTable,
        record_intervals: bool = True,
    ) -> None:
        if not isinstance(capacities, LinkTable):
            for link, capacity in capacities.items():
                if not 0 < capacity < float("inf"):
                    raise ValueError(f"link {link} needs a positive, finite capacity, got "
                                     f"{capacity} B/s")
            links = tuple(capacities)
            capacities = LinkTable(links, {link: i for i, link in enumerate(links)},
                                   np.array([capacities[link] for link in links],
                                            dtype=np.float64))
        self.env = env
        # Shared, never written: a topology's table serves all its simulations.
        self.links: Sequence[LinkId] = capacities.links
        self._index = capacities.positions
        self._capacity = capacities.bytes_per_s
        self._own_capacity = False  # whether _capacity is this network's to change
        num_links = len(self.links)
        self._bytes_carried = np.zeros(num_links)
        self._busy_s = np.zeros(num_links)
        self._peak_flows = np.zeros(num_links)
        self._busy_since = np.full(num_links, np.nan)
        # Per-link work is done on the links in use only (sorted indices): a folded
        # simulation of thousands of nodes holds every node's links and uses two nodes'.
        self._busy_links = np.zeros(0, dtype=np.int64)  # links carrying flows, sorted
        # Scratch for _record_busy and _links_used: all False between calls; a used
        # link's position among the links in use.
        self._mark = np.zeros(num_links, dtype=bool)
        self._slot = np.zeros(num_links, dtype=np.int64)
        self._used: tuple[np.ndarray, np.ndarray] | None = None  # np.unique of _nnz_link
        # Flows admitted since the last update, appended together in it: a Ring's passes
        # start one one-flow collective per rank at the same instant, and appending each
        # to every array on its own was an eighth of a thousand-node simulation's time.
        self._admitted: list[tuple[_Admission, int]] = []
        self._intervals: dict[int, list[tuple[float, float]]] = {}
        self._record_intervals = record_intervals
        # Active flows, one entry per flow; their links as (flow, link) pairs.
        self._remaining = np.zeros(0)
        self._size = np.zeros(0)
        self._count = np.zeros(0)
        self._rate = np.zeros(0)
        self._cap = np.zeros(0)
        self._owners = np.zeros((0, 2), dtype=np.int64)
        self._nnz_flow = np.zeros(0, dtype=np.int64)
        self._nnz_link = np.zeros(0, dtype=np.int64)
        # Owners: flows still to arrive, and the event to fire at zero. Owner slots are
        # never reused, so the counts live in a buffer that doubles when full: appending
        # with np.concatenate copied every slot ever made on every start (quadratic in
        # the collectives of a step: 5.6 of 18 s for 16 TAPA chunks on one Aurora node).
        self._owner_left = np.zeros(1024, dtype=np.int64)
        self._owner_events: list[simpy.Event] = []
        self._last_update = 0.0
        self._generation = 0  # invalidates completion timers made stale by a reallocation
        self._update_pending = False
        # Batches recur (one per collective signature): their admission arrays are
        # prepared once, keyed by identity (the entry keeps the batch alive).
        self._prepared: dict[int, _Prepared] = {}
        self._slot_of_endless: dict[simpy.Event, int] = {}
        self.num_reallocations = 0
        self.num_flows_started = 0

    # -- public ---------------------------------------------------------------------

    def link_index(self, link: LinkId) -> int:
        try:
            return self._index[link]
        except KeyError:
            raise KeyError(f"unknown link {link}") from None

    def start(self, batch: FlowBatch) -> list[simpy.Event]:
        """Start a batch of flows; returns one event per owner slot, fired when every
        flow naming that owner has arrived (at once for owners with no flows)."""
        prepared = self._prepared.get(id(batch))
        if prepared is None or prepared.batch is not batch:
            prepared = self._prepared[id(batch)] = _Prepared.of(batch)
        first = len(self._owner_events)
        events = [self.env.event() for _ in range(batch.num_owners)]
        self._owner_events.extend(events)
        end = first + batch.num_owners
        if end > len(self._owner_left):
            grown = np.zeros(max(end, 2 * len(self._owner_left)), dtype=np.int64)
            grown[:first] = self._owner_left[:first]
            self._owner_left = grown
        self._owner_left[first:end] = prepared.owner_flows
        for slot in prepared.idle_owners:
            events[slot].succeed()
        self.num_flows_started += batch.num_flows
        for group in prepared.groups:
            if group.latency_s > 0:
                self.env.timeout(group.latency_s).callbacks.append(
                    lambda _e, group=group: self._admit(group, first)
                )
            else:
                self._admit(group, first)
        return events

    def transfer(
        self,
        links: Iterable[LinkId],
        num_bytes: float,
        latency_s: float = 0.0,
        count: int = 1,
        label: str = "",
    ) -> simpy.Event:
        """Start one flow over ``links``; returns the event of its arrival."""
        indices = [self.link_index(link) for link in links]
        if num_bytes < 0 or count < 1 or latency_s < 0:
            raise ValueError(
                f"flow {label!r}: bytes {num_bytes}, count {count}, latency {latency_s} s"
            )
        batch = FlowBatch.build([(indices, num_bytes, count, latency_s, (0,))], num_owners=1)
        return self.start(batch)[0]

    @property
    def settled(self) -> bool:
        """False between admitting flows and the reallocation that gives them rates
        (zero simulated time, but other processes may run in between)."""
        return not self._update_pending

    def allocation(self) -> list[tuple[tuple[LinkId, ...], int, float]]:
        """The active flows as (links, count, rate per member): for tests and debugging."""
        self._append_admitted()
        links_of: list[list[LinkId]] = [[] for _ in range(len(self._remaining))]
        for flow, link in zip(self._nnz_flow.tolist(), self._nnz_link.tolist(), strict=True):
            links_of[flow].append(self.links[link])
        return [
            (tuple(links_of[i]), int(self._count[i]), float(self._rate[i]))
            for i in range(len(self._remaining))
        ]

    @property
    def stats(self) -> dict[LinkId, LinkStats]:
        """Per-link totals (materialised on demand from the arrays)."""
        return {
            link: LinkStats(
                float(self._capacity[i]),
                float(self._bytes_carried[i]),
                float(self._busy_s[i]),
                int(self._peak_flows[i]),
                list(self._intervals.get(i, ())),
            )
            for i, link in enumerate(self.links)
        }

    def carried_bytes(self) -> dict[LinkId, float]:
        """Bytes carried by each link that carried any, in link order: what
        :attr:`stats` says of them, without materialising every link's record (a
        thousand-node machine has hundreds of thousands of links, most of them idle in a
        folded simulation)."""
        return {self.links[i]: float(self._bytes_carried[i])
                for i in np.flatnonzero(self._bytes_carried > 0).tolist()}

    def capacity_bytes_per_s(self, link: LinkId) -> float:
        return float(self._capacity[self.link_index(link)])

    def finish(self) -> None:
        """Close the busy intervals still open at the end of a simulation."""
        now = self.env.now
        for link in self._busy_links:
            self._close_interval(int(link), float(self._busy_since[link]), now)
        self._busy_since[self._busy_links] = np.nan
        self._busy_links = np.zeros(0, dtype=np.int64)

    # -- internals ------------------------------------------------------------------

    def _admit(self, group: _Admission, first_owner: int) -> None:
        if len(group.instant_owners):
            # Nothing to share: zero-byte messages, or a rank sending to itself.
            self._owners_done(np.where(group.instant_owners >= 0,
                                       group.instant_owners + first_owner, -1))
        if not len(group.sizes):
            return
        self._advance()
        self._admitted.append((group, first_owner))
        self._request_update()

    def _append_admitted(self) -> None:
        """Append the flows admitted since the last update to the active ones, in the
        order they were admitted (the update that follows at the same instant, or a
        reader of the arrays, calls it first)."""
        if not self._admitted:
            return
        admitted, self._admitted = self._admitted, []
        base = len(self._remaining)
        links, flows, sizes = [self._nnz_link], [self._nnz_flow], [self._remaining]
        counts, caps, owners = [self._count], [self._cap], [self._owners]
        for group, first in admitted:
            links.append(group.nnz_link)
            flows.append(base + group.nnz_flow)
            sizes.append(group.sizes)
            counts.append(group.count)
            caps.append(group.cap)
            owners.append(np.where(group.owners >= 0, group.owners + first, -1))
            base += len(group.sizes)
        self._used = None
        self._nnz_link = np.concatenate(links)
        self._nnz_flow = np.concatenate(flows)
        self._remaining = np.concatenate(sizes)
        self._size = np.concatenate([self._size, *sizes[1:]])
        self._count = np.concatenate(counts)
        self._rate = np.concatenate([self._rate, np.zeros(base - len(self._rate))])
        self._cap = np.concatenate(caps)
        self._owners = np.concatenate(owners)

    def _request_update(self) -> None:
        # Flows admitted at the same instant are batched into one reallocation: the
        # zero-delay timer runs after the processes already scheduled for this instant.
        if not self._update_pending:
            self._update_pending = True
            self.env.timeout(0).callbacks.append(self._update)

    def _update(self, _event: simpy.Event | None = None) -> None:
        self._update_pending = False
        self._advance()
        self._append_admitted()
        self._complete_finished()
        self._reallocate()
        self._schedule_next_completion()

    def _advance(self) -> None:
        """Move every flow forward to ``env.now`` at its current rate."""
        now = self.env.now
        elapsed = now - self._last_update
        if elapsed > 0 and len(self._remaining):
            moved = np.minimum(self._remaining, self._rate * elapsed)
            self._remaining -= moved
            weights = (moved * self._count)[self._nnz_flow]
            if len(self.links) <= _DENSE_LINKS:
                self._bytes_carried += np.bincount(self._nnz_link, weights=weights,
                                                   minlength=len(self.links))
            else:  # the links in use only; summed per link in flow order all the same
                used, nnz_local = self._links_used()
                self._bytes_carried[used] += np.bincount(nnz_local, weights=weights,
                                                         minlength=len(used))
        self._last_update = now

    def stop(self, owner_event: simpy.Event) -> None:
        """End now the flows whose owner is ``owner_event`` (an event :meth:`start` gave),
        whatever they have left: how an endless flow (``num_bytes = inf``, a task that
        runs until told otherwise, such as a busy-poll) ends. Their event fires."""
        slot = self._slot_of_endless.pop(owner_event)
        self._advance()
        self._append_admitted()
        self._remaining[(self._owners == slot).any(axis=1)] = 0.0
        self._update()

    def set_capacity(self, link: LinkId, bytes_per_s: float) -> None:
        """Give ``link`` a new capacity from now (a host losing cores to other work)."""
        if not 0 < bytes_per_s < float("inf"):
            raise ValueError(f"link {link} needs a positive, finite capacity, got "
                             f"{bytes_per_s} B/s")
        self._advance()
        self._append_admitted()
        if not self._own_capacity:  # a topology's table is shared: write a copy
            self._capacity, self._own_capacity = self._capacity.copy(), True
        self._capacity[self.link_index(link)] = bytes_per_s
        self._update()

    def start_endless(self, batch: FlowBatch) -> simpy.Event:
        """Start a one-owner batch of endless flows (``num_bytes`` inf); :meth:`stop` ends
        them. Returns the owner's event."""
        slot = len(self._owner_events)
        (event,) = self.start(batch)
        self._slot_of_endless[event] = slot
        return event

    def _complete_finished(self) -> None:
        # inf <= eps * inf would count an endless flow as done: it ends only by stop().
        done = (self._remaining <= _REL_EPS * self._size) & np.isfinite(self._remaining)
        if not done.any():
            return
        finished_owners = self._owners[done]
        keep = ~done
        new_id = np.cumsum(keep) - 1
        keep_nnz = keep[self._nnz_flow]
        self._used = None
        self._nnz_link = self._nnz_link[keep_nnz]
        self._nnz_flow = new_id[self._nnz_flow[keep_nnz]]
        for name in ("_remaining", "_size", "_count", "_rate", "_cap", "_owners"):
            setattr(self, name, getattr(self, name)[keep])
        self._owners_done(finished_owners)

    def _owners_done(self, owners: np.ndarray) -> None:
        owners = owners[owners >= 0]
        if not len(owners):
            return
        ids, arrived = np.unique(owners, return_counts=True)
        self._owner_left[ids] -= arrived
        for owner in ids[self._owner_left[ids] == 0]:
            self._owner_events[owner].succeed()

    def _reallocate(self) -> None:
        """Max-min fair rates by progressive filling.

        Repeatedly find the links whose remaining capacity divided by the number of
        unfrozen flow members crossing them is smallest; that fair share is the rate
        of every unfrozen flow on them. Freeze those flows and charge their links. A
        flow whose own cap is below the smallest share freezes at its cap instead.
        """
        self.num_reallocations += 1
        num_flows = len(self._remaining)
        used, nnz_local = self._links_used()
        num_used = len(used)
        residual = self._capacity[used].copy()
        nnz_count = self._count[self._nnz_flow]
        members = np.bincount(nnz_local, weights=nnz_count, minlength=num_used)
        rate = np.zeros(num_flows)
        unfrozen = np.ones(num_flows, dtype=bool)
        nnz_unfrozen = np.ones(len(nnz_local), dtype=bool)
        while nnz_unfrozen.any():
            with np.errstate(divide="ignore", invalid="ignore"):
                share = np.where(members > 0.5, residual / members, np.inf)
            fair = share.min()
            capped = unfrozen & (self._cap <= fair * (1 + _SHARE_EPS))
            if capped.any():
                fair = self._cap[capped].min()
                hit = unfrozen & (self._cap <= fair * (1 + _SHARE_EPS))
            else:
                bottleneck = share <= fair * (1 + _SHARE_EPS)
                hit = np.zeros(num_flows, dtype=bool)
                hit[self._nnz_flow[bottleneck[nnz_local] & nnz_unfrozen]] = True
            if not hit.any():  # NaN shares would loop forever: say so instead
                raise RuntimeError(f"max-min allocation stalled at fair share {fair} B/s")
            rate[hit] = np.minimum(fair, self._cap[hit])
            unfrozen &= ~hit
            charged = hit[self._nnz_flow]
            residual -= np.bincount(
                nnz_local[charged], weights=nnz_count[charged] * fair, minlength=num_used
            )
            np.maximum(residual, 0.0, out=residual)
            members -= np.bincount(
                nnz_local[charged], weights=nnz_count[charged], minlength=num_used
            )
            nnz_unfrozen &= ~charged
        self._rate = rate
        self._record_busy(used, np.bincount(nnz_local, weights=nnz_count, minlength=num_used))

    def _links_used(self) -> tuple[np.ndarray, np.ndarray]:
        """The links the active flows cross (sorted) and each (flow, link) pair's index
        into them; recomputed only after flows were admitted or removed."""
        if self._used is None:
            # np.unique's result without its sort (a quarter of the Wan run's time):
            # mark the links crossed, read them back in link order, number them.
            self._mark[self._nnz_link] = True
            used = np.flatnonzero(self._mark)
            self._mark[used] = False
            self._slot[used] = np.arange(len(used))
            self._used = used, self._slot[self._nnz_link]
        return self._used

    def _record_busy(self, used: np.ndarray, load: np.ndarray) -> None:
        now = self.env.now
        np.maximum.at(self._peak_flows, used, load)
        self._busy_since[used[np.isnan(self._busy_since[used])]] = now
        # The links busy before and not now, in link order: marked in a scratch mask
        # (no sort, no pass over every link), which is cleared again after.
        self._mark[used] = True
        ending = self._busy_links[~self._mark[self._busy_links]]
        self._mark[used] = False
        for link in ending:
            self._close_interval(int(link), float(self._busy_since[link]), now)
            self._busy_since[link] = np.nan
        self._busy_links = used

    def _close_interval(self, link: int, start: float, end: float) -> None:
        self._busy_s[link] += end - start
        if self._record_intervals and end > start:
            self._intervals.setdefault(link, []).append((start, end))

    def _schedule_next_completion(self) -> None:
        self._generation += 1
        if not len(self._remaining):
            return
        finite = np.isfinite(self._remaining)
        if not finite.any():
            return  # endless flows only: nothing ends until one is stopped
        positive = (self._rate > 0) & finite
        if not positive.any():
            raise RuntimeError(f"{len(self._remaining)} flows stalled with zero rate")
        delay = float((self._remaining[positive] / self._rate[positive]).min())
        generation = self._generation

        def on_timer(_event: simpy.Event) -> None:
            if generation == self._generation:
                self._update()

        # A completion due sooner than the clock can step (1e-16 s at t = 1 s) would
        # never advance time: wait at least one representable step.
        self.env.timeout(max(delay, float(np.spacing(self.env.now)))).callbacks.append(on_timer)
