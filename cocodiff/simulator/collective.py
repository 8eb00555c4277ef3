"""One all-to-all on a machine, simulated as nccl-tests would measure it.

Conventions (nccl-tests, ``doc/PERFORMANCE.md``): ``bytes_per_rank`` is one rank's whole
send buffer, ``1/P`` of it to every rank of the P (itself included, a local copy that
costs nothing here); ``algbw = bytes_per_rank / time`` and, for all-to-all,
``busbw = algbw * (P - 1) / P``. Like nccl-tests, the buffer is rounded down to a
whole number of equal blocks, one per rank.

The all-to-all is a one-step :class:`~cocodiff.plan.steps.Plan` (one exchange per rank) run by
the same simulator and executor as a DiT's plans: ``flat`` sends every block directly,
``tapa`` carries it as the topology-aligned phases of :mod:`cocodiff.schedules.tapa`.
"""

from __future__ import annotations

from dataclasses import dataclass

from cocodiff.plan.steps import Exchange, HeadSplit, LayerPlan, Plan, RankProgram, Wait
from cocodiff.schedules.grid import RankGrid
from cocodiff.schedules.tapa import TapaRows
from topology import Placement, Topology, TopologyError
from transports.sim import CollectiveModel

SCHEDULES = ("flat", "tapa")


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
