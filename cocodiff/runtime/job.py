"""One denoising job on every rank of a launch (what ``cocodiff run`` does once its
flags are checked).

Every rank loads the same model, the transformer is parallelised over the transport,
and rank 0 shows progress and writes the outputs (each written whole or not at all).
Every wait on a peer is bounded by the transport's timeout; NaN or Inf in a step stops
the run with the step and layer (unless ``guards`` is off), before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cocodiff.runtime.failures import RankFailure
from cocodiff.util.errors import CocodiffError


@dataclass(frozen=True, slots=True)
class RunRequest:
    """What one run asks of every rank, checked by the command layer."""

    model: str  # a tiny model's name or a diffusers pipeline directory
    prompt: str | None  # None: the model's default
    steps: int
    resolution: str | None  # PIXELS or WIDTHxHEIGHT; None: the model's
    frames: int | None
    seed: int
    schedule: str  # a plan schedule or a baseline (cocodiff.runtime.baseline)
    plan_layout: bool  # the planner chooses the Ulysses x Ring x batch degrees
    transport: str
    timeout_s: float | None  # None: the transport's default for its backend
    dtype: str
    guards: bool  # check every step for NaN/Inf
    progress: bool  # a progress bar on rank 0
    reference: bool  # also run the exact plan and report the quality against it
    record_activity: Path | None
    output: Path | None
    json: Path | None
    save_latents: Path | None
    latents_format: str  # "diffusers" or "unpacked"
    argv: tuple[str, ...]  # what every rank must agree on


def run_job(request: RunRequest, launch, fault, run_plan, grid, parallel, options) -> None:
    """Generate on every rank of ``launch`` and write the outputs on rank 0.

    Args:
        fault: the injected fault for tests (:mod:`cocodiff.runtime.faults`), or None.
        run_plan: the plan file's plan (:class:`~cocodiff.schedules.run_plan.RunPlan`), or None.
        grid: the ranks' :class:`~cocodiff.schedules.RankGrid`; None: the nodes the launch
            spans.
        parallel: the Ulysses x Ring x batch layout; None: pure Ulysses (or the
            planner's, under ``plan_layout``); a PipelineLayout: pipefusion's stages.
        options: the schedule's :class:`~cocodiff.schedules.PlanOptions`.
    """
    import torch

    from cocodiff.runtime.faults import install_faults
    from cocodiff.runtime.nodes import launched_grid
    from cocodiff.runtime.quiet import quiet_libraries

    # Library chatter (tokenizer length notes, deprecations, loading bars) would drown the
    # one line a user needs.
    quiet_libraries()

    from cocodiff.layout import PipelineLayout
    from cocodiff.models import load_object
    from cocodiff.quality import compare
    from cocodiff.runtime.baseline import BASELINES, BaselineRuntime
    from cocodiff.runtime.digits import read_agreement
    from cocodiff.runtime.guards import NumericsGuard
    from cocodiff.runtime.model_names import model_size, model_spec
    from cocodiff.runtime.parallel import UlyssesRuntime, parallelize
    from cocodiff.runtime.pipelines import decode, load_pipeline, run_pipeline, tiny_name_of
    from cocodiff.runtime.tiny import DEFAULT_PROMPT, TINY_DEFAULTS
    from cocodiff.runtime.vmajor import gather_activity
    from cocodiff.schedules.run_plan import Generation
    from cocodiff.util.atomic import atomic_write_text
    from transports.registry import create_transport
    from transports.torch_dist import rank_device

    transport = None
    if launch.is_distributed:
        transport = create_transport(request.transport, timeout_s=request.timeout_s)
    try:
        transport, step_fault = install_faults(fault, transport, launch.rank)
        if transport is not None:
            # Ranks on other hosts may read another file of the same name: agree on content.
            agree_on_arguments(transport, list(request.argv))
            if grid is None:
                grid = launched_grid(transport)
            if request.record_activity and grid is None:
                raise CocodiffError("--record-activity: V-Major acts on the inter-node tier, "
                                    "and every rank is on one node; give --grid")
        dtype = getattr(torch, request.dtype)
        pipe = load_pipeline(request.model, dtype).to(rank_device(transport, launch.local_rank))
        tiny = tiny_name_of(request.model)
        prompt = (request.prompt if request.prompt is not None
                  else TINY_DEFAULTS[tiny].prompt if tiny else DEFAULT_PROMPT)
        width, height, frames = model_size(request.model, request.resolution, request.frames)
        # Tiny models use short prompts; real ones keep their pipeline's default length.
        text_tokens = TINY_DEFAULTS[tiny].max_sequence_length if tiny else None
        runtime: BaselineRuntime | UlyssesRuntime | None = None
        if transport is not None and request.schedule in BASELINES:
            runtime = BASELINES[request.schedule](pipe, transport)
        elif transport is not None:
            if request.plan_layout:
                parallel = _planned_parallel(pipe, grid, launch.world_size, width, height,
                                             frames)
            # The model as `cocodiff plan --model` names it, and the size: the plan built
            # here is then the one `plan --out` writes for the same flags (same hash).
            generation = Generation(model_spec(request.model), (width, height), frames)
            if isinstance(parallel, PipelineLayout):
                from cocodiff.runtime.pipefusion import parallelize_pipefusion

                runtime = parallelize_pipefusion(pipe, transport, parallel, grid,
                                                 options=options, run_plan=run_plan,
                                                 generation=generation)
            elif parallel is not None and not parallel.is_pure_ulysses:
                from cocodiff.runtime.hybrid import parallelize_hybrid

                runtime = parallelize_hybrid(pipe, transport, request.schedule, parallel, grid,
                                             options=options, run_plan=run_plan,
                                             generation=generation)
            else:
                runtime = parallelize(pipe, transport, request.schedule, grid, options=options,
                                      run_plan=run_plan, generation=generation)
        ulysses = runtime if isinstance(runtime, UlyssesRuntime) else None
        guard = NumericsGuard(launch.rank).install(pipe.transformer) if request.guards else None
        step_times: list[float] = []
        # This rank's traffic after each step: bytes sent per tier, exchanges started.
        traffic: list[list[float]] = []
        with StepProgress(is_root=launch.rank == 0 and request.progress,
                       steps=request.steps) as advance:
            last = time.perf_counter()
            started = last

            def on_step(done: int, total: int) -> None:
                nonlocal last
                now = time.perf_counter()
                step_times.append(now - last)
                last = now
                if guard is not None:
                    guard.end_step()
                if ulysses is not None:
                    traffic.append([*ulysses.bytes_by_tier.values(), ulysses.exchanges_started])
                if step_fault is not None:
                    step_fault.after_step(done)
                advance()

            if ulysses is not None:
                ulysses.start_generation(request.steps)
            latents = run_pipeline(pipe, prompt, request.steps, width, height, frames,
                                   request.seed, on_step, max_sequence_length=text_tokens)
            total_s = time.perf_counter() - started
        if guard is not None:
            guard.check_latents(latents)
        traffic_record = _traffic_per_step(transport, ulysses, traffic)
        # The plan this run executed (an exact reference below runs another).
        plan_sha256 = (ulysses.run_plan.sha256 if ulysses is not None
                       and ulysses.run_plan is not None
                       else run_plan.sha256 if run_plan is not None else None)
        vmajor_report, activity = None, None
        if ulysses is not None and ulysses.vmajor is not None:
            vmajor_report, activity = gather_activity(ulysses)
        reference = None
        if request.reference:
            reference = latents  # one process: nothing is lossy
            if ulysses is not None:
                reference = _exact_reference(request, prompt, pipe, ulysses, guard,
                                             launch.rank == 0, (width, height, frames),
                                             text_tokens)
        if launch.rank == 0:
            record: dict[str, Any] = {}
            if vmajor_report is not None:
                record["vmajor"] = vmajor_report.to_json()
                print(vmajor_report.summary(), flush=True)
            image = None
            if reference is not None:
                image = decode(pipe, latents)
                reference_image = decode(pipe, reference)
                quality = compare(reference, latents, reference_image, image)
                record["quality"] = quality.to_json()
                print(f"quality against the exact plan: {quality.summary()}", flush=True)
                reader_name = TINY_DEFAULTS[tiny].reader if tiny else None
                if reader_name:
                    agreement = read_agreement(load_object(reader_name)(), prompt,
                                               reference_image, image)
                    record["quality"]["classifier"] = agreement.to_json()
                    print(agreement.summary(), flush=True)
            if request.record_activity and activity is not None:
                atomic_write_text(request.record_activity, activity.to_json())
            _write_outputs(request, pipe, latents, image, {
                "model": request.model,
                "num_ranks": launch.world_size,
                "schedule": request.schedule,
                "grid": list(grid.shape) if grid else None,
                "parallel": parallel.name if parallel is not None else None,
                "transport": transport.name if transport else "none",
                "steps": request.steps,
                "resolution": [width, height],
                "frames": frames,
                "step_times_s": step_times,
                "total_s": total_s,
                "comm_s": runtime.comm_s if runtime else 0.0,
                "plan_sha256": plan_sha256,
                **traffic_record,
                "output": str(request.output) if request.output else None,
                **record,
            })
        if transport is not None:
            transport.barrier()
    finally:
        if transport is not None:
            transport.close()


def _planned_parallel(pipe, grid, num_ranks: int, width: int, height: int, frames: int):
    """``--parallel-layout auto``: the planner's layout for this model on a one-node machine of
    ``num_ranks`` ranks (the `cluster` preset; the ranks' grid when one is given)."""
    from cocodiff.models import spec_from_config
    from cocodiff.simulator.planner import rank_layouts
    from topology import build_topology
    from topology.presets import cluster

    transformer = pipe.transformer
    spec = spec_from_config({"_class_name": type(transformer).__name__,
                             **dict(transformer.config)}, name=type(transformer).__name__)
    nodes, gpus, tiles = grid.shape if grid is not None else (1, num_ranks, 1)
    topology = build_topology(cluster(num_nodes=nodes, ranks_per_node=gpus * tiles))
    streams = (spec.image_tokens(width, height, frames), spec.text_tokens)
    return rank_layouts(spec, topology, streams).best.layout


def _traffic_per_step(transport, runtime, traffic: list[list[float]]) -> dict[str, Any]:
    """What every rank's exchanges moved, summed over the ranks: bytes sent to other ranks
    per link tier (the mean of a denoising step) and exchanges started in each step, as
    ``cocodiff simulate`` reports them for the same plan. Collective: every rank calls it."""
    if runtime is None or not traffic:
        return {}
    import torch

    from cocodiff.runtime.exchange import all_gather_rows

    # (steps, tiers + 1), cumulative -> per step
    mine = torch.tensor(traffic, dtype=torch.float64)
    mine = torch.diff(mine, dim=0, prepend=torch.zeros_like(mine[:1]))
    # (ranks, steps, tiers + 1) -> summed over the ranks
    total = all_gather_rows(transport, mine.unsqueeze(0)).sum(dim=(0, 1))
    tiers = list(runtime.bytes_by_tier)
    steps = total.shape[0]
    return {
        "bytes_by_tier": {tier: float(total[:, i].sum()) / steps for i, tier in enumerate(tiers)},
        "exchanges_per_step": [int(n) for n in total[:, len(tiers)].tolist()],
    }


def _exact_reference(request: RunRequest, prompt: str, pipe, runtime, guard, is_root: bool,
                     size: tuple[int, int, int], text_tokens: int | None):
    """The same generation with V-Major off (TAPA + V-First, exact), or for PipeFusion
    with every step synchronous (no stale K/V): the final latents."""
    from cocodiff.runtime.pipefusion import PipelineRuntime
    from cocodiff.runtime.pipelines import run_pipeline

    pipeline = isinstance(runtime, PipelineRuntime)
    options = runtime.vmajor
    if pipeline:
        runtime.exact = True
    else:
        runtime.vmajor = None
    try:
        runtime.start_generation(request.steps)
        with StepProgress(is_root=is_root and request.progress, steps=request.steps,
                       label="exact reference") as advance:
            def on_step(done: int, total: int) -> None:
                if guard is not None:
                    guard.end_step()
                advance()

            latents = run_pipeline(pipe, prompt, request.steps, *size, request.seed, on_step,
                                   max_sequence_length=text_tokens)
    finally:
        if pipeline:
            runtime.exact = False
        else:
            runtime.vmajor = options
    if guard is not None:
        guard.check_latents(latents)
    return latents


def agree_on_arguments(transport, argv: list[str]) -> None:
    """Every rank must run the same command: compare a digest of the arguments."""
    import torch

    from cocodiff.runtime.exchange import all_gather_rows

    digest = hashlib.sha256("\0".join(argv).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    everyone = all_gather_rows(transport, mine).flatten().tolist()
    differing = [rank for rank, value in enumerate(everyone) if value != everyone[0]]
    if differing:
        raise RankFailure(
            f"ranks disagree on arguments: ranks {differing} differ from rank 0"
        )


class StepProgress:
    """A rich progress bar over denoising steps on rank 0; nothing elsewhere."""

    def __init__(self, is_root: bool, steps: int, label: str = "denoising") -> None:
        self._enabled = is_root
        self._steps = steps
        self._label = label
        self._bar: Any = None
        self._task: Any = None

    def grow(self, steps: int) -> None:
        """More steps than first announced (e.g. validate's extra rounds)."""
        self._steps += steps
        if self._bar is not None:
            self._bar.update(self._task, total=self._steps)

    def __enter__(self):
        if not self._enabled:
            return lambda: None
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn(self._label), BarColumn(), TextColumn("{task.completed}/"
                             "{task.total}"), TimeElapsedColumn(), transient=False)
        self._bar.start()
        self._task = self._bar.add_task("steps", total=self._steps)
        return lambda: self._bar.advance(self._task)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


def _write_outputs(request: RunRequest, pipe, latents, image, record: dict) -> None:
    """Write what was asked for; ``image``: the decoded latents, or None (decoded here)."""
    import torch

    from cocodiff.runtime.pipelines import decode, diffusers_latents
    from cocodiff.util.atomic import atomic_write, atomic_write_text

    if request.save_latents:
        saved = (latents if request.latents_format == "unpacked"
                 else diffusers_latents(pipe, latents))
        atomic_write(request.save_latents, lambda tmp: torch.save(saved.detach().cpu(), tmp))
    if request.output:
        image = decode(pipe, latents) if image is None else image
        if isinstance(image, list):  # video: the frames side by side
            from PIL import Image

            strip = Image.new("RGB", (image[0].width * len(image), image[0].height))
            for index, frame in enumerate(image):
                strip.paste(frame, (index * frame.width, 0))
            image = strip
        atomic_write(request.output, lambda tmp: image.save(tmp, format="PNG"))
    if request.json:
        atomic_write_text(request.json, json.dumps(record, indent=2))
