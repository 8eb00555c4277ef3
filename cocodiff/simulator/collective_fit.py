"""Fitting a collective model's span costs to all-to-all microbenchmarks.

Input: measured times of flat all-to-alls (nodes, ranks, bytes per rank, seconds) on a
machine whose links the topology already describes. Every measurement has a *span*
(``transports.sim.SPANS``: a pair, one GPU, one node, several nodes); each span gets
its own :class:`~transports.sim.SpanCost`, fitted on that span's measurements only:

* ``rank_gbps`` (what a rank's transfers of one collective reach together) by a
  search over a log-spaced grid, refined by golden section, ``inf`` (links only)
  included;
* for each candidate rate, ``startup_us`` in closed form: the simulated all-to-all
  with no set-up takes ``D``, and with set-up ``s`` per transfer exactly ``(P-1) s + D``
  (every rank of a flat all-to-all has the same P-1 transfers, all delayed alike), so
  the least-squares ``s >= 0`` on relative error is a ratio of sums.

The simulator is in the loop (each ``D`` is a simulated all-to-all on the topology), so
the fit accounts for what the links already explain. ``cocodiff calibrate`` fits its
own sweeps this way; Aurora's preset is this fit on :data:`AURORA_TABLE`.

A step's exchange patterns (:mod:`cocodiff.simulator.collective`), timed by calibrate at a
step's size and four times it, come after the spans when given (``cocodiff calibrate
--fit-patterns``; by default calibrate only checks them, docs/changelog.md, "Measured on
2026-11-26, evening and night") and price what the sweeps cannot:

* ``world`` (the flat all-to-all as a step issues it: every rank at once, back to back)
  sets the world span's ``rank_gbps``, searched the same way on these rows alone with the
  set-up kept, and only ever lowered. The sweeps' rows cannot set it: their smallest
  all-to-all is mostly the host's CPU, which no rate speeds up, and the span's form (a
  set-up and a rate) did not bend to both (on 2 x 2 at 0.2 Gbit/s the fit kept the links
  alone while the world at four times a step's size ran 21% slower than they say);
* ``column+sync`` (TAPA's cross-node phase: every rank's column exchange at once, then a
  one-row sync over the node) prices what one transfer across the node boundary reaches
  while the others share its link: the ``inter-node`` entry of ``transfer_cap_gbps``,
  searched the same way (``inf`` included) with the rest fixed. On a shaped TCP link the
  columns' few transfers per link filled it far less than the world all-to-all's many
  (docs/changelog.md, "Why TAPA alone loses on 2 x 2 slow links"), where a fluid link
  shares perfectly and prices both alike. The world's transfers each get less than such
  a cap (more of them share the link), so it leaves the flat all-to-all alone.

Two sizes, because a rate has to hold at both: at one size, a pattern slowed by its fixed
costs was read as bandwidth (on 4 x 2 at 5 Gbit/s one world exchange of 17 KiB per rank
set the several-node rate to 3.7 MB/s, and the sweep's 2 MiB all-to-all then simulated in
502 ms against 12 measured).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cocodiff.simulator.collective import (
    pattern_groups,
    simulate_all_to_all,
    simulate_pattern,
    spread_placement,
)
from topology import Topology, build_topology, get_preset
from transports.sim import CollectiveModel, SpanCost, group_span

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

AURORA_TABLE = Path(__file__).parents[1] / "data" / "aurora_alltoall.toml"
# The stack the runtime uses on Aurora gives the levels; torchcomms, the only stack
# measured at several sizes, gives the trend over size.
LEVEL_STACK = "torch.distributed"
TREND_STACK = "torchcomms"

_RATE_GRID_GBPS = tuple(1e-3 * 10 ** (k / 3) for k in range(19))  # 0.001 .. 1000 GB/s
_GOLDEN_STEPS = 12  # narrows the bracket to 0.3% of its width


# The tier whose per-transfer cap the cross-node pattern prices: TAPA's column phase is
# the only exchange of a step that loads it with few transfers.
CAP_TIER = "inter-node"


@dataclass(frozen=True, slots=True)
class Measurement:
    """One flat all-to-all: ``time_s`` for ``bytes_per_rank`` per rank over ``ranks``
    ranks spread evenly over ``nodes`` nodes; ``weight`` in the fit. With ``pattern``
    (one of :data:`cocodiff.simulator.collective.PATTERNS`), that exchange pattern
    instead, every rank of ``nodes`` nodes holding ``bytes_per_rank``."""

    nodes: int
    ranks: int
    bytes_per_rank: int
    time_s: float
    weight: float = 1.0
    label: str = ""
    pattern: str | None = None

    def simulated_s(self, topology: Topology, model: CollectiveModel) -> float:
        if self.pattern is None:
            return simulate_all_to_all(topology, self.bytes_per_rank, "flat", model,
                                       self.ranks).time_s
        return simulate_pattern(topology, self.pattern, self.bytes_per_rank, model)


@dataclass(frozen=True, slots=True)
class SpanFit:
    """A span's fitted cost and how far it lands from each measurement."""

    span: str
    cost: SpanCost
    rows: tuple[tuple[Measurement, float], ...]  # (measurement, fitted time_s)

    @property
    def max_rel_error(self) -> float:
        return max(abs(fitted / m.time_s - 1) for m, fitted in self.rows)


@dataclass(frozen=True, slots=True)
class PatternFit:
    """How far the final model lands from each measured exchange pattern (what was fitted
    on them, the world span's rate and the transfer cap, is in the model)."""

    rows: tuple[tuple[Measurement, float], ...]
    span: str = "patterns"  # the key reports list the fit's rows under

    @property
    def max_rel_error(self) -> float:
        return max(abs(fitted / m.time_s - 1) for m, fitted in self.rows)


def all_to_all_time_s(bytes_per_rank: int, ranks: int, busbw_gbps: float) -> float:
    """The time behind a published all-to-all busbw (nccl-tests convention)."""
    algbw_gbps = busbw_gbps * ranks / (ranks - 1)
    return bytes_per_rank / (algbw_gbps * 1e9)


def load_table(path: Path = AURORA_TABLE) -> dict:
    """The microbenchmark table (TOML: ``source``, ``ranks_per_node``, ``[[cell]]``,
    ``[[control]]``)."""
    with open(path, "rb") as handle:
        return tomllib.load(handle)


def aurora_measurements(table: dict) -> list[Measurement]:
    """What Aurora's model is fitted on: at each rank count, the torch.distributed cell
    as the level and the torchcomms cells' shape over size (their times scaled to meet
    the torch.distributed cell at its size), plus the cross-node point-to-point control
    as a two-rank exchange."""
    per_node = table["ranks_per_node"]
    cells = [c for c in table["cell"] if "busbw_gbps" in c]
    out = []
    for level in (c for c in cells if c["stack"] == LEVEL_STACK):
        ranks, size = level["ranks"], level["bytes_per_rank"]
        level_s = all_to_all_time_s(size, ranks, level["busbw_gbps"])
        nodes = -(-ranks // per_node)
        out.append(Measurement(nodes, ranks, size, level_s, 2.0,
                               f"{LEVEL_STACK} {ranks} ranks {size >> 20} MiB"))
        trend = {c["bytes_per_rank"]: all_to_all_time_s(c["bytes_per_rank"], ranks,
                                                         c["busbw_gbps"])
                 for c in cells if c["stack"] == TREND_STACK and c["ranks"] == ranks}
        for trend_size, trend_s in sorted(trend.items()):
            if trend_size != size and size in trend:
                out.append(Measurement(nodes, ranks, trend_size,
                                       level_s * trend_s / trend[size], 1.0,
                                       f"{TREND_STACK} trend {ranks} ranks "
                                       f"{trend_size >> 20} MiB"))
    for control in table.get("control", ()):
        if control["op"] == "sendrecv" and control["nodes"] > 1:
            # sendrecv sends its whole buffer to the peer: a two-rank all-to-all
            # whose buffer is twice that (half of it stays home).
            size = control["bytes_per_rank"]
            out.append(Measurement(2, 2, 2 * size, size / (control["busbw_gbps"] * 1e9), 1.0,
                                   "sendrecv across nodes"))
    return out


def measurement_span(topology: Topology, measurement: Measurement) -> str:
    placement = spread_placement(topology, measurement.ranks)
    if measurement.pattern in (None, "world"):
        return group_span(topology, placement.tiles)
    column = pattern_groups(topology.num_nodes, topology.tiles_per_node, 0)["column"]
    return group_span(topology, [placement.tiles[rank] for rank in column])


def fit_collective(topology_for: Callable[[int], Topology],
                   measurements: Sequence[Measurement], base: CollectiveModel
                   ) -> tuple[CollectiveModel, list[SpanFit | PatternFit]]:
    """``base`` with each measured span's cost fitted (spans not measured keep theirs),
    then, from a step's exchange patterns when measured, the world span's rate and the
    ``inter-node`` transfer cap (see the module doc).

    Args:
        topology_for: the machine with a given number of nodes.
        measurements: flat all-to-alls (each span needs at least one) and patterns.
        base: the model to extend (its per-tier transfer caps are used while fitting).

    Returns:
        The fitted model and, per span, its fit (then the patterns', when measured).
    """
    model, fits = _fit_spans(topology_for, [m for m in measurements if m.pattern is None],
                             base)
    world = [m for m in measurements if m.pattern == "world"]
    crossing = [m for m in measurements if m.pattern not in (None, "world")]
    if not world and not crossing:
        return model, fits

    def error(rows: Sequence[Measurement], candidate: CollectiveModel) -> float:
        return sum(m.weight * (m.simulated_s(topology_for(m.nodes), candidate) / m.time_s - 1)
                   ** 2 for m in rows)

    if world:
        span = measurement_span(topology_for(world[0].nodes), world[0])
        cost = model.cost(span)

        def with_rate(rate_gbps: float) -> CollectiveModel:
            rate_gbps = min(rate_gbps, cost.rank_gbps)  # only ever lowered
            spans = {**dict(model.spans), span: dataclasses.replace(cost, rank_gbps=rate_gbps)}
            return dataclasses.replace(model, spans=tuple(spans.items()))

        model = with_rate(_search_rate(lambda rate: error(world, with_rate(rate))))
    if crossing:
        caps = dict(model.transfer_cap_gbps)

        def capped(cap_gbps: float) -> CollectiveModel:
            tiers = {**caps, CAP_TIER: cap_gbps}
            return dataclasses.replace(model, transfer_cap_gbps=tuple(
                (tier, gbps) for tier, gbps in tiers.items() if math.isfinite(gbps)))

        model = capped(_search_rate(lambda cap: error(crossing, capped(cap))))
    # Every row where the final model puts it (the patterns' fits move the spans' rows).
    return model, [*(SpanFit(fit.span, model.cost(fit.span), _times([m for m, _ in fit.rows],
                                                                    topology_for, model))
                     for fit in fits), PatternFit(_times(world + crossing, topology_for, model))]


def _times(rows: Sequence[Measurement], topology_for, model: CollectiveModel
           ) -> tuple[tuple[Measurement, float], ...]:
    return tuple((m, m.simulated_s(topology_for(m.nodes), model)) for m in rows)


def _fit_spans(topology_for, measurements: Sequence[Measurement], base: CollectiveModel
               ) -> tuple[CollectiveModel, list[SpanFit | PatternFit]]:
    by_span: dict[str, list[Measurement]] = defaultdict(list)
    for m in measurements:
        by_span[measurement_span(topology_for(m.nodes), m)].append(m)
    costs = dict(base.spans)
    fits: list[SpanFit | PatternFit] = []
    for span, rows in by_span.items():
        fit = _fit_span(span, rows, topology_for, base)
        costs[span] = fit.cost
        fits.append(fit)
    model = CollectiveModel(base.name, base.startup_us, base.engines, base.transfer_cap_gbps,
                            tuple(costs.items()))
    return model, fits


def _search_rate(error_of: Callable[[float], float]) -> float:
    """The rate (GB/s, ``inf`` included) of least ``error_of``: the best point of a
    log-spaced grid, refined by golden section between its neighbours; ``inf`` when it
    does as well (claim no limit the measurements do not show).

    The refinement runs even where ``inf`` leads the grid: a limit only shows once it
    binds, so the error is flat above some rate, and the best limit may lie between the
    last grid point that binds too hard and the first that does not bind at all (the
    smallest of the flat ones, rounding aside, is the grid point picked, its neighbours
    the bracket)."""
    errors: dict[float, float] = {}

    def error(rate: float) -> float:
        if rate not in errors:
            errors[rate] = error_of(rate)
        return errors[rate]

    least = min(error(rate) for rate in _RATE_GRID_GBPS)
    best = min(rate for rate in _RATE_GRID_GBPS if error(rate) <= least * (1 + 1e-9))
    # Golden section on log(rate) between the grid neighbours of the best point.
    step = math.log(_RATE_GRID_GBPS[1] / _RATE_GRID_GBPS[0])
    low, high = math.log(best) - step, math.log(best) + step
    ratio = (math.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    for _ in range(_GOLDEN_STEPS):
        if error(math.exp(a)) < error(math.exp(b)):
            high, b = b, a
            a = high - ratio * (high - low)
        else:
            low, a = a, b
            b = low + ratio * (high - low)
    best = min(errors, key=errors.__getitem__)
    return math.inf if error(math.inf) <= errors[best] * (1 + 1e-9) else best


def _fit_span(span: str, rows: list[Measurement], topology_for, base) -> SpanFit:
    def data_times(rate_gbps: float) -> list[float]:
        model = CollectiveModel(base.name, transfer_cap_gbps=base.transfer_cap_gbps,
                                spans=((span, SpanCost(0.0, 1, rate_gbps)),))
        return [m.simulated_s(topology_for(m.nodes), model) for m in rows]

    solved: dict[float, tuple[float, float, list[float]]] = {}

    def solve(rate_gbps: float) -> tuple[float, float, list[float]]:
        """(error, startup_s, times) at this rate, the set-up chosen in closed form."""
        data = data_times(rate_gbps)
        messages = [m.ranks - 1 for m in rows]
        # Minimise sum w ((n s + D) / t - 1)^2 over s >= 0.
        num = sum(m.weight * (n / m.time_s) * (1 - d / m.time_s)
                  for m, n, d in zip(rows, messages, data, strict=True))
        den = sum(m.weight * (n / m.time_s) ** 2 for m, n in zip(rows, messages, strict=True))
        startup_s = max(0.0, num / den)
        times = [n * startup_s + d for n, d in zip(messages, data, strict=True)]
        error = sum(m.weight * (t / m.time_s - 1) ** 2 for m, t in zip(rows, times, strict=True))
        solved[rate_gbps] = error, startup_s, times
        return solved[rate_gbps]

    best = _search_rate(lambda rate: solve(rate)[0])
    _, startup_s, times = solved[best]
    cost = SpanCost(startup_s * 1e6, 1, best)
    return SpanFit(span, cost, tuple(zip(rows, times, strict=True)))


def aurora_topology(num_nodes: int) -> Topology:
    return build_topology(get_preset("aurora", num_nodes))


def fit_aurora(path: Path = AURORA_TABLE
               ) -> tuple[CollectiveModel, list[SpanFit | PatternFit]]:
    """Aurora's collective model, fitted on the published table (the preset's numbers
    in ``transports.sim.AURORA_SPANS`` are this function's output, rounded)."""
    from transports.sim import COLLECTIVE_MODELS

    base = COLLECTIVE_MODELS["aurora"]
    base = CollectiveModel(base.name, transfer_cap_gbps=base.transfer_cap_gbps)
    return fit_collective(aurora_topology, aurora_measurements(load_table(path)), base)
