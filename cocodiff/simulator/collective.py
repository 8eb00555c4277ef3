"""One all-to-all on a machine, simulated as nccl-tests would measure it.

Conventions (nccl-tests, ``doc/PERFORMANCE.md``): ``bytes_per_rank`` is one rank's whole
send buffer, ``1/P`` of it to every rank of the P (itself included, a local copy that
costs nothing here); ``algbw = bytes_per_rank / time`` and, for all-to-all,
``busbw = algbw * (P - 1) / P``. Like nccl-tests, the buffer is rounded down to a
whole number of equal blocks, one per rank.

The all-to-all is a one-step :class:`~cocodiff.plan.steps.Plan` (one exchange per rank) run by
the same simulator and executor as a DiT's plans: ``flat`` sends every block directly,
``tapa`` carries it as the topology-aligned phases of :mod:`cocodiff.schedules.tapa`.

The exchange *patterns* (:data:`PATTERNS`) are the all-to-alls a step issues, as it issues
them: every rank at once, each rank's data split over a group's members. ``world`` is
``flat``'s exchange; ``node`` and ``column`` are TAPA's two phases (the rank's node, then
the ranks at its place on every node); ``column+sync`` is the second phase followed by a
one-row exchange over the node, what couples it to the next exchange of a step; ``tapa``
is both phases in a row. ``cocodiff calibrate`` times ``world`` and ``column+sync`` at a
step's size, and :mod:`cocodiff.simulator.collective_fit` prices both from them;
``bench/phase_coupling.py`` times all five.
"""

from __future__ import annotations

from dataclasses import dataclass

from cocodiff.plan.steps import Exchange, HeadSplit, LayerPlan, Plan, RankProgram, Tensor, Wait
from cocodiff.schedules.grid import RankGrid
from cocodiff.schedules.tapa import TapaRows
from topology import Placement, Topology, TopologyError
from transports.sim import CollectiveModel

SCHEDULES = ("flat", "tapa")

# Per pattern, its calls in order: (group, one row only).
PATTERN_CALLS: dict[str, tuple[tuple[str, bool], ...]] = {
    "world": (("world", False),),
    "node": (("node", False),),
    "column": (("column", False),),
    "column+sync": (("column", False), ("node", True)),
    "tapa": (("node", False), ("column", False)),
}
PATTERNS = tuple(PATTERN_CALLS)


@dataclass(frozen=True, slots=True)
class AllToAllResult:
    """One simulated all-to-all (bytes in bytes, time in seconds, rates in GB/s)."""

    nodes: int
    ranks: int
    bytes_per_rank: int
    schedule: str
    time_s: float

    @property
    def algbw_gbps(self) -> float:
        return self.bytes_per_rank / self.time_s / 1e9

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps * (self.ranks - 1) / self.ranks

    def to_json(self) -> dict:
        return {"nodes": self.nodes, "ranks": self.ranks, "bytes_per_rank": self.bytes_per_rank,
                "schedule": self.schedule, "time_s": self.time_s,
                "algbw_gbps": self.algbw_gbps, "busbw_gbps": self.busbw_gbps}


def spread_placement(topology: Topology, num_ranks: int) -> Placement:
    """``num_ranks`` ranks spread evenly over every node of ``topology``, filling each
    node's tiles GPU by GPU (12 ranks on 2 Aurora nodes: 6 per node, 3 GPUs each).

    Raises:
        TopologyError: the ranks do not split evenly over the nodes, or too many.
    """
    nodes, per_node = topology.num_nodes, topology.tiles_per_node
    if num_ranks % nodes or not 1 <= num_ranks // nodes <= per_node:
        raise TopologyError(f"{num_ranks} ranks cannot spread evenly over {nodes} node(s) of "
                            f"{per_node} tiles")
    ranks_per_node = num_ranks // nodes
    return Placement(tuple(tile for node in range(nodes) for tile in
                           topology.tiles[node * per_node: node * per_node + ranks_per_node]))


def all_to_all_plan(grid: RankGrid, block_bytes: int, schedule: str) -> Plan:
    """Every rank of ``grid`` sends ``block_bytes`` to every rank, once."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown all-to-all schedule {schedule!r}; valid: "
                         f"{', '.join(SCHEDULES)}")
    num_ranks = grid.num_ranks
    ones = (1,) * num_ranks
    # One row per block: (1 row per peer) -> (1 row from each peer); row = one block.
    tapa = TapaRows(grid, ones, "scatter_heads") if schedule == "tapa" else None
    programs = []
    for rank in range(num_ranks):
        exchange = Exchange("q", grid.ranks, ones, ones, block_bytes, "scatter_heads")
        if tapa is not None:
            exchange = tapa.exchange(exchange, rank, chunks=1)
        layer = LayerPlan(before=(), attention=(exchange, Wait("q")), after=())
        programs.append(RankProgram(rank, (layer,)))
    split = HeadSplit(num_ranks, num_ranks, ones, head_dim=0)
    _, gpus, tiles = grid.shape
    return Plan(f"all-to-all {schedule}", "all-to-all", split, tuple(programs),
                shift_period=gpus * tiles)


def simulate_all_to_all(topology: Topology, bytes_per_rank: int, schedule: str = "flat",
                        collective: CollectiveModel | None = None,
                        num_ranks: int | None = None) -> AllToAllResult:
    """Simulate one all-to-all of ``bytes_per_rank`` per rank over ``num_ranks`` ranks
    (default: every tile) spread evenly over the topology's nodes.

    Raises:
        ValueError: ``bytes_per_rank`` holds less than one byte per rank.
    """
    from cocodiff.simulator.simulate import simulate_plan

    placement = spread_placement(topology, num_ranks or len(topology.tiles))
    ranks = placement.num_ranks
    block_bytes = bytes_per_rank // ranks
    if block_bytes < 1:
        raise ValueError(f"{bytes_per_rank} bytes per rank is less than one byte for each of "
                         f"{ranks} ranks")
    grid = RankGrid.from_placement(topology, placement)
    plan = all_to_all_plan(grid, block_bytes, schedule)
    # An all-to-all microbenchmark, not a denoising step: no step overhead.
    result = simulate_plan(plan, topology, placement, collective=collective,
                           denoising_step=False)
    return AllToAllResult(topology.num_nodes, ranks, block_bytes * ranks, schedule,
                          result.step_time_s)


def pattern_groups(num_nodes: int, per_node: int, rank: int) -> dict[str, tuple[int, ...]]:
    """``rank``'s groups in the patterns (node-major ranks: rank ``r`` on node
    ``r // per_node``): the world, its node, its column."""
    node, place = divmod(rank, per_node)
    return {"world": tuple(range(num_nodes * per_node)),
            "node": tuple(range(node * per_node, (node + 1) * per_node)),
            "column": tuple(n * per_node + place for n in range(num_nodes))}


def pattern_plan(pattern: str, num_nodes: int, per_node: int, rows: int,
                 row_bytes: int) -> Plan:
    """Every rank of ``num_nodes x per_node`` runs ``pattern`` once, holding ``rows`` rows
    of ``row_bytes`` (each call splits them evenly over its group, rounded down to whole
    rows per member)."""
    if pattern not in PATTERN_CALLS:
        raise ValueError(f"unknown exchange pattern {pattern!r}; valid: {', '.join(PATTERNS)}")
    world = num_nodes * per_node
    programs = []
    for rank in range(world):
        groups = pattern_groups(num_nodes, per_node, rank)
        steps: list = []
        for index, (name, one_row) in enumerate(PATTERN_CALLS[pattern]):
            members = groups[name]
            split = (1 if one_row else rows // len(members),) * len(members)
            tensor: Tensor = ("q", "k")[index]
            steps += [Exchange(tensor, members, split, split, row_bytes, "scatter_heads"),
                      Wait(tensor)]
        programs.append(RankProgram(rank, (LayerPlan((), tuple(steps), ()),)))
    ones = (1,) * world
    return Plan(f"pattern {pattern}", "exchange pattern", HeadSplit(world, world, ones, 0),
                tuple(programs), shift_period=None)


def simulate_pattern(topology: Topology, pattern: str, bytes_per_rank: int,
                     collective: CollectiveModel | None = None, row_bytes: int = 1024) -> float:
    """Seconds of one ``pattern`` with every rank holding ``bytes_per_rank``, on every tile
    of ``topology`` (node-major: a calibrated cluster's ranks)."""
    from cocodiff.simulator.simulate import simulate_plan

    plan = pattern_plan(pattern, topology.num_nodes, topology.tiles_per_node,
                        bytes_per_rank // row_bytes, row_bytes)
    return simulate_plan(plan, topology, fold=False, collective=collective,
                         denoising_step=False).step_time_s
