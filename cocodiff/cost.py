"""The step cost model: FLOPs and HBM bytes of each operation of one layer on one rank.

Under Ulysses a rank holds ``local_tokens`` of the (padded) sequence with every head, except
inside attention, where the all-to-all has given it all ``total_tokens`` for
``local_heads`` heads. :func:`op_cost` prices one operation of one transformer layer in
that state, with the kernels it launches (:func:`op_kernels`, :mod:`cocodiff.kernels`);
:func:`compute_seconds` turns a price into time on a topology's tile: the kernel model
where the tile has device rates (GPU presets), else :func:`roofline_seconds`.

Conventions (``d`` = hidden size, ``S_loc`` = local tokens, ``S`` = total tokens,
``h`` = local heads, ``hd`` = head dim, ``T`` = cross-attention tokens, ``b`` = dtype bytes):

- A GEMM ``(m x k) @ (k x n)`` costs ``2mkn`` FLOPs and moves ``(mk + kn + mn) * b`` bytes
  (read both operands once, write the result once).
- ``proj_q``, ``proj_k``, ``proj_v``, ``proj_out``: ``d x d`` GEMMs on the local tokens.
  Joint-attention models (FLUX, SD3, Qwen-Image) have separate text and image weights;
  the weights are counted once.
- ``mlp``: ``d -> r*d -> d``, two GEMMs, ``4 r S_loc d^2`` FLOPs (16 for ``r`` = 4),
  ``r = spec.mlp_ratio``; the activation is taken as fused into the first GEMM.
  With ratio 4 the linear operations total ``24 S_loc d^2`` per layer.
- ``attention``: local heads over the full sequence, ``4 S^2 hd h`` FLOPs (``QK^T`` and
  ``PV``). Memory is flash-style: Q, K, V read and O written, ``4 S h hd b`` bytes; the
  ``S x S`` score matrix never reaches HBM. Summed over ``P`` ranks with ``h = H/P`` this
  is ``4 S^2 d``.
- ``norm``: the layer's two normalisations of its hidden states (before attention and
  before the MLP, each with its adaLN scale and shift) on the local tokens:
  ``_NORM_FLOPS_PER_ELEMENT`` FLOPs per element per pass, and a read and a write.
- ``qk_norm`` and ``rope``: elementwise on Q and K (local tokens, all heads: they run
  before the all-to-all), a read and a write of each; zero for models without them
  (``spec.has_qk_norm``, ``spec.has_rope``). RoPE's cos/sin table is not counted.
- ``cross_attention`` (zero unless ``spec.cross_attention_tokens`` > 0): the Q and output
  projections on the local tokens, the K and V projections of the ``T`` text tokens
  (replicated: every rank computes them), and attention of the local tokens against the
  text tokens with all heads, ``4 S_loc T d`` FLOPs. It needs no all-to-all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from cocodiff import kernels as kn
from cocodiff.models import ModelSpec

OPS = (
    "norm",
    "proj_q",
    "proj_k",
    "proj_v",
    "qk_norm",
    "rope",
    "attention",
    "proj_out",
    "cross_attention",
    "mlp",
)
# The operations that are matrix products (the rest are elementwise).
MATMUL_OPS = ("proj_q", "proj_k", "proj_v", "attention", "proj_out", "cross_attention", "mlp")

# LayerNorm (mean, variance, subtract, scale) + adaLN (scale, shift), per element.
_NORM_FLOPS_PER_ELEMENT = 7
_NORM_PASSES = 2  # before attention and before the MLP
# RMSNorm: square, accumulate, scale, weight.
_QK_NORM_FLOPS_PER_ELEMENT = 4
# Rotation of each (x1, x2) pair: 4 multiplies and 2 adds, i.e. 3 per element.
_ROPE_FLOPS_PER_ELEMENT = 3


@dataclass(frozen=True, slots=True)
class Cost:
    """Work of one operation: floating-point operations and bytes moved to/from HBM, and
    the kernels that do it (:mod:`cocodiff.kernels`; empty for work priced by the roofline
    alone, e.g. a plan file's steps)."""

    flops: float
    memory_bytes: float
    # How the work is split into kernels, not more work: two costs of equal FLOPs and
    # bytes are equal (a plan file from before kernels were written equals the plan).
    kernels: tuple[kn.Kernel, ...] = field(default=(), compare=False)

    def __add__(self, other: Cost) -> Cost:
        if not isinstance(other, Cost):
            return NotImplemented
        return Cost(self.flops + other.flops, self.memory_bytes + other.memory_bytes,
                    self.kernels + other.kernels)

    def times(self, batch: int) -> Cost:
        """The work over ``batch`` samples (costs are per sample)."""
        if batch == 1:
            return self
        return Cost(self.flops * batch, self.memory_bytes * batch,
                    tuple(kernel.times(batch) for kernel in self.kernels))


ZERO = Cost(0.0, 0.0)


@dataclass(frozen=True, slots=True)
class LayerShape:
    """Everything one rank's layer cost depends on besides the model.

    Attributes:
        local_tokens: sequence tokens this rank holds (the padded ``S / P``).
        total_tokens: the full padded sequence, as attention sees it after the all-to-all.
        local_heads: heads this rank attends over after the all-to-all.
        dtype_bytes: bytes per element (2 for bf16).
    """

    local_tokens: int
    total_tokens: int
    local_heads: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        # A rank may hold no head when there are more ranks than heads.
        for name, least in (("local_tokens", 1), ("total_tokens", 1), ("local_heads", 0),
                            ("dtype_bytes", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"LayerShape.{name} must be an integer >= {least}, got {value!r}")
        if self.local_tokens > self.total_tokens:
            raise ValueError(
                f"LayerShape.local_tokens {self.local_tokens} exceeds total_tokens "
                f"{self.total_tokens}"
            )


def gemm_cost(m: int, k: int, n: int, dtype_bytes: int) -> Cost:
    """``(m x k) @ (k x n)``: ``2mkn`` FLOPs; both operands read and the result written once."""
    return Cost(2.0 * m * k * n, float(m * k + k * n + m * n) * dtype_bytes)


def _elementwise(elements: int, flops_per_element: int, dtype_bytes: int) -> Cost:
    # Read and write every element once.
    return Cost(float(elements) * flops_per_element, 2.0 * elements * dtype_bytes)


def _norm(spec: ModelSpec, shape: LayerShape) -> Cost:
    elements = _NORM_PASSES * shape.local_tokens * spec.hidden_size
    return _elementwise(elements, _NORM_FLOPS_PER_ELEMENT, shape.dtype_bytes)


def _projection(spec: ModelSpec, shape: LayerShape) -> Cost:
    d = spec.hidden_size
    return gemm_cost(shape.local_tokens, d, d, shape.dtype_bytes)


def _qk_norm(spec: ModelSpec, shape: LayerShape) -> Cost:
    if not spec.has_qk_norm:
        return ZERO
    elements = 2 * shape.local_tokens * spec.hidden_size  # Q and K
    return _elementwise(elements, _QK_NORM_FLOPS_PER_ELEMENT, shape.dtype_bytes)


def _rope(spec: ModelSpec, shape: LayerShape) -> Cost:
    if not spec.has_rope:
        return ZERO
    elements = 2 * shape.local_tokens * spec.hidden_size  # Q and K
    return _elementwise(elements, _ROPE_FLOPS_PER_ELEMENT, shape.dtype_bytes)


def _attention(spec: ModelSpec, shape: LayerShape) -> Cost:
    s, heads, hd = shape.total_tokens, shape.local_heads, spec.head_dim
    flops = 4.0 * s * s * hd * heads  # QK^T and PV, 2 FLOPs per multiply-add each
    memory = 4.0 * s * heads * hd * shape.dtype_bytes  # Q, K, V in, O out
    return Cost(flops, memory)


def _cross_attention(spec: ModelSpec, shape: LayerShape) -> Cost:
    text = spec.cross_attention_tokens
    if text == 0:
        return ZERO
    d, s_loc, b = spec.hidden_size, shape.local_tokens, shape.dtype_bytes
    projections = (
        gemm_cost(s_loc, d, d, b)  # Q of the local tokens
        + gemm_cost(text, d, d, b)  # K of the text, on every rank
        + gemm_cost(text, d, d, b)  # V of the text, on every rank
        + gemm_cost(s_loc, d, d, b)  # output projection
    )
    attention = Cost(4.0 * s_loc * text * d, 2.0 * (s_loc + text) * d * b)  # Q, K, V in, O out
    return projections + attention


def _mlp(spec: ModelSpec, shape: LayerShape) -> Cost:
    d, s_loc, b = spec.hidden_size, shape.local_tokens, shape.dtype_bytes
    inner = spec.mlp_ratio * d  # may be fractional for an equivalent ratio (FLUX.2, Wan)
    up = Cost(2.0 * s_loc * d * inner, (s_loc * d + d * inner + s_loc * inner) * b)
    down = Cost(2.0 * s_loc * inner * d, (s_loc * inner + inner * d + s_loc * d) * b)
    return up + down


_OP_COSTS = {
    "norm": _norm,
    "proj_q": _projection,
    "proj_k": _projection,
    "proj_v": _projection,
    "qk_norm": _qk_norm,
    "rope": _rope,
    "attention": _attention,
    "proj_out": _projection,
    "cross_attention": _cross_attention,
    "mlp": _mlp,
}


def op_cost(spec: ModelSpec, op: str, shape: LayerShape) -> Cost:
    """Price one operation of one transformer layer on one Ulysses rank.

    Args:
        spec: the model.
        op: one of :data:`OPS`.
        shape: the rank's token and head counts.

    Returns:
        The FLOPs and HBM bytes of ``op`` (zero for an operation the model lacks).

    Raises:
        ValueError: ``op`` is not in :data:`OPS` (the message lists them).
    """
    price = _OP_COSTS.get(op)
    if price is None:
        raise ValueError(f"unknown operation {op!r}; valid: {', '.join(OPS)}")
    cost = price(spec, shape)
    if cost == ZERO:
        return ZERO
    return Cost(cost.flops, cost.memory_bytes, op_kernels(spec, op, shape))


def op_kernels(spec: ModelSpec, op: str, shape: LayerShape) -> tuple[kn.Kernel, ...]:
    """The kernels ``op`` launches on one rank (:mod:`cocodiff.kernels`): its matrix
    products or attention at their shapes, and the elementwise work diffusers runs around
    them (per token, :func:`cocodiff.kernels.family_passes`), each carrying its share of
    the ATen ops the layer dispatches eager (:func:`host_ops_per_launch`)."""
    out = _op_kernels(spec, op, shape)
    per_launch = host_ops_per_launch(spec, shape)
    return out if per_launch is None else tuple(k.with_host_ops(per_launch) for k in out)


@functools.lru_cache(maxsize=512)
def host_ops_per_launch(spec: ModelSpec, shape: LayerShape,
                        ops_per_layer: float | None = None) -> float | None:
    """ATen ops dispatched per eager kernel launch in a layer of ``spec`` at ``shape``:
    the layer's dispatched ops (``ops_per_layer``, else the family's count,
    :func:`cocodiff.kernels.dispatched_ops_per_layer`) spread over its launches in
    proportion (an assumption: which op of the layer dispatches what is not counted,
    only the layer's total). None where the family's ops are not counted (one per
    launch, as the launch counts alone).

    The family's count is the one of the rank's layout, counted for each: diffusers'
    own blocks on an unsplit shape (one rank), this runtime's processors where the
    shape splits the sequence (Ulysses; FLUX 151 / 101 against 114 / 68). A Ring's
    blocks add their own ops on the Ring's steps (:func:`ring_block_cost`, with
    :func:`ring_host_ops`), and a Ring of one-rank Ulysses groups, whose layer shape is
    unsplit, is charged the runtime's count there (:attr:`RingHostOps.layer_scale`):
    every layout pays what its rank dispatches, so no split looks cheaper for being
    counted less."""
    if ops_per_layer is None:
        # The runtime's count is the same at every Ulysses degree (counted at 2 and 4).
        ops_per_layer = kn.dispatched_ops_per_layer(
            spec, ulysses=2 if shape.local_tokens < shape.total_tokens else 1)
    if ops_per_layer is None:
        return None
    count = sum(kn.launches(k, "eager") for op in OPS if _OP_COSTS[op](spec, shape) != ZERO
                for k in _op_kernels(spec, op, shape))
    return ops_per_layer / count if count else None


@dataclass(frozen=True, slots=True)
class RingHostOps:
    """What a Ring rank's host dispatches beyond its Ulysses group's layer
    (:class:`cocodiff.kernels.DispatchCount`), eager.

    Attributes:
        first: ATen ops the Ring's first block adds beyond the attention step it replaces.
        later: ATen ops each later block dispatches (its attention kernel and merge).
        layer_scale: the factor on the layer's other kernels' ops: a Ring of one-rank
            Ulysses groups runs the runtime's processors, where its unsplit layer shape
            alone would charge diffusers' blocks (runtime / diffusers); 1 otherwise.
    """

    first: float
    later: float
    layer_scale: float = 1.0


def ring_host_ops(spec: ModelSpec, ulysses: int) -> RingHostOps | None:
    """The Ring's host ops for ``spec`` with Ulysses groups of ``ulysses`` ranks; None
    for a family whose ops are not counted (its merges then dispatch one op per
    launch)."""
    ring = kn.ring_dispatched_ops(spec)
    if ring is None:
        return None
    scale = 1.0
    if ulysses == 1:
        unsplit, split = (kn.dispatched_ops_per_layer(spec),
                          kn.dispatched_ops_per_layer(spec, ulysses=2))
        scale = split / unsplit if unsplit and split else 1.0
    return RingHostOps(ring[0], ring[1], scale)


def scale_host_ops(cost: Cost, factor: float) -> Cost:
    """``cost`` with its kernels' counted host ops multiplied by ``factor``."""
    if factor == 1.0:
        return cost
    return Cost(cost.flops, cost.memory_bytes, tuple(
        k if k.host_ops is None else replace(k, host_ops=k.host_ops * factor)
        for k in cost.kernels))


def _op_kernels(spec: ModelSpec, op: str, shape: LayerShape) -> tuple[kn.Kernel, ...]:
    d, s_loc, b = spec.hidden_size, shape.local_tokens, shape.dtype_bytes
    out: list[kn.Kernel] = []
    if op in ("proj_q", "proj_k", "proj_v", "proj_out"):
        launches = kn.gemm_launches(spec, op)
        out.append(kn.gemm(s_loc, d, d, b, launches))
    elif op == "mlp":
        inner = max(1, int(round(spec.mlp_ratio * d)))
        launches = kn.gemm_launches(spec, op) / 2  # up and down
        out += [kn.gemm(s_loc, d, inner, b, launches), kn.gemm(s_loc, inner, d, b, launches)]
    elif op == "attention":
        if shape.local_heads:  # a rank past the head count attends to nothing
            out.append(kn.attention(shape.total_tokens, shape.total_tokens, shape.local_heads,
                                    spec.head_dim, b))
        if shape.local_tokens < shape.total_tokens:
            # Ulysses: each of Q, K, V and the output is laid out for its all-to-all and
            # back (a permute + contiguous copy, read and write, on each side).
            out.append(kn.elementwise(float(s_loc * d * b), 16, 8, 8, 4))
    elif op == "cross_attention":
        text = spec.cross_attention_tokens
        out += [kn.gemm(s_loc, d, d, b), kn.gemm(text, d, d, b), kn.gemm(text, d, d, b),
                kn.gemm(s_loc, d, d, b)]
        # All heads of the local tokens against the text tokens.
        out.append(kn.attention(s_loc, text, spec.num_heads, spec.head_dim, b))
    elif op == "norm":
        out.append(kn.adaln_kernel(spec, b))
    passes = kn.family_passes(spec, op)
    if passes.eager or passes.launches:
        out.append(kn.elementwise(float(s_loc * d * b), passes.eager, passes.compiled,
                                  passes.launches, passes.fused_launches))
    return tuple(out)


def ring_block_cost(attention: Cost, block: int, dtype_bytes: int,
                    host: RingHostOps | None = None) -> Cost:
    """One Ring block's attention: ``attention`` (already at the block's shape) and the
    merge of its output into the running one (:func:`cocodiff.kernels.ring_merge`; the
    first block only converts its output). The merge's bytes join ``memory_bytes``.

    ``host``: the Ring's counted host ops (:func:`ring_host_ops`): the first block keeps
    the attention step's share of the layer's ops and its merge carries ``host.first``;
    a later block's ops are ``host.later``, all on its merge. None: the merges dispatch
    one op per launch and every block's attention keeps the step's share."""
    kernels = attention.kernels
    if block > 0:  # the Ulysses layout copies around the attention happen once, in block 0
        kernels = tuple(kernel for kernel in kernels if kernel.kind == "attention")
        if host is not None:
            kernels = tuple(replace(kernel, host_ops=0.0) for kernel in kernels)
    merges = tuple(kn.ring_merge(kernel, dtype_bytes, first=block == 0)
                   for kernel in kernels if kernel.kind == "attention")
    if host is not None:
        merges = tuple(replace(m, host_ops=(host.first if block == 0 else host.later)
                               / len(merges)) for m in merges)
    return Cost(attention.flops, attention.memory_bytes + sum(m.memory_bytes for m in merges),
                kernels + merges)


def roofline_seconds(cost: Cost, tflops: float, memory_gbps: float) -> float:
    """Time of ``cost`` on a device, whichever of compute and memory bounds it.

    Args:
        cost: the work.
        tflops: achievable compute, in 10^12 FLOP/s.
        memory_gbps: achievable HBM bandwidth, in 10^9 bytes/s.

    Returns:
        ``max(flops / (tflops * 1e12), memory_bytes / (memory_gbps * 1e9))`` seconds.

    Raises:
        ValueError: ``tflops`` or ``memory_gbps`` is not positive.
    """
    if tflops <= 0 or memory_gbps <= 0:
        raise ValueError(
            f"device rates must be positive, got {tflops} TFLOP/s and {memory_gbps} GB/s"
        )
    return max(cost.flops / (tflops * 1e12), cost.memory_bytes / (memory_gbps * 1e9))


def compute_seconds(cost: Cost, tile) -> float:
    """Time of a compute step on a topology's tile (a ``topology.TopologySpec``).

    With the tile's kernel rates (``tile.device``), the kernel model of
    :mod:`cocodiff.kernels` in ``tile.compute_mode``; work without kernels (a plan file's
    step) then takes the roofline of the achieved GEMM and HBM rates. Without them, the
    roofline of ``tile.tile_tflops`` and ``tile.tile_memory_gbps``.
    """
    rates = tile.device
    if rates is None:
        return roofline_seconds(cost, tile.tile_tflops, tile.tile_memory_gbps)
    if not cost.kernels:
        return roofline_seconds(cost, rates.gemm_tflops, rates.memory_gbps)
    return kn.device_seconds(cost.kernels, rates, tile.compute_mode)


def step_flops(spec: ModelSpec, tokens: int) -> float:
    """Matrix-product FLOPs of one denoising step of the whole model on one device.

    ``num_layers * ((8 + 4r) S d^2 + 4 S^2 d)`` with ``r = mlp_ratio`` (the textbook
    ``24 S d^2 + 4 S^2 d`` for ``r`` = 4), plus, for cross-attention models,
    ``4 S d^2 + 4 T d^2 + 4 S T d`` per layer. Elementwise work, embeddings and the final
    layer are left out: this is a sanity check, not the simulator's model.

    Args:
        spec: the model.
        tokens: the attention sequence length ``S`` (:meth:`ModelSpec.sequence_tokens`).
    """
    s, d, r = float(tokens), float(spec.hidden_size), spec.mlp_ratio
    per_layer = (8.0 + 4.0 * r) * s * d * d + 4.0 * s * s * d
    text = float(spec.cross_attention_tokens)
    if text:
        per_layer += 4.0 * s * d * d + 4.0 * text * d * d + 4.0 * s * text * d
    return spec.num_layers * per_layer
