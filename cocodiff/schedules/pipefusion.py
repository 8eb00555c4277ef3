"""PipeFusion: layers split into pipeline stages, image tokens into patches streamed
through them (arXiv 2405.14430; xDiT ``xfuser/model_executor/pipelines/``,
``xfuser/core/cache_manager/``).

For a :class:`~cocodiff.layout.PipelineLayout` of N stages x U Ulysses ranks:

* stage ``s`` holds the contiguous layers ``stage_layers[s] .. stage_layers[s+1] - 1``
  (and only their weights); its U ranks form a Ulysses group that runs a Ulysses schedule
  (``flat`` by default) on each patch exactly as pure Ulysses would on that many tokens;
* a **pipelined** step cuts the image tokens into M patches. Stage s computes patch m of
  its layers while stage s+1 computes patch m-1. Each patch carries the joint text with
  it (xDiT's joint processor concatenates the text's Q/K/V to every patch's), so the
  text is recomputed with every patch; the hidden states of the text travel to the next
  stage once per step, with patch 0 (xDiT's ``encoder_hidden_states`` send);
* attention of a patch runs its queries against a **K/V buffer over the whole
  sequence** in which only the patch's slice is fresh (this step) and the other
  patches' slices are one step stale: ``4 q S hd h`` FLOPs for ``q`` patch tokens
  against ``S`` buffered ones. With U > 1 the fresh K/V of the patch is exchanged in the
  stage's Ulysses group (the Ulysses all-to-alls of the patch) before it is written
  into the buffer;
* between stages only the patch's activations travel, point to point
  (:func:`cocodiff.plan.steps.transfer`), rank u of stage s to rank u of stage s+1; the
  last stage sends each patch's latents back to stage 0 for the next step (the pipeline
  is a ring across steps). Whether consecutive steps overlap is the layout's
  ``overlap``: with it, the last stage sends patch m as soon as it is done and stage 0
  starts the next step's patch m as soon as it is back (xDiT's ``_async_pipeline``,
  whose scheduler steps each patch: the pipeline fills once and drains once per
  generation); without it (the default, what ``cocodiff run`` executes: diffusers' loop
  steps the scheduler on the whole latents between two transformer calls), the last
  stage sends its M patches after its last one and stage 0 waits for all of them before
  its first patch, so the pipeline fills and drains every step. The same transfers and
  bytes either way; only the order differs;
* the first ``warmup`` steps are **synchronous**: the same program with one patch (the
  whole sequence, every K/V slice fresh), which is exact.

Each step's plan therefore depends on what the step before sent (one message with the
whole latent after a synchronous step, one per patch after a pipelined one) and on
whether a next step follows: :func:`pipefusion_step_plans` makes the distinct plans of a
generation and which step uses which.

A receive is posted as soon as the previous one has arrived (before the compute that
precedes its use), a send after the patch's last layer; a rank waits for its previous
send before it starts the next (one of each in flight).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from cocodiff import kernels as kn
from cocodiff.cost import Cost
from cocodiff.layout import PipelineLayout
from cocodiff.models import ModelSpec
from cocodiff.plan.gather import image_stream
from cocodiff.plan.steps import (
    Compute,
    Exchange,
    LayerPlan,
    Plan,
    RankProgram,
    Step,
    Wait,
    transfer,
)
from cocodiff.schedules.grid import RankGrid
from cocodiff.schedules.hybrid import group_grid, relabel_layer, scale_layer_host_ops
from cocodiff.schedules.options import DEFAULT_OPTIONS, PlanOptions
from cocodiff.schedules.registry import get_schedule
from cocodiff.schedules.ulysses import head_split
from cocodiff.util.errors import ScheduleError

# The Ulysses schedules a stage's group may run (exact ones; V-Major is not combined).
STAGE_SCHEDULES = ("flat", "tapa", "vfirst")
# The pipeline schedules by name (one so far). They are not in
# ``cocodiff.schedules.SCHEDULES``: a pipeline's plan is made from a PipelineLayout and
# differs per step in structure. ``run`` carries its synchronous steps
# (``cocodiff.runtime.pipefusion``) and refuses pipelined ones.
PIPELINE_SCHEDULES = ("pipefusion",)


def patch_tokens(image_tokens: int, patches: int, ulysses: int) -> int:
    """Image tokens of one patch, padded so that the stage's ranks share it evenly."""
    per_patch = -(-image_tokens // patches)
    return -(-per_patch // ulysses) * ulysses


def split_streams(spec: ModelSpec, stream_tokens: Sequence[int]) -> tuple[int, int]:
    """(image tokens, joint text tokens) of a plan's streams."""
    streams = [int(t) for t in stream_tokens if t > 0]
    if not streams:
        raise ScheduleError("a plan needs at least one token")
    image = image_stream(spec, streams)
    return image, sum(streams) - image


def buffer_tokens(spec: ModelSpec, stream_tokens: Sequence[int], pipeline: PipelineLayout,
                  patches: int) -> int:
    """Tokens of a layer's K/V buffer (the whole sequence as the patches pad it)."""
    image, text = split_streams(spec, stream_tokens)
    u = pipeline.ulysses
    return patches * patch_tokens(image, patches, u) + -(-text // u) * u


def patch_attention(base: Compute, q_tokens: int, kv_tokens: int, heads: int, head_dim: int,
                    dtype_bytes: int, batch: int) -> Compute:
    """Attention of ``q_tokens`` queries against a K/V buffer of ``kv_tokens`` tokens over
    ``heads`` heads: ``4 q S hd h`` FLOPs (``QK^T`` and ``PV``), flash-style memory (Q
    and O of the patch, K and V of the buffer); ``base`` is the attention step of the
    patch alone (``q == S``), whose other kernels (the Ulysses layout copies) stay. With
    ``q == S`` it is :func:`cocodiff.cost.op_cost`'s attention."""
    flops = 4.0 * q_tokens * kv_tokens * head_dim * heads * batch
    memory = 2.0 * (q_tokens + kv_tokens) * heads * head_dim * dtype_bytes * batch
    # The patch's kernel keeps the host ops the base charged its launch.
    kernels = tuple(
        replace(kn.attention(q_tokens, kv_tokens, heads, head_dim, dtype_bytes).times(batch),
                host_ops=kernel.host_ops)
        if kernel.kind == "attention" else kernel for kernel in base.cost.kernels)
    return Compute("attention", Cost(flops, memory, kernels))


def layer_kinds(spec: ModelSpec) -> tuple[ModelSpec, ...]:
    """Each layer's one-layer spec: FLUX's double- and single-stream blocks apart where
    the spec says which is which (a stage is charged the blocks it holds, not the
    model's mean layer: the slowest stage sets the pipeline's pace), else the mean layer
    for every one."""
    one = replace(spec, num_layers=1)
    kinds: dict[bool | None, ModelSpec] = {
        None: one, True: replace(one, double_stream_share=1.0),
        False: replace(one, double_stream_share=0.0)}
    return tuple(kinds[spec.double_stream(layer)] for layer in range(spec.num_layers))


def _stage_layer(spec: ModelSpec, grid: RankGrid, stream_tokens: Sequence[int],
                 pipeline: PipelineLayout, patches: int, inner: str, options: PlanOptions,
                 stage: int, one: ModelSpec) -> tuple[LayerPlan, ...]:
    """One layer of one patch on each rank of ``stage`` (Ulysses order), costed as
    ``one`` (:func:`layer_kinds`)."""
    image, text = split_streams(spec, stream_tokens)
    u = pipeline.ulysses
    per_patch = patch_tokens(image, patches, u)
    streams = tuple(t for t in (per_patch, text) if t > 0)
    positions = pipeline.stage_group(stage)
    members = group_grid(grid, positions)
    local = RankGrid(members.shape, tuple(range(u)))
    sub = get_schedule(inner).plan(one, local, streams, options)
    split = sub.head_split
    kv_tokens = buffer_tokens(spec, stream_tokens, pipeline, patches)
    host_scale = pipelined_host_scale(one, u)
    layers = []
    for index in range(u):
        layer = sub.program(index).layers[0]
        steps: list[Step] = []
        for step in layer.attention:
            if isinstance(step, Compute) and step.op == "attention":
                steps.append(patch_attention(step, split.padded_tokens, kv_tokens,
                                             split.heads[index], spec.head_dim,
                                             options.dtype_bytes, split.batch))
            elif u == 1 and isinstance(step, Exchange | Wait):
                continue  # one rank holds every head: nothing to exchange
            else:
                steps.append(step)
        layer = replace(layer, attention=tuple(steps))
        if patches > 1:  # a pipelined step's patch (a warm-up layer keeps its split's count)
            layer = scale_layer_host_ops(layer, host_scale)
        layers.append(relabel_layer(layer, members.ranks))
    return tuple(layers)


def pipelined_host_scale(spec: ModelSpec, ulysses: int) -> float:
    """A pipelined step's patch layer's dispatched ops over what its stage's Ulysses plan
    charges (diffusers' blocks on a one-rank stage, the runtime's processors on a Ulysses
    group): every layout pays the ops its rank dispatches (:func:`cocodiff.cost.
    host_ops_per_launch`); 1 where the family's pipelined ops are not counted."""
    pipelined = kn.pipeline_dispatched_ops_per_layer(spec, ulysses)
    charged = kn.dispatched_ops_per_layer(spec, ulysses=ulysses)
    return pipelined / charged if pipelined and charged else 1.0


def plan_pipefusion(spec: ModelSpec, grid: RankGrid, stream_tokens: Sequence[int],
                    pipeline: PipelineLayout, options: PlanOptions = DEFAULT_OPTIONS, *,
                    patches: int | None = None, ring_from: int | None = None,
                    ring_to: bool = True, inner: str = "flat") -> Plan:
    """One denoising step of PipeFusion on every rank of ``grid``.

    Args:
        spec: the model.
        grid: the ranks, stage-major (stage ``p // ulysses`` at grid position ``p``).
        stream_tokens: tokens of each stream of one sample (image, joint text).
        pipeline: the layout.
        options: dtype and batch (``chunks`` applies to a phased stage schedule).
        patches: patches this step streams (default ``pipeline.patches``; 1: a
            synchronous step).
        ring_from: messages stage 0 receives from the last stage for this step's input
            (0: none, the first step; 1: the whole latent, after a synchronous step;
            ``patches``: one per patch, after a pipelined step). Default ``patches``.
        ring_to: the last stage sends its output to stage 0 (False on the last step).
        inner: the Ulysses schedule each stage's group runs (:data:`STAGE_SCHEDULES`).

    Raises:
        LayoutError: the layout does not fit the ranks, heads or layers.
        ScheduleError: an unknown stage schedule, or a ``ring_from`` that no previous
            step sends.
    """
    pipeline.check(grid.num_ranks, spec.num_heads, spec.num_layers)
    if inner not in STAGE_SCHEDULES:
        raise ScheduleError(f"pipefusion stages run one of {', '.join(STAGE_SCHEDULES)}, "
                            f"not {inner!r}")
    patches = pipeline.patches if patches is None else patches
    ring_from = patches if ring_from is None else ring_from
    if ring_from not in (0, 1, patches):
        raise ScheduleError(f"stage 0 receives 0, 1 or {patches} messages per step, not "
                            f"{ring_from}")
    n, u = pipeline.stages, pipeline.ulysses
    image, text = split_streams(spec, stream_tokens)
    per_patch = patch_tokens(image, patches, u)
    hidden_bytes = spec.hidden_size * options.dtype_bytes * options.batch
    latent_bytes = (spec.output_channels or spec.hidden_size) * options.dtype_bytes \
        * options.batch
    text_local = -(-text // u)
    patch_local = per_patch // u
    bounds = pipeline.stage_layers(spec.num_layers)
    programs: list[RankProgram | None] = [None] * grid.num_ranks
    kinds = layer_kinds(spec)
    for stage in range(n):
        # Each distinct kind of the stage's layers, planned once.
        own = kinds[bounds[stage]:bounds[stage + 1]]
        planned = {kind: _stage_layer(spec, grid, stream_tokens, pipeline, patches, inner,
                                      options, stage, kind) for kind in own}
        for index, position in enumerate(pipeline.stage_group(stage)):
            rank = grid.ranks[position]
            prev_rank = grid.ranks[pipeline.stage_group((stage - 1) % n)[index]]
            next_rank = grid.ranks[pipeline.stage_group((stage + 1) % n)[index]]
            # Messages in: (bytes, the patch before which it must have arrived).
            if stage > 0:
                inputs = [(patch_local * hidden_bytes + (text_local * hidden_bytes
                                                         if m == 0 else 0), m)
                          for m in range(patches)]
            elif n == 1 or ring_from == 0:
                inputs = []
            elif ring_from == patches:
                # Overlapping steps: patch m waits for patch m of the step before only;
                # else the whole latent is back before the first patch starts.
                inputs = [(patch_local * latent_bytes, m if pipeline.overlap else 0)
                          for m in range(patches)]
            else:  # the whole latent of a synchronous step
                inputs = [(patches * patch_local * latent_bytes, 0)]
            last = stage == n - 1
            sends = not last or (ring_to and n > 1)
            out_bytes = [((text_local * hidden_bytes if m == 0 and not last else 0)
                          + patch_local * (latent_bytes if last else hidden_bytes))
                         for m in range(patches)]
            # Without overlap the last stage's ring sends follow its last patch (the
            # runtime sends the latents after the transformer's output projection).
            sends_late = last and not pipeline.overlap
            parts: list[LayerPlan] = []
            pending = list(inputs)
            if pending:
                parts.append(_glue(transfer(prev_rank, rank, pending[0][0], rank)))
            for m in range(patches):
                while pending and pending[0][1] == m:
                    pending.pop(0)
                    # Post the next receive before computing: it starts as soon as the
                    # sender posts its side.
                    parts.append(_glue(Wait("recv"), *(
                        (transfer(prev_rank, rank, pending[0][0], rank),) if pending else ())))
                parts += [planned[kind][index] for kind in own]
                if sends and not sends_late:
                    parts.append(_glue(*((Wait("send"),) if m > 0 else ()),
                                       transfer(rank, next_rank, out_bytes[m], rank)))
            if sends and sends_late:
                parts += [_glue(*((Wait("send"),) if m > 0 else ()),
                                transfer(rank, next_rank, out_bytes[m], rank))
                          for m in range(patches)]
            if sends:
                parts.append(_glue(Wait("send")))
            programs[rank] = RankProgram(rank, tuple(parts))
    split = head_split(spec, u, (per_patch, text), options.batch)
    return Plan("pipefusion", spec.name, split, tuple(programs),  # type: ignore[arg-type]
                None, None, replace(pipeline, patches=patches))


def _glue(*steps: Step) -> LayerPlan:
    """Transfers and waits between a stage's layers, as a plan layer of their own (the
    executor runs a program's layers in order; the model's layers stay shared objects,
    written once in a plan file)."""
    return LayerPlan((), steps, ())


def pipefusion_step_plans(spec: ModelSpec, grid: RankGrid, stream_tokens: Sequence[int],
                          pipeline: PipelineLayout, num_steps: int,
                          options: PlanOptions = DEFAULT_OPTIONS, inner: str = "flat"
                          ) -> tuple[tuple[Plan, ...], tuple[int, ...]]:
    """The distinct plans of a generation of ``num_steps`` steps and, for each step, its
    plan's index: ``warmup`` synchronous steps, then pipelined ones; each step's input
    as the step before sent it, the last step sending nothing back."""
    if num_steps < 1:
        raise ScheduleError(f"a generation needs at least one step, got {num_steps}")
    keys: dict[tuple[int, int, bool], int] = {}
    plans: list[Plan] = []
    step_plans: list[int] = []
    previous = 0
    for step in range(num_steps):
        patches = 1 if step < pipeline.warmup else pipeline.patches
        key = (patches, previous, step < num_steps - 1)
        if key not in keys:
            keys[key] = len(plans)
            plans.append(plan_pipefusion(spec, grid, stream_tokens, pipeline, options,
                                         patches=patches, ring_from=previous,
                                         ring_to=key[2], inner=inner))
        step_plans.append(keys[key])
        previous = patches
    return tuple(plans), tuple(step_plans)


def generation_plan(plans: Sequence[Plan], step_plans: Sequence[int]) -> Plan:
    """One plan whose programs run the given steps' programs back to back (a pipeline's
    steps depend on each other: the simulator runs them as one program per rank)."""
    first = plans[step_plans[0]]
    programs = tuple(
        RankProgram(rank, tuple(layer for index in step_plans
                                for layer in plans[index].program(rank).layers))
        for rank in range(first.num_ranks))
    return replace(first, programs=programs, shift_period=None)
