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

Only synchronous steps run (warm-up = every step): exact. The pipelined steps (patches,
stale K/V buffers) are refused.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from cocodiff.layout import PipelineLayout
from cocodiff.plan.executor import PlanError, drive_blocking, run_layer
from cocodiff.plan.steps import Compute, Exchange, LayerPlan
from cocodiff.runtime.backend import StepRecord, TimedHandle
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


def _is_glue(layer: LayerPlan) -> bool:
    """A plan layer of transfers and waits only (no model layer)."""
    return not any(isinstance(step, Compute) for step in layer.steps)


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
        # The block output the pipeline carries; what the next send sends; what the last
        # receive delivered (flat).
        self.payload: Any = None
        self.outgoing: torch.Tensor | None = None
        self.received: torch.Tensor | None = None
        # Bytes this rank sent that the plan does not carry (the simulator does not
        # charge them): the last step's output returned to stage 0, and the output
        # gathers inside each stage's Ulysses group.
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

    def start_generation(self, num_steps: int) -> None:
        super().start_generation(num_steps)
        self._entered = -2  # the next call starts a program, even at the same step
        self._prefetched = False

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
        key = (stream_tokens, batch, dtype_name, self.num_steps)
        run_plan = self._run_plans.get(key)
        if run_plan is None:
            if self._follow_file:
                assert self.plan_file is not None
                check_plan_fits_call(self.plan_file, stream_tokens, batch, dtype_name,
                                     self.num_steps)
                run_plan = self.plan_file
            else:
                options = PlanOptions(dtype=dtype_name, batch=batch, chunks=self.options.chunks)
                run_plan = build_run_plan("pipefusion", self.spec, self.grid, stream_tokens,
                                          self.num_steps or 1, options, pipeline=self.pipeline,
                                          **self._size())
            if any(plan.pipeline is not None and plan.pipeline.patches > 1
                   for plan in run_plan.plans):
                raise ScheduleError("pipefusion's pipelined steps (patches, stale K/V) do not "
                                    "run yet: give --warmup at least the step count")
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
            self._prefetched = False
            self._entered = self.step
        self.plan = run_plan.plan_at(step)
        self.run_glue(cross=False)

    def _layers(self) -> tuple[LayerPlan, ...]:
        assert self.run_plan is not None
        return self.run_plan.plan_at(self._at_step).program(self.transport.rank).layers

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

    def count_gathered(self, group: Group, num_bytes: int) -> None:
        self.unplanned_bytes += num_bytes * (group.size - 1)

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
            if runtime.outgoing is None:
                raise PlanError(f"rank {runtime.transport.rank}: a send with nothing to send")
            send = runtime.outgoing.reshape(1, -1)
            runtime.outgoing = None
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
            self.runtime.received = received.reshape(-1)


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
            if runtime.received is None:
                raise PlanError(f"rank {runtime.transport.rank}: stage {runtime.stage} "
                                "received nothing before its layers")
            runtime.payload = _unflatten(runtime.received, like_value)
            runtime.received = None
        return runtime.payload


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
    """Replace the other stages' blocks by stand-ins and hook the stage's own."""
    transformer = runtime.transformer
    outputs = BLOCK_OUTPUTS[type(transformer).__name__]
    blocks = _blocks(transformer, runtime.family.attention_modules)
    if len(blocks) != runtime.spec.num_layers:
        raise UnsupportedModelError(f"{type(transformer).__name__}: found {len(blocks)} "
                                    f"blocks, the model has {runtime.spec.num_layers} layers")
    own = runtime.own_layers

    def start(module, args, kwargs):
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        hidden = bound["hidden_states"]
        runtime.enter(hidden.shape[0], hidden.dtype, hidden.device)

    def end_of_stage(module, args, output):
        runtime.payload = output
        runtime.outgoing = _flatten(output)
        runtime.run_glue(cross=False)

    for index, name in enumerate(blocks):
        block = transformer.get_submodule(name)
        if index in own:
            if index == own.start and runtime.is_first:
                block.register_forward_pre_hook(start, with_kwargs=True)
            if index == own.stop - 1 and not runtime.is_last:
                block.register_forward_hook(end_of_stage)
            continue
        parent, _, child = name.rpartition(".")
        stand_in = _StandIn(runtime, inspect.signature(block.forward), outputs)
        setattr(transformer.get_submodule(parent) if parent else transformer, child, stand_in)

    def begin(module, args, kwargs):
        runtime.payload = None
        runtime.received = None

    def at_output(module, args, output):
        # The output projection's local rows, before the stage's Ulysses gather: what
        # the plan's ring carries (each stage rank's own tokens).
        if runtime.pipeline.stages == 1:
            return output
        if runtime.is_last:
            runtime.outgoing = output
            runtime.run_glue(cross=False)  # the ring: this step's output to stage 0
            return runtime.return_output(output) if runtime.is_last_step() else output
        if not runtime.is_first:
            return output
        runtime.run_glue(cross=True)  # the next step's program starts with the ring
        if runtime.is_last_step():
            return runtime.return_output(output)
        if runtime.received is None:
            raise PlanError("stage 0 received no output from the last stage")
        received = _unflatten(runtime.received, output)
        runtime.received = None
        return received

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

