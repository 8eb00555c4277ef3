"""``parallelize``: Ulysses sequence parallelism on an unmodified diffusers model.

Three things are installed on the transformer, all from the model's :class:`Family`:

1. hooks that split the token streams over the ranks where they enter the model, and
   gather them where they leave (padding streams that do not divide);
2. attention processors that run the plan's attention steps with the shared executor
   (``cocodiff.plan.executor``) through any transport;
3. nothing else: the rest of every block runs as diffusers wrote it, on local tokens.

The plan is made on the first forward call, when the token counts are known, by the
named scheduler for the rank grid (where the ranks sit: nodes x GPUs x tiles), and
remade if they change (and, for cocodiff, every denoising step: V-Major's cached
fraction follows a schedule over the steps). A topology-aligned plan's phased exchanges
run as all-to-alls on the phase sub-groups (:mod:`cocodiff.runtime.tapa`); their
selective (V-Major) phases send only the chosen V blocks (:mod:`cocodiff.runtime.vmajor`).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from cocodiff.layout import ParallelLayout
from cocodiff.models import ModelSpec, spec_from_config
from cocodiff.plan.executor import PlanError, drive_blocking, run_steps
from cocodiff.plan.file import RunPlan, build_run_plan, check_plan_fits_call, check_plan_fits_model
from cocodiff.plan.steps import Compute, Exchange, LayerPlan, Plan
from cocodiff.runtime.exchange import (
    all_gather_rows,
    pack_gather_heads,
    pack_scatter_heads,
    unpack_gather_heads,
    unpack_scatter_heads,
)
from cocodiff.runtime.families import FAMILIES
from cocodiff.runtime.families.base import (
    AttentionOps,
    AttentionState,
    Family,
    Split,
    module_matches,
)
from cocodiff.runtime.sharding import TokenLayout, TokenShard
from cocodiff.runtime.tapa import PhasedHandle, Route, plan_route
from cocodiff.runtime.vmajor import VMajorCache
from cocodiff.schedules import PlanOptions, RankGrid, VMajorOptions, get_schedule
from cocodiff.schedules.grid import LEVELS
from cocodiff.util.errors import CocodiffError, ScheduleError
from transports.base import CompletedHandle, Group, Handle, Transport

# The tier (a topology.TIERS name) that messages between ranks differing first in this
# level cross: the runtime counts its bytes per tier, as the simulator does.
LEVEL_TIERS = {"node": "inter-node", "gpu": "intra-node", "tile": "intra-gpu"}


class UnsupportedModelError(CocodiffError):
    """A model class the runtime has no family for."""


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What the runtime did, for comparing with the plan: ("compute", op, 0) or
    ("exchange", tensor, bytes sent)."""

    kind: str
    name: str
    num_bytes: int


class UlyssesRuntime:
    """Shared state of one parallelised transformer on one rank."""

    # The Ulysses x Ring x batch layout; None: pure Ulysses (HybridRuntime sets one).
    parallel: ParallelLayout | None = None

    def __init__(
        self, transformer: torch.nn.Module, transport: Transport, family: Family, schedule: str,
        grid: RankGrid | None = None, options: PlanOptions | None = None,
        run_plan: RunPlan | None = None,
    ) -> None:
        self.transformer = transformer
        self.transport = transport
        self.family = family
        # An in-memory config lacks the "_class_name" a saved config.json has.
        config = {"_class_name": type(transformer).__name__, **dict(transformer.config)}
        self.spec: ModelSpec = spec_from_config(config, name=type(transformer).__name__)
        if run_plan is not None:
            check_plan_fits_model(run_plan, self.spec, transport.world_size, self.parallel)
            schedule, grid, options = run_plan.schedule, run_plan.grid, run_plan.options
        if self.ulysses_ranks(transport) > self.spec.num_heads:
            raise UnsupportedModelError(
                f"{transport.world_size} ranks cannot split the {self.spec.num_heads} attention "
                f"heads of {self.spec.name}: launch at most {self.spec.num_heads} ranks"
            )
        self.grid = RankGrid.line(transport.world_size) if grid is None else grid
        if self.grid.num_ranks != transport.world_size:
            raise ScheduleError(
                f"the rank grid {'x'.join(map(str, self.grid.shape))} holds "
                f"{self.grid.num_ranks} ranks, the job has {transport.world_size}"
            )
        # The token split gives rank r the r-th chunk, and the exchanges' group order is
        # the grid order: the two agree only when the grid holds the ranks in order.
        if self.grid.ranks != tuple(range(transport.world_size)):
            raise ScheduleError(
                f"rank grid {'x'.join(map(str, self.grid.shape))} holds ranks "
                f"{self.grid.ranks}; the runtime needs ranks 0..{transport.world_size - 1} "
                "in (node, gpu, tile) order"
            )
        self.entry = get_schedule(schedule)
        self.schedule = schedule
        # dtype and batch are the model's, taken at each forward call.
        self.options = options or PlanOptions()
        # The plan file this run executes, or None: plans are built as the token counts
        # become known (by the same function ``cocodiff plan`` uses).
        self.plan_file = run_plan
        self._follow_file = run_plan is not None
        self.vcache = VMajorCache()
        self.num_steps: int | None = None
        self.step = -1  # denoising step of the current forward call (0-based)
        self.call = 0  # forward call within the step
        self.calls_per_step = 1
        self._timestep: float | None = None
        # Bytes this rank's attention exchanges sent to other ranks, by tier, and the
        # exchanges it started (all-to-alls and Ring passes).
        self.bytes_by_tier: dict[str, int] = dict.fromkeys(LEVEL_TIERS.values(), 0)
        self.exchanges_started = 0
        self.shards: dict[str, TokenShard] = {}
        self._run_plans: dict[tuple, RunPlan] = {}
        self._groups: dict[tuple[int, ...], Group] = {transport.world.ranks: transport.world}
        self._routes: dict[Exchange, Route] = {}
        self._layouts: dict[tuple, tuple[TokenLayout, torch.Tensor]] = {}
        self.records: list[StepRecord] | None = None  # set to [] to record
        self.run_plan: RunPlan | None = None  # the run's plan, once the first call made it
        self.plan: Plan | None = None  # the current step's
        self.comm_s = 0.0  # time spent waiting for exchanges and gathers

    @property
    def vmajor(self) -> VMajorOptions | None:
        """V-Major's options (step-dependent schedules), None when off: set it to None to
        run the cocodiff schedule exactly (TAPA + V-First), e.g. for a reference."""
        return self.options.vmajor if self.entry.step_dependent else None

    @vmajor.setter
    def vmajor(self, value: VMajorOptions | None) -> None:
        self.options = replace(self.options, vmajor=value)
        self._run_plans.clear()
        # An exact reference is not the plan file's run: it is built, the file set aside.
        self._follow_file = self.plan_file is not None and value == self.plan_file.options.vmajor

    def plan_batch(self, batch: int) -> int:
        """The samples a plan counts when one attention call sees ``batch``."""
        return batch

    # -- hooks a hybrid layout (cocodiff.runtime.hybrid) overrides ----------------------

    def ulysses_ranks(self, transport: Transport) -> int:
        """Ranks the heads are split over: every rank, under pure Ulysses."""
        return transport.world_size

    @property
    def sequence_index(self) -> int:
        """Which chunk of every token stream this rank holds."""
        return self.transport.rank

    @property
    def sequence_group(self) -> Group:
        """The ranks whose chunks make up the whole sequence, in chunk order."""
        return self.transport.world

    @property
    def backend_type(self) -> type[TensorBackend]:
        return TensorBackend

    # -- token streams ----------------------------------------------------------------

    def start_generation(self, num_steps: int) -> None:
        """Call before each generation of ``num_steps`` denoising steps: V-Major's ratio
        schedule runs over them, and its caches start empty."""
        self.num_steps = num_steps
        self.step = -1
        self.call = 0
        self._timestep = None
        self.vcache.clear()

    def begin_forward(self, timestep: Any) -> None:
        """A forward call starts. A new timestep starts a new denoising step; the same
        timestep again is another call of the same step (Wan's unconditional pass)."""
        self.shards.clear()
        value = (float(timestep.flatten()[0]) if isinstance(timestep, torch.Tensor)
                 else timestep)
        if value is None or value != self._timestep:
            self.step += 1
            self.call = 0
        else:
            self.call += 1
            self.calls_per_step = max(self.calls_per_step, self.call + 1)
        self._timestep = value

    def shard(self, stream: str, total: int) -> TokenShard:
        shard = self.shards.get(stream)
        if shard is None:
            shard = self.shards[stream] = TokenShard(total, self.sequence_group.size)
        elif shard.total != total:
            raise PlanError(f"stream {stream} has {total} tokens here, {shard.total} before")
        return shard

    def original_positions(self, streams: tuple[str, ...]) -> torch.Tensor:
        key = tuple((name, self.shards[name].total) for name in streams)
        if key not in self._layouts:
            layout = TokenLayout(tuple(self.shards[name] for name in streams))
            self._layouts[key] = (layout, layout.original_positions())
        return self._layouts[key][1]

    # -- plans --------------------------------------------------------------------------

    def layer_plan(self, layer_index: int, streams: tuple[str, ...], batch: int,
                   dtype: torch.dtype) -> LayerPlan:
        stream_tokens = tuple(self.shards[name].total for name in streams)
        dtype_name = str(dtype).removeprefix("torch.")
        step_dependent = self.entry.step_dependent and self.vmajor is not None
        if step_dependent and self.num_steps is None:
            raise PlanError("the cocodiff schedule follows a ratio schedule over the "
                            "denoising steps: call runtime.start_generation(num_steps) first")
        key = (stream_tokens, batch, dtype_name, self.num_steps)
        run_plan = self._run_plans.get(key)
        if run_plan is None:
            if self._follow_file:
                assert self.plan_file is not None
                check_plan_fits_call(self.plan_file, stream_tokens, self.plan_batch(batch),
                                     dtype_name, self.num_steps)
                run_plan = self.plan_file
            else:
                options = replace(self.options, dtype=dtype_name, batch=self.plan_batch(batch))
                run_plan = build_run_plan(self.schedule, self.spec, self.grid, stream_tokens,
                                          self.num_steps or 1, options, parallel=self.parallel)
            for plan in run_plan.plans:
                self._create_groups(plan)
            self._run_plans[key] = run_plan
        self.run_plan = run_plan
        # A schedule that does the same every step has one plan, whatever the step count.
        self.plan = run_plan.plan_at(self.step if self.entry.step_dependent else 0)
        return self.plan.program(self.transport.rank).layers[layer_index]

    def count_sent(self, tier: str, num_bytes: int) -> None:
        self.bytes_by_tier[tier] += num_bytes

    def tier_to(self, rank: int) -> str:
        """The tier between this rank and ``rank`` (the slowest coordinate they differ in)."""
        mine, theirs = self.grid.coords(self.transport.rank), self.grid.coords(rank)
        level = next(level for level, a, b in zip(LEVELS, mine, theirs, strict=True) if a != b)
        return LEVEL_TIERS[level]

    def _create_groups(self, plan: Plan) -> None:
        # torch.distributed.new_group is collective over the world: every rank creates
        # every group, in the same (sorted) order, even groups it is not in.
        exchanges = {step for program in plan.programs for layer in program.layers
                     for step in layer.exchanges}
        needed = sorted({step.group for step in exchanges}
                        | {phase.group for step in exchanges for phase in step.phases})
        for ranks in needed:
            if ranks not in self._groups:
                self._groups[ranks] = self.transport.new_group(ranks)

    def group(self, ranks: tuple[int, ...]) -> Group:
        return self._groups[ranks]

    def route(self, step: Exchange) -> Route:
        """This rank's blocks in each phase of a phased exchange of the current plan
        (checked against the plan once, then cached)."""
        route = self._routes.get(step)
        if route is None:
            assert self.plan is not None
            route = self._routes[step] = plan_route(step, self.grid, self.plan.layout.heads,
                                                    self.transport.rank)
        return route


class TimedHandle:
    """A transport handle whose ``wait()`` adds its blocking time to the runtime's
    ``comm_s``: the communication time the rank actually waited for."""

    __slots__ = ("_handle", "_runtime")

    def __init__(self, handle: Handle, runtime: UlyssesRuntime) -> None:
        self._handle = handle
        self._runtime = runtime

    def is_completed(self) -> bool:
        return self._handle.is_completed()

    def wait(self) -> Any:
        start = time.perf_counter()
        try:
            return self._handle.wait()
        finally:
            self._runtime.comm_s += time.perf_counter() - start


class TensorBackend:
    """Binds plan steps to one attention call's tensors and the transport."""

    def __init__(self, runtime: UlyssesRuntime, ops: AttentionOps, state: AttentionState,
                 layer_index: int) -> None:
        self.runtime = runtime
        self.ops = ops
        self.state = state
        self.layer_index = layer_index

    def _record(self, kind: str, name: str, num_bytes: int = 0) -> None:
        if self.runtime.records is not None:
            self.runtime.records.append(StepRecord(kind, name, num_bytes))

    def compute(self, step: Compute) -> Handle:
        if step.op == "attention":
            self._attention()
        else:
            getattr(self.ops, step.op)(self.state)
        self._record("compute", step.op)
        return CompletedHandle()

    def _attention(self) -> None:
        # Pick the real tokens in the model's original order out of the gathered
        # sequence, so the kernel sees exactly the single-process input (no padding).
        # The mask is the model's own, over that same sequence.
        tensors = self.state.tensors
        positions = self.runtime.original_positions(self.ops.streams)
        stream_tokens = tuple(self.runtime.shards[name].total for name in self.ops.streams)
        q, k, v = (tensors[name].index_select(1, positions) for name in ("q", "k", "v"))
        mask = self.ops.attention_mask(self.state, stream_tokens)
        out = dispatch_attention_fn(q, k, v, attn_mask=mask)
        gathered = out.new_zeros(tensors["q"].shape)
        gathered[:, positions] = out
        tensors["out"] = gathered

    def start_exchange(self, step: Exchange) -> Handle:
        self.runtime.exchanges_started += 1
        x = self.state.tensors[step.tensor]
        group = self.runtime.group(step.group)
        if step.direction == "scatter_heads":
            send = pack_scatter_heads(x)
        else:
            send = pack_gather_heads(x, group.size)
        row_bytes = send[0].numel() * send.element_size()
        if row_bytes != step.row_bytes or send.shape[0] != sum(step.send_rows):
            raise PlanError(
                f"exchange of {step.tensor}: the plan moves {sum(step.send_rows)} rows of "
                f"{step.row_bytes} B, the model has {send.shape[0]} rows of {row_bytes} B"
            )
        self._record("exchange", step.tensor, send.numel() * send.element_size())
        runtime = self.runtime
        if step.phases:
            # The rows go through the phases' sub-groups; the handle delivers them in the
            # flat all-to-all's layout, so finish_exchange is the same for both.
            groups = [runtime.group(phase.group) for phase in step.phases]
            codecs = {
                index: runtime.vcache.codec(step.tensor, runtime.step, runtime.call,
                                            self.layer_index, phase.sent_fraction,
                                            phase.blocks_per_row)
                for index, phase in enumerate(step.phases) if phase.selective
            }
            tiers = [LEVEL_TIERS[phase.level] for phase in step.phases]
            handle: Handle = PhasedHandle(
                runtime.transport, groups, runtime.route(step), send, step.chunks, codecs,
                on_sent=lambda phase, num_bytes: runtime.count_sent(tiers[phase], num_bytes),
            )
        else:
            for member, rows in zip(step.group, step.send_rows, strict=True):
                if member != runtime.transport.rank:
                    runtime.count_sent(runtime.tier_to(member), rows * row_bytes)
            handle = runtime.transport.all_to_all(send, step.send_rows, step.recv_rows, group)
        return TimedHandle(handle, runtime)

    def finish_exchange(self, step: Exchange, received: torch.Tensor) -> None:
        if step.direction == "scatter_heads":
            self.state.tensors[step.tensor] = unpack_scatter_heads(received, len(step.group))
        else:
            self.state.tensors[step.tensor] = unpack_gather_heads(received)


class UlyssesAttnProcessor:
    """Runs one layer's planned attention steps in place of a diffusers processor.

    The explicit parameters matter: diffusers passes a processor only the keyword
    arguments its ``__call__`` signature names. They are the union of what the supported
    attention modules pass: FLUX (``image_rotary_emb``) and Wan (``rotary_emb``) pass the
    rotary embedding positionally after ``attention_mask``, Qwen-Image passes
    ``image_rotary_emb`` and ``encoder_hidden_states_mask`` by keyword.
    """

    def __init__(self, runtime: UlyssesRuntime, ops: AttentionOps, layer_index: int) -> None:
        self.runtime = runtime
        self.ops = ops
        self.layer_index = layer_index

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
        rotary_emb: Any = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
    ) -> Any:
        rotary = image_rotary_emb if image_rotary_emb is not None else rotary_emb
        extra = {"rotary_emb": rotary, "encoder_hidden_states_mask": encoder_hidden_states_mask}
        state = AttentionState(attn, hidden_states, encoder_hidden_states, attention_mask, extra)
        layer = self.runtime.layer_plan(
            self.layer_index, self.ops.streams, hidden_states.shape[0], hidden_states.dtype
        )
        backend = self.runtime.backend_type(self.runtime, self.ops, state, self.layer_index)
        drive_blocking(run_steps(layer.attention, backend))
        return state.result


def family_of(transformer: torch.nn.Module) -> Family:
    name = type(transformer).__name__
    if name not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported transformer class {name}; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[name]


def parallelize(model: Any, transport: Transport, schedule: str = "flat",
                grid: RankGrid | None = None, *, options: PlanOptions | None = None,
                run_plan: RunPlan | None = None) -> UlyssesRuntime:
    """Make a diffusers pipeline (or its transformer) run Ulysses-parallel over
    ``transport``. Every rank calls this and then runs the pipeline as usual, with the
    same inputs; every rank gets the full output.

    Args:
        model: a diffusers pipeline or transformer.
        transport: the transport over every rank of the job.
        schedule: a name in :data:`cocodiff.schedules.SCHEDULES`. For a step-dependent
            one (cocodiff), call ``runtime.start_generation(num_steps)`` before each
            generation.
        grid: where the ranks sit (nodes x GPUs x tiles, ranks 0..P-1 in order); the
            phased schedules (tapa, vfirst, cocodiff) cut each exchange into one phase per
            level with more than one member. None: one node of P GPUs, where they carry
            each exchange as one flat all-to-all.
        options: chunks and V-Major's ratio schedule (:class:`PlanOptions`; its dtype and
            batch are taken from the model's calls). Set ``runtime.vmajor = None`` to run
            cocodiff exactly (TAPA + V-First).
        run_plan: a plan file's plan (:mod:`cocodiff.plan.file`) to execute instead; it
            fixes the schedule, the grid and the options, and the first call checks that
            the model's tokens, batch and dtype are the plan's.

    Returns:
        The runtime state (its ``plan`` and, when ``records`` is set to a list, what
        each attention call did).
    """
    transformer = getattr(model, "transformer", model)
    family = family_of(transformer)
    runtime = UlyssesRuntime(transformer, transport, family, schedule, grid, options, run_plan)
    _install_splits(runtime)
    _install_processors(runtime)
    return runtime


def _install_processors(runtime: UlyssesRuntime) -> None:
    ops = runtime.family.ops
    pattern = runtime.family.attention_modules
    layer_index = 0
    for name, module in runtime.transformer.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None or type(processor).__name__ not in ops.processor_classes:
            continue
        if pattern is None or module_matches(name, pattern):
            module.set_processor(UlyssesAttnProcessor(runtime, ops, layer_index))
            layer_index += 1
    if layer_index != runtime.spec.num_layers:
        raise UnsupportedModelError(
            f"{type(runtime.transformer).__name__}: found {layer_index} attention processors "
            f"to replace, expected {runtime.spec.num_layers} (a custom processor installed, "
            f"or attention layers the runtime does not know?)"
        )


def _install_splits(runtime: UlyssesRuntime) -> None:
    transformer = runtime.transformer
    transport = runtime.transport
    rank = runtime.sequence_index
    module_names = [name for name, _ in transformer.named_modules()]
    by_module: dict[str, list[Split]] = {}
    for split in runtime.family.splits:
        matched = [name for name in module_names if module_matches(name, split.module)]
        if not matched:
            raise UnsupportedModelError(
                f"{type(transformer).__name__} has no module {split.module!r} to split "
                f"{split.argument!r} at"
            )
        for name in matched:
            by_module.setdefault(name, []).append(split)

    def split_value(split: Split, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or split.ndim not in (None, value.ndim):
            return value
        shard = runtime.shard(split.stream, value.shape[split.dim])
        return shard.split(value, split.dim, rank)

    def input_hook(module, args, kwargs, splits):
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        for split in splits:
            if split.argument in bound.arguments:
                bound.arguments[split.argument] = split_value(
                    split, bound.arguments[split.argument]
                )
        return bound.args, bound.kwargs

    def output_hook(module, args, output, splits):
        single = isinstance(output, torch.Tensor)
        values = [output] if single else list(output)
        for split in splits:
            values[split.argument] = split_value(split, values[split.argument])
        return values[0] if single else tuple(values)

    def root_hook(module, args, kwargs):
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        runtime.begin_forward(bound.arguments.get("timestep"))
        return input_hook(module, args, kwargs, [s for s in by_module.get("", []) if not s.output])

    transformer.register_forward_pre_hook(root_hook, with_kwargs=True)
    for module_name, splits in by_module.items():
        module = transformer.get_submodule(module_name)
        inputs = [s for s in splits if not s.output]
        outputs = [s for s in splits if s.output]
        if module_name and inputs:
            module.register_forward_pre_hook(
                lambda m, a, k, s=inputs: input_hook(m, a, k, s), with_kwargs=True
            )
        if outputs:
            module.register_forward_hook(lambda m, a, o, s=outputs: output_hook(m, a, o, s))

    for gather in runtime.family.gathers:
        def gather_hook(module, args, output, gather=gather):
            shard = runtime.shards[gather.stream]
            start = time.perf_counter()
            chunks = all_gather_rows(transport, output.contiguous(), runtime.sequence_group)
            runtime.comm_s += time.perf_counter() - start
            # (P, ..., chunk, ...) -> (..., P*chunk, ...) -> drop the padding
            return shard.unsplit(torch.cat(list(chunks), dim=gather.dim), gather.dim)

        transformer.get_submodule(gather.module).register_forward_hook(gather_hook)
