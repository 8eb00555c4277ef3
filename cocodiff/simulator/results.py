"""What a simulation says about one plan: step time, exposed communication, traffic per
link tier, the busiest links."""

from __future__ import annotations

from dataclasses import dataclass, field

from cocodiff.memory import RankMemory
from sim import Simulation


@dataclass(frozen=True, slots=True)
class LinkUse:
    link: tuple[str, str]
    kind: str
    utilisation: float  # bytes carried / (capacity x step time)


@dataclass(slots=True)
class SimResult:
    """One simulated denoising step of one plan."""

    schedule: str
    num_ranks: int
    step_time_s: float
    compute_s: float  # on the slowest rank (the step overhead outside the blocks included)
    comm_exposed_s: float  # step time the slowest rank spends waiting for exchanges
    bytes_by_tier: dict[str, float]
    busiest_links: list[LinkUse]
    simulated_ranks: int
    folded: bool
    wall_s: float
    num_flows: int
    num_events: int
    exchange_s: float = 0.0  # time the slowest rank has an exchange in flight
    bound_s: float = 0.0  # the topology's lower bound for the same exchanges
    # The bound of this plan's own collectives under the collective model in use
    # (cocodiff.simulator.bounds.model_bound_s); 0 when not computed.
    model_bound_s: float = 0.0
    step_times_s: list[float] = field(default_factory=list)  # per denoising step
    # Exchanges (all-to-alls and Ring passes) all ranks start, per denoising step.
    exchanges_per_step: list[int] = field(default_factory=list)
    simulation: Simulation | None = field(default=None, repr=False)
    # Whether a long Ring's passes were extrapolated from three short simulations
    # (cocodiff.simulator.simulate._simulate_passes) rather than all simulated.
    passes_extrapolated: bool = False
    # Device memory one rank needs (cocodiff.memory.RankMemory), where it was computed.
    memory: RankMemory | None = None

    @property
    def efficiency(self) -> float:
        """Lower bound over simulated exchange time (1 = as fast as the links allow)."""
        return self.bound_s / self.exchange_s if self.exchange_s > 0 else 1.0

    @property
    def model_efficiency(self) -> float:
        """The collective model's bound for this plan over simulated exchange time (1 =
        as fast as the model's prices allow this plan's collectives)."""
        return self.model_bound_s / self.exchange_s if self.exchange_s > 0 else 1.0

    @property
    def comm_share(self) -> float:
        return self.comm_exposed_s / self.step_time_s if self.step_time_s > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "schedule": self.schedule,
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "comm_exposed_s": self.comm_exposed_s,
            "comm_share": self.comm_share,
            "bytes_by_tier": dict(self.bytes_by_tier),
            "busiest_link": (
                {
                    "link": "->".join(self.busiest_links[0].link),
                    "kind": self.busiest_links[0].kind,
                    "utilisation": self.busiest_links[0].utilisation,
                }
                if self.busiest_links
                else None
            ),
            "exchange_s": self.exchange_s,
            "bound_s": self.bound_s,
            "efficiency": self.efficiency,
            "model_bound_s": self.model_bound_s,
            "model_efficiency": self.model_efficiency,
            "step_times_s": self.step_times_s or [self.step_time_s],
            "exchanges_per_step": self.exchanges_per_step,
            "simulated_ranks": self.simulated_ranks,
            "folded": self.folded,
            "passes_extrapolated": self.passes_extrapolated,
            "sim_wall_s": self.wall_s,
            "sim_flows": self.num_flows,
            "sim_events": self.num_events,
            **({} if self.memory is None else {"memory_per_rank": self.memory.to_json()}),
        }


def busiest_links(simulation: Simulation, step_time_s: float, top: int = 5,
                   bytes_carried: dict | None = None) -> list[LinkUse]:
    """The ``top`` links by utilisation; ``bytes_carried`` (link -> bytes) replaces
    what the simulation's links carried (an extrapolated step's bytes)."""
    if step_time_s <= 0:
        return []
    topology = simulation.topology
    network = simulation.network
    carried: dict = bytes_carried or network.carried_bytes()
    uses = [
        LinkUse(link, topology.link_attrs(link)[2],
                num_bytes / (network.capacity_bytes_per_s(link) * step_time_s))
        for link, num_bytes in carried.items()
        if num_bytes > 0
    ]
    # Links within a billionth of each other tie and keep the network's order: an
    # extrapolated step's bytes differ from a full simulation's in the last bits.
    uses.sort(key=lambda use: round(use.utilisation, 9), reverse=True)
    return uses[:top]
