"""The output gathers a denoising step ends with, as a run's layout implies them: every
rank's share of the transformer's output gathered in its sequence group, then across the
batch groups (:class:`cocodiff.plan.gather.GatherStage`, which the simulator charges and
the runtime performs).
"""

from __future__ import annotations

from collections.abc import Sequence

from cocodiff.layout import ParallelLayout, PipelineLayout
from cocodiff.models import ModelSpec
from cocodiff.plan.gather import GatherStage, image_stream
from cocodiff.schedules.grid import RankGrid
from cocodiff.schedules.options import PlanOptions


def output_gather(spec: ModelSpec, grid: RankGrid, stream_tokens: Sequence[int],
                  parallel: ParallelLayout | PipelineLayout | None, options: PlanOptions
                  ) -> tuple[GatherStage, ...]:
    """The gathers a denoising step ends with, in order, for a run of ``spec`` on ``grid``
    split as ``parallel`` (None or a pure-Ulysses layout: the whole grid is one sequence
    group; a PipeFusion layout: each stage's Ulysses group, :func:`stage_gather`) with
    ``options`` (dtype; ``batch``: the step's samples, every batch share's together);
    none when the model's output width is not known (``ModelSpec.output_channels`` 0)."""
    if not spec.output_channels or not any(t > 0 for t in stream_tokens):
        return ()
    if isinstance(parallel, PipelineLayout):
        return stage_gather(spec, grid, stream_tokens, parallel, options)
    if parallel is not None and parallel.is_pure_ulysses:
        parallel = None  # as a run's plan records it (build_run_plan)
    image = image_stream(spec, stream_tokens)
    batch_shares = 1 if parallel is None else parallel.batch
    # Bytes of one image token's output, over the samples a rank holds.
    token_bytes = spec.output_channels * options.dtype_bytes * options.batch // batch_shares

    def groups(group_of) -> tuple[tuple[int, ...], ...]:
        # The groups are disjoint and cover every position: ask each group once (asking
        # every position costs ranks x group size, quadratic on a pure sequence group).
        positions, seen = [], bytearray(grid.num_ranks)
        for p in range(grid.num_ranks):
            if not seen[p]:
                group = tuple(group_of(p))
                positions.append(group)
                for member in group:
                    seen[member] = 1
        return tuple(sorted(tuple(grid.ranks[p] for p in group) for group in positions))

    sequence: tuple[tuple[int, ...], ...]
    if parallel is None:
        sequence = (tuple(range(grid.num_ranks)),)
        sequence_ranks = grid.num_ranks
    else:
        sequence = groups(parallel.sequence_group)
        sequence_ranks = parallel.sequence_ranks
    # Each rank's chunk is padded to an equal share (cocodiff.runtime.sharding).
    stages = []
    if sequence_ranks > 1:
        stages.append(GatherStage(sequence, -(-image // sequence_ranks) * token_bytes))
    if parallel is not None and parallel.batch > 1:
        stages.append(GatherStage(groups(parallel.batch_group), image * token_bytes))
    return tuple(stages)


def stage_gather(spec: ModelSpec, grid: RankGrid, stream_tokens: Sequence[int],
                 pipeline: PipelineLayout, options: PlanOptions) -> tuple[GatherStage, ...]:
    """A PipeFusion step's gather: every stage runs the model's output projection on its
    ranks' shares of the image and gathers them in its Ulysses group, as under Ulysses
    (the runtime's gather hook; stage 0's is the step's latents, the others' are
    gathered all the same); none where the layout has none
    (:attr:`~cocodiff.layout.PipelineLayout.gathers_output`)."""
    if not pipeline.gathers_output:
        return ()
    image = image_stream(spec, stream_tokens)
    token_bytes = spec.output_channels * options.dtype_bytes * options.batch
    groups = tuple(tuple(grid.ranks[p] for p in pipeline.stage_group(stage))
                   for stage in range(pipeline.stages))
    return (GatherStage(groups, -(-image // pipeline.ulysses) * token_bytes),)
