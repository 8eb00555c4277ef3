"""A whole run's plan as one file: what ``cocodiff plan --out`` writes and both
``cocodiff simulate --plan`` and ``cocodiff run --plan`` execute. It sits above the
schedulers, which make its step plans, and below the simulator and the runtime, which
execute them.

A :class:`RunPlan` holds everything the executor needs for a generation: the model's
spec and the activation dtype, the token streams, where the ranks sit (the rank grid)
and the Ulysses x Ring x batch layout, the schedule and its options, and every
denoising step's plan (V-Major's per-step choices included). Steps whose plans are
equal share one; layers shared by ranks or steps are written once.

:func:`build_run_plan` is the one way a run's plan is made (``plan``, ``simulate`` and
``run`` without ``--plan`` all call it). The file is canonical JSON: a plan written,
read and written again is byte-identical, and :attr:`RunPlan.sha256` (the hash of
that text less the machine it was made for) names it in both commands' JSON output:
the same flags give ``plan --out`` and ``run`` the same plan, and the same hash.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

from cocodiff.cost import OPS, Cost
from cocodiff.kernels import Kernel, KernelKind
from cocodiff.layout import ParallelLayout, PipelineLayout
from cocodiff.models import ModelSpec, check_family
from cocodiff.plan.steps import (
    Compute,
    Exchange,
    HeadSplit,
    LayerPlan,
    Level,
    Phase,
    Plan,
    RankProgram,
    Step,
    Tensor,
    Wait,
)
from cocodiff.schedules import PlanOptions, RankGrid, VMajorOptions, get_schedule, plan_for_step
from cocodiff.schedules.pipefusion import PIPELINE_SCHEDULES, pipefusion_step_plans
from cocodiff.util.errors import CocodiffError

FORMAT = "cocodiff-plan/1"
# The fields of a model's spec its plans depend on (the rest describes it).
_SHAPE_FIELDS = ("family", "num_layers", "num_heads", "head_dim")


class PlanFileError(CocodiffError):
    """A plan file that cannot be read, or that does not fit the run (one line)."""


@dataclass(frozen=True, slots=True)
class Generation:
    """What a run generates, as its plan records it beside the token counts: the model's
    spec, named and shaped as ``cocodiff plan --model`` gives it (a transformer's config
    alone knows neither the model's name nor its pipeline's text length), and the image
    size. ``cocodiff run`` hands it to the runtime so that the plan it builds is the plan
    ``cocodiff plan`` writes for the same flags, hash included.

    Args:
        spec: the model.
        resolution: (width, height) in pixels.
        frames: video frames (1 for images).
    """

    spec: ModelSpec
    resolution: tuple[int, int]
    frames: int = 1


@dataclass(frozen=True, slots=True)
class RunPlan:
    """Every denoising step of one generation, for every rank.

    Args:
        spec: the model.
        resolution: (width, height) in pixels.
        frames: video frames (1 for images).
        stream_tokens: tokens of each stream of one sample (image, joint text), largest
            first (:func:`canonical_streams`).
        grid: where the ranks sit (nodes x GPUs x tiles).
        parallel: the Ulysses x Ring x batch layout; None: pure Ulysses.
        schedule: the schedule's registry name.
        options: its options (dtype, batch, chunks, V-Major).
        plans: the distinct step plans.
        step_plans: for each denoising step, its index in ``plans``.
        machine: the topology the plan was made for (``{"topology", "nodes"}``), or
            None; ``simulate --plan`` uses it when no ``--topology`` is given.
    """

    spec: ModelSpec
    resolution: tuple[int, int]
    frames: int
    stream_tokens: tuple[int, ...]
    grid: RankGrid
    parallel: ParallelLayout | None
    schedule: str
    options: PlanOptions
    plans: tuple[Plan, ...]
    step_plans: tuple[int, ...]
    machine: dict[str, Any] | None = None

    @property
    def num_steps(self) -> int:
        return len(self.step_plans)

    @property
    def num_ranks(self) -> int:
        return self.grid.num_ranks

    def plan_at(self, step: int) -> Plan:
        """The plan of denoising step ``step`` (0-based)."""
        if not 0 <= step < self.num_steps:
            raise PlanFileError(f"the plan covers {self.num_steps} denoising steps; step "
                                f"{step + 1} was asked for")
        return self.plans[self.step_plans[step]]

    def to_json(self) -> str:
        """The canonical JSON text (one line)."""
        return _canonical(self._document())

    @property
    def sha256(self) -> str:
        """The plan's hash: of its canonical JSON less ``machine``. Where a plan was made
        for is a note for ``simulate --plan`` (its default topology), not part of what
        runs: ``cocodiff run`` builds the same plan knowing no topology, and a plan runs
        the same on any machine whose ranks sit as its grid says."""
        document = self._document()
        del document["machine"]
        return hashlib.sha256(_canonical(document).encode()).hexdigest()

    def _document(self) -> dict[str, Any]:
        layers = _LayerTable()
        plans = [_plan_json(plan, layers) for plan in self.plans]
        return {
            "format": FORMAT,
            "model": asdict(self.spec),
            "resolution": list(self.resolution),
            "frames": self.frames,
            "stream_tokens": list(self.stream_tokens),
            "grid": {"shape": list(self.grid.shape), "ranks": list(self.grid.ranks)},
            "parallel": _parallel_json(self.parallel),
            "schedule": self.schedule,
            "options": _options_json(self.options),
            "machine": self.machine,
            "steps": list(self.step_plans),
            "layers": layers.rows,
            "plans": plans,
        }

    @staticmethod
    def from_json(text: str) -> RunPlan:
        """Read :meth:`to_json`'s text back.

        Raises:
            PlanFileError: not JSON, another format, or a field missing or of the wrong
                kind (the message names it).
        """
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as err:
            raise PlanFileError(f"not a JSON plan file: {err}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise PlanFileError(f"not a {FORMAT} file (format {found!r}); write one with "
                                "`cocodiff plan ... --out PATH`")
        try:
            return _run_plan_from(data)
        except PlanFileError:
            raise
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
            what = f"missing field {err}" if isinstance(err, KeyError) else str(err)
            raise PlanFileError(f"malformed plan file: {what}") from None


def load_run_plan(path: Path) -> RunPlan:
    """Read a plan file; every failure is one line naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise PlanFileError(f"cannot read plan file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise PlanFileError(f"plan file {path} is not UTF-8 text") from None
    try:
        return RunPlan.from_json(text)
    except PlanFileError as err:
        raise PlanFileError(f"{path}: {err}") from None


def build_run_plan(schedule: str, spec: ModelSpec, grid: RankGrid, stream_tokens: Sequence[int],
                   num_steps: int, options: PlanOptions, *, parallel: ParallelLayout | None = None,
                   resolution: tuple[int, int] = (0, 0), frames: int = 1, activity=None,
                   machine: dict[str, Any] | None = None,
                   pipeline: PipelineLayout | None = None) -> RunPlan:
    """Every step's plan of a generation of ``num_steps`` steps.

    A ``pipeline`` layout (schedule ``pipefusion``) gives PipeFusion's step plans
    (:func:`~cocodiff.schedules.pipefusion.pipefusion_step_plans`: warm-up, pipelined,
    the last step).

    Schedules whose plan does not change per step have one plan; V-Major's has one per
    distinct (planned) cache ratio, or with ``activity`` (a recorded
    :class:`~cocodiff.schedules.activity.ActivityTrace`) one per recorded step. A pure
    Ulysses ``parallel`` (no Ring, no batch groups) is recorded as None, as a run that
    names no layout records it: the plans are the same.

    Raises:
        LayoutError: ``parallel`` does not fit the grid, the heads or the batch.
    """
    streams = canonical_streams(stream_tokens)
    if pipeline is not None or schedule in PIPELINE_SCHEDULES:
        if schedule not in PIPELINE_SCHEDULES or pipeline is None or parallel is not None:
            raise PlanFileError(f"a pipeline layout goes with schedule "
                                f"{', '.join(PIPELINE_SCHEDULES)} alone, not {schedule!r}"
                                + (" and a Ulysses x Ring x batch layout" if parallel else ""))
        pipeline_plans, pipeline_steps = pipefusion_step_plans(spec, grid, streams, pipeline,
                                                               num_steps, options)
        return RunPlan(spec, (resolution[0], resolution[1]), frames, streams, grid, None,
                       schedule, options, pipeline_plans, pipeline_steps, machine)
    entry = get_schedule(schedule)
    if parallel is not None and parallel.is_pure_ulysses:
        parallel.check(grid.num_ranks, spec.num_heads, options.batch)  # as plan_hybrid would
        parallel = None
    plans: list[Plan] = []
    step_plans: list[int] = []
    if activity is not None and entry.step_dependent:
        from cocodiff.schedules.activity import plan_from_activity

        if parallel is not None:
            raise PlanFileError("an activity trace replays a pure-Ulysses run; it cannot "
                                "drive a parallel layout")
        for step in range(activity.num_steps):
            plans.append(plan_from_activity(spec, grid, streams, activity, step, options))
            step_plans.append(step)
    else:
        by_ratio: dict[float, int] = {}
        for step in range(num_steps if entry.step_dependent else 1):
            ratio = entry.cache_ratio(options, step, num_steps)
            if ratio not in by_ratio:
                by_ratio[ratio] = len(plans)
                plans.append(plan_for_step(schedule, spec, grid, streams, options, step,
                                           num_steps, parallel))
            step_plans.append(by_ratio[ratio])
        if not entry.step_dependent:
            step_plans *= num_steps
    return RunPlan(spec, (resolution[0], resolution[1]), frames, streams, grid, parallel, schedule,
                   options, tuple(plans), tuple(step_plans), machine)


def canonical_streams(stream_tokens: Sequence[int]) -> tuple[int, ...]:
    """The token streams in the order a plan records them: each stream is split over the
    ranks on its own, so their order (the simulator lists the image first, FLUX's
    attention the text) changes nothing in the plan; empty ones are dropped."""
    return tuple(sorted((int(t) for t in stream_tokens if t > 0), reverse=True))


# -- writing ------------------------------------------------------------------------


def _canonical(document: dict[str, Any]) -> str:
    """One line, no spaces: the same plan is always the same text (and hash)."""
    return json.dumps(document, separators=(",", ":"))


class _LayerTable:
    """Layers written once each, referred to by index (equal layers share one)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self._by_id: dict[int, int] = {}
        self._by_value: dict[LayerPlan, int] = {}
        self._keep: list[LayerPlan] = []  # keeps ids valid while the table lives

    def index(self, layer: LayerPlan) -> int:
        found = self._by_id.get(id(layer))
        if found is None:
            found = self._by_value.get(layer)
            if found is None:
                found = self._by_value[layer] = len(self.rows)
                self.rows.append({part: [_step_json(s) for s in getattr(layer, part)]
                                  for part in ("before", "attention", "after")})
            self._by_id[id(layer)] = found
            self._keep.append(layer)
        return found


def _step_json(step: Step) -> dict:
    if isinstance(step, Compute):
        # The kernels (cocodiff.kernels) only where the step has them: files of steps
        # without stay as they were.
        kernels = ({"kernels": [asdict(kernel) for kernel in step.cost.kernels]}
                   if step.cost.kernels else {})
        return {"kind": "compute", "op": step.op, "flops": step.cost.flops,
                "memory_bytes": step.cost.memory_bytes, **kernels}
    if isinstance(step, Wait):
        return {"kind": "wait", "tensor": step.tensor}
    return {"kind": "exchange", **asdict(step)}


def _plan_json(plan: Plan, layers: _LayerTable) -> dict:
    return {
        "schedule": plan.schedule,
        "model": plan.model,
        "head_split": asdict(plan.head_split),
        "shift_period": plan.shift_period,
        "parallel": _parallel_json(plan.parallel),
        # Written only for a pipeline's plans: the other plans' text (and hash) stay as
        # they were.
        **({} if plan.pipeline is None else {"pipeline": asdict(plan.pipeline)}),
        "programs": [[layers.index(layer) for layer in program.layers]
                     for program in plan.programs],
    }


def _parallel_json(parallel: ParallelLayout | None) -> dict | None:
    return None if parallel is None else asdict(parallel)


def _options_json(options: PlanOptions) -> dict:
    return {"dtype": options.dtype, "batch": options.batch, "chunks": options.chunks,
            "vmajor": None if options.vmajor is None else asdict(options.vmajor)}


# -- reading ------------------------------------------------------------------------


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise PlanFileError(f"malformed plan file: {what} must be a list of integers")
    return tuple(value)


def _dataclass_from(cls, data: Any, what: str, **converted: Any):
    """``cls`` from a JSON object holding its fields: every one without a default, and no
    other (a field added later with a default may be missing from an older file)."""
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls)
                if f.default is MISSING and f.default_factory is MISSING}
    if not isinstance(data, dict) or not required <= set(data) <= names:
        raise PlanFileError(f"malformed plan file: {what} must hold the fields "
                            f"{', '.join(sorted(names))}")
    return cls(**{**data, **converted})


def _check(ok: bool, what: str, value: Any) -> None:
    if not ok:
        text = repr(value)
        raise PlanFileError(f"malformed plan file: {what} "
                            f"{text if len(text) <= 40 else text[:37] + '...'}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _kernels_from(data: Any) -> tuple[Kernel, ...]:
    """A compute step's kernels (``cocodiff.kernels.Kernel`` fields), checked."""
    _check(isinstance(data, list), "compute kernels must be a list, got", data)
    kernels = []
    for entry in data:
        if isinstance(entry, dict) and "host_ops" not in entry:
            entry = {**entry, "host_ops": None}  # a plan written before the host term
        kernel = _dataclass_from(Kernel, entry, "a compute kernel")
        _check(kernel.kind in get_args(KernelKind), "unknown kernel kind", kernel.kind)
        # host_ops None: one dispatched op per launch (cocodiff.kernels.host_ops)
        _check(all(_is_number(getattr(kernel, f.name)) for f in fields(Kernel)
                   if f.name != "kind" and not (f.name == "host_ops" and kernel.host_ops is None)),
               "kernel sizes must be non-negative numbers, got", entry)
        kernels.append(kernel)
    return tuple(kernels)


def _step_from(data: dict) -> Step:
    """One step, its fields checked for kind and range (a plan file may have been edited:
    the executors trust a plan's values)."""
    kind = data["kind"]
    if kind == "compute":
        _check(data["op"] in OPS, "unknown compute op", data["op"])
        _check(_is_number(data["flops"]) and _is_number(data["memory_bytes"]),
               "compute cost must be non-negative numbers, got", data)
        return Compute(data["op"], Cost(data["flops"], data["memory_bytes"],
                                        _kernels_from(data.get("kernels", []))))
    _check(data.get("tensor") in get_args(Tensor), "unknown tensor", data.get("tensor"))
    if kind == "wait":
        return Wait(data["tensor"])
    _check(kind == "exchange", "unknown step kind", kind)
    _check(data["direction"] in get_args(get_type_hints(Exchange)["direction"]),
           "unknown exchange direction", data["direction"])
    for name in ("row_bytes", "chunks"):
        _check(isinstance(data[name], int) and not isinstance(data[name], bool)
               and data[name] >= (1 if name == "chunks" else 0), f"exchange {name}", data[name])
    for phase in data["phases"]:
        _check(phase["level"] in get_args(Level), "unknown phase level", phase["level"])
        _check(_is_number(phase["sent_fraction"]) and phase["sent_fraction"] <= 1,
               "phase sent_fraction must be in [0, 1], got", phase["sent_fraction"])
        _check(isinstance(phase["blocks_per_row"], int) and phase["blocks_per_row"] >= 0,
               "phase blocks_per_row", phase["blocks_per_row"])
    body = {key: value for key, value in data.items() if key != "kind"}
    # Files written before chunks could cut tokens: their chunks cut rows.
    body.setdefault("chunk_tokens", [])
    chunk_tokens = _ints(body["chunk_tokens"], "chunk_tokens")
    _check(not chunk_tokens or (len(chunk_tokens) == data["chunks"] and min(chunk_tokens) > 0),
           "exchange chunk_tokens (one positive count per chunk, or none)", chunk_tokens)
    phases = tuple(
        _dataclass_from(Phase, phase, "a phase", group=_ints(phase["group"], "a group"),
                        send_rows=_ints(phase["send_rows"], "send_rows"),
                        recv_rows=_ints(phase["recv_rows"], "recv_rows"),
                        chunk_send_rows=tuple(_ints(rows, "chunk_send_rows")
                                              for rows in phase["chunk_send_rows"]),
                        chunk_recv_rows=tuple(_ints(rows, "chunk_recv_rows")
                                              for rows in phase["chunk_recv_rows"]))
        for phase in body["phases"])
    return _dataclass_from(Exchange, body, "an exchange", group=_ints(body["group"], "a group"),
                           send_rows=_ints(body["send_rows"], "send_rows"),
                           recv_rows=_ints(body["recv_rows"], "recv_rows"), phases=phases,
                           chunk_tokens=chunk_tokens)


def _parallel_from(data: Any) -> ParallelLayout | None:
    if data is None:
        return None
    return _dataclass_from(ParallelLayout, data, "parallel", order=tuple(data["order"]))


def _run_plan_from(data: dict) -> RunPlan:
    spec = check_family(_dataclass_from(ModelSpec, data["model"], "model"))
    vmajor = data["options"]["vmajor"]
    if vmajor is not None:
        vmajor = _dataclass_from(VMajorOptions, vmajor, "options.vmajor",
                                 slow_levels=tuple(vmajor["slow_levels"]))
    options = _dataclass_from(PlanOptions, data["options"], "options", vmajor=vmajor)
    schedule = (data["schedule"] if data["schedule"] in PIPELINE_SCHEDULES
                else get_schedule(data["schedule"]).name)
    # _step_from returns any kind of step; which kinds each part holds is as the file
    # (written by _plan_json) has them.
    layers = [LayerPlan(*(tuple(_step_from(s) for s in row[part])  # type: ignore[arg-type]
                          for part in ("before", "attention", "after")))
              for row in data["layers"]]
    grid = data["grid"]
    shape = _ints(grid["shape"], "grid.shape")
    ranks = _ints(grid["ranks"], "grid.ranks")
    if len(shape) != 3 or shape[0] * shape[1] * shape[2] != len(ranks) \
            or sorted(ranks) != list(range(len(ranks))):
        raise PlanFileError(f"malformed plan file: grid {shape} does not hold ranks "
                            f"0..{len(ranks) - 1}")
    for layer in layers:
        for step in layer.attention:
            if isinstance(step, Exchange):
                parts: tuple[Exchange | Phase, ...] = (step, *step.phases)
                for part in parts:
                    _check(all(0 <= r < len(ranks) for r in part.group)
                           and len(part.send_rows) == len(part.recv_rows) == len(part.group),
                           "an exchange group that is not the grid's ranks, or rows that do "
                           "not match it:", part.group)
    plans = []
    for plan in data["plans"]:
        # Files written before the rename call the head split "layout"; read them as such.
        split = plan["head_split"] if "head_split" in plan else plan["layout"]
        head_split = _dataclass_from(HeadSplit, split, "head_split",
                                     heads=_ints(split["heads"], "head_split.heads"))
        ids = [_ints(program, "a program") for program in plan["programs"]]
        _check(all(0 <= i < len(layers) for program in ids for i in program),
               "a program names a layer that is not in the table:", plan["programs"])
        programs = tuple(RankProgram(rank, tuple(layers[i] for i in program))
                         for rank, program in enumerate(ids))
        pipeline = plan.get("pipeline")
        if pipeline is not None:
            if isinstance(pipeline, dict) and "overlap" not in pipeline:
                # Written before the field: its programs overlap consecutive steps (the
                # only order the planner had then), and say so now.
                pipeline = {**pipeline, "overlap": True}
            pipeline = _dataclass_from(PipelineLayout, pipeline, "pipeline")
        plans.append(Plan(plan["schedule"], plan["model"], head_split, programs,
                          plan["shift_period"], _parallel_from(plan["parallel"]), pipeline))
    step_plans = _ints(data["steps"], "steps")
    if not step_plans or any(not 0 <= i < len(plans) for i in step_plans):
        raise PlanFileError("malformed plan file: steps must name plans by index")
    if any(p.num_ranks != len(ranks) for p in plans):
        raise PlanFileError(f"malformed plan file: a step plan does not have the grid's "
                            f"{len(ranks)} ranks")
    machine = data["machine"]
    if machine is not None and not isinstance(machine, dict):
        raise PlanFileError("malformed plan file: machine must be an object or null")
    resolution = _ints(data["resolution"], "resolution")
    if len(resolution) != 2:
        raise PlanFileError("malformed plan file: resolution must be [width, height]")
    return RunPlan(spec, resolution, data["frames"], _ints(data["stream_tokens"], "stream_tokens"),
                   RankGrid(shape, ranks), _parallel_from(data["parallel"]), schedule, options,
                   tuple(plans), step_plans, machine)


# -- does it fit the run? -------------------------------------------------------------


def check_plan_fits_model(run_plan: RunPlan, spec: ModelSpec, num_ranks: int,
                          parallel: ParallelLayout | None = None) -> None:
    """Refuse a plan made for another model shape, rank count or parallel layout (one
    line)."""
    if run_plan.num_ranks != num_ranks:
        raise PlanFileError(f"the plan is for {run_plan.num_ranks} ranks, the launch has "
                            f"{num_ranks}")
    planned, running = (None if p is None or p.is_pure_ulysses else p
                        for p in (run_plan.parallel, parallel))
    if planned != running:
        raise PlanFileError(f"the plan's layout is {planned.name if planned else 'pure Ulysses'}"
                            f", the runtime's {running.name if running else 'pure Ulysses'}")
    check_same_shape(run_plan.spec, spec, "the plan")


def check_same_shape(planned: ModelSpec, loaded: ModelSpec, what: str) -> None:
    """Refuse a spec (``what``'s) of another shape than the model loaded: another family,
    layer count, head count or head size (one line). The name and the token counts may
    differ: they describe the model, the plans follow the model's calls.
    """
    planned_shape = tuple(getattr(planned, name) for name in _SHAPE_FIELDS)
    loaded_shape = tuple(getattr(loaded, name) for name in _SHAPE_FIELDS)
    if planned_shape != loaded_shape:
        raise PlanFileError(
            f"{what} is for {planned.name} ("
            + ", ".join(f"{n} {v}" for n, v in zip(_SHAPE_FIELDS, planned_shape, strict=True))
            + "), the model loaded has " + ", ".join(
                f"{n} {v}" for n, v in zip(_SHAPE_FIELDS, loaded_shape, strict=True)))


def check_plan_fits_call(run_plan: RunPlan, stream_tokens: Sequence[int], batch: int,
                         dtype: str, num_steps: int | None) -> None:
    """Refuse a plan whose token streams, batch, dtype or step count are not the ones the
    model's first call shows (one line)."""
    planned = (canonical_streams(run_plan.stream_tokens), run_plan.options.batch,
               run_plan.options.dtype)
    running = (canonical_streams(stream_tokens), batch, dtype)
    if planned != running:
        raise PlanFileError(
            f"the plan is for token streams {planned[0]}, batch {planned[1]}, {planned[2]}; "
            f"the model runs {running[0]}, batch {running[1]}, {running[2]} (make the plan "
            "with this model's --resolution, --batch-size and --dtype)")
    if num_steps is not None and num_steps != run_plan.num_steps:
        raise PlanFileError(f"the plan covers {run_plan.num_steps} denoising steps, the run "
                            f"has {num_steps}")
