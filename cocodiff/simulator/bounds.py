"""The fastest an all-to-all can possibly be on a topology, whatever the schedule.

Every block (source, destination) must leave its source's tile, GPU and node when the
destination is elsewhere. So for each tier the bytes leaving (and entering) each tile,
GPU and node are fixed by the exchange, and the links of that tier can carry them no
faster than their total capacity. Tiers run in parallel at best, so the bound is the
slowest tier, plus the latency of the longest route. Schedules are measured against
it: ``efficiency = bound / simulated``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import compress

from cocodiff.cost import compute_seconds
from cocodiff.plan.gather import GatherStage
from cocodiff.plan.passes import PASS_STEPS, repeated_passes
from cocodiff.plan.steps import Compute, Exchange, LayerPlan, Plan, Step
from cocodiff.simulator.backend import step_overhead_s
from cocodiff.simulator.symmetry import fold_period_ranks
from topology import Placement, Topology
from transports.sim import CollectiveModel


@dataclass(frozen=True, slots=True)
class ExchangeBound:
    """The bound of one logical exchange, and which tier sets it."""

    seconds: float
    tier: str


def exchange_bound(
    exchanges: dict[int, Exchange], topology: Topology, placement: Placement,
    fold_ranks: int | None = None,
) -> ExchangeBound:
    """Bound of one all-to-all, given every member rank's logical exchange.

    Args:
        exchanges: global rank -> that rank's :class:`Exchange` of the collective (ranks
            ``0..fold_ranks-1`` only, when folded).
        fold_ranks: as :func:`traffic_bound`.
    """
    return traffic_bound(
        ((src, dst, rows * exchange.row_bytes) for src, exchange in exchanges.items()
         for dst, rows in zip(exchange.group, exchange.send_rows, strict=True)),
        topology, placement, fold_ranks)


def traffic_bound(traffic: Iterable[tuple[int, int, float]], topology: Topology,
                  placement: Placement, fold_ranks: int | None = None) -> ExchangeBound:
    """Bound of moving ``(source rank, destination rank, bytes)`` messages at once: the
    busiest tier's bytes over its capacity, plus the longest route's latency.

    ``fold_ranks``: the traffic repeats every ``fold_ranks`` ranks, whole nodes
    (:func:`cocodiff.simulator.symmetry.fold_period_ranks`), and ``traffic`` holds only
    the messages of sources ``0..fold_ranks-1``. Then every unit's load is its image's
    in those ranks' nodes: a message into unit ``u`` from any source is, shifted, a
    message of one of those sources into a unit that folds onto ``u``'s image, so each
    message's bytes in count on its destination's folded unit (whether it crosses a
    boundary is decided on the real units). The same bound as the full traffic's.
    """
    spec = topology.spec
    out_bytes: dict[str, defaultdict[str, float]] = {tier: defaultdict(float)
                                                     for tier in ("tile", "gpu", "node")}
    in_bytes: dict[str, defaultdict[str, float]] = {tier: defaultdict(float)
                                                    for tier in ("tile", "gpu", "node")}
    latency_us = 0.0
    units: dict[int, dict[str, str]] = {}  # rank -> its tile, GPU and node
    latencies: dict[tuple[str, str], float] = {}  # (src, dst) unit pair -> route latency

    def units_of(rank: int) -> dict[str, str]:
        if rank not in units:
            units[rank] = _units(topology, placement.tile_of(rank))
        return units[rank]

    for src, dst, num_bytes in traffic:
        if dst == src or not num_bytes:
            continue
        src_unit, dst_unit = units_of(src), units_of(dst)
        into = dst_unit if fold_ranks is None else units_of(dst % fold_ranks)
        # A block crosses the boundary of every unit its endpoints do not share.
        for tier in ("tile", "gpu", "node"):
            if src_unit[tier] != dst_unit[tier]:
                out_bytes[tier][src_unit[tier]] += num_bytes
                in_bytes[tier][into[tier]] += num_bytes
        pair = (src_unit["tile"], dst_unit["tile"])
        if pair not in latencies:
            latencies[pair] = topology.route_latency_us(topology.route(*pair))
        latency_us = max(latency_us, latencies[pair])
    capacity = {
        # a tile's sibling links (tile -> other tiles of its GPU); its GPU port otherwise
        "tile": _bytes_per_s(spec.tile_link) * (spec.tiles_per_gpu - 1) if spec.tile_link
        else _bytes_per_s(spec.port_link),
        "gpu": _gpu_capacity(spec),
        "node": _bytes_per_s(spec.nic_link) * spec.nics_per_node if spec.nics_per_node
        else float("inf"),
    }
    worst = ExchangeBound(0.0, "none")
    for tier in ("tile", "gpu", "node"):
        loads = list(out_bytes[tier].values()) + list(in_bytes[tier].values())
        if loads and capacity[tier] > 0:
            seconds = max(loads) / capacity[tier]
            if seconds > worst.seconds:
                worst = ExchangeBound(seconds, _TIER_NAMES[tier])
    return ExchangeBound(worst.seconds + latency_us * 1e-6, worst.tier)


def plan_bound_s(plan: Plan, topology: Topology, placement: Placement, layer: int = 0,
                 fold: bool = True) -> float:
    """Sum of the bounds of one layer's exchanges, times the number of layers.

    ``fold``: where plan and placement repeat every few nodes, sum only those nodes'
    ranks' traffic (:func:`traffic_bound`'s ``fold_ranks``; the same bound)."""
    fold_ranks = fold_period_ranks(plan, topology, placement) if fold else None
    ranks = range(fold_ranks or plan.num_ranks)
    # LayerPlan.exchanges builds a tuple on every call: once per rank here.
    exchanges = [plan.program(rank).layers[layer].exchanges for rank in ranks]
    total = 0.0
    # The same step objects on every rank (a Ring's pass, ring - 1 times) have one bound.
    by_steps: dict[tuple[int, ...], float] = {}
    for index in range(len(exchanges[0])):
        members = {rank: exchanges[rank][index] for rank in ranks}
        key = tuple(map(id, members.values()))
        if key not in by_steps:
            by_steps[key] = exchange_bound(members, topology, placement, fold_ranks).seconds
        total += by_steps[key]
    return total * len(plan.program(0).layers)


_TIER_NAMES = {"tile": "intra-gpu", "gpu": "intra-node", "node": "inter-node"}


def _units(topology: Topology, tile: str) -> dict[str, str]:
    node = topology.node_of(tile)
    return {"tile": tile, "gpu": topology.gpu_of(tile), "node": f"n{node}"}


def _bytes_per_s(link) -> float:
    return link.bandwidth_gbps * 1e9 if link is not None else 0.0


def _gpu_capacity(spec) -> float:
    """Bytes/s one GPU can send to the other GPUs of its node."""
    if spec.gpu_link is None:
        return float("inf")
    if spec.gpu_fabric == "all-to-all":
        return _bytes_per_s(spec.gpu_link) * (spec.gpus_per_node - 1)
    return _bytes_per_s(spec.gpu_link)


def step_floor_s(plan: Plan, topology: Topology, placement: Placement,
                 collective: CollectiveModel, gathers: Sequence[GatherStage] = (),
                 num_layers: int | None = None) -> float:
    """A lower bound on the simulated step time of ``plan`` that needs no simulation.

    Each rank runs its steps in order: compute steps take exactly their roofline time
    (as in the simulator), and an exchange waited for cannot end before every message
    this rank sends in it has paid its route latency and the set-up the collective
    model charges for the exchange's span and this rank's message count, and moved its
    bytes at the fastest rate its route, its tier's single-transfer cap and the span's
    per-rank rate allow (:class:`transports.sim.CollectiveModel`; contention and
    waiting for peers only add to that). Walking a rank's layers with those times gives
    a time no simulation of the plan can beat. A phased exchange is charged its first
    chunk's way through the phases, one after another (the chunk pipeline posts a
    chunk's next phase only once the previous one has landed). The planner skips
    candidates whose floor is above the best step time it has already simulated.

    ``gathers``: the output gathers that end the step, as the simulator runs them after
    the plan (:func:`cocodiff.schedules.gather.output_gather`): each adds the fastest its
    rank's messages can go, as an exchange does (every rank sends its chunk to every
    other: 0.56 s of a 7.46 s step on 1,024 Aurora nodes); without them the floor of
    FLUX.1-dev's Ring-innermost U24 layout on 256 nodes stays under the winner's step and
    it is simulated on 384 ranks for nothing. ``num_layers``: the step's layers when
    ``plan`` holds its first ones only, all alike (the planner's two): the walk of the
    plan's layers is scaled to them.
    """
    walk = _FloorWalk(plan, topology, placement, collective)
    scale = 1.0 if num_layers is None else num_layers / len(plan.program(0).layers)
    # Any rank's walk bounds the step; node 0's ranks stand for the others (nodes are
    # alike), which keeps this a small fraction of one simulation's cost.
    return max(walk.program_s(rank) * scale
               + sum(walk.gather_s(rank, stage) for stage in gathers)
               for rank in range(min(plan.num_ranks, placement.ranks_per_node)))


def generation_floor_s(plans: Sequence[Plan], step_plans: Sequence[int], topology: Topology,
                       placement: Placement, collective: CollectiveModel) -> float:
    """A lower bound on the per-step time a PipeFusion generation simulates
    (:func:`cocodiff.simulator.simulate.simulate_generation`: the generation's time over
    its steps, each step's overhead outside the blocks included), with no simulation.

    :func:`step_floor_s`'s walk over each rank's whole generation (its steps' programs
    back to back): compute at its exact time, each exchange and point-to-point transfer
    this rank sends at the fastest its route and the collective model allow, a receive
    at no cost (the sender's side is what takes time, and it is not walked here). Every
    rank is walked (stages hold different layers); the slowest walk bounds the
    generation. The planner skips a pipeline layout whose floor is above the step time
    it must beat.
    """
    from cocodiff.schedules.pipefusion import generation_plan

    plan = generation_plan(plans, step_plans)
    walk = _FloorWalk(plan, topology, placement, collective)
    total_s = max(walk.program_s(rank) for rank in range(plan.num_ranks))
    overhead_s = sum(step_overhead_s(topology.spec, plans[index]) for index in step_plans)
    return (total_s + overhead_s) / len(step_plans)


class _FloorWalk:
    """The walks of :func:`step_floor_s` and :func:`generation_floor_s`: a rank's program
    with compute at its exact time and every exchange at the fastest this rank's own
    messages can go."""

    def __init__(self, plan: Plan, topology: Topology, placement: Placement,
                 collective: CollectiveModel) -> None:
        self.plan, self.topology, self.collective = plan, topology, collective
        self.tiles = placement.tiles  # by global rank
        self.message_s: dict[tuple, float] = {}
        # Groups by identity (a Ring pass's group is thousands of ranks long, and hashing
        # it on every pass cost more than the walk; the plan keeps the groups alive).
        self.span_of = _span_memo(topology, self.tiles)
        # A Ring repeats one pass object (ring - 1) times in a rank's layer, and layers
        # are shared objects: times are worked out once per rank (keyed by identity; the
        # plan keeps the steps alive).
        self.by_step: dict[tuple[int, int], float] = {}
        self.compute_s: dict[int, float] = {}
        self.layers: dict[tuple[int, int], float | None] = {}
        self.passes: dict[int, tuple[int, int] | None] = {}  # by layer identity

    def fastest_s(self, src: int, dst: int, num_bytes: int, messages: int, span: str) -> float:
        tiles, topology, collective = self.tiles, self.topology, self.collective
        key = (tiles[src], tiles[dst], num_bytes, messages, span)
        if key not in self.message_s:
            route = topology.route(tiles[src], tiles[dst])
            cost = collective.cost(span)
            rate = min(cost.rank_gbps * 1e9 / messages,
                       collective.cap_bytes_per_s(topology.tier(tiles[src], tiles[dst])),
                       *(topology.link_attrs(link)[0] * 1e9 for link in route))
            self.message_s[key] = (topology.route_latency_us(route) * 1e-6
                                   + cost.setup_s(messages) + num_bytes / rate)
        return self.message_s[key]

    def sends_s(self, rank: int, group: tuple[int, ...], amounts: Sequence[int],
                unit: int = 1) -> float:
        """The slowest of ``rank``'s messages to ``group``, ``amounts[i] * unit`` bytes to
        member i, each at the fastest it can go."""
        sends = _sends(rank, group, amounts, unit)
        span = self.span_of(group)
        return max((self.fastest_s(rank, dst, num_bytes, len(sends), span)
                    for dst, num_bytes in sends), default=0.0)

    def gather_s(self, rank: int, stage: GatherStage) -> float:
        """An output gather's messages from ``rank``, each at the fastest it can go
        (:meth:`sends_s`), over one destination per kind: the same node or another, and
        which tile of its node. Nodes are built alike, so the others are the same
        messages again; leaving any out could only lower the maximum, which keeps it a
        floor on any machine, and keeps it to a few dozen routes where the group is every
        rank of a thousand nodes."""
        group = stage.group_of(rank)
        if stage.bytes_per_member == 0 or len(group) < 2:
            return 0.0
        messages = len(group) - 1
        span = self.span_of(group)
        node = self.tiles[rank].partition(".")[0]
        kinds: dict[tuple[bool, str], int] = {}
        # Every kind there can be: the node's other tiles, and each tile of another node
        # (found early in a group of every rank, which is in node order).
        every_kind = 2 * self.topology.tiles_per_node - 1
        for dst in group:
            if dst != rank:
                dst_node, _, local = self.tiles[dst].partition(".")
                kinds.setdefault((dst_node == node, local), dst)
                if len(kinds) == every_kind:
                    break
        return max(self.fastest_s(rank, dst, stage.bytes_per_member, messages, span)
                   for dst in kinds.values())

    def exchange_s(self, rank: int, step: Exchange) -> float:
        from cocodiff.plan.phasing import chunk_member_bytes

        key = (rank, id(step))
        if key not in self.by_step:
            if not step.phases:
                total = self.sends_s(rank, step.group, step.send_rows, step.row_bytes)
            else:
                total = 0.0
                for phase in step.phases:
                    total += self.sends_s(rank, phase.group,
                                          chunk_member_bytes(step, phase, 0)[0])
            self.by_step[key] = total
        return self.by_step[key]

    def step_compute_s(self, step: Compute) -> float:
        key = id(step)
        if key not in self.compute_s:
            self.compute_s[key] = compute_seconds(step.cost, self.topology.spec)
        return self.compute_s[key]

    def walk(self, rank: int, steps, now: float, started: dict[str, float]) -> float:
        """``now`` after ``steps`` from ``now``, ``started`` holding each exchange in
        flight's earliest end (it may span layers: PipeFusion's transfers)."""
        for step in steps:
            if isinstance(step, Compute):
                now += self.step_compute_s(step)
            elif isinstance(step, Exchange):
                started[step.tensor] = now + self.exchange_s(rank, step)
            else:  # Wait
                now = max(now, started.pop(step.tensor))
        return now

    def layer_s(self, rank: int, layer) -> float | None:
        """The time of a layer that waits for every exchange it starts and for no other
        (so its time does not depend on what is in flight around it); None otherwise."""
        key = (rank, id(layer))
        if key not in self.layers:
            started: dict[str, float] = {}
            try:
                end = self.walk_layer(rank, layer, 0.0, started)
            except KeyError:  # waits for an exchange an earlier layer started
                end = None
            self.layers[key] = None if started else end
        return self.layers[key]

    def program_s(self, rank: int) -> float:
        now = 0.0
        started: dict[str, float] = {}
        for layer in self.plan.program(rank).layers:
            alone = self.layer_s(rank, layer)
            if alone is not None:
                now += alone
            else:
                now = self.walk_layer(rank, layer, now, started)
        return now

    def walk_layer(self, rank: int, layer, now: float, started: dict[str, float]) -> float:
        """:meth:`walk` over a layer, a long Ring's repeated block walked once: each repeat
        waits for the pass it starts (:func:`cocodiff.plan.passes.repeated_passes`), so
        every one adds the same time (2,046 repeats per layer on 4,096 Aurora nodes)."""
        if id(layer) not in self.passes:
            self.passes[id(layer)] = repeated_passes(layer)
        found = self.passes[id(layer)]
        if found is None:
            return self.walk(rank, layer.steps, now, started)
        start, count = found
        steps = layer.attention
        now = self.walk(rank, layer.before + steps[:start], now, started)
        before = now
        now = self.walk(rank, steps[start:start + PASS_STEPS], now, started)
        now += (count - 1) * (now - before)
        return self.walk(rank, steps[start + count * PASS_STEPS:] + layer.after, now, started)


def model_bound_s(plan: Plan, topology: Topology, placement: Placement,
                  collective: CollectiveModel, fold: bool = True) -> float:
    """A lower bound on the time per step that ``plan``'s exchanges are in flight on its
    slowest rank, under the collective model ``collective``: the link bound's question
    asked of this plan's own collectives, at the model's prices.

    Each collective the plan makes (a flat exchange, or one chunk of one phase) takes,
    for each rank, at least its messages' route latency, the set-up the model charges
    for the collective's span and the rank's message count, and its largest message at
    the fastest rate the span's per-rank rate, the tier's single-transfer cap and the
    route's links allow (as :func:`step_floor_s`); and at least the busiest tier's bytes
    of that collective over the tier's capacity (:func:`traffic_bound`: links shared
    max-min do no better). A phased exchange pipelines its chunks (phase p of chunk c
    after chunk c's phase p-1 and chunk c-1's phase p), so it takes at least, for every
    phase p, the first chunk's way to p, p's chunks one after another, and the last
    chunk's way on from p. Exchanges in flight together (started while another is)
    count as the longest of them; the others, and the layers, add up.

    Unlike the link bound, which no schedule beats, this one holds for this plan's
    collectives only: their spans and message counts set what the model charges.
    ``efficiency`` against it is what the run loses beyond the model's prices (waiting
    on peers, links contended by concurrent collectives, ordering).

    ``fold``: where plan and placement repeat every few nodes, only those nodes' ranks
    are walked (the others' times are theirs, shifted) and their traffic bounds the
    links (:func:`traffic_bound`'s ``fold_ranks``): the same bound.
    """
    from cocodiff.plan.phasing import chunk_member_bytes
    from transports.sim import IdentityMemo

    tiles = placement.tiles  # by global rank
    span_of = _span_memo(topology, tiles)
    message_s: dict[tuple, float] = {}

    def rank_s(rank: int, group: tuple[int, ...], send_bytes: list[int]) -> float:
        sends = _sends(rank, group, send_bytes, 1)
        cost = collective.cost(span_of(group))
        worst = 0.0
        for dst, num_bytes in sends:
            key = (tiles[rank], tiles[dst], num_bytes, len(sends), span_of(group))
            if key not in message_s:
                route = topology.route(tiles[rank], tiles[dst])
                rate = min(cost.rank_gbps * 1e9 / len(sends),
                           collective.cap_bytes_per_s(topology.tier(tiles[rank], tiles[dst])),
                           *(topology.link_attrs(link)[0] * 1e9 for link in route))
                message_s[key] = (topology.route_latency_us(route) * 1e-6
                                  + cost.setup_s(len(sends)) + num_bytes / rate)
            worst = max(worst, message_s[key])
        return worst

    fold_ranks = fold_period_ranks(plan, topology, placement) if fold else None
    layers = [plan.program(rank).layers[0] for rank in range(fold_ranks or plan.num_ranks)]
    exchanges = [layer.exchanges for layer in layers]
    # Per exchange index: per rank, t[phase][chunk] (a flat exchange: one phase, one chunk).
    per_exchange: list[list[list[list[float]]]] = []
    # A Ring repeats each rank's pass object ring - 1 times per layer: the same steps
    # on every rank have the same times (worked out once; the layers hold the steps).
    by_steps: dict[tuple[int, ...], list[list[list[float]]]] = {}
    for index in range(len(exchanges[0])):
        steps = [exchanges[rank][index] for rank in range(len(layers))]
        same = by_steps.get(tuple(map(id, steps)))
        if same is not None:
            per_exchange.append(same)
            continue
        phases = max(len(step.phases) for step in steps) or 1
        chunks = steps[0].chunks if steps[0].phases else 1
        times = [[[0.0] * chunks for _ in range(phases)] for _ in steps]
        for p in range(phases):
            for c in range(chunks):
                sent: list[tuple[tuple[int, ...], list[int]]] = []
                for step in steps:
                    if step.phases:
                        phase = step.phases[p]
                        sent.append((phase.group, chunk_member_bytes(step, phase, c)[0]))
                    else:
                        sent.append((step.group, [r * step.row_bytes for r in step.send_rows]))
                links_s = traffic_bound(
                    ((rank, dst, b) for rank, (group, send) in enumerate(sent)
                     for dst, b in zip(group, send, strict=True)), topology, placement,
                    fold_ranks).seconds
                for rank, (group, send) in enumerate(sent):
                    times[rank][p][c] = max(links_s, rank_s(rank, group, send))
        per_exchange.append(times)
        by_steps[tuple(map(id, steps))] = times

    def pipelined_s(t: list[list[float]]) -> float:
        return max(sum(t[q][0] for q in range(p)) + sum(t[p])
                   + sum(t[q][-1] for q in range(p + 1, len(t))) for p in range(len(t)))

    # By identity: a Ring's passes share their times' lists (``by_steps``).
    exchange_s = IdentityMemo(pipelined_s)

    def layer_s(rank: int, layer: LayerPlan) -> float:
        # Exchanges started while none is in flight open a group; groups add up, and a
        # group takes its longest exchange.
        total = group_s = 0.0
        in_flight: set[str] = set()
        index = 0

        def walk(steps: Sequence[Step]) -> None:
            nonlocal total, group_s, index
            for item in steps:
                if isinstance(item, Exchange):
                    if not in_flight:
                        total += group_s
                        group_s = 0.0
                    group_s = max(group_s, exchange_s(per_exchange[index][rank]))
                    in_flight.add(item.tensor)
                    index += 1
                elif not isinstance(item, Compute):  # Wait
                    in_flight.discard(item.tensor)

        found = repeated_passes(layer)
        if found is None:
            walk(layer.attention)
            return total + group_s
        # A long Ring's repeated block walked twice: every later repeat adds what the
        # second did (it waits for the pass it starts: the state it leaves is the same).
        start, count = found
        steps = layer.attention
        walk(steps[:start + PASS_STEPS])
        before = (total, index)
        walk(steps[start + PASS_STEPS:start + 2 * PASS_STEPS])
        total += (count - 2) * (total - before[0])
        index += (count - 2) * (index - before[1])
        walk(steps[start + count * PASS_STEPS:])
        return total + group_s

    worst = max(layer_s(rank, layer) for rank, layer in enumerate(layers))
    return worst * len(plan.program(0).layers)


def _sends(rank: int, group: Sequence[int], amounts: Sequence[int], unit: int
           ) -> list[tuple[int, int]]:
    """(destination, bytes) of ``rank``'s messages: ``amounts[i] * unit`` bytes to
    ``group[i]``, none to itself and none empty. Picked out in C (``compress``): a Ring
    pass sends one message to a group of up to 49,152 ranks, and every pass asks."""
    if len(group) != len(amounts):
        raise ValueError(f"{len(amounts)} amounts for a group of {len(group)}")
    return [(dst, amount * unit) for dst, amount
            in zip(compress(group, amounts), compress(amounts, amounts), strict=True)
            if dst != rank]


def _span_memo(topology: Topology, tiles: Sequence[str]):
    """``span_of(group)``: the tier a group of global ranks spans, worked out once per
    group object (:class:`transports.sim.IdentityMemo`)."""
    from transports.sim import IdentityMemo, group_span

    return IdentityMemo(lambda group: group_span(topology, (tiles[rank] for rank in group)))
