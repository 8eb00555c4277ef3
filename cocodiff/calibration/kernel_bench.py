"""The kernel classes of :mod:`cocodiff.kernels` timed on the device a run computes on (the
rank's accelerator, else its CPU), the kernel model's rates fitted to them alone
(:mod:`~cocodiff.calibration.kernel_fit`), and the model's price of the real blocks beside
their measured time.

What is timed, at the model's shapes on one rank of this world (``LayerShapes``):

- matrix products ``(m x k) @ (k x n)`` at the layer's ``(k, n)`` (projections, MLP up and
  down) and ``m`` = the rank's tokens x 1, 2, 4 (the spread the line needs);
- attention (``scaled_dot_product_attention``) over the rank's heads of the model's head
  size at sequence lengths around the model's (``S/4`` .. ``2S``), and with ``S/8`` ..
  ``S/2`` queries over every head against the model's ``S`` keys, as the runtime runs a
  PipeFusion patch's attention step against its K/V buffer (the query factor,
  :func:`patch_attention_points`);
- elementwise work (a multiply, a layer norm, a tanh GELU) at the rank's rows x 1 .. 64,
  by the bytes each reads and writes;
- a one-element op: on the CPU the per-launch cost itself, on an accelerator the host's
  CPU time to issue a bare op (``host_us``);
- the host's time per ATen op as model code issues them: a small stack of module calls at
  sizes where its kernels cost nothing (:func:`cocodiff.calibration.dispatch.host_stack`),
  its process CPU time over the ops it dispatches (counted, ``host_op_us``). Eager, every
  op a layer dispatches costs this (:data:`cocodiff.kernels.DISPATCHED_OPS`).

Each is a throughput, every rank at once (:func:`~cocodiff.calibration.compute.timed_rounds`):
on the CPU the process's CPU seconds, on an accelerator the wall clock, the device
synchronised around each round. ``torch.compile`` is not timed (compiled mode keeps
eager's launch costs).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cocodiff.calibration.compute import Lineup, device_clock, median_of, timed_rounds
from cocodiff.calibration.dispatch import count_ops, host_stack, runtime_ops_per_layer
from cocodiff.calibration.kernel_fit import (
    AttentionPoint,
    ElementwisePoint,
    GemmPoint,
    KernelFit,
    fit_device_rates,
)
from cocodiff.calibration.model_shapes import LayerShapes
from cocodiff.calibration.options import CalibrationError

GEMM_ROW_FACTORS = (1, 2, 4)
ATTENTION_LENGTH_FACTORS = (0.25, 0.5, 1.0, 2.0)
# Queries (of the model's S) timed against S keys: a pipelined patch's attention, M = 2..8.
ATTENTION_QUERY_FACTORS = (0.125, 0.25, 0.5)
ELEMENTWISE_ROW_FACTORS = (1, 2, 4, 8, 16, 64)
# The host microbenchmark's rounds at least (about 0.5 s in all).
HOST_ROUNDS, HOST_ROUND_S = 5, 0.1
# Shorter sequences than this are not timed (a table entry of a few tokens says nothing).
MIN_ATTENTION_TOKENS = 8
# Rows of the elementwise microbenchmarks read + written per element by each op, as the
# kernel model counts passes (cocodiff.kernels): a binary op reads two and writes one.
ELEMENTWISE_PASSES = {"mul": 3, "layer_norm": 2, "gelu": 2}


@dataclass(frozen=True, slots=True)
class KernelPoints:
    """One rank's (or the ranks' median) microbenchmarks."""

    elementwise: tuple[ElementwisePoint, ...]
    gemms: tuple[GemmPoint, ...]
    attention: tuple[AttentionPoint, ...]
    host_us: float
    host_op_us: float = 0.0
    host_stack_ops: int = 0

    def seconds(self) -> list[float]:
        """Every time in a fixed order (to gather over ranks), the host's last."""
        return ([p.seconds for p in self.elementwise] + [p.seconds for p in self.gemms]
                + [p.seconds for p in self.attention] + [self.host_us * 1e-6,
                                                         self.host_op_us * 1e-6])

    def with_seconds(self, seconds: list[float]) -> KernelPoints:
        """The same points with ``seconds`` (the order of :meth:`seconds`)."""
        it = iter(seconds)
        return KernelPoints(
            tuple(dataclasses.replace(p, seconds=next(it)) for p in self.elementwise),
            tuple(dataclasses.replace(p, seconds=next(it)) for p in self.gemms),
            tuple(dataclasses.replace(p, seconds=next(it)) for p in self.attention),
            next(it) * 1e6, next(it) * 1e6, self.host_stack_ops)

    def to_json(self) -> dict[str, Any]:
        return {"elementwise": [dataclasses.asdict(p) for p in self.elementwise],
                "gemms": [dataclasses.asdict(p) for p in self.gemms],
                "attention": [dataclasses.asdict(p) for p in self.attention],
                "host_us": self.host_us, "host_op_us": self.host_op_us,
                "host_stack_ops": self.host_stack_ops}


def time_kernels(shapes: LayerShapes, dtype_name: str = "float32", device: Any = "cpu",
                 rounds: int = 5, round_s: float = 0.05, lineup: Lineup | None = None
                 ) -> KernelPoints:
    """Time every microbenchmark of this module's docstring on ``device``."""
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    device = torch.device(device)
    sync, clock = device_clock(device)
    size = torch.finfo(dtype).bits // 8
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device, dtype)

    def timed(call: Callable[[], object], attribute: str = clock) -> float:
        return median_of(timed_rounds(call, rounds, round_s, lineup, sync=sync), attribute)

    s_loc, d, s = shapes.local_tokens, shapes.hidden_size, shapes.total_tokens
    inner = max(1, round(shapes.mlp_ratio * d))
    on_cpu = device.type == "cpu"
    elementwise, gemms, attention = [], [], []
    with torch.inference_mode():
        for factor in ELEMENTWISE_ROW_FACTORS:
            x, y = rand(factor * s_loc, d), rand(factor * s_loc, d)
            calls = {"mul": lambda x=x, y=y: x * y,
                     "layer_norm": lambda x=x: F.layer_norm(x, (d,)),
                     "gelu": lambda x=x: F.gelu(x, approximate="tanh")}
            for op, call in calls.items():
                nbytes = float(ELEMENTWISE_PASSES[op] * x.numel() * size)
                elementwise.append(ElementwisePoint(op, nbytes, timed(call)))
            del x, y
        one, other = rand(1), rand(1)
        tiny = timed_rounds(lambda: one * other, rounds, round_s, lineup, sync=sync)
        tiny_s, tiny_cpu_s = median_of(tiny, clock), median_of(tiny, "cpu_s")
        if on_cpu:  # all launch: pins the per-launch cost the small kernels pay
            elementwise.append(ElementwisePoint("mul", float(3 * size), tiny_s))
        for factor in GEMM_ROW_FACTORS:
            m = factor * s_loc
            x, hidden = rand(m, d), rand(m, inner)
            for k, n, a in ((d, d, x), (d, inner, x), (inner, d, hidden)):
                w = rand(k, n)
                gemms.append(GemmPoint(m, k, n, timed(lambda a=a, w=w: a @ w)))
            del x, hidden
        heads, head_dim = shapes.local_heads, shapes.head_dim
        lengths = sorted({max(MIN_ATTENTION_TOKENS, round(f * s))
                          for f in ATTENTION_LENGTH_FACTORS})
        for length in lengths:
            query, key, value = (rand(1, heads, length, head_dim) for _ in range(3))
            seconds = timed(lambda q=query, k=key, v=value:
                            F.scaled_dot_product_attention(q, k, v))
            attention.append(AttentionPoint(length, length, heads, head_dim, seconds))
        attention += patch_attention_points(shapes, rand, timed, attention)
        stack, inputs = host_stack(dtype, device)
        stack_ops = count_ops(lambda: stack(*inputs))
        # The host's own time (process CPU) on either device: what issuing costs it.
        # Every layer op pays it, so it gets longer rounds than one kernel's point (a
        # shared core's noise moves every op of the model at once).
        stack_s = median_of(timed_rounds(lambda: stack(*inputs), max(rounds, HOST_ROUNDS),
                                         max(round_s, HOST_ROUND_S), lineup, sync=sync), "cpu_s")
    return KernelPoints(tuple(elementwise), tuple(gemms), tuple(attention), tiny_cpu_s * 1e6,
                        stack_s / stack_ops * 1e6, stack_ops)


def patch_attention_points(shapes: LayerShapes, rand: Callable[..., Any],
                           timed: Callable[[Callable[[], object]], float],
                           square: list[AttentionPoint]) -> list[AttentionPoint]:
    """A pipelined patch's attention step: ``S/8 .. S/2`` queries over every head of the
    model (a one-rank stage) against ``S`` keys, run as the runtime runs it
    (``cocodiff.runtime.pipefusion.PatchBackend``: the patch's K and V written into the
    layer's buffer, the keys and values concatenated, attention on ``(B, tokens, heads,
    head size)`` tensors, its output scattered back), each time put in the contiguous
    table's terms by the ratio of ``square``'s point at ``S`` to the Ulysses rank's call
    at ``S`` in the runtime's layout (its own layout copies are priced apart): the query
    factor fitted on them then prices a patch's attention step against the Ulysses call
    the blocks were timed with. On a CPU a patch's interleaved heads, short query blocks
    and buffer copies cost more per FLOP (docs/pipefusion.md)."""
    import torch
    import torch.nn.functional as F

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2)).transpose(1, 2)

    def ulysses_call(heads: int) -> float:
        q, k, v = (rand(1, s, heads, shapes.head_dim) for _ in range(3))
        return timed(lambda: attend(q, k, v))

    def patch_step(queries: int, heads: int) -> float:
        fresh = [rand(1, queries, heads, shapes.head_dim) for _ in range(3)]  # Q, K, V
        buffers = [rand(1, s, heads, shapes.head_dim) for _ in range(2)]
        rows = torch.arange(queries, device=fresh[0].device)  # the tensors' device

        def step() -> None:
            for buffer, new in zip(buffers, fresh[1:], strict=True):
                buffer[:, rows] = new.index_select(1, rows)
            # The text's K/V ahead of the buffer's: a copy of the whole sequence's.
            keys, values = (torch.cat((b[:, :1], b[:, 1:]), dim=1) for b in buffers)
            result = fresh[0].new_zeros(fresh[0].shape)
            result[:, rows] = attend(fresh[0].index_select(1, rows), keys, values)
        return timed(step)

    s = shapes.total_tokens
    at_s = [p.seconds for p in square if p.kv_tokens == s]
    if not at_s:
        return []
    to_table = at_s[0] / ulysses_call(shapes.local_heads)
    heads = max(1, shapes.hidden_size // shapes.head_dim)
    return [AttentionPoint(queries, s, heads, shapes.head_dim,
                           patch_step(queries, heads) * to_table)
            for queries in sorted({q for q in (max(MIN_ATTENTION_TOKENS, round(f * s))
                                               for f in ATTENTION_QUERY_FACTORS) if q < s})]


def sm_count_of(device: Any) -> int:
    """The units an attention kernel's thread blocks spread over: an accelerator's SMs
    (Xe-cores), 1 on the CPU (a rank computes on one core: no partial wave)."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return 1
    properties = getattr(torch, device.type).get_device_properties(device)
    for name in ("multi_processor_count", "gpu_subslice_count"):
        count = getattr(properties, name, None)
        if isinstance(count, int) and count > 0:
            return count
    return 1


def fit_points(points: KernelPoints, device: Any) -> KernelFit:
    """The kernel model's rates of ``points`` timed on ``device`` (named ``calibrated-<type>``)."""
    import torch

    device = torch.device(device)
    return fit_device_rates(f"calibrated-{device.type}", points.elementwise, points.gemms,
                            points.attention, sm_count_of(device), points.host_us,
                            on_host=device.type == "cpu",
                            host_op_us=points.host_op_us or None)


def kernel_layer_seconds(spec, shape, rates, mode: str = "eager",
                         ops_per_layer: float | None = None) -> float:
    """One layer as the simulator prices it with ``rates``: every operation of
    :mod:`cocodiff.cost` a compute step of its own (as a plan emits them), each
    :func:`cocodiff.kernels.device_seconds`. ``ops_per_layer``: the ATen ops a layer
    dispatches eager, counted on the model at hand (else the family's table,
    :data:`cocodiff.kernels.DISPATCHED_OPS`)."""
    from cocodiff import kernels
    from cocodiff.cost import OPS, host_ops_per_launch, op_cost

    per_launch = (None if ops_per_layer is None
                  else host_ops_per_launch(spec, shape, ops_per_layer))
    total = 0.0
    for op in OPS:
        launched = op_cost(spec, op, shape).kernels
        if per_launch is not None:
            launched = tuple(k.with_host_ops(per_launch) for k in launched)
        if launched:
            total += kernels.device_seconds(launched, rates, mode)
    return total


# Where the real blocks were timed, the kernel model prices a calibrated topology's compute
# scaled to them: every kernel's time by one factor, measured / predicted layer (on this
# 2-core machine the microbenchmarks alone priced the blocks 7-32% short in ten
# calibrations: time the model does not split into kernels, and the ranks' contention).
# The factor keeps what the kernels say about shape (a launch's fixed cost, a GEMM's
# intercept), which the blocks' effective rate, proportional to FLOPs, cannot: a PipeFusion
# patch of a quarter image costs 0.73-0.84 of the whole where its FLOPs are 0.40. Past this
# miss the microbenchmarks and the blocks disagree too much for one factor (something else
# ran, or the model lacks a kernel): the blocks' effective rate stays.
KERNEL_SCALE_LIMIT = 0.5


def scaled_rates(rates, factor: float):
    """``rates`` (a ``topology.DeviceRates``) with every kernel's time multiplied by
    ``factor``: rates divided by it, fixed and per-launch costs multiplied."""
    return dataclasses.replace(
        rates, gemm_tflops=rates.gemm_tflops / factor,
        gemm_fixed_us=rates.gemm_fixed_us * factor,
        attention_tflops=tuple((length, rate / factor)
                               for length, rate in rates.attention_tflops),
        memory_gbps=rates.memory_gbps / factor, launch_us=rates.launch_us * factor,
        host_us=rates.host_us * factor, compiled_launch_us=rates.compiled_launch_us * factor,
        compiled_host_us=rates.compiled_host_us * factor)


@dataclass(frozen=True, slots=True)
class KernelCalibration:
    """The kernel microbenchmarks (the ranks' medians), the rates fitted on them, and the
    fitted model's price of the real blocks beside their measured time (when timed).

    Attributes:
        points: the medians over ranks of every microbenchmark.
        fit: the rates and each fit's largest miss.
        per_rank_seconds: each rank's own times (:meth:`KernelPoints.seconds` order).
        block_check: ``{"measured_layer_s", "kernel_layer_s", "error"}``; None when the
            real blocks were not timed.
        on_accelerator: the kernels ran on an accelerator (not the CPU).
    """

    points: KernelPoints
    fit: KernelFit
    per_rank_seconds: tuple[tuple[float, ...], ...] = ()
    block_check: dict[str, float] | None = None
    on_accelerator: bool = False

    @property
    def scale(self) -> float:
        """The factor on every kernel's time that prices the real blocks as measured (1
        where none were timed)."""
        check = self.block_check
        return 1.0 if check is None else check["measured_layer_s"] / check["kernel_layer_s"]

    @property
    def rates(self):
        """The rates a topology gets: the fitted ones scaled to the blocks (:attr:`scale`)."""
        return scaled_rates(self.fit.rates, self.scale)

    @property
    def used(self) -> bool:
        """Whether the topology prices compute with these rates (``[device]``): where the
        fitted model priced the real blocks within :data:`KERNEL_SCALE_LIMIT` (then scaled
        to them), or, where no blocks were timed, on an accelerator (the model's home; on
        a CPU the blocks' effective rate is the better-tested answer)."""
        if self.block_check is None:
            return self.on_accelerator
        return abs(self.block_check["error"]) <= KERNEL_SCALE_LIMIT

    def verdict(self) -> str:
        """Why the rates are or are not the topology's, in a few words."""
        check = self.block_check
        if check is None:
            return ("written as [device] (no blocks timed to check them)" if self.used else
                    "not written as [device]: no blocks timed to check them on a CPU")
        if self.used:
            return (f"written as [device], every kernel's time x{self.scale:.2f} so that they "
                    f"price the real blocks as measured (the microbenchmarks alone: "
                    f"{check['error']:+.0%})")
        return (f"not used: the blocks missed by more than {KERNEL_SCALE_LIMIT:.0%}; the "
                "topology keeps the blocks' effective rate ([device] written commented)")

    def to_json(self) -> dict[str, Any]:
        return {"method": "kernel microbenchmarks every rank at once, the ranks' medians; "
                          "rates fitted to them alone (cocodiff.calibration.kernel_fit)",
                "points": self.points.to_json(), **self.fit.to_json(),
                "per_rank_seconds": [list(row) for row in self.per_rank_seconds],
                "block_check": self.block_check, "on_accelerator": self.on_accelerator,
                "scale": self.scale, "used": self.used, "verdict": self.verdict()}

    def summary_lines(self) -> list[str]:
        """What calibrate prints of the kernel model."""
        r = self.fit.rates
        table = ", ".join(f"{length}: {rate * 1e3:.3g}" for length, rate in r.attention_tflops)
        if r.attention_query_factor:
            table += "; x time with fewer queries: " + ", ".join(
                f"{queries}: {factor:.2f}" for queries, factor in r.attention_query_factor)
        lines = [f"  kernel model (microbenchmarks only): GEMM {r.gemm_tflops * 1e3:.3g} GFLOP/s "
                 f"+ {r.gemm_fixed_us:.2f} us (max fit error {self.fit.gemm_error:.0%}); "
                 f"attention GFLOP/s by length {{{table}}}; elementwise "
                 f"{r.memory_gbps:.3g} GB/s + {r.compiled_launch_us:.2f} us per launch (max "
                 f"fit error {self.fit.elementwise_error:.0%}); "
                 + (f"host {r.host_us:.2f} us per dispatched op" if self.on_accelerator else
                    f"host and kernels on one core: {r.launch_us:.2f} us per dispatched op "
                    f"(a module stack of {self.points.host_stack_ops} ops)")]
        check = self.block_check
        if check is not None:
            ops = check.get("dispatched_ops_per_layer")
            lines.append(f"  kernel model on the real blocks: {check['kernel_layer_s'] * 1e3:.3f} "
                         f"ms per layer against {check['measured_layer_s'] * 1e3:.3f} measured "
                         f"({check['error']:+.0%})"
                         + (f", {ops:.0f} ATen ops dispatched per layer" if ops else ""))
        lines.append(f"  kernel rates: {self.verdict()}")
        return lines

    def commented_table(self) -> str:
        """The ``[device]`` table as TOML comments (appended when not :attr:`used`)."""
        from topology.toml_format import device_lines

        body = "".join(f"# {line}\n" if line else "#\n" for line in device_lines(self.fit.rates))
        return ("\n# The kernel model's rates measured by calibrate, "
                f"{self.verdict()}.\n# Uncomment to price compute with them "
                "(docs/compute-model.md).\n" + body)


def block_check(spec, shape, rates, measured_layer_s: float,
                ops_per_layer: float | None = None) -> dict[str, float]:
    """The kernel model's layer (eager) at ``rates`` beside the real blocks' measured one;
    ``ops_per_layer``: the ATen ops the blocks dispatch, counted (else the table's)."""
    predicted = kernel_layer_seconds(spec, shape, rates, ops_per_layer=ops_per_layer)
    check = {"measured_layer_s": measured_layer_s, "kernel_layer_s": predicted,
             "error": predicted / measured_layer_s - 1}
    if ops_per_layer is not None:
        check["dispatched_ops_per_layer"] = ops_per_layer
    return check


def measure_kernel_rates(transport, options, shapes: LayerShapes, device: Any,
                         block: dict[str, Any] | None) -> KernelCalibration | None:
    """Time the kernel microbenchmarks on every rank at once (collective), fit the rates on
    the ranks' medians, and price the real blocks with them when ``block`` (the measured
    blocks, :func:`~cocodiff.calibration.blocks.measure_blocks`) was timed. None (with a
    warning) when the times cannot be fitted: the calibration goes on without them."""
    import torch

    from cocodiff.calibration.blocks import timed_model
    from cocodiff.calibration.collect import WorldLineup, gather_floats
    from cocodiff.schedules import DTYPE_BYTES
    from cocodiff.schedules.ulysses import head_split, layer_shape

    rounds, round_s = (3, 0.005) if options.quick else (3, 0.02)
    mine = time_kernels(shapes, options.dtype, device, rounds, round_s, WorldLineup(transport))
    rows = gather_floats(transport, mine.seconds())
    medians = [statistics.median(column) for column in zip(*rows, strict=True)]
    points = mine.with_seconds(medians)
    try:
        fit = fit_points(points, device)
    except CalibrationError as exc:  # the same shared medians, the same answer on every rank
        if transport.rank == 0:  # the rest of the calibration stands without it
            print(f"warning: kernel model not fitted: {exc}", file=sys.stderr)
        return None
    check = None
    model = timed_model(options)
    if block is not None and model is not None:
        config, spec, streams = model
        shape = layer_shape(head_split(spec, transport.world_size, streams), 0,
                            DTYPE_BYTES[options.dtype])
        # What these blocks dispatch, counted on a fresh copy (not timed): the host term.
        ops = runtime_ops_per_layer(config, streams, transport.world_size, options.dtype,
                                    device)
        check = block_check(spec, shape, fit.rates, block["layer_s"], ops)
    return KernelCalibration(points, fit, tuple(tuple(row) for row in rows), check,
                             torch.device(device).type != "cpu")
