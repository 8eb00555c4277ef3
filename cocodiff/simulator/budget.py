"""Resource guards: what a simulation will cost, estimated before it starts.

A valid command line can still ask for more than a machine has: ``--nodes 5000`` (60,000
Aurora ranks) builds plans of billions of entries, and ``--chunks 1000`` posts millions
of collectives. Both used to run for hours or exhaust memory. This module counts, from the
topology's shape, the ranks, the model's layers, the chunks and the steps (never from a
simulation), what the simulator will do, and turns it into memory and wall-time
estimates, so a command can refuse in one line what would not fit, and show progress on
what runs long.

The counts are properties of the plans (collectives posted, rank-to-peer messages, plan
entries held); the per-unit costs that turn them into seconds and bytes are measured on
this simulator (``bench/sim_guard.py``: microbenchmarks of the simulator itself, not of
any result it is compared with) or, where said, assumed; docs/hardening.md has them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from cocodiff.util.errors import CocodiffError

# Per-unit times fitted by bench/sim_guard.py to the CPU time of eleven simulations on the
# development machine (docs/hardening.md; the median of three fits, 2026-11-28): per
# collective one simulated rank posts (SimPy events, flow batches) and per rank-to-peer
# message (flow set-up, bundling, max-min; held, not fitted).
SECONDS_PER_COLLECTIVE = 57e-6
SECONDS_PER_MESSAGE = 0.1e-6
# Per rank of the machine, for each layout simulated: the topology, the layout's groups
# and plan, its gathers and bounds, what grows with the machine when the simulation does
# not (folded, a long Ring's passes extrapolated). Fitted beside the cost per collective.
SECONDS_PER_RANK = 33e-6
# A PipeFusion generation's ranks are all simulated (its stages hold different layers, so no
# fold applies) and its flows share links across the stages: CPU time per collective a rank
# posts, the point-to-point transfers between stages counted as collectives. Measured by
# bench/sim_guard.py on generations of 1 and 2 Aurora nodes (131 us) and on one of 8
# nodes, `P16xU6xM16` (118 us; docs/hardening.md).
SECONDS_PER_PIPELINE_COLLECTIVE = 120e-6
# The planner also builds a plan and its links' bound per (layout, schedule) pair: CPU
# time per rank of each (`cocodiff plan --nodes 8`: 17.4 s for 49 pairs of 96 ranks, of
# which the simulations above account for 5.9 s).
SECONDS_PER_PLANNED_RANK = 2.5e-3
# Memory per plan entry (a peer's row count in a phase: Python ints in tuples; TAPA's plan
# of 500 Aurora nodes measured 1.5 GB for 24 M entries), per topology element (vertex or
# directed link: the topology's link attributes, folds and link table; 460-480 B
# measured at 1,024 and 4,096 Aurora nodes, the networkx graph, built only when asked
# for, another 260 B) and per cached message of a simulated rank (flow arrays; assumed).
BYTES_PER_PLAN_ENTRY = 64
BYTES_PER_GRAPH_ELEMENT = 500
BYTES_PER_MESSAGE = 200
BASE_BYTES = 300e6  # the interpreter with numpy, simpy and rich (8 nodes peak at 45 MB)
# Memory per bundle of a folded output gather (one per sender, destination class and
# same-node-or-not: transports.sim SimWorld._destinations), held while its simulation
# runs: routes, flow arrays, the launch's batch. Measured on one simulation: the 1-layer
# flat step on U24xR128 with the Ring innermost, 256 Aurora nodes, folded on 384 ranks,
# peaked at 381 MB of RSS (74 MB before it) for 295k bundles (1.04 KB each; tracemalloc,
# in a separate run, counted the bundles).
BYTES_PER_GATHER_BUNDLE = 1000
# CPU time per such bundle: its folded route, tier and latency worked out in Python, its
# flows reallocated with the rest. A gather whose fold period is long (the Ring
# innermost: 384 simulated ranks reach 768 classes each) costs more than its
# collectives; fitted by bench/sim_guard.py beside the costs per collective and per rank
# (8.5-15.6 us in three fits).
SECONDS_PER_GATHER_BUNDLE = 10e-6

# Refuse what would run longer than this (override: COCODIFF_MAX_SIM_S); show progress
# beyond PROGRESS_S.
MAX_WALL_S = 3600.0
PROGRESS_S = 10.0
# Use at most this share of the memory available when the command starts.
MEMORY_SHARE = 0.8
EXCHANGES_PER_LAYER = 4  # Q, K, V and the attention output


@dataclass(frozen=True, slots=True)
class Estimate:
    """What simulating some schedules will cost.

    Attributes:
        collectives: all-to-alls posted by the simulated ranks (chunks and phases count).
        messages: rank-to-peer messages of those collectives.
        plan_entries: per-peer row counts the largest plan holds.
        graph_elements: nodes and links of the topology graph.
        memory_bytes: estimated peak memory.
        wall_s: estimated wall time.
        gather_bundles: the bundles folded output gathers send (one per sender,
            destination class and same-node-or-not).
    """

    collectives: int
    messages: int
    plan_entries: int
    graph_elements: int
    memory_bytes: float
    wall_s: float
    gather_bundles: int = 0


def graph_elements(spec) -> int:
    """Vertices and directed links of :func:`topology.build_topology`'s graph."""
    gpus, per_gpu, nics = spec.gpus_per_node, spec.tiles_per_gpu, spec.nics_per_node
    switched = spec.gpu_link is not None and spec.gpu_fabric == "switch"
    vertices = 1 + gpus + gpus * per_gpu + nics + (1 if switched else 0)  # 1: the host
    if spec.gpu_link is None:
        gpu_links = 0
    else:
        gpu_links = 2 * gpus if switched else gpus * (gpus - 1)
    # Both directions of: GPU-host, tile-GPU, tile-tile, the GPU fabric, host-NIC, and
    # NIC-fabric switch between nodes.
    links = (2 * gpus + 2 * gpus * per_gpu + gpus * per_gpu * (per_gpu - 1) + gpu_links
             + 2 * nics + (2 * nics if spec.num_nodes > 1 else 0))
    return spec.num_nodes * (vertices + links) + (1 if spec.num_nodes > 1 else 0)


def _simulated_ranks(spec, num_ranks: int, heads: tuple[int, ...]) -> int:
    """Ranks the simulator runs: the fold period of a node-symmetric plan
    (``cocodiff.simulator.simulate._fold_period_nodes``) or all of them."""
    from cocodiff.schedules.ulysses import smallest_period

    per_node = spec.gpus_per_node * spec.tiles_per_gpu
    if spec.num_nodes == 1 or num_ranks != spec.num_nodes * per_node:
        return num_ranks
    period_nodes = math.lcm(smallest_period(heads), per_node) // per_node
    if period_nodes >= spec.num_nodes or spec.num_nodes % period_nodes:
        return num_ranks
    return period_nodes * per_node


def _phase_sizes(spec, group: int) -> list[int]:
    """Group sizes of TAPA's phases over ``group`` node-major ranks (tile, GPU, node)."""
    sizes = []
    for level_size in (spec.tiles_per_gpu, spec.gpus_per_node, spec.num_nodes):
        size = min(level_size, group)
        if size > 1:
            sizes.append(size)
        group = max(1, group // max(1, level_size))
    return sizes


def estimate_simulation(spec, num_layers: int, num_heads: int, schedules: dict[str, int],
                        chunks: int, group: int | None = None) -> Estimate:
    """The cost of simulating ``schedules`` on the machine ``spec``, every layer counted:
    exact for a full simulation (a recorded timeline) of a model whose output gather is
    simulated (``ModelSpec.output_channels``), an upper bound otherwise and when the
    simulator extrapolates a step from one and two layers
    (:func:`cocodiff.simulator.simulate.simulate_layers`).

    Args:
        spec: the machine (a ``topology.TopologySpec``); every tile is a rank.
        num_layers: the model's attention layers.
        num_heads: its heads (they decide how far the simulator folds the machine).
        schedules: schedule name -> how many distinct plans it simulates (V-Major: one
            per distinct cache ratio; others 1).
        chunks: TAPA's pipeline chunks.
        group: ranks of one Ulysses group (a hybrid layout); None: all of them.
    """
    from cocodiff.schedules import get_schedule
    from cocodiff.schedules.ulysses import split_heads

    num_ranks = spec.num_nodes * spec.gpus_per_node * spec.tiles_per_gpu
    group = group or num_ranks
    # A hybrid layout's folding is not worked out here: count every rank (an upper bound).
    simulated = (_simulated_ranks(spec, num_ranks, split_heads(num_heads, group))
                 if group == num_ranks else num_ranks)
    collectives = messages = plan_entries = 0
    for name, plans in schedules.items():
        per_rank = simulated * num_layers * EXCHANGES_PER_LAYER * plans
        if get_schedule(name).phased:  # the topology-aligned schedules: phases, chunks
            sizes = _phase_sizes(spec, group)
            # One tier: the exchange stays flat and unchunked (V-Major's selective phase
            # on a single inter-node tier is the exception, counted unchunked here).
            pieces = chunks if len(sizes) > 1 else 1
            collectives += per_rank * pieces * len(sizes)
            messages += per_rank * pieces * sum(size - 1 for size in sizes)
            # Every rank holds its own phases (send and receive rows per member).
            plan_entries = max(plan_entries, num_ranks * EXCHANGES_PER_LAYER * 2 * sum(sizes))
        else:
            collectives += per_rank
            messages += per_rank * (group - 1)
            # Ranks with equal head counts share one layer: two kinds at most.
            plan_entries = max(plan_entries, 2 * EXCHANGES_PER_LAYER * 2 * group)
        # The output gather that ends the step (cocodiff.plan.gather): one over the
        # sequence, and one over the batch groups of a hybrid layout (counted whenever
        # the layout is hybrid: an upper bound). Its messages: at most one to every rank.
        gathers = 1 if group == num_ranks else 2
        collectives += simulated * plans * gathers
        messages += simulated * plans * (num_ranks - 1)
    elements = graph_elements(spec)
    sizes = _phase_sizes(spec, group)
    cached_messages = simulated * EXCHANGES_PER_LAYER * max(
        (chunks if len(sizes) > 1 else 1) * sum(size - 1 for size in sizes), group - 1)
    memory = (BASE_BYTES + BYTES_PER_GRAPH_ELEMENT * elements
              + BYTES_PER_PLAN_ENTRY * plan_entries + BYTES_PER_MESSAGE * cached_messages)
    wall_s = SECONDS_PER_COLLECTIVE * collectives + SECONDS_PER_MESSAGE * messages
    return Estimate(collectives, messages, plan_entries, elements, memory, wall_s)


def estimate_pipelines(spec, num_layers: int, layouts, num_steps: int) -> Estimate:
    """The cost of simulating PipeFusion ``layouts`` over a generation of ``num_steps``
    steps as :func:`cocodiff.simulator.simulate.simulate_generation` does (past
    ``warmup + 3`` steps, two short generations of ``warmup + 2`` and ``warmup + 3``
    steps): every rank; per step, the stage's layers' exchanges (4 a layer with Ulysses
    inside the stage) and a transfer in and out, once per synchronous step and per patch
    of a pipelined one, and the stage's output gather. An upper bound for the planner,
    which prunes layouts by floors.
    """
    num_ranks = spec.num_tiles
    collectives = messages = 0
    for layout in layouts:
        warmup = min(layout.warmup, num_steps)
        if num_steps <= warmup + 3:
            synchronous, pipelined, generations = warmup, num_steps - warmup, 1
        else:
            synchronous, pipelined, generations = 2 * warmup, 5, 2
        # A stage's layers, on average over the stages (their counts differ by one).
        exchanges = EXCHANGES_PER_LAYER * num_layers / layout.stages if layout.ulysses > 1 else 0
        passes = synchronous + pipelined * layout.patches
        # Each step ends with the stage's output gather (schedules.gather.stage_gather).
        gathers = (synchronous + pipelined) * layout.gathers_output
        # A generation's ends post two fewer a rank (counted against the simulator).
        collectives += round(num_ranks * (passes * (exchanges + 2) - 2 * generations
                                          + gathers))
        messages += round(num_ranks * (passes * (exchanges * (layout.ulysses - 1) + 2)
                                       + gathers * (layout.ulysses - 1)))
    elements = graph_elements(spec)
    memory = BASE_BYTES + BYTES_PER_GRAPH_ELEMENT * elements
    wall_s = (SECONDS_PER_PIPELINE_COLLECTIVE * collectives + SECONDS_PER_MESSAGE * messages
              + SECONDS_PER_RANK * num_ranks * len(layouts))
    return Estimate(collectives, messages, 0, elements, memory, wall_s)


def estimate_planner(spec, num_layers: int, num_heads: int, schedules, batch_size: int,
                     chunks: int) -> Estimate:
    """The cost of :func:`cocodiff.simulator.planner.rank_layouts`: one step of every candidate
    layout under each schedule, two layers of it (the planner extrapolates identical
    layers), every rank counted (its folding is not worked out here). Ring passes are
    not counted: a lower bound for layouts with a Ring, which the all-rank count covers.
    """
    from cocodiff.simulator.planner import candidate_layouts

    estimates = []
    for layout in candidate_layouts(spec.num_tiles, num_heads, batch_size):
        names = tuple(schedules)[:1] if layout.ulysses == 1 else tuple(schedules)
        simulation = estimate_simulation(spec, min(num_layers, 2), num_heads,
                                         dict.fromkeys(names, 1), chunks, group=layout.ulysses)
        planning_s = SECONDS_PER_PLANNED_RANK * spec.num_tiles * len(names)
        estimates.append(replace(simulation, wall_s=simulation.wall_s + planning_s))
    return combine(estimates)


# Chunk counts past the first that the planner's search (`--chunks auto`) simulates before
# two in a row are slower (cocodiff.simulator.planner.choose_chunks: 2 and 3 at 8 to
# 1,024 Aurora nodes).
CHUNK_TRIES = 2


def estimate_layout(spec, num_layers: int, num_heads: int, layout, name: str, plans: int,
                    chunks: int, extrapolated: bool = True) -> Estimate:
    """The cost of simulating ``plans`` plans of schedule ``name`` on ``layout`` (a
    ``cocodiff.layout.ParallelLayout`` of every tile) as the simulator runs them: the
    ranks of one fold period only (the layout's shift period in whole nodes,
    :func:`cocodiff.simulator.symmetry.fold_period_nodes`), the Ring's passes (one message
    to the next member, ``ring - 1`` per layer) and the output gathers, in a simulation
    of one and one of two layers when ``extrapolated`` (``simulate_layers``; a long Ring
    in three of each, with 2, 3 and 4 passes per layer), else in one of every layer (a
    recorded timeline). Plans are built lazily
    (``cocodiff.plan.lazy``): only the simulated ranks' programs are held.
    """
    from cocodiff.schedules import get_schedule
    from cocodiff.schedules.ulysses import split_heads
    from cocodiff.simulator.simulate import MIN_EXTRAPOLATED_PASSES, PASS_POINTS

    per_node = spec.gpus_per_node * spec.tiles_per_gpu
    num_ranks = spec.num_nodes * per_node
    ulysses, ring = layout.ulysses, layout.ring
    period = math.lcm(layout.shift_period(split_heads(num_heads, ulysses)), per_node)
    simulated = period if num_ranks % period == 0 and period < num_ranks else num_ranks
    # The simulations run: (layers, Ring passes per layer) of each. Extrapolated, a step
    # is simulated with one and with two layers, and a long Ring with 1, 2 and 3 repeats
    # of its block after the first pass (cocodiff.simulator.simulate.simulate_layers).
    layer_runs = [1, 2] if extrapolated and num_layers > 2 else [num_layers]
    reduced = extrapolated and ring - 2 >= MIN_EXTRAPOLATED_PASSES
    passes = [1 + repeats for repeats in PASS_POINTS] if reduced else [ring - 1]
    runs = [(layers, count) for layers in layer_runs for count in passes]
    if get_schedule(name).phased:
        sizes = _phase_sizes_of_group(spec, layout)
        pieces = chunks if len(sizes) > 1 else 1
        collectives_per_layer = EXCHANGES_PER_LAYER * pieces * len(sizes)
        messages_per_layer = EXCHANGES_PER_LAYER * pieces * sum(size - 1 for size in sizes)
        rows = EXCHANGES_PER_LAYER * 2 * sum(sizes)
    else:
        collectives_per_layer = EXCHANGES_PER_LAYER
        messages_per_layer = EXCHANGES_PER_LAYER * (ulysses - 1)
        rows = EXCHANGES_PER_LAYER * 2 * ulysses
    # A Ring pass is one collective with one message (``count`` per layer).
    gathers = 1 + (layout.batch > 1)
    # Gather messages are bundled by fold class: at most one per simulated rank.
    collectives = simulated * plans * sum(layers * (collectives_per_layer + count) + gathers
                                          for layers, count in runs)
    messages = simulated * plans * sum(layers * (messages_per_layer + count)
                                       + gathers * min(num_ranks - 1, simulated)
                                       for layers, count in runs)
    # A simulated rank's messages held at once: one layer's, every pass included.
    cached_messages = simulated * (messages_per_layer + ring - 1)
    # A rank holds its pass's two one-hot rows of ``ring`` entries and 3 steps per block.
    plan_entries = simulated * (rows + 5 * ring)
    # A folded gather bundles each sender's messages by destination class (rank modulo
    # the simulated ranks) and whether it shares the sender's node: the square of a long
    # fold period (1,536 ranks for the Ring innermost on 1,024 nodes) dominates memory.
    bundles = simulated * gathers * min(num_ranks - 1, 2 * simulated)
    elements = graph_elements(spec)
    memory = (BASE_BYTES + BYTES_PER_GRAPH_ELEMENT * elements
              + BYTES_PER_PLAN_ENTRY * plan_entries + BYTES_PER_MESSAGE * cached_messages
              + BYTES_PER_GATHER_BUNDLE * bundles)
    wall_s = (SECONDS_PER_COLLECTIVE * collectives + SECONDS_PER_MESSAGE * messages
              + SECONDS_PER_RANK * num_ranks + SECONDS_PER_GATHER_BUNDLE * bundles)
    return Estimate(collectives, messages, plan_entries, elements, memory, wall_s, bundles)


def _phase_sizes_of_group(spec, layout) -> list[int]:
    """TAPA's phase sizes (tile, GPU, node) in the Ulysses groups of ``layout`` on
    node-major ranks: the box every group fills, or one flat level
    (``cocodiff.schedules.hybrid.ulysses_grids``, which the plans then use)."""
    from cocodiff.schedules import RankGrid
    from cocodiff.schedules.hybrid import ulysses_grids

    grid = RankGrid((spec.num_nodes, spec.gpus_per_node, spec.tiles_per_gpu),
                    tuple(range(spec.num_tiles)))
    return [size for size in reversed(ulysses_grids(grid, layout).shape) if size > 1]


def estimate_planned(spec, num_layers: int, num_heads: int, schedules: dict[str, int],
                     chunks: int, auto_chunks: bool, floors=None) -> Estimate:
    """The cost of ``cocodiff simulate`` on the planner's layouts: what the planner
    simulates, then each schedule on its layout (``schedules``: name -> distinct plans).

    The planner walks every candidate's floor (cheap: one node's ranks, no simulation)
    and simulates in floor order until a floor is above the best step simulated. At
    scale the largest Ulysses degree wins and its floor prunes every other degree, and
    its Ring-innermost placement too (its floor is above the winner's step, as at 256
    nodes, or ties it, as at 1,024, and a tie goes to the winner's name), so what is
    counted is that degree's Ulysses-innermost placement for each ranked schedule
    (below ~64 nodes, where the twin is simulated, it is cheap); then, with
    ``--chunks auto``, :data:`CHUNK_TRIES` more chunk counts of each phased ranked
    schedule; then the schedules whose step the planner did not already simulate (V-Major's
    plans). Measured against runs in docs/hardening.md.

    With ``floors`` (``cocodiff.simulator.planner.layout_floors`` of the ranked
    schedules), the candidates whose floor is below that layout's are counted too: the
    planner simulates in floor order and none of them can be pruned, as the winner's step
    is at least its floor (Wan2.1-14B on 256 nodes: the winner's Ring-innermost twin, 5x
    the winner's cost). Those above it may still be simulated (a floor below the
    winner's step): not counted.
    """
    from cocodiff.layout import ParallelLayout
    from cocodiff.schedules import get_schedule
    from cocodiff.simulator.planner import candidate_layouts

    num_ranks = spec.num_tiles
    layouts = candidate_layouts(num_ranks, num_heads)
    top = max(layout.ulysses for layout in layouts)
    if top == num_ranks:  # pure Ulysses: one layout
        inner = ParallelLayout(num_ranks)
    else:
        inner = next(layout for layout in layouts if layout.ulysses == top
                     and layout.batch == 1 and (top == 1 or layout.order[-1] == "ulysses"))
    estimates = []
    ranked = ranked_schedules(schedules)
    for name in ranked:
        estimates.append(estimate_layout(spec, num_layers, num_heads, inner, name, 1, chunks))
        if floors is not None:
            walked = floors[name]
            winner_floor = next(floor for floor, layout_name, _ in walked
                                if layout_name == inner.name)
            estimates += [estimate_layout(spec, num_layers, num_heads, layouts[index], name, 1,
                                          chunks)
                          for floor, _, index in walked if floor < winner_floor]
        if auto_chunks and get_schedule(name).phased:
            for extra in range(CHUNK_TRIES):
                estimates.append(estimate_layout(spec, num_layers, num_heads, inner, name, 1,
                                                 chunks + 1 + extra))
        # The floors: one node's ranks walked per candidate.
        floors_s = SECONDS_PER_PLANNED_RANK * len(layouts) * spec.gpus_per_node \
            * spec.tiles_per_gpu
        estimates.append(Estimate(0, 0, 0, 0, BASE_BYTES, floors_s))
    for name, plans in schedules.items():
        if name not in ranked:  # the planner's step of a ranked schedule is reused
            estimates.append(estimate_layout(spec, num_layers, num_heads, inner, name, plans,
                                             chunks))
    return combine(estimates)


def combine(estimates) -> Estimate:
    """Estimates of work done one after another: counts and time add, memory is the
    largest (each simulation's memory is freed before the next)."""
    estimates = list(estimates)
    if not estimates:
        return Estimate(0, 0, 0, 0, BASE_BYTES, 0.0)
    return Estimate(sum(e.collectives for e in estimates), sum(e.messages for e in estimates),
                    max(e.plan_entries for e in estimates),
                    max(e.graph_elements for e in estimates),
                    max(e.memory_bytes for e in estimates), sum(e.wall_s for e in estimates),
                    sum(e.gather_bundles for e in estimates))


def distinct_plans(name: str, num_steps: int, options, activity) -> int:
    """Plans :func:`cocodiff.schedules.run_plan.build_run_plan` makes (and the simulator runs) for
    ``name``: one per recorded step with an activity trace, one per distinct planned
    cache ratio for a step-dependent schedule (V-Major), else one."""
    from cocodiff.schedules import get_schedule

    entry = get_schedule(name)
    if not entry.step_dependent:
        return 1
    if activity is not None:
        return activity.num_steps
    return len({entry.cache_ratio(options, step, num_steps) for step in range(num_steps)})


def ranked_schedules(names) -> dict[str, None]:
    """The schedules the planner ranks layouts by for ``names`` (each registry entry's
    ``ranked_as``), in order, once each."""
    from cocodiff.schedules import get_schedule

    return dict.fromkeys(get_schedule(name).ranked_as for name in names)


def available_memory_bytes() -> float:
    """Memory this process may still use: MemAvailable (Linux), else physical memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return math.inf


def max_wall_s() -> float:
    text = os.environ.get("COCODIFF_MAX_SIM_S")
    if text is None:
        return MAX_WALL_S
    try:
        value = float(text)
    except ValueError:
        raise CocodiffError(f"COCODIFF_MAX_SIM_S={text!r} is not a number of seconds") from None
    if not value > 0:
        raise CocodiffError(f"COCODIFF_MAX_SIM_S={text!r} must be positive")
    return value


def check_estimate(estimate: Estimate, what: str) -> None:
    """Refuse, in one line naming the estimate and the limit, what would not fit in
    memory or would run longer than :func:`max_wall_s`.

    Args:
        estimate: from :func:`estimate_simulation`.
        what: the request in words, for the message ("60000 ranks, 4 schedules").
    """
    limit_bytes = MEMORY_SHARE * available_memory_bytes()
    if estimate.memory_bytes > limit_bytes:
        raise CocodiffError(
            f"{what} would need about {_gb(estimate.memory_bytes)} of memory "
            f"({estimate.plan_entries:,} plan entries, {estimate.graph_elements:,} graph "
            f"elements); the limit here is {_gb(limit_bytes)} ({MEMORY_SHARE:.0%} of the "
            "memory available)")
    limit_s = max_wall_s()
    if estimate.wall_s > limit_s:
        raise CocodiffError(
            f"{what} would run for about {_duration(estimate.wall_s)} "
            f"({estimate.collectives:,} collectives, {estimate.messages:,} messages to "
            f"simulate); the limit is {_duration(limit_s)} (COCODIFF_MAX_SIM_S)")


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.1f} GB"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"
