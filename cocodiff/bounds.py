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
from dataclasses import dataclass

from cocodiff.plan import Exchange, Plan
from topology import Placement, Topology


@dataclass(frozen=True, slots=True)
class ExchangeBound:
    """The bound of one logical exchange, and which tier sets it."""

    seconds: float
    tier: str


def exchange_bound(
    exchanges: dict[int, Exchange], topology: Topology, placement: Placement
) -> ExchangeBound:
    """Bound of one all-to-all, given every member rank's logical exchange.

    Args:
        exchanges: global rank -> that rank's :class:`Exchange` of the collective.
    """
    spec = topology.spec
    out_bytes = {tier: defaultdict(float) for tier in ("tile", "gpu", "node")}
    in_bytes = {tier: defaultdict(float) for tier in ("tile", "gpu", "node")}
    latency_us = 0.0
    for src, exchange in exchanges.items():
        src_tile = placement.tile_of(src)
        src_unit = _units(topology, src_tile)
        for dst, rows in zip(exchange.group, exchange.send_rows, strict=True):
            if dst == src or not rows:
                continue
            dst_tile = placement.tile_of(dst)
            dst_unit = _units(topology, dst_tile)
            num_bytes = rows * exchange.row_bytes
            # A block crosses the boundary of every unit its endpoints do not share.
            for tier in ("tile", "gpu", "node"):
                if src_unit[tier] != dst_unit[tier]:
                    out_bytes[tier][src_unit[tier]] += num_bytes
                    in_bytes[tier][dst_unit[tier]] += num_bytes
            latency_us = max(latency_us,
                             topology.route_latency_us(topology.route(src_tile, dst_tile)))
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


def plan_bound_s(plan: Plan, topology: Topology, placement: Placement, layer: int = 0) -> float:
    """Sum of the bounds of one layer's exchanges, times the number of layers."""
    first = plan.program(0).layers[layer]
    total = 0.0
    for index, _exchange in enumerate(first.exchanges):
        members = {rank: plan.program(rank).layers[layer].exchanges[index]
                   for rank in range(plan.num_ranks)}
        total += exchange_bound(members, topology, placement).seconds
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
