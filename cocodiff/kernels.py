"""The compute model per kernel class: what one layer's operations launch, and what that
takes on a device whose rates come from kernel microbenchmarks (``topology.DeviceRates``).

A datasheet roofline prices a FLUX.1-dev step on an H100 66% too fast (issue 34): matrix
products reach their achieved rate, not the peak; attention reaches the FlashAttention
tables' rate for its shape; the elementwise work between them moves bytes at the achieved
HBM rate; and every kernel costs a launch, on the GPU and (eager PyTorch) on the host.

Kernel classes and their closed forms (``R`` = the device's rates, :func:`kernel_seconds`):

- ``gemm`` ``(m x k) @ (k x n)``: ``max(2mkn / R.gemm, bytes / R.memory) + R.gemm_fixed``
  per launch. The fixed term is the shape curve's intercept (ramp-up, tail wave): small
  GEMMs reach a lower rate, large ones the achieved rate.
- ``attention`` (FlashAttention forward, ``q`` query tokens against ``kv`` tokens, ``h``
  heads of ``d``): ``4 q kv h d / R.attention(kv) * waves``, with ``R.attention`` read off
  the FlashAttention tables by sequence length and ``waves = ceil(c / sm) / (c / sm)`` for
  ``c = ceil(q / 128) h`` thread blocks (one per 128-query tile and head, as FlashAttention-2
  partitions the work): a problem of fewer blocks than the device has SMs leaves SMs idle.
  With fewer queries than keys (a PipeFusion patch against its K/V buffer) the time is
  further multiplied by ``R.attention_query_factor(q)``, where calibrate timed it (the
  patch's attention step as the runtime runs it, buffer copies included, per FLOP over
  the Ulysses call's: on this CPU about 1.5x at a quarter of the keys); the presets have none.
- ``elementwise`` (norms, modulation, RoPE, gates, residuals, casts, copies, the Ring's
  merges): ``bytes / R.memory``; eager PyTorch runs each op as its own kernel over the
  whole tensor, ``torch.compile`` fuses a chain between two matrix products into one kernel
  that reads its inputs and writes its outputs once (:data:`PASSES` gives both counts).
- every launch adds ``R.launch`` on the GPU; the host spends ``R.host`` on every ATen op
  it dispatches, eager (:data:`DISPATCHED_OPS`: views, chunks and casts included, several
  per kernel: diffusers' FLUX blocks dispatch 114 / 68 ops where they launch ~40 kernels,
  this runtime's 151 / 101 on a rank of a split and 26 more per Ring block), compiled on
  every kernel of the fused graph. A compute step takes
  ``max(GPU time, host time)``: the GPU runs ahead of nothing, so a step of many small
  kernels is bound by the host that issues them (eager), not the GPU. Where the device is
  the host (a CPU: ``R.host`` is 0) one core does both, one after the other: the step is
  the work plus ``R.launch`` per dispatched op.

The kernels and bytes per operation are counted from diffusers' transformer code (see
:data:`PASSES`): "passes" are reads or writes of one ``d``-wide row per token in the
model's dtype (a float32 intermediate counts two).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from cocodiff.models import ModelSpec
    from topology import DeviceRates

COMPUTE_MODES = ("eager", "compiled")
KernelKind = Literal["gemm", "attention", "elementwise"]
# FlashAttention-2's forward partitions queries into 128-row tiles, one thread block per
# (batch, head, tile) (Dao, arXiv 2307.08691, section 3.2).
ATTENTION_Q_TILE = 128


@dataclass(frozen=True, slots=True)
class Kernel:
    """One kernel class's work in one operation.

    Attributes:
        kind: ``gemm``, ``attention`` or ``elementwise``.
        flops: floating-point operations (all launches together).
        memory_bytes: HBM bytes, eager (all launches together).
        fused_bytes: HBM bytes once ``torch.compile`` fuses the chain (elementwise only;
            the same as ``memory_bytes`` for the others).
        launches: kernels eager PyTorch launches (may be fractional: an average over the
            blocks of a model whose layers differ, FLUX's double and single blocks).
        fused_launches: kernels the compiled graph launches.
        m, k, n: a GEMM's shape (per launch).
        q_tokens, kv_tokens, heads, head_dim: an attention kernel's shape.
        host_ops: ATen ops eager PyTorch dispatches for this kernel's share of the model
            code (views and casts included, :func:`host_ops_per_launch`); None: one per
            launch.
    """

    kind: KernelKind
    flops: float = 0.0
    memory_bytes: float = 0.0
    fused_bytes: float = 0.0
    launches: float = 1.0
    fused_launches: float = 1.0
    m: int = 0
    k: int = 0
    n: int = 0
    q_tokens: int = 0
    kv_tokens: int = 0
    heads: int = 0
    head_dim: int = 0
    host_ops: float | None = None

    def times(self, factor: int) -> Kernel:
        """The kernel over ``factor`` samples: a GEMM's rows and an attention's batch grow
        (launches do not); elementwise bytes grow."""
        if factor == 1:
            return self
        return Kernel(self.kind, self.flops * factor, self.memory_bytes * factor,
                      self.fused_bytes * factor, self.launches, self.fused_launches,
                      self.m * factor, self.k, self.n, self.q_tokens, self.kv_tokens,
                      self.heads * factor, self.head_dim, self.host_ops)

    def with_host_ops(self, per_launch: float) -> Kernel:
        """The kernel with ``per_launch`` dispatched ATen ops per eager launch."""
        return Kernel(self.kind, self.flops, self.memory_bytes, self.fused_bytes,
                      self.launches, self.fused_launches, self.m, self.k, self.n,
                      self.q_tokens, self.kv_tokens, self.heads, self.head_dim,
                      self.launches * per_launch)


def gemm(m: int, k: int, n: int, dtype_bytes: int, launches: float = 1.0) -> Kernel:
    """``(m x k) @ (k x n)``, ``2mkn`` FLOPs, operands read and result written once."""
    nbytes = float(m * k + k * n + m * n) * dtype_bytes
    return Kernel("gemm", 2.0 * m * k * n, nbytes, nbytes, launches, launches, m=m, k=k, n=n)


def attention(q_tokens: int, kv_tokens: int, heads: int, head_dim: int,
              dtype_bytes: int) -> Kernel:
    """A FlashAttention forward: ``4 q kv h d`` FLOPs; Q, K, V in and O out."""
    nbytes = float((2 * q_tokens + 2 * kv_tokens) * heads * head_dim * dtype_bytes)
    return Kernel("attention", 4.0 * q_tokens * kv_tokens * heads * head_dim, nbytes, nbytes,
                  q_tokens=q_tokens, kv_tokens=kv_tokens, heads=heads, head_dim=head_dim)


def elementwise(row_bytes: float, passes: float, fused_passes: float, launches: float,
                fused_launches: float) -> Kernel:
    """Elementwise work of ``passes`` reads/writes of ``row_bytes`` (eager), ``fused_passes``
    compiled."""
    return Kernel("elementwise", 0.0, row_bytes * passes, row_bytes * fused_passes,
                  launches, fused_launches)


@dataclass(frozen=True, slots=True)
class Passes:
    """Elementwise work of one operation of one layer, per token: (eager passes, compiled
    passes, eager launches, compiled launches); passes are in ``d``-wide rows of the dtype."""

    eager: float
    compiled: float
    launches: float
    fused_launches: float


def _mix(double: Passes, single: Passes, double_share: float) -> Passes:
    s = 1.0 - double_share
    return Passes(*(double_share * a + s * b for a, b in
                    zip((double.eager, double.compiled, double.launches, double.fused_launches),
                        (single.eager, single.compiled, single.launches, single.fused_launches),
                        strict=True)))


# FLUX.1 (diffusers transformer_flux.py, FluxTransformerBlock / FluxSingleTransformerBlock /
# FluxAttnProcessor), eager, per token of one layer, in d-wide rows:
#   (A token is in one stream: per token a double block runs one stream's chain; the
#   launches count both streams' kernels.)
#   norm     AdaLayerNormZero: layer_norm (r+w), * (1 + scale) (r+w), + shift (r+w) = 6 per
#            norm; double blocks run norm1 and norm2 (12; 2 streams x 2 x 3 launches),
#            single blocks one (6, 3 launches); plus the tiny (1 + scale) and silu launches.
#            Compiled: layer norm and modulation in one kernel (2).
#   qk_norm  torch.nn.RMSNorm on Q and K (one fused kernel each, r+w): 4; launches 2 per
#            stream.
#   rope     apply_rotary_emb on Q and K, each: -x_imag (1), stack (2), x.float() (1 r + 2 w),
#            * cos (2 r + 2 cos + 2 w), x_rotated.float() (3), * sin (6), + (4 r + 2 w),
#            .to(bf16) (2 r + 1 w) = 30 -> 60, 16 launches. Compiled: Q, K in and out + the
#            float32 cos/sin table = 8, one kernel (qk_norm fused in, 0 of its own).
#   attention  double: torch.cat of text and image Q, K, V (6, 3 launches); both: the
#            output's flatten(2, 3) of a transposed tensor, a copy (2, 1 launch);
#            compiled: the cat fuses into RoPE's kernel, the copy stays.
#   proj_out gate * attn (2) + residual (3) = 5, 2 launches per stream;
#            compiled: gate, residual, norm2's layer norm and modulation in one (4).
#   mlp      GELU(tanh) on 4d (8), gate * ff (2) + residual (3): 13, 3 launches per stream;
#            single blocks: GELU (8) and the cat of attention and MLP outputs (1 + 4 r,
#            5 w = 10): 18, 2 launches. Compiled: GELU stays a kernel of its own after the
#            GEMM (8), the gate and residual fuse (3).
# Double blocks: 19 of 57 layers in FLUX.1-dev (1/3).
_FLUX_DOUBLE = {
    "norm": Passes(12, 2, 12 + 6, 2),
    "qk_norm": Passes(4, 0, 4, 0),
    "rope": Passes(60, 8, 16, 2),
    "attention": Passes(8, 2, 4, 1),
    "proj_out": Passes(5, 4, 4, 2),
    "mlp": Passes(13, 11, 6, 4),
}
_FLUX_SINGLE = {
    # the block-opening cat of text and image (2, 1 launch) included; compiled, it fuses
    # into the norm's kernel (read 1, write the cat and the normed rows: 3)
    "norm": Passes(8, 3, 1 + 3 + 2, 1),
    "qk_norm": Passes(4, 0, 2, 0),
    "rope": Passes(60, 8, 16, 1),
    "attention": Passes(2, 2, 1, 1),
    "proj_out": Passes(5, 4, 2, 1),
    # compiled: GELU fuses into the cat (read 4 + 1, write 5)
    "mlp": Passes(18, 10, 2, 1),
}
# GEMM launches per layer (double blocks: the image and the text stream each run their
# own projections and MLP; single: Q, K, V separately, one proj_mlp, one proj_out that
# also does the MLP's down projection).
_FLUX_GEMM_LAUNCHES: dict[str, dict[str, float]] = {
    "double": {"proj_q": 2, "proj_k": 2, "proj_v": 2, "proj_out": 2, "mlp": 4},
    "single": {"proj_q": 1, "proj_k": 1, "proj_v": 1, "proj_out": 0.5, "mlp": 1.5},
}
# The adaLN modulation: silu(temb) @ W, W of d x (6d) per stream in double blocks and
# d x (3d) in single blocks: a matrix-vector product that reads the whole weight.
_FLUX_ADALN_WIDTH = {"double": 12, "single": 3}

# Generic joint-attention DiT (SD3, Qwen-Image, FLUX.2's shape without the split): two
# streams, adaLN before attention and MLP, Q/K RMSNorm, RoPE where the model has it.
_JOINT = dict(_FLUX_DOUBLE)
# Wan (transformer_wan.py): one stream, self-attention with RoPE and full-width RMSNorm on
# Q and K, then cross-attention on the text, then the FFN; the cross-attention's own
# RMSNorms, output copy and residual count as its elementwise work.
_CROSS = {
    "norm": Passes(14, 4, 9, 3),
    "qk_norm": Passes(4, 0, 2, 0),
    "rope": Passes(60, 8, 16, 1),
    "attention": Passes(2, 2, 1, 1),
    "proj_out": Passes(5, 4, 2, 1),
    "cross_attention": Passes(9, 5, 4, 2),
    "mlp": Passes(13, 11, 3, 2),
}


def family_passes(spec: ModelSpec, op: str) -> Passes:
    """Elementwise work per token of ``op`` in one (average) layer of ``spec``."""
    if spec.family == "flux":
        share = _flux_double_share(spec)
        table = _mix(_FLUX_DOUBLE.get(op, _ZERO), _FLUX_SINGLE.get(op, _ZERO), share)
    elif spec.cross_attention_tokens:
        table = _CROSS.get(op, _ZERO)
    else:
        table = _JOINT.get(op, _ZERO)
    if op == "rope" and not spec.has_rope:
        return _ZERO
    if op == "qk_norm" and not spec.has_qk_norm:
        return _ZERO
    return table


_ZERO = Passes(0.0, 0.0, 0.0, 0.0)


def _flux_double_share(spec: ModelSpec) -> float:
    # The spec's own share; FLUX.1's 19 double-stream of 57 blocks where it is not known.
    share = spec.double_stream_share
    return 19.0 / 57.0 if share is None else share


def gemm_launches(spec: ModelSpec, op: str) -> float:
    """GEMM launches of ``op`` per layer (one per projection unless the family splits its
    streams)."""
    if spec.family == "flux":
        share = _flux_double_share(spec)
        return (share * _FLUX_GEMM_LAUNCHES["double"].get(op, 1)
                + (1 - share) * _FLUX_GEMM_LAUNCHES["single"].get(op, 1))
    if not spec.cross_attention_tokens and spec.text_tokens:
        return 2.0 if op != "mlp" else 4.0  # joint: text and image weights apart
    return 1.0 if op != "mlp" else 2.0


def adaln_kernel(spec: ModelSpec, dtype_bytes: int) -> Kernel:
    """The layer's adaLN modulation GEMV(s): ``silu(temb) @ W`` reading the whole weight."""
    d = spec.hidden_size
    if spec.family == "flux":
        share = _flux_double_share(spec)
        width = share * _FLUX_ADALN_WIDTH["double"] + (1 - share) * _FLUX_ADALN_WIDTH["single"]
        launches = share * 2 + (1 - share)
    else:
        width = 12.0 if spec.text_tokens and not spec.cross_attention_tokens else 6.0
        launches = 2.0 if width == 12.0 else 1.0
    n = int(round(width * d / launches))
    one = gemm(1, d, n, dtype_bytes)
    return Kernel("gemm", one.flops * launches, one.memory_bytes * launches,
                  one.fused_bytes * launches, launches, launches, m=1, k=d, n=n)


# The Ring's merge of one block's output into the running output (yunchang's
# update_out_and_lse, eager): out - block_out (2 r fp32 + 1 r + 2 w fp32 = 5),
# * sigmoid(lse diff) (2 r + 2 w = 4), out - that (4 r + 2 w = 6): 15 passes of the block's
# output (q tokens x local heads x head dim), 5 launches on the output and 3 on the
# log-sum-exp; compiled, one kernel reads both outputs and writes one (5).
RING_MERGE = Passes(15, 5, 8, 1)
# First block: out = block_out.float() (3), and the final .to(dtype) (3) after the last.
RING_FIRST_LAST = Passes(6, 3, 3, 1)


def ring_merge(attention_kernel: Kernel, dtype_bytes: int, first: bool) -> Kernel:
    """The elementwise merge a Ring block adds after its attention kernel."""
    rows = attention_kernel.q_tokens * attention_kernel.heads * attention_kernel.head_dim
    passes = RING_FIRST_LAST if first else RING_MERGE
    return elementwise(float(rows * dtype_bytes), passes.eager, passes.compiled,
                       passes.launches, passes.fused_launches)


@dataclass(frozen=True, slots=True)
class DispatchCount:
    """ATen ops one block of a model dispatches in eager mode, by who runs it and how the
    sequence is split (counted with a TorchDispatchMode over one forward, inside the block:
    views, chunks, casts and copies included; :data:`DISPATCHED_OPS`).

    Attributes:
        diffusers: diffusers' own block on one rank (no split).
        runtime: this project's runtime on a rank of any split, Ulysses, Ring or both,
            before the Ring's blocks: its processors' layout copies, head splits and
            exchange calls added (the same count at Ulysses 2 and 4, and for a Ring of
            one-rank Ulysses groups: those run the same processors).
        ring_first: the Ring's first block, beyond the attention call it replaces (its
            attention on the block in hand, the pass's send, the output's scatter back).
        ring_later: every later Ring block: the block's index selects, its attention with
            the log-sum-exp, the merge into the running output, the pass's send and
            receive.
    """

    diffusers: float
    runtime: float
    ring_first: float
    ring_later: float

    def per_block(self, ulysses: int = 1, ring: int = 1) -> float:
        """Ops per block on a rank of a ``ulysses x ring`` split: diffusers' alone on one
        rank, else ``runtime + ring_first + (ring - 1) ring_later`` (no Ring terms at
        ``ring`` 1)."""
        if ulysses * ring == 1:
            return self.diffusers
        if ring == 1:
            return self.runtime
        return self.runtime + self.ring_first + (ring - 1) * self.ring_later


# Counted on the tiny twins (tiny-flux, tiny-sd3, tiny-qwen, tiny-wan; diffusers 0.42,
# float32) through the runtime over a stand-in transport (nothing moved), at U1, U2, U4,
# R2, R3, R4 and U2xR2: a Ring's ops are linear in its degree (FLUX: 183 / 209 / 235 at
# R = 2 / 3 / 4 for a double block), and U2xR2 counts what R2 counts. The counts do not
# depend on the sizes (the same at 4 x 16 and 8 x 32 heads, and at twice the tokens) nor
# on the rank. tests/test_dispatch_count.py re-counts every entry so this table cannot
# rot. Qwen-Image's blocks pass an attention mask: the Ring then attends by the explicit
# (masked) path, 45 ops a block instead of 26; in bfloat16 its blocks dispatch 4 more
# casts (149 / 192 / 258 at 1 / U2 / R2; FLUX's counts do not change). What a kernel
# launch costs the host is these ops, not one: FLUX's blocks launch ~46 kernels.
DISPATCHED_OPS: dict[str, dict[str, DispatchCount]] = {
    "flux": {"double": DispatchCount(114, 151, 6, 26),
             "single": DispatchCount(68, 101, 6, 26)},
    "sd3": {"joint": DispatchCount(92, 126, 6, 26)},
    "qwen-image": {"joint": DispatchCount(145, 188, 21, 45)},
    "wan": {"cross": DispatchCount(106, 143, 6, 26)},
}


# A pipelined PipeFusion step runs each patch through the stage's blocks with the
# runtime's processors and its K/V buffer (cocodiff.runtime.pipefusion.PatchBackend: the
# buffer's write, the patch's index selects and scatter, and with Ulysses inside the stage
# the patch's exchanges): ATen ops per block call, ``(stage of one rank, stage of a
# Ulysses group)``. Counted on tiny-flux with 2 blocks of each kind, 4 ranks as 4 stages
# and as 2 stages x Ulysses 2, warm-up 1 (no guards); the same on every rank and patch.
# tests/runtime/test_runtime_pipefusion.py re-counts them. FLUX only: SD3's last block
# (text stream pre-only) counts differently from the others, and PixArt is not in the
# table above; their pipelined layers keep the Ulysses count.
PIPELINE_DISPATCHED_OPS: dict[str, dict[str, tuple[float, float]]] = {
    "flux": {"double": (158, 209), "single": (108, 159)},
}


def pipeline_dispatched_ops_per_layer(spec: ModelSpec, ulysses: int) -> float | None:
    """ATen ops an (average) layer of ``spec`` dispatches eager per patch in a pipelined
    PipeFusion step, on a stage of ``ulysses`` ranks; None where not counted."""
    column = 0 if ulysses == 1 else 1
    return _per_layer(spec, lambda pair: pair[column], PIPELINE_DISPATCHED_OPS)


def _per_layer(spec: ModelSpec, count: Callable[[Any], float],
               tables: Mapping[str, Mapping[str, Any]] = DISPATCHED_OPS) -> float | None:
    """``count`` of ``spec``'s family's entry in ``tables`` per (average) layer."""
    table = tables.get(spec.family)
    if table is None:
        return None
    if spec.family == "flux":
        share = _flux_double_share(spec)
        return share * count(table["double"]) + (1 - share) * count(table["single"])
    return count(next(iter(table.values())))


def dispatched_ops_per_layer(spec: ModelSpec, ulysses: int = 1, ring: int = 1
                             ) -> float | None:
    """ATen ops an (average) layer of ``spec`` dispatches eager on a rank of a
    ``ulysses x ring`` split (:meth:`DispatchCount.per_block`; FLUX's block kinds mixed
    as the kernel counts are). None for a family not counted."""
    return _per_layer(spec, lambda c: c.per_block(ulysses, ring))


def ring_dispatched_ops(spec: ModelSpec) -> tuple[float, float] | None:
    """``(first, later)``: ATen ops the Ring's first block adds beyond the attention call
    it replaces, and each later block's (:class:`DispatchCount`). None for a family not
    counted."""
    first = _per_layer(spec, lambda c: c.ring_first)
    later = _per_layer(spec, lambda c: c.ring_later)
    return None if first is None or later is None else (first, later)


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`COMPUTE_MODES`.

    Raises:
        ValueError: another value (the message lists the valid ones).
    """
    if mode not in COMPUTE_MODES:
        raise ValueError(f"unknown compute mode {mode!r} (valid: {', '.join(COMPUTE_MODES)})")
    return mode


def attention_tflops(rates: DeviceRates, kv_tokens: int) -> float:
    """The FlashAttention table's rate at ``kv_tokens``, interpolated on log2 of the length
    and held flat past the table's ends."""
    return log_interpolated(rates.attention_tflops, kv_tokens)


def attention_query_factor(rates: DeviceRates, q_tokens: int, kv_tokens: int) -> float:
    """The time factor of ``q_tokens`` queries against more keys
    (``rates.attention_query_factor``, interpolated on log2 of the queries, held flat past
    the table's ends); 1 without a table or with as many queries as keys."""
    table = rates.attention_query_factor
    if not table or q_tokens >= kv_tokens:
        return 1.0
    return log_interpolated(table, q_tokens)


def log_interpolated(table: tuple[tuple[int, float], ...], x: float) -> float:
    """``table``'s value at ``x``, linear in log2 of the key, flat past the ends."""
    if x <= table[0][0]:
        return table[0][1]
    for (x0, y0), (x1, y1) in zip(table, table[1:], strict=False):
        if x <= x1:
            t = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
            return y0 + t * (y1 - y0)
    return table[-1][1]


def attention_waves(rates: DeviceRates, kernel: Kernel) -> float:
    """Time factor of a partial last wave: ``ceil(c / sm) / (c / sm)`` for ``c`` blocks."""
    blocks = -(-kernel.q_tokens // ATTENTION_Q_TILE) * kernel.heads
    if blocks == 0:
        return 1.0
    waves = blocks / rates.sm_count
    return math.ceil(waves) / waves


def kernel_seconds(kernel: Kernel, rates: DeviceRates, mode: str) -> float:
    """GPU seconds of ``kernel``'s work, launches excluded (:func:`launch_seconds`)."""
    memory = rates.memory_gbps * 1e9
    if kernel.kind == "gemm":
        return (max(kernel.flops / (rates.gemm_tflops * 1e12), kernel.memory_bytes / memory)
                + kernel.launches * rates.gemm_fixed_us * 1e-6)
    if kernel.kind == "attention":
        if kernel.flops == 0:
            return 0.0
        rate = attention_tflops(rates, kernel.kv_tokens) * 1e12
        return (kernel.flops / rate * attention_waves(rates, kernel)
                * attention_query_factor(rates, kernel.q_tokens, kernel.kv_tokens))
    nbytes = kernel.fused_bytes if mode == "compiled" else kernel.memory_bytes
    return nbytes / memory


def launches(kernel: Kernel, mode: str) -> float:
    return kernel.fused_launches if mode == "compiled" else kernel.launches


def host_ops(kernel: Kernel, mode: str) -> float:
    """ATen ops the host dispatches for ``kernel``: eager, its share of the model code's
    ops (:attr:`Kernel.host_ops`, else one per launch); compiled, the fused graph's
    launches."""
    if mode == "compiled" or kernel.host_ops is None:
        return launches(kernel, mode)
    return kernel.host_ops


def device_seconds(kernels: tuple[Kernel, ...], rates: DeviceRates, mode: str) -> float:
    """A compute step's time: ``max(GPU, host)`` where the GPU does every kernel's work
    plus a launch gap per kernel and the host spends ``host_us`` on every op it
    dispatches (:func:`host_ops`). With ``host_us`` 0 the device is the host (a CPU):
    the work plus ``launch_us`` per dispatched op, one after the other."""
    check_mode(mode)
    gap_us, host_us = ((rates.compiled_launch_us, rates.compiled_host_us) if mode == "compiled"
                       else (rates.launch_us, rates.host_us))
    work = sum(kernel_seconds(k, rates, mode) for k in kernels)
    dispatched = sum(host_ops(k, mode) for k in kernels)
    if host_us == 0:
        return work + dispatched * gap_us * 1e-6
    count = sum(launches(k, mode) for k in kernels)
    return max(work + count * gap_us * 1e-6, dispatched * host_us * 1e-6)
