"""PipeFusion on an unmodified diffusers model: each rank runs only its stage's blocks.

The run plan is PipeFusion's (:func:`~cocodiff.schedules.run_plan.build_run_plan` with a
:class:`~cocodiff.layout.PipelineLayout`, the plan ``cocodiff plan`` writes and
``cocodiff simulate`` executes). A rank's program of a step is its stage's layers with
the stage-to-stage transfers between them as plan layers of their own ("glue": p2p
exchanges and waits); the shared executor runs both:

* a model layer's attention steps run in the block's attention processor, as under
  Ulysses (:class:`~cocodiff.runtime.hooks.UlyssesAttnProcessor`; the stage's ranks are
  its Ulysses group);
* glue layers run where the model reaches them: before the stage's first block (the
  receive of the previous stage's output), after its last block (the send), and, on the
  last stage, after the whole transformer (the send of its output back to stage 0, the
  pipeline's ring across steps).

Blocks of the other stages are replaced by stand-ins that hold no weights (that is the
memory PipeFusion saves) and return the block output the pipeline carries: what the
previous stage sent before the stage, what the stage's last block gave after it. The
model's own code between blocks runs unchanged.

Stage 0 and the last stage end each step with the transformer's true output: the last
stage computed it, stage 0 receives it through the plan's ring transfer (the plan calls
it the latents; it is the transformer output, which both then feed to the same scheduler
step, so their latents stay equal). The last step sends nothing back in the plan; its
output reaches stage 0 by one transfer outside the plan (``returned_bytes``), so that
rank 0 writes the result. Middle stages' latents are not the run's.

Pipelined steps (after the warm-up) stream the M patches through the stages as xDiT's
PipeFusion does: the stage's first block runs all the stage's blocks on each patch in
turn (:meth:`PipelineRuntime.run_stage`), receiving the patch before and sending it
after, so stage s+1 computes patch m while stage s computes patch m+1. A patch of a
stage rank is a contiguous slice of that rank's image tokens (xDiT's
``pp_patches_token_start_idx_local``): with Ulysses U inside the stage, patch m is the
m-th slice of each of the U shards. Each of the rank's attention layers keeps a K/V
buffer over the whole image (its heads, after the Ulysses exchange): a synchronous step
writes all of it, a patch overwrites its own slice; the patch's queries attend to the
buffer, so patches already computed this step are fresh and the later ones are the
step before's (xDiT's ``CacheManager``, updated in place). The joint text (FLUX, SD3) is
not buffered: as in xDiT's FLUX processor its K/V are computed fresh with every patch
(the text's hidden states go through the stage's blocks with each patch), and the text
reaching stage s+1 is stage s's output with patch 0, used for all its patches (xDiT
sends ``encoder_hidden_states`` once per step, with patch 0). Why: the text is short
and every patch's image queries need all of it; keeping it whole and fresh costs one
text-length of recomputation per patch and no stale text.

The ring across steps runs in the plan's order: the last stage sends its M patch
outputs after the transformer's output projection (which diffusers runs once, on the
whole sequence), and stage 0 receives all of them before its next step's first patch,
because the unmodified pipeline runs the scheduler on the whole latents between two
transformer calls. So the pipeline fills and drains every step, and the plan says so
(:class:`~cocodiff.layout.PipelineLayout`'s ``overlap`` False, the default: ``run``,
``simulate --plan`` and ``plan --out`` describe the same dependencies). xDiT's engine
steps the scheduler per patch, so its steps overlap and the pipeline fills once per
generation: ``cocodiff plan --pipefusion-overlap`` simulates that order, and this runtime
refuses such a plan (it cannot execute it without forking diffusers' loop).
``tests/workers/pipefusion_reference.py`` holds the same algorithm in one process,
serially: the reference the parallel runs are checked against (equal within 1e-5 in
float32).
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from cocodiff.layout import PipelineLayout
from cocodiff.plan.executor import PlanError, drive_blocking, run_layer, run_steps
from cocodiff.plan.steps import Compute, Exchange, LayerPlan, Step, Wait
from cocodiff.runtime.backend import StepRecord, TensorBackend, TimedHandle
from cocodiff.runtime.families.base import module_matches
from cocodiff.runtime.hooks import UnsupportedModelError, install_processors, install_splits
from cocodiff.runtime.parallel import UlyssesRuntime, family_of
from cocodiff.schedules import PlanOptions, RankGrid
from cocodiff.schedules.pipefusion import STAGE_SCHEDULES
from cocodiff.schedules.run_plan import (
    Generation,
    RunPlan,
    build_run_plan,
    check_plan_fits_call,
    check_same_shape,
)
from cocodiff.util.errors import ScheduleError
from transports.base import Group, Handle, Transport

# What a transformer block returns, by transformer class: the names of the block's
# arguments whose (updated) values it returns, in order (a tuple when more than one).
# They are what travels from stage to stage.
BLOCK_OUTPUTS: dict[str, tuple[str, ...]] = {
    "FluxTransformer2DModel": ("encoder_hidden_states", "hidden_states"),
    "SD3Transformer2DModel": ("encoder_hidden_states", "hidden_states"),
    "PixArtTransformer2DModel": ("hidden_states",),
}

# Block arguments whose rows are the call's tokens, [text, image] in that order (FLUX's
# rotary embedding, a (cos, sin) pair): a patch's block call gets the text rows and its
# own image rows. Others are per sample (temb) or the whole cross-attention text.
TOKEN_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "FluxTransformer2DModel": ("image_rotary_emb",),
    "SD3Transformer2DModel": (),
    "PixArtTransformer2DModel": (),
}


def patch_rows(value: Any, text_tokens: int, start: int, stop: int) -> Any:
    """Rows ``[:text_tokens]`` and ``text_tokens + start .. text_tokens + stop`` of a
    per-token block argument (a tensor or a tuple of them, tokens in dim 0), or
    ``value`` unchanged when it is None."""
    if value is None:
        return None
    if isinstance(value, tuple | list):
        return type(value)(patch_rows(part, text_tokens, start, stop) for part in value)
    return torch.cat([value[:text_tokens], value[text_tokens + start:text_tokens + stop]])


def check_patches(image_tokens: int, ulysses: int, patches: int) -> None:
    """Each of the stage's ``ulysses`` shards of the image cuts into ``patches`` equal
    slices (the runtime does not pad patches).

    Raises:
        ScheduleError: it does not.
    """
    if image_tokens % (ulysses * patches):
        raise ScheduleError(f"{image_tokens} image tokens do not cut into {patches} patches "
                            f"on each of {ulysses} Ulysses rank(s): pipelined pipefusion "
                            f"steps need the image tokens to be a multiple of "
                            f"{ulysses * patches} (change --resolution, --patches or --pipefusion)")


def _is_glue(layer: LayerPlan) -> bool:
    """A plan layer of transfers and waits only (no model layer)."""
    return not any(isinstance(step, Compute) for step in layer.steps)


def _without(layer: LayerPlan, tensor: str) -> LayerPlan:
    """A glue layer without its transfers of ``tensor`` ("send" or "recv") and their waits."""
    return LayerPlan((), tuple(step for step in layer.steps
                               if not (isinstance(step, Exchange | Wait)
                                       and step.tensor == tensor)), ())


def _only(layers: tuple[LayerPlan, ...], tensor: str) -> tuple[Step, ...]:
    """The glue layers' transfers of ``tensor`` and their waits, in program order."""
    return tuple(step for layer in layers if _is_glue(layer) for step in layer.steps
                 if isinstance(step, Exchange | Wait) and step.tensor == tensor)


def _flatten(value: Any) -> torch.Tensor:
    """A block output (tensor or tuple of tensors) as one flat tensor."""
    tensors = [value] if isinstance(value, torch.Tensor) else list(value)
    return torch.cat([tensor.reshape(-1) for tensor in tensors])


def _unflatten(flat: torch.Tensor, like: Any) -> Any:
    """``flat`` cut into tensors shaped as ``like``'s (a tensor or tuple of tensors)."""
    tensors = [like] if isinstance(like, torch.Tensor) else list(like)
    if flat.numel() != sum(t.numel() for t in tensors):
        raise PlanError(f"received {flat.numel()} values, the block carries "
                        f"{sum(t.numel() for t in tensors)}")
    parts = flat.split([t.numel() for t in tensors])
    shaped = tuple(part.view(t.shape).to(t.dtype) for part, t in zip(parts, tensors, strict=True))
    return shaped[0] if isinstance(like, torch.Tensor) else shaped


class PipelineRuntime(UlyssesRuntime):
    """:class:`UlyssesRuntime` for a PipeFusion layout: this rank's stage, its program's
    position, and what the pipeline carries between blocks."""

    def __init__(self, transformer: torch.nn.Module, transport: Transport, family: Any,
                 pipeline: PipelineLayout, grid: RankGrid | None = None,
                 options: PlanOptions | None = None, run_plan: RunPlan | None = None,
                 generation: Generation | None = None, inner: str = "flat") -> None:
        self.pipeline = pipeline
        in_file = [plan.pipeline for plan in run_plan.plans] if run_plan is not None else []
        if any(layout is not None and layout.overlap for layout in (pipeline, *in_file)):
            raise ScheduleError("pipefusion with overlapping steps (xDiT's per-patch "
                                "scheduler step) does not run on diffusers' loop, which "
                                "fills and drains the pipeline every step; simulate it only")
        if inner not in STAGE_SCHEDULES:
            raise ScheduleError(f"pipefusion stages run one of {', '.join(STAGE_SCHEDULES)}, "
                                f"not {inner!r}")
        # The stage's Ulysses schedule drives the attention calls; the plans are
        # PipeFusion's (built here or read from the file, checked below).
        super().__init__(transformer, transport, family, inner, grid, options, None, generation)
        self.schedule = "pipefusion"
        self.inner = inner
        pipeline.check(transport.world_size, self.spec.num_heads, self.spec.num_layers)
        if type(transformer).__name__ not in BLOCK_OUTPUTS:
            raise UnsupportedModelError(
                f"pipefusion runs {', '.join(sorted(BLOCK_OUTPUTS))}, not "
                f"{type(transformer).__name__}")
        if run_plan is not None:
            if run_plan.schedule != "pipefusion":
                raise ScheduleError(f"the plan's schedule is {run_plan.schedule}, not pipefusion")
            check_same_shape(run_plan.spec, self.spec, "the plan")
            planned = run_plan.plans[0].pipeline
            if planned is None or (planned.stages, planned.ulysses) != (pipeline.stages,
                                                                        pipeline.ulysses):
                raise ScheduleError(f"the plan's pipeline is "
                                    f"{planned.name if planned else 'none'}, the run's "
                                    f"{pipeline.name}")
            self.grid = run_plan.grid
        self.plan_file = run_plan
        self._follow_file = run_plan is not None
        u = pipeline.ulysses
        position = self.grid.position(transport.rank)
        self.stage, self.stage_index = pipeline.stage_of(position), position % u
        bounds = pipeline.stage_layers(self.spec.num_layers)
        self.own_layers = range(bounds[self.stage], bounds[self.stage + 1])
        self.is_first = self.stage == 0
        self.is_last = self.stage == pipeline.stages - 1
        # new_group is collective over the world: every rank makes every group, in order.
        stages = [tuple(self.grid.ranks[p] for p in pipeline.stage_group(s))
                  for s in range(pipeline.stages)]
        # The last stage's rank i returns the last step's output to stage 0's rank i
        # over the pair the plan's ring transfers use.
        returns = ([(stages[-1][i], stages[0][i]) for i in range(u)]
                   if pipeline.stages > 1 else [])
        for ranks in sorted({*stages, *returns}):
            if ranks not in self._groups:
                self._groups[ranks] = transport.new_group(ranks)
        self._stage_group = self._groups[stages[self.stage]]
        self._return_pair = returns[self.stage_index] if returns else None
        # The program's position: which step's program, which layer next.
        self._at_step = -1
        self._cursor = 0
        self._entered = -2  # the runtime's step of the last call that entered the blocks
        self._prefetched = False
        self._in_flight: dict = {}
        # The current forward call's activations dtype and device.
        self._dtype: torch.dtype = torch.float32
        self._device: torch.device = torch.device("cpu")
        # The block output the pipeline carries; what the next sends send (in order);
        # what the receives delivered and nobody took yet (flat, in order).
        self.payload: Any = None
        self.outgoing: list[torch.Tensor] = []
        self.received: list[torch.Tensor] = []
        # Whether this call's step streams patches, and the patch being computed (None:
        # the whole sequence).
        self.pipelined = False
        self.keep_buffers = False
        self.patches = 1
        self.patch: int | None = None
        # Each own attention layer's K/V buffer over the whole image, (B, S, h, D) each,
        # in the model's token order: what a patch's queries attend to.
        self.kv_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Run every step synchronously (the exact reference of a lossy run): plans are
        # built with the warm-up covering every step, a plan file set aside.
        self.exact = False
        # Each step's program as this rank runs it (see _programs).
        self._programs: dict[int, tuple[tuple[LayerPlan, ...], tuple[Step, ...]]] = {}
        # Bytes this rank sent that the plan does not carry (the simulator does not
        # charge them): the last step's output returned to stage 0. (The output gathers
        # inside each stage's Ulysses group are counted by tier, as the simulator
        # charges them: cocodiff.schedules.gather.stage_gather.)
        self.unplanned_bytes = 0

    # -- the Ulysses runtime's hooks --------------------------------------------------

    def ulysses_ranks(self, transport: Transport) -> int:
        return self.pipeline.ulysses

    @property
    def sequence_index(self) -> int:
        return self.stage_index

    @property
    def sequence_group(self) -> Group:
        return self._stage_group

    @property
    def backend_type(self) -> type[TensorBackend]:
        return PatchBackend

    def start_generation(self, num_steps: int) -> None:
        super().start_generation(num_steps)
        self._entered = -2  # the next call starts a program, even at the same step
        self._prefetched = False
        self.kv_buffers.clear()

    # -- plans and the program's position ---------------------------------------------

    def _plan_step(self) -> int:
        """The current forward call's step in the run plan (a call outside a generation
        runs the one step of a one-step plan)."""
        return self.step if self.num_steps is not None else 0

    def enter(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        """The forward call reached the blocks: make (or take) the run plan, move to this
        step's program, and run the glue up to the stage's next layer."""
        self._dtype, self._device = dtype, device
        streams = self.family.ops.streams
        stream_tokens = tuple(self.shards[name].total for name in streams)
        dtype_name = str(dtype).removeprefix("torch.")
        key = (stream_tokens, batch, dtype_name, self.num_steps, self.exact)
        run_plan = self._run_plans.get(key)
        if run_plan is None:
            if self._follow_file and not self.exact:
                assert self.plan_file is not None
                check_plan_fits_call(self.plan_file, stream_tokens, batch, dtype_name,
                                     self.num_steps)
                run_plan = self.plan_file
            else:
                options = PlanOptions(dtype=dtype_name, batch=batch, chunks=self.options.chunks)
                steps = self.num_steps or 1
                pipeline = (replace(self.pipeline, warmup=max(steps, self.pipeline.warmup))
                            if self.exact else self.pipeline)
                run_plan = build_run_plan("pipefusion", self.spec, self.grid, stream_tokens,
                                          steps, options, pipeline=pipeline, **self._size())
            for plan in run_plan.plans:
                if plan.pipeline is not None and plan.pipeline.patches > 1:
                    check_patches(self.shards["image"].total, self.pipeline.ulysses,
                                  plan.pipeline.patches)
            for plan in run_plan.plans:
                self._create_groups(plan)
            self._run_plans[key] = run_plan
        step = self._plan_step()
        if self._entered != self.step or self.run_plan is not run_plan:
            # A new forward call: stage 0 may have started its program already (the ring
            # receive that ended the previous call).
            if not (self._prefetched and self.run_plan is run_plan and self._at_step == step):
                self._check_done()
                self.run_plan, self._at_step, self._cursor = run_plan, step, 0
                self._programs.clear()
                if self.is_first:  # the last stage's ring runs at the output (at_output)
                    self._run_ring(self._programs_at(step)[1])
            self._prefetched = False
            self._entered = self.step
        self.plan = run_plan.plan_at(step)
        # A run with no pipelined step keeps no K/V buffers.
        self.keep_buffers = any(plan.pipeline is not None and plan.pipeline.patches > 1
                                for plan in run_plan.plans)
        planned = self.plan.pipeline
        self.patches = planned.patches if planned is not None else 1
        self.pipelined = self.patches > 1
        self.run_glue(cross=False)

    def _programs_at(self, step: int) -> tuple[tuple[LayerPlan, ...], tuple[Step, ...]]:
        """Step ``step``'s program as this rank runs it, and its ring transfers.

        The ring (last stage -> stage 0) runs apart from the program: stage 0 takes all
        its receives (and their waits) before the step's first layer, the last stage
        makes all its sends after the transformer's output projection, where the plan
        (without overlapping steps) has them too. In between, the glue layers run
        without them, in the plan's order.
        """
        cached = self._programs.get(step)
        if cached is None:
            assert self.run_plan is not None
            layers = self.run_plan.plan_at(step).program(self.transport.rank).layers
            ring = ("recv" if self.is_first else "send"
                    if self.is_last else None) if self.pipeline.stages > 1 else None
            if ring is None:
                cached = (layers, ())
            else:
                cached = (tuple(_without(layer, ring) if _is_glue(layer) else layer
                                for layer in layers), _only(layers, ring))
            self._programs[step] = cached
        return cached

    def _run_ring(self, steps: tuple[Step, ...]) -> None:
        if steps:
            drive_blocking(run_steps(steps, PointToPointBackend(self), self._in_flight))

    def _layers(self) -> tuple[LayerPlan, ...]:
        return self._programs_at(self._at_step)[0]

    def _check_done(self) -> None:
        """The previous call ran its program to the end (a start_generation between
        generations leaves nothing in flight either)."""
        if self.run_plan is None:
            return
        if self._cursor < len(self._layers()) or self._in_flight:
            raise PlanError(f"rank {self.transport.rank}: step {self._at_step + 1}'s program "
                            f"stopped at layer {self._cursor} of {len(self._layers())}")

    def run_glue(self, cross: bool) -> None:
        """Run the program's glue layers up to its next model layer; with ``cross``, on
        into the next step's program when this one ends (stage 0 takes the last stage's
        output of this step from the start of the next step's program)."""
        backend = PointToPointBackend(self)
        while True:
            layers = self._layers()
            while self._cursor < len(layers) and _is_glue(layers[self._cursor]):
                drive_blocking(run_layer(layers[self._cursor], backend, self._in_flight))
                self._cursor += 1
            assert self.run_plan is not None
            if (self._cursor < len(layers) or not cross
                    or self._at_step + 1 >= self.run_plan.num_steps):
                return
            self._at_step, self._cursor = self._at_step + 1, 0
            self._programs = {step: program for step, program in self._programs.items()
                              if step >= self._at_step}
            self._run_ring(self._programs_at(self._at_step)[1])
            self._prefetched = True

    def layer_plan(self, layer_index: int, streams: tuple[str, ...], batch: int,
                   dtype: torch.dtype) -> LayerPlan:
        if layer_index not in self.own_layers:
            raise PlanError(f"rank {self.transport.rank} (stage {self.stage}) was asked for "
                            f"layer {layer_index}, outside its layers {self.own_layers.start}.."
                            f"{self.own_layers.stop - 1}")
        self.run_glue(cross=False)
        layers = self._layers()
        if self._cursor >= len(layers):
            raise PlanError(f"rank {self.transport.rank}: the plan has no layer left for "
                            f"layer {layer_index}")
        layer = layers[self._cursor]
        self._cursor += 1
        return layer

    def take_received(self) -> torch.Tensor:
        """The oldest message received and not yet taken."""
        if not self.received:
            raise PlanError(f"rank {self.transport.rank}: stage {self.stage} received "
                            "nothing before its layers")
        return self.received.pop(0)

    def run_stage(self, blocks: list[torch.nn.Module], arguments: dict[str, Any]) -> Any:
        """A pipelined step of this stage: each patch through the stage's ``blocks``
        (received from the stage before, sent to the stage after, as the plan's glue
        says), called with the first block's ``arguments``. Returns the stage's output
        over the rank's whole sequence: the image patches' outputs in order and, for a
        joint model, the text as patch 0 left it (what the next stage gets)."""
        outputs = BLOCK_OUTPUTS[type(self.transformer).__name__]
        joint = len(outputs) == 2
        hidden = arguments["hidden_states"]
        text_in = arguments.get("encoder_hidden_states") if joint else None
        text_tokens = text_in.shape[1] if text_in is not None else 0
        per_patch = hidden.shape[1] // self.patches
        token_arguments = TOKEN_ARGUMENTS[type(self.transformer).__name__]
        images: list[torch.Tensor] = []
        text_out = None
        for m in range(self.patches):
            start, stop = m * per_patch, (m + 1) * per_patch
            self.run_glue(cross=False)  # the receive of patch m (after stage 0)
            if self.is_first:
                image = hidden[:, start:stop]
            elif joint and m == 0:
                # (B, t, D) text and (B, p, D) patch, as the stage before flattened them
                text_in, image = _unflatten(self.take_received(),
                                            (text_in, hidden[:, start:stop]))
            else:
                image = _unflatten(self.take_received(), hidden[:, start:stop])
            call = dict(arguments, hidden_states=image)
            if joint:
                call["encoder_hidden_states"] = text_in
            for name in token_arguments:
                call[name] = patch_rows(call.get(name), text_tokens, start, stop)
            self.patch = m
            try:
                for block in blocks:
                    out = block(**call)
                    if joint:
                        call["encoder_hidden_states"], call["hidden_states"] = out
                    else:
                        call["hidden_states"] = out
            finally:
                self.patch = None
            images.append(call["hidden_states"])
            if m == 0 and joint:
                text_out = call["encoder_hidden_states"]
            if not self.is_last:
                self.outgoing.append(_flatten((text_out, images[-1]) if joint and m == 0
                                              else images[-1]))
                self.run_glue(cross=False)  # the send of patch m
        image_out = torch.cat(images, dim=1)
        return (text_out, image_out) if joint else image_out

    def is_last_step(self) -> bool:
        return self.num_steps is None or self.step >= self.num_steps - 1

    def return_output(self, output: torch.Tensor | None) -> torch.Tensor | None:
        """The last step's output, last stage -> stage 0 (outside the plan): the sender
        gives its output and gets it back, the receiver gets the sender's."""
        if self._return_pair is None or not (self.is_first or self.is_last):
            return output
        group = self.group(self._return_pair)
        if self.is_last:
            assert output is not None
            flat = output.contiguous().reshape(1, -1)
            self.unplanned_bytes += flat.numel() * flat.element_size()
            TimedHandle(self.transport.all_to_all(flat, (0, 1), (0, 0), group), self).wait()
            return output
        assert output is not None
        empty = output.new_empty((0, output.numel()))
        received = TimedHandle(self.transport.all_to_all(empty, (0, 0), (1, 0), group),
                               self).wait()
        return received.reshape(output.shape)


class PointToPointBackend:
    """The executor's backend for glue layers: a p2p exchange sends the runtime's
    ``outgoing`` tensor or receives into ``received``; nothing else is a glue step."""

    def __init__(self, runtime: PipelineRuntime) -> None:
        self.runtime = runtime

    def compute(self, step: Compute) -> Handle:
        raise PlanError(f"a compute step ({step.op}) between a stage's layers")

    def progress(self) -> None:
        return None

    def start_exchange(self, step: Exchange, early: frozenset[int] = frozenset()) -> Handle:
        runtime = self.runtime
        if step.direction != "p2p":
            raise PlanError(f"a {step.direction} exchange between a stage's layers")
        group = runtime.group(step.group)
        element_bytes = torch.empty((), dtype=runtime._dtype).element_size()
        if step.tensor == "send":
            if not runtime.outgoing:
                raise PlanError(f"rank {runtime.transport.rank}: a send with nothing to send")
            send = runtime.outgoing.pop(0).reshape(1, -1)
            num_bytes = send.numel() * send.element_size()
            if num_bytes != step.row_bytes:
                raise PlanError(f"the plan sends {step.row_bytes} B from rank {step.group[0]} "
                                f"to {step.group[1]}, the model has {num_bytes} B")
            runtime.count_sent(runtime.tier_to(step.group[1]), num_bytes)
        else:
            send = torch.empty((0, step.row_bytes // element_bytes), dtype=runtime._dtype,
                               device=runtime._device)
            num_bytes = 0
        # A transfer is one exchange, counted by its sender (as the simulator counts it).
        runtime.exchanges_started += step.tensor == "send"
        if runtime.records is not None:
            runtime.records.append(StepRecord("exchange", step.tensor, num_bytes))
        return TimedHandle(runtime.transport.all_to_all(send, step.send_rows, step.recv_rows,
                                                        group), runtime)

    def finish_exchange(self, step: Exchange, received: Any) -> None:
        if step.tensor == "recv":
            self.runtime.received.append(received.reshape(-1))


class PatchBackend(TensorBackend):
    """The attention of a PipeFusion stage: over the whole sequence in a synchronous
    step, writing the image's K/V into the layer's buffer; a patch's queries against the
    buffer (its own slice written first) and the fresh text in a pipelined one."""

    def _attention(self) -> None:
        runtime = self.runtime
        assert isinstance(runtime, PipelineRuntime)
        if runtime.patch is None:
            super()._attention()
            if not runtime.keep_buffers:
                return
            # The image's K/V in the model's order: a later pipelined step's buffer.
            positions = runtime.original_positions(self.ops.streams,
                                                   self.state.tensors["k"].device)
            before = sum(runtime.shards[name].total for name in
                         self.ops.streams[:self.ops.streams.index("image")])
            image = positions[before:before + runtime.shards["image"].total]
            runtime.kv_buffers[self.layer_index] = tuple(  # type: ignore[assignment]
                self.state.tensors[name].index_select(1, image) for name in ("k", "v"))
            return
        self._patch_attention(runtime, runtime.patch)

    def _patch_attention(self, runtime: PipelineRuntime, patch: int) -> None:
        tensors = self.state.tensors
        if self.layer_index not in runtime.kv_buffers:
            raise PlanError(f"layer {self.layer_index}: a pipelined step before any "
                            "synchronous one (the K/V buffer is empty): give --warmup 1 "
                            "or more")
        buffer_k, buffer_v = runtime.kv_buffers[self.layer_index]
        device = tensors["q"].device
        u = runtime.sequence_group.size
        image_total = runtime.shards["image"].total
        shard = image_total // u  # check_patches: exact
        per_patch = shard // runtime.patches
        widths = {"image": per_patch, "text": runtime.shards["text"].chunk
                  if "text" in self.ops.streams else 0}
        local = sum(widths[name] for name in self.ops.streams)
        # After the exchange, rank r's local sequence sits at r * local: its streams'
        # rows in the model's order (the text's chunk, the patch's rows).
        gathered: dict[str, torch.Tensor] = {}
        offset = 0
        for name in self.ops.streams:
            if name == "text":
                tokens = torch.arange(runtime.shards["text"].total)
                chunk = widths["text"]
                gathered["text"] = (tokens // chunk) * local + offset + tokens % chunk
            else:
                rows = torch.arange(per_patch)
                gathered["image"] = (torch.arange(u)[:, None] * local + offset
                                     + rows[None]).reshape(-1)
            offset += widths[name]
        # The patch's rows of the whole image: the patch-th slice of every rank's shard.
        image_rows = (torch.arange(u)[:, None] * shard + patch * per_patch
                      + torch.arange(per_patch)[None]).reshape(-1).to(device)
        picked = {name: index.to(device) for name, index in gathered.items()}
        # Fresh K/V of the patch into the buffer (in place: the later patches of this
        # step see it, as xDiT's cache does).
        buffer_k[:, image_rows] = tensors["k"].index_select(1, picked["image"])
        buffer_v[:, image_rows] = tensors["v"].index_select(1, picked["image"])
        keys = {"image": (buffer_k, buffer_v)}
        if "text" in picked:
            keys["text"] = (tensors["k"].index_select(1, picked["text"]),
                            tensors["v"].index_select(1, picked["text"]))
        # (B, q, h, D) queries of the call's real tokens against (B, S, h, D) keys of
        # the whole sequence, both in the model's stream order.
        queries = torch.cat([picked[name] for name in self.ops.streams])
        k = torch.cat([keys[name][0] for name in self.ops.streams], dim=1)
        v = torch.cat([keys[name][1] for name in self.ops.streams], dim=1)
        stream_tokens = tuple(runtime.shards[name].total for name in self.ops.streams)
        mask = self.ops.attention_mask(self.state, stream_tokens)
        out = dispatch_attention_fn(tensors["q"].index_select(1, queries), k, v,
                                    attn_mask=mask)
        result = out.new_zeros(tensors["q"].shape)
        result[:, queries] = out
        tensors["out"] = result


class _StandIn(torch.nn.Module):
    """A block of another stage: no weights; returns what the pipeline carries."""

    def __init__(self, runtime: PipelineRuntime, signature: inspect.Signature,
                 outputs: tuple[str, ...]) -> None:
        super().__init__()
        self._runtime = [runtime]  # a list: not a submodule
        self._signature = signature
        self._outputs = outputs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runtime = self._runtime[0]
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        like = tuple(bound[name] for name in self._outputs)
        like_value = like[0] if len(like) == 1 else like
        if runtime.payload is None:  # the first block of the forward call
            hidden = bound["hidden_states"]
            runtime.enter(hidden.shape[0], hidden.dtype, hidden.device)
            if runtime.pipelined:
                # The stage receives patch by patch (run_stage); until then the blocks
                # carry their inputs' shapes.
                runtime.payload = like_value
            else:
                runtime.payload = _unflatten(runtime.take_received(), like_value)
        return runtime.payload


class _OwnBlock(torch.nn.Module):
    """A block of this rank's stage. In a synchronous step it runs as it is (the first
    of stage 0 enters the program, the last sends the stage's output); in a pipelined
    one the first runs the whole stage patch by patch and the others pass its output
    on."""

    def __init__(self, runtime: PipelineRuntime, block: torch.nn.Module, index: int,
                 stage_blocks: list[torch.nn.Module]) -> None:
        super().__init__()
        self.block = block
        self._runtime = [runtime]
        self._index = index
        self._stage_blocks = stage_blocks  # a plain list: the blocks are submodules here
        self._signature = inspect.signature(block.forward)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runtime = self._runtime[0]
        own = runtime.own_layers
        first, last = self._index == own.start, self._index == own.stop - 1
        if first and runtime.is_first:
            hidden = self._signature.bind_partial(*args, **kwargs).arguments["hidden_states"]
            runtime.enter(hidden.shape[0], hidden.dtype, hidden.device)
        if runtime.pipelined:
            if first:
                arguments = self._signature.bind_partial(*args, **kwargs).arguments
                runtime.payload = runtime.run_stage(self._stage_blocks, dict(arguments))
            return runtime.payload
        output = self.block(*args, **kwargs)
        if last and not runtime.is_last:
            runtime.payload = output
            runtime.outgoing.append(_flatten(output))
            runtime.run_glue(cross=False)
        return output


def _blocks(transformer: torch.nn.Module, pattern: str | None) -> list[str]:
    """The transformer's blocks in layer order: the parents of the attention modules the
    processors replace (one per planned layer)."""
    names = []
    for name, module in transformer.named_modules():
        if getattr(module, "processor", None) is None:
            continue
        if pattern is None or module_matches(name, pattern):
            names.append(name.rsplit(".", 1)[0])
    return names


def install_stages(runtime: PipelineRuntime) -> None:
    """Replace the other stages' blocks by stand-ins and wrap the stage's own."""
    transformer = runtime.transformer
    outputs = BLOCK_OUTPUTS[type(transformer).__name__]
    blocks = _blocks(transformer, runtime.family.attention_modules)
    if len(blocks) != runtime.spec.num_layers:
        raise UnsupportedModelError(f"{type(transformer).__name__}: found {len(blocks)} "
                                    f"blocks, the model has {runtime.spec.num_layers} layers")
    own = runtime.own_layers
    stage_blocks = [transformer.get_submodule(blocks[index]) for index in own]
    for index, name in enumerate(blocks):
        block = transformer.get_submodule(name)
        replacement: torch.nn.Module
        if index in own:
            replacement = _OwnBlock(runtime, block, index, stage_blocks)
        else:
            replacement = _StandIn(runtime, inspect.signature(block.forward), outputs)
        parent, _, child = name.rpartition(".")
        setattr(transformer.get_submodule(parent) if parent else transformer, child,
                replacement)

    def begin(module, args, kwargs):
        runtime.payload = None
        runtime.pipelined = False

    def at_output(module, args, output):
        # The output projection's local rows, before the stage's Ulysses gather: what
        # the plan's ring carries (each stage rank's own tokens, patch by patch).
        if runtime.pipeline.stages == 1:
            return output
        if runtime.is_last:
            runtime.run_glue(cross=False)
            ring = runtime._programs_at(runtime._at_step)[1]
            if ring:  # the last step sends nothing back in the plan
                # (B, s, C) -> patches' (B, s/M, C), in order
                runtime.outgoing.extend(part.contiguous()
                                        for part in output.chunk(runtime.patches, dim=1))
                runtime._run_ring(ring)
            return runtime.return_output(output) if runtime.is_last_step() else output
        if not runtime.is_first:
            return output
        runtime.run_glue(cross=True)  # the next step's program starts with the ring
        if runtime.is_last_step():
            return runtime.return_output(output)
        parts, runtime.received = runtime.received, []
        if not parts:
            raise PlanError("stage 0 received no output from the last stage")
        like = output.chunk(len(parts), dim=1)
        return torch.cat([_unflatten(part, piece) for part, piece in zip(parts, like,
                                                                        strict=True)], dim=1)

    # Before the splits' root hook (registered later, runs later): nothing carried yet.
    transformer.register_forward_pre_hook(begin, with_kwargs=True)
    # Before the gather's hook (install_splits registers it later, so it runs later).
    for gather in runtime.family.gathers:
        transformer.get_submodule(gather.module).register_forward_hook(at_output)


def parallelize_pipefusion(model: Any, transport: Transport, pipeline: PipelineLayout,
                           grid: RankGrid | None = None, *, options: PlanOptions | None = None,
                           run_plan: RunPlan | None = None,
                           generation: Generation | None = None,
                           inner: str = "flat") -> PipelineRuntime:
    """:func:`~cocodiff.runtime.parallel.parallelize` for a PipeFusion layout: every rank
    keeps only its stage's blocks. Every rank calls it with the same arguments, then
    ``runtime.start_generation(num_steps)`` before each generation.

    Args:
        model: a diffusers pipeline or transformer.
        transport: the transport over every rank of the job.
        pipeline: the layout (stages x Ulysses; warm-up at least the step count).
        grid: where the ranks sit (None: one node of P GPUs).
        options: chunks of a phased stage schedule (dtype and batch: the model's).
        run_plan: a pipefusion plan file's plan to execute instead.
        generation: the model's spec and image size the plans record.
        inner: the Ulysses schedule inside each stage (flat, tapa, vfirst).

    Raises:
        LayoutError: the layout does not fit the job or the model.
    """
    transformer = getattr(model, "transformer", model)
    runtime = PipelineRuntime(transformer, transport, family_of(transformer), pipeline, grid,
                              options, run_plan, generation, inner)
    install_processors(runtime)  # counts every attention layer: before the stand-ins
    install_stages(runtime)
    install_splits(runtime)
    return runtime

