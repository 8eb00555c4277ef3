"""``parallelize``: Ulysses sequence parallelism on an unmodified diffusers model.

Three things are installed on the transformer, all from the model's :class:`Family`:

1. hooks that split the token streams over the ranks where they enter the model, and
   gather them where they leave (padding streams that do not divide;
   :mod:`cocodiff.runtime.hooks`);
2. attention processors that run the plan's attention steps with the shared executor
   (``cocodiff.plan.executor``) through any transport (:mod:`cocodiff.runtime.backend`);
3. nothing else: the rest of every block runs as diffusers wrote it, on local tokens.

The plan is made on the first forward call, when the token counts are known, by the
named scheduler for the rank grid (where the ranks sit: nodes x GPUs x tiles), and
remade if they change (and, for cocodiff, every denoising step: V-Major's cached
fraction follows a schedule over the steps). A topology-aligned plan's phased exchanges
run as all-to-alls on the phase sub-groups (:mod:`cocodiff.runtime.tapa`); their
selective (V-Major) phases send only the chosen V blocks (:mod:`cocodiff.runtime.vmajor`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from cocodiff.layout import ParallelLayout
from cocodiff.models import ModelSpec, ModelSpecError, spec_from_config
from cocodiff.plan.executor import PlanError
from cocodiff.plan.steps import Exchange, LayerPlan, Plan
from cocodiff.runtime.backend import LEVEL_TIERS, StepRecord, TensorBackend
from cocodiff.runtime.families import runtime_family
from cocodiff.runtime.families.base import Family
from cocodiff.runtime.hooks import UnsupportedModelError, install_processors, install_splits
from cocodiff.runtime.sharding import TokenShard, TokenStreams
from cocodiff.runtime.tapa import Route, plan_route
from cocodiff.runtime.vmajor import VMajorCache
from cocodiff.schedules import PlanOptions, RankGrid, VMajorOptions, get_schedule
from cocodiff.schedules.grid import LEVELS
from cocodiff.schedules.run_plan import (
    Generation,
    RunPlan,
    build_run_plan,
    check_plan_fits_call,
    check_plan_fits_model,
    check_same_shape,
)
from cocodiff.util.errors import ScheduleError
from transports.base import Group, Transport


class UlyssesRuntime:
    """Shared state of one parallelised transformer on one rank."""

    # The Ulysses x Ring x batch layout; None: pure Ulysses (HybridRuntime sets one).
    parallel: ParallelLayout | None = None

    def __init__(
        self, transformer: torch.nn.Module, transport: Transport, family: Family, schedule: str,
        grid: RankGrid | None = None, options: PlanOptions | None = None,
        run_plan: RunPlan | None = None, generation: Generation | None = None,
    ) -> None:
        self.transformer = transformer
        self.transport = transport
        self.family = family
        # An in-memory config lacks the "_class_name" a saved config.json has.
        config = {"_class_name": type(transformer).__name__, **dict(transformer.config)}
        self.spec: ModelSpec = spec_from_config(config, name=type(transformer).__name__)
        # What the run generates, recorded in the plans it builds (None: the spec above,
        # no image size).
        self.generation = generation
        if generation is not None:
            check_same_shape(generation.spec, self.spec, "the run's model spec")
            self.spec = generation.spec
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
        self._token_streams: dict[tuple, tuple[TokenStreams, torch.Tensor]] = {}
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

    def original_positions(self, streams: tuple[str, ...],
                           device: torch.device | None = None) -> torch.Tensor:
        """:meth:`TokenStreams.original_positions` of ``streams``, on ``device`` (an index
        must be where the tensor it selects from is), made once per shape and device."""
        key = (tuple((name, self.shards[name].total) for name in streams), str(device))
        if key not in self._token_streams:
            token_streams = TokenStreams(tuple(self.shards[name] for name in streams))
            self._token_streams[key] = (token_streams,
                                        token_streams.original_positions().to(device))
        return self._token_streams[key][1]

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
                                          self.num_steps or 1, options, parallel=self.parallel,
                                          **self._size())
            for plan in run_plan.plans:
                self._create_groups(plan)
            self._run_plans[key] = run_plan
        self.run_plan = run_plan
        # A schedule that does the same every step has one plan, whatever the step count.
        self.plan = run_plan.plan_at(self.step if self.entry.step_dependent else 0)
        return self.plan.program(self.transport.rank).layers[layer_index]

    def _size(self) -> dict[str, Any]:
        """The image size a plan built here records (as ``cocodiff plan`` does), when known."""
        if self.generation is None:
            return {}
        return {"resolution": self.generation.resolution, "frames": self.generation.frames}

    def count_sent(self, tier: str, num_bytes: int) -> None:
        self.bytes_by_tier[tier] += num_bytes

    def count_gathered(self, group: Group, num_bytes: int) -> None:
        """Count an all-gather's traffic: ``num_bytes`` to every other member of ``group``
        (the output gathers, which the simulator charges too: cocodiff.plan.gather)."""
        for member in group.ranks:
            if member != self.transport.rank:
                self.count_sent(self.tier_to(member), num_bytes)

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
            route = self._routes[step] = plan_route(step, self.grid, self.plan.head_split.heads,
                                                    self.transport.rank)
        return route


def family_of(transformer: torch.nn.Module) -> Family:
    try:
        return runtime_family(type(transformer).__name__)
    except ModelSpecError as err:
        raise UnsupportedModelError(str(err)) from None


def parallelize(model: Any, transport: Transport, schedule: str = "flat",
                grid: RankGrid | None = None, *, options: PlanOptions | None = None,
                run_plan: RunPlan | None = None,
                generation: Generation | None = None) -> UlyssesRuntime:
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
        run_plan: a plan file's plan (:mod:`cocodiff.schedules.run_plan`) to execute instead; it
            fixes the schedule, the grid and the options, and the first call checks that
            the model's tokens, batch and dtype are the plan's.
        generation: what the run generates (:class:`~cocodiff.schedules.run_plan.Generation`):
            the model's spec and image size the plans record; None: the spec the
            transformer's config gives, named after its class, and no image size.

    Returns:
        The runtime state (its ``plan`` and, when ``records`` is set to a list, what
        each attention call did).
    """
    transformer = getattr(model, "transformer", model)
    family = family_of(transformer)
    runtime = UlyssesRuntime(transformer, transport, family, schedule, grid, options, run_plan,
                             generation)
    install_splits(runtime)
    install_processors(runtime)
    return runtime
