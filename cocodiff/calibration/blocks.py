"""The model's real transformer blocks, timed as the runtime runs them on one rank of a step,
with nothing communicated (:mod:`cocodiff.calibration.standin`)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cocodiff.calibration.collect import WorldLineup, gather_floats
from cocodiff.calibration.compute import (
    ComputeRates,
    Lineup,
    device_clock,
    effective_rates,
    layer_roofline_seconds,
    median_of,
    timed_rounds,
)
from cocodiff.calibration.model_shapes import model_tokens, tiny_transformer_config
from cocodiff.calibration.options import CalibrateOptions, CalibrationError

if TYPE_CHECKING:
    from cocodiff.calibration.standin import StandInTransport
    from cocodiff.models.families import ModelFamily


@dataclass(frozen=True, slots=True)
class BlockTiming:
    """One rank's timing of the model's real transformer blocks on its local shard, every
    rank of the lineup timing at once.

    Figures are the process's CPU seconds (the median round of
    :func:`~cocodiff.calibration.compute.timed_rounds`): the work at one core, with every
    rank's work competing for the caches and memory as in a step, but without the time a
    rank waited for a core, which depends on how the OS interleaved the ranks and on what
    else ran on the machine. The ``*_wall_s`` figures are the wall-clock ones, kept beside
    them for comparison (with ranks sharing cores, wall = CPU / the cores a rank had). On
    an accelerator the figures are the wall clock's, the device synchronised around each
    block (its work is not the process's CPU).

    Attributes:
        blocks: transformer blocks timed per forward (the model's layers).
        blocks_s: all blocks of one forward, as the runtime runs them on one rank.
        layer_s: one layer: ``blocks_s / blocks``.
        outside_blocks_s: one forward outside its blocks (the sharding hooks, embedders,
            RoPE's positions, norm_out, proj_out, the output's gather: what a rank runs
            besides the blocks).
        scheduler_step_s: one flow-match Euler step on the full latents (every rank runs
            it after the output is gathered).
        layer_wall_s: ``layer_s`` by the wall clock (blocks and attention alike).
        outside_blocks_wall_s: ``outside_blocks_s`` by the wall clock.
        rounds: rounds of forwards timed; round_s: about how long each lasted.
    """

    blocks: int
    blocks_s: float
    layer_s: float
    outside_blocks_s: float = 0.0
    scheduler_step_s: float = 0.0
    layer_wall_s: float = 0.0
    outside_blocks_wall_s: float = 0.0
    rounds: int = 0
    round_s: float = 0.0

    @property
    def step_overhead_s(self) -> float:
        """A denoising step's compute outside the blocks, as this rank ran it."""
        return self.outside_blocks_s + self.scheduler_step_s


def flux_inputs(config, image_tokens: int, text_tokens: int, dtype) -> dict:
    """FLUX transformer inputs holding ``image_tokens`` image and ``text_tokens`` text
    tokens (positions are a row of the image, values random)."""
    import torch

    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int):
        return torch.randn(*shape, generator=gen).to(dtype)

    img_ids = torch.zeros(image_tokens, 3)
    img_ids[:, 2] = torch.arange(float(image_tokens))
    return {
        "hidden_states": randn(1, image_tokens, config.in_channels),
        "encoder_hidden_states": randn(1, text_tokens, config.joint_attention_dim),
        "pooled_projections": randn(1, config.pooled_projection_dim),
        "timestep": torch.full((1,), 0.5, dtype=dtype),
        "guidance": torch.full((1,), 3.5, dtype=dtype) if config.guidance_embeds else None,
        "img_ids": img_ids,
        "txt_ids": torch.zeros(text_tokens, 3),
    }


def _timed_classes() -> dict[str, ModelFamily]:
    """Transformer class name -> the family record that says how to time its blocks."""
    from cocodiff.models.families import FAMILIES

    return {name: family for family in FAMILIES.values() if family.block_inputs
            for name in family.transformer_classes}


def block_timing(class_name: object) -> tuple[Callable[..., dict], tuple[str, ...]]:
    """The family record's builder of local-shard inputs and the block lists it times."""
    from cocodiff.models import load_object

    timed = _timed_classes()
    family = timed.get(str(class_name))
    if family is None:
        raise CalibrationError(
            f"cannot time the real blocks of {class_name}; supported: {', '.join(timed)}")
    assert family.block_inputs is not None
    return load_object(family.block_inputs), family.timed_blocks


def build_transformer(config: dict[str, Any]):
    """The diffusers transformer of ``config`` (random weights from a fixed seed)."""
    import diffusers
    import torch

    name = config.get("_class_name")
    block_timing(name)
    cls = getattr(diffusers, str(name))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls.from_config(config).eval()


def standin_forward(transformer, stream_tokens: Sequence[int], world: int, rank: int = 0,
                    dtype_name: str = "float32", device: Any = "cpu"
                    ) -> tuple[Callable[[], Any], StandInTransport]:
    """``(forward, stand-in)``: ``transformer`` parallelised in place as rank ``rank`` of
    ``world`` Ulysses ranks over a :class:`StandInTransport` (nothing communicated), and a
    callable that runs one forward of a step of ``stream_tokens`` (image, text) tokens on
    ``device``. Call it under ``torch.inference_mode()``, as the runtime runs a step."""
    import torch

    from cocodiff.calibration.standin import StandInTransport
    from cocodiff.runtime.parallel import parallelize

    build_inputs, _lists = block_timing(type(transformer).__name__)
    dtype = getattr(torch, dtype_name)
    transformer.to(device=device, dtype=dtype)
    standin = StandInTransport(rank, world)
    standin.runtime = parallelize(transformer, standin, "flat")
    image, text = stream_tokens
    inputs = {name: value.to(device) if isinstance(value, torch.Tensor) else value
              for name, value in build_inputs(transformer.config, image, text, dtype).items()}
    return (lambda: transformer(**inputs, return_dict=False)), standin


def timed_model(options: CalibrateOptions) -> tuple[dict[str, Any], Any, tuple[int, int]] | None:
    """``(transformer config, model spec, (image, text) tokens)`` of ``options.model`` at
    its calibration size, when its transformer is built and timed here (see
    :func:`tiny_transformer_config`); None otherwise (the same answer on every rank)."""
    config = tiny_transformer_config(options.model)
    if config is None or config.get("_class_name") not in _timed_classes():
        return None
    spec, tokens, image = model_tokens(options.model, options.tokens, options.resolution)
    return config, spec, (image, tokens - image)


def model_standin(options: CalibrateOptions, world: int, rank: int
                  ) -> tuple[Callable[[], Any], StandInTransport] | None:
    """:func:`standin_forward` of ``options.model``'s transformer at its calibration size;
    None when that transformer is not built here (the same answer on every rank)."""
    from cocodiff.runtime.hooks import UnsupportedModelError

    model = timed_model(options)
    if model is None:
        return None
    config, _spec, streams = model
    try:
        return standin_forward(build_transformer(config), streams, world, rank, options.dtype)
    except UnsupportedModelError:
        return None


def time_blocks(transformer, stream_tokens: Sequence[int], world: int, rank: int = 0,
                dtype_name: str = "float32", rounds: int = 5, round_s: float = 0.3,
                lineup: Lineup | None = None, device: Any = "cpu") -> BlockTiming:
    """Time ``transformer``'s real blocks as rank ``rank`` of ``world`` Ulysses ranks runs
    them in a step of ``stream_tokens`` (image, text): the runtime parallelises the
    transformer (in place) over a :class:`StandInTransport`, so its sharding hooks, its
    attention processors (packing and unpacking each exchange, attention at the Ulysses
    shape) and the output's gather all run, and nothing is communicated. Forwards run in
    ``rounds`` loops of about ``round_s`` each, lined up over ``lineup`` (every rank at
    once): a throughput, as ranks sharing cores run in a step (see :func:`timed_rounds`).

    Why the runtime's path: a step runs the blocks through the runtime's processors and
    hooks, not diffusers' own attention (which calibrate timed before, corrected to the
    Ulysses shape: 1.67 ms per layer of the small model and 1.00 ms outside the blocks,
    where this gives 1.73 and 1.10; 4 ranks on loopback, docs/changelog.md, 2026-11-25).

    On an accelerator (``device``) the device is synchronised at each block's start and
    end, so that the wall-clock figures are its work (the CPU ones are then only the
    host's share)."""
    import torch

    forward, _standin = standin_forward(transformer, stream_tokens, world, rank, dtype_name,
                                        device)
    sync = device_clock(device)[0] or (lambda: None)
    _build_inputs, lists = block_timing(type(transformer).__name__)
    blocks = [block for attr in lists for block in getattr(transformer, attr)]
    began: list[tuple[float, float]] = []
    in_blocks = [0.0, 0.0]  # cumulative (wall, CPU) seconds inside the blocks

    def before(module, args, kwargs) -> None:
        sync()
        began.append((time.perf_counter(), time.process_time()))

    def after(module, args, kwargs, output) -> None:
        sync()
        wall, cpu = began.pop()
        in_blocks[0] += time.perf_counter() - wall
        in_blocks[1] += time.process_time() - cpu

    handles = [hook for block in blocks for hook in (
        block.register_forward_pre_hook(before, with_kwargs=True),
        block.register_forward_hook(after, with_kwargs=True))]
    try:
        with torch.inference_mode():
            timed = timed_rounds(forward, rounds, round_s, lineup,
                                 inside=lambda: (in_blocks[0], in_blocks[1]), sync=sync)
    finally:
        for handle in handles:
            handle.remove()
    scheduler = _scheduler_step_s(transformer.config, stream_tokens[0],
                                  getattr(torch, dtype_name), lineup)

    def outside(clock: str) -> float:
        return statistics.median(
            max(0.0, getattr(r, clock) - getattr(r, f"inside_{clock}")) for r in timed)

    # The CPU's work by its process time; an accelerator's by the wall clock.
    clock = device_clock(device)[1]
    blocks_s = median_of(timed, f"inside_{clock}")
    return BlockTiming(len(blocks), blocks_s, blocks_s / len(blocks), outside(clock), scheduler,
                       median_of(timed, "inside_wall_s") / len(blocks), outside("wall_s"),
                       rounds, round_s)


def _scheduler_step_s(config, image_tokens: int, dtype, lineup: Lineup | None) -> float:
    """CPU seconds of one scheduler step on the full latents (``image_tokens`` x the
    transformer's input channels): the flow-match Euler step of the FLUX, SD3 and
    Qwen-Image pipelines, lined up over ``lineup``."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    rounds, round_s, max_calls = 3, 0.02, 200
    scheduler = FlowMatchEulerDiscreteScheduler()
    # Enough steps for every call of every round (each call moves one step on).
    scheduler.set_timesteps(rounds * max_calls + 4)
    latents = torch.zeros(1, image_tokens, config.in_channels, dtype=dtype)
    noise = torch.ones_like(latents)
    timestep = scheduler.timesteps[0]
    with torch.inference_mode():
        timed = timed_rounds(lambda: scheduler.step(noise, timestep, latents, return_dict=False),
                             rounds, round_s, lineup, max_calls=max_calls)
    return median_of(timed, "cpu_s")


def measure_blocks(transport, options: CalibrateOptions, compute: ComputeRates,
                   world: int, device: Any = "cpu") -> dict[str, Any] | None:
    """Time the model's real blocks on every rank at once (collective; the same decision
    on every rank) and give the effective rate; None when the model's transformer is not
    built here (see :func:`tiny_transformer_config`)."""
    from cocodiff.runtime.hooks import UnsupportedModelError
    from cocodiff.schedules import DTYPE_BYTES
    from cocodiff.schedules.ulysses import head_split, layer_shape

    model = timed_model(options)
    if model is None:
        return None
    config, spec, streams = model
    transformer = build_transformer(config)
    # Rounds of ~0.3 s: dozens of forwards of a tiny model, many time slices of the OS.
    rounds, round_s = (3, 0.1) if options.quick else (7, 0.3)
    try:
        timing = time_blocks(transformer, streams, world, transport.rank, options.dtype, rounds,
                             round_s, WorldLineup(transport), device)
    except UnsupportedModelError:  # the same on every rank: the runtime cannot run it here
        return None
    del transformer
    # The same forward with the whole sequence on every rank (a one-rank world): how the
    # work outside the blocks grows with the rank's share of the sequence, which a
    # PipeFusion stage's rank carries u times a flat rank's of (step_overhead_line).
    whole = (time_blocks(build_transformer(config), streams, 1, 0, options.dtype, rounds,
                         round_s, WorldLineup(transport), device).step_overhead_s
             if world > 1 else timing.step_overhead_s)
    rows = gather_floats(transport, [timing.layer_s, timing.step_overhead_s, timing.layer_wall_s,
                                     timing.outside_blocks_wall_s, whole])
    per_rank, per_rank_overhead, per_rank_wall, per_rank_outside_wall, per_rank_whole = (
        list(column) for column in zip(*rows, strict=True))
    overhead_s = statistics.median(per_rank_overhead)
    fixed_s, sequence_s = step_overhead_line(overhead_s, statistics.median(per_rank_whole),
                                             world)
    layer_s = statistics.median(per_rank)
    # The layer as a plan charges it on rank 0 (padded per-stream shards, its heads).
    cost_shape = layer_shape(head_split(spec, world, streams), 0,
                             DTYPE_BYTES[options.dtype])
    effective, effective_memory = effective_rates(spec, cost_shape, layer_s, compute.tflops,
                                                  compute.memory_gbps)
    from cocodiff.cost import MATMUL_OPS, OPS, op_cost

    return {
        "method": "the runtime's forward of rank r of the world, nothing communicated",
        "layer_s": layer_s,
        "per_rank_layer_s": per_rank,
        "rank0": dataclasses.asdict(timing),
        "layer_flops": sum(op_cost(spec, op, cost_shape).flops for op in OPS),
        "layer_matmul_flops": sum(op_cost(spec, op, cost_shape).flops for op in MATMUL_OPS),
        "matmul_rate_layer_s": layer_roofline_seconds(spec, cost_shape, compute.tflops,
                                                      compute.memory_gbps),
        "effective_tflops": effective,
        "effective_memory_gbps": effective_memory,
        # Each rank's forward outside its blocks plus the scheduler's step.
        "step_overhead_s": overhead_s,
        "per_rank_step_overhead_s": per_rank_overhead,
        # The same with the whole sequence on the rank, and the line through both.
        "whole_sequence_overhead_s": statistics.median(per_rank_whole),
        "per_rank_whole_sequence_overhead_s": per_rank_whole,
        "step_overhead_fixed_s": fixed_s,
        "step_overhead_sequence_s": sequence_s,
        # The same by the wall clock, all ranks busy (not used: for comparison).
        "per_rank_layer_wall_s": per_rank_wall,
        "per_rank_outside_blocks_wall_s": per_rank_outside_wall,
    }


def step_overhead_line(shard_s: float, whole_s: float, world: int) -> tuple[float, float]:
    """``(fixed, per sequence)`` seconds of a step's work outside the blocks, as a line in
    the rank's share of the sequence through ``shard_s`` at ``1/world`` and ``whole_s`` at
    1 (the topology's ``step_overhead_us`` and ``step_overhead_sequence_us``). The slope
    is kept at 0 or more (timing noise can put the whole sequence below the shard), and
    one rank (``world`` 1) has no second point: all of it is fixed."""
    if world <= 1:
        return shard_s, 0.0
    sequence_s = max(0.0, (whole_s - shard_s) / (1.0 - 1.0 / world))
    return shard_s - sequence_s / world, sequence_s
