"""How far a plan and its placement repeat: the whole nodes after which every rank does
what the rank that many nodes earlier does, shifted (node-symmetric traffic).

The simulator then runs only those nodes' ranks and folds the others' routes onto them
(``transports.sim``); the bounds (:mod:`cocodiff.simulator.bounds`) sum and compare
only those ranks' traffic. Both give the full computation's answer.
"""

from __future__ import annotations

import math

from cocodiff.plan.steps import Plan
from topology import Placement, Topology


def fold_period_nodes(plan: Plan, topology: Topology, placement: Placement) -> int | None:
    """The fewest whole nodes after which both the plan and the placement repeat, when
    fewer than all of them: those nodes are all the simulator needs to run."""
    if plan.shift_period is None or not placement.is_node_symmetric(topology):
        return None
    per_node = placement.ranks_per_node
    host = topology.spec.host
    if host is not None and (host.ranks_per_host is None or per_node % host.ranks_per_host):
        return None  # a host that spans nodes: ranks of every node compete for its cores
    period_ranks = math.lcm(plan.shift_period, per_node)
    nodes = placement.num_ranks // per_node
    period_nodes = period_ranks // per_node
    if period_nodes >= nodes or nodes % period_nodes:
        return None
    return period_nodes


def fold_period_ranks(plan: Plan, topology: Topology, placement: Placement) -> int | None:
    """:func:`fold_period_nodes` in ranks (ranks ``0..n-1`` stand for all), or None."""
    nodes = fold_period_nodes(plan, topology, placement)
    return None if nodes is None else nodes * placement.ranks_per_node
