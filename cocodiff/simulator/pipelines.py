"""The planner's pipeline side: PipeFusion layouts ranked by simulated step time, and the
device-memory check every candidate (pipeline or sequence family) passes first.

A pipeline layout is ``stages x ulysses`` ranks (each stage a Ulysses group, stage-major
so the groups sit on the fast tiers); by default ``patches = stages`` and one warm-up
step, xDiT's defaults, and consecutive steps not overlapped: the planner ranks what
``cocodiff run`` executes (``plan --pipefusion-overlap`` ranks xDiT's engine instead).
Its step time is the mean over the whole generation
(:func:`cocodiff.simulator.simulate.simulate_generation`: the warm-up steps, the pipeline's
fill and drain), comparable with a sequence layout's step, which is the same every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from cocodiff.layout import LayoutError, PipelineLayout
from cocodiff.memory import RankMemory, check_fits, pipeline_memory, sequence_memory
from cocodiff.models import ModelSpec
from cocodiff.schedules import DEFAULT_OPTIONS, PlanOptions, RankGrid, get_schedule
from cocodiff.schedules.run_plan import build_run_plan
from cocodiff.simulator.planner import Candidate, divisors, step_key
from cocodiff.simulator.simulate import simulate_run_plan
from topology import Placement, Topology
from transports.sim import CollectiveModel


def pipeline_layouts(num_ranks: int, spec: ModelSpec, patches: int | None = None,
                     warmup: int = 1, overlap: bool = False) -> list[PipelineLayout]:
    """Every PipeFusion layout of ``num_ranks`` ranks with at least two stages, each stage
    a Ulysses group of at most the head count, at most one stage per layer; ``overlap``:
    consecutive steps overlapped as in xDiT (:class:`~cocodiff.layout.PipelineLayout`;
    the default is what ``cocodiff run`` executes)."""
    return [PipelineLayout(stages, num_ranks // stages, patches or stages, warmup, overlap)
            for stages in divisors(num_ranks)
            if 2 <= stages <= spec.num_layers and num_ranks // stages <= spec.num_heads]


def candidate_memory(candidate: Candidate, spec: ModelSpec, stream_tokens: Sequence[int],
                     num_ranks: int, options: PlanOptions) -> RankMemory:
    """What one rank of ``candidate`` needs (:mod:`cocodiff.memory`)."""
    layout = candidate.layout
    if isinstance(layout, PipelineLayout):
        return pipeline_memory(spec, stream_tokens, layout, options.dtype_bytes, options.batch)
    entry = get_schedule(candidate.schedule)
    return sequence_memory(spec, stream_tokens, num_ranks, layout, options.dtype_bytes,
                           options.batch, v_cache=entry.step_dependent
                           and options.vmajor is not None)


def keep_fitting(candidates: Sequence[Candidate], spec: ModelSpec,
                 stream_tokens: Sequence[int], topology: Topology, options: PlanOptions
                 ) -> tuple[list[Candidate], list[str]]:
    """The candidates with their memory, those whose ranks fit the device; and one line
    per layout refused (:func:`cocodiff.memory.check_fits`)."""
    kept: list[Candidate] = []
    refused: dict[str, str] = {}
    num_ranks = len(topology.tiles)
    for candidate in candidates:
        memory = candidate_memory(candidate, spec, stream_tokens, num_ranks, options)
        try:
            check_fits(memory, topology.spec.tile_memory_gb, candidate.layout.name,
                       topology.spec.name)
        except LayoutError as err:
            refused.setdefault(candidate.layout.name, str(err))
            continue
        kept.append(replace(candidate, memory=memory))
    return kept, list(refused.values())


def rank_pipelines(spec: ModelSpec, topology: Topology, stream_tokens: Sequence[int],
                   num_steps: int, options: PlanOptions = DEFAULT_OPTIONS,
                   collective: CollectiveModel | None = None,
                   layouts: Sequence[PipelineLayout] | None = None
                   ) -> tuple[list[Candidate], list[str]]:
    """Simulate every pipeline layout that fits the device over a generation of
    ``num_steps`` steps; (candidates fastest first, the lines refusing the others)."""
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    if layouts is None:
        layouts = pipeline_layouts(placement.num_ranks, spec)
    unsimulated = [Candidate(layout, "pipefusion", 0.0, 0.0, None) for layout in layouts]
    fitting, refused = keep_fitting(unsimulated, spec, stream_tokens, topology, options)
    candidates = []
    for candidate in fitting:
        assert isinstance(candidate.layout, PipelineLayout)  # made from `layouts` above
        run_plan = build_run_plan("pipefusion", spec, grid, stream_tokens, num_steps, options,
                                  pipeline=candidate.layout)
        result = simulate_run_plan(run_plan, topology, placement, collective=collective,
                                   with_bound=False)
        candidates.append(replace(candidate, step_time_s=result.step_time_s,
                                  compute_s=result.compute_s))
    # As every ranking: ties to 7 significant digits go to the name (planner.step_key).
    candidates.sort(key=lambda c: (step_key(c.step_time_s), c.layout.name))
    return candidates, refused
