"""Device memory one rank needs: the transformer's weights it holds, the buffers kept from
one step to the next, and the largest transient of one layer.

* **weights**: the sequence family (Ulysses x Ring x batch) replicates the whole
  transformer on every rank; a pipeline stage holds its layers' share
  (``params x stage layers / layers``). Parameter counts come from the model cards
  (:data:`PUBLISHED_PARAMS`); a model without one is counted from its shape,
  ``layers x (4 + 2 r + 6) d^2`` (Q, K, V and output projections, the MLP, the adaLN
  modulation's six ``d``-wide outputs). Text encoders, the VAE and the embedders (a few
  percent) are not counted.
* **buffers** kept across steps: PipeFusion's K/V buffer, for each of the stage's layers
  K and V of the whole sequence over the rank's heads (only with more than one patch);
  V-Major's V cache (``cocodiff``), each layer's V as the rank received it last step.
* **activations**: the largest transient of one layer, ``b x batch x (t d (6 + r) +
  4 q h hd)`` for ``t`` tokens held, ``q`` tokens attended over ``h`` heads after the
  exchange: the hidden states and residual, Q, K, V and the output before the exchange,
  the MLP's inner width, and Q, K, V and the output after it.

It is a model to refuse what cannot fit, not an allocator's trace: the runtime's peak
also holds the framework's workspace and fragmentation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cocodiff.layout import LayoutError, ParallelLayout, PipelineLayout
from cocodiff.models import ModelSpec
from cocodiff.schedules.pipefusion import buffer_tokens, patch_tokens, split_streams

# Transformer parameters of the registry's models, as their model cards state them.
PUBLISHED_PARAMS: dict[str, float] = {
    # black-forest-labs/FLUX.1-dev: "a 12 billion parameter rectified flow transformer".
    "flux1-dev": 12e9,
    # black-forest-labs/FLUX.2-dev: "a 32 billion parameter rectified flow transformer".
    "flux2-dev": 32e9,
    # stabilityai/stable-diffusion-3.5-large: "8.1 billion parameters".
    "sd35-large": 8.1e9,
    # Qwen/Qwen-Image: "a 20B MMDiT image foundation model".
    "qwen-image": 20e9,
    # Wan-AI/Wan2.1-T2V-14B: 14 billion parameters.
    "wan21-14b": 14e9,
    # PixArt-Sigma (arXiv 2403.04692): 0.6B parameters.
    "pixart-sigma": 0.6e9,
    # DiT-XL/2 (arXiv 2212.09748, table 1): 675M parameters.
    "dit-xl-2": 675e6,
}


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Bytes one rank needs (the busiest rank of a layout)."""

    weights_bytes: float
    buffer_bytes: float
    activation_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.buffer_bytes + self.activation_bytes

    def to_json(self) -> dict:
        return {"weights_gb": self.weights_bytes / 1e9, "buffers_gb": self.buffer_bytes / 1e9,
                "activations_gb": self.activation_bytes / 1e9,
                "total_gb": self.total_bytes / 1e9}


def transformer_params(spec: ModelSpec) -> float:
    """The transformer's parameters: the model card's count, else from its shape."""
    published = PUBLISHED_PARAMS.get(spec.name)
    if published is not None:
        return published
    d = spec.hidden_size
    return spec.num_layers * (4 + 2 * spec.mlp_ratio + 6) * d * d


def _activations(spec: ModelSpec, tokens_held: int, attended: int, heads: int,
                 dtype_bytes: int, batch: int) -> float:
    d = spec.hidden_size
    return dtype_bytes * batch * (tokens_held * d * (6 + spec.mlp_ratio)
                                  + 4 * attended * heads * spec.head_dim)


def sequence_memory(spec: ModelSpec, stream_tokens: Sequence[int], num_ranks: int,
                    parallel: ParallelLayout | None, dtype_bytes: int, batch: int,
                    v_cache: bool = False) -> RankMemory:
    """A sequence-family rank's memory (``parallel`` None: pure Ulysses over all ranks).

    Args:
        spec: the model.
        stream_tokens: tokens of each stream of one sample.
        num_ranks: ranks of the run.
        parallel: the Ulysses x Ring x batch layout.
        dtype_bytes: bytes per value (weights and activations alike).
        batch: samples per step, every batch share's together.
        v_cache: the schedule keeps last step's V (V-Major).
    """
    parallel = parallel or ParallelLayout(num_ranks)
    ranks = parallel.sequence_ranks
    padded = sum(-(-int(t) // ranks) * ranks for t in stream_tokens if t > 0)
    heads = -(-spec.num_heads // parallel.ulysses)  # the busiest rank's
    samples = -(-batch // parallel.batch)
    weights = transformer_params(spec) * dtype_bytes
    attended = padded // parallel.ring  # a Ring member attends in blocks of S / ring
    activations = _activations(spec, padded // ranks, attended, heads, dtype_bytes, samples)
    buffers = (spec.num_layers * padded * heads * spec.head_dim * dtype_bytes * samples
               if v_cache else 0.0)
    return RankMemory(weights, buffers, activations)


def pipeline_memory(spec: ModelSpec, stream_tokens: Sequence[int], pipeline: PipelineLayout,
                    dtype_bytes: int, batch: int) -> RankMemory:
    """A PipeFusion rank's memory, on the stage with the most layers."""
    bounds = pipeline.stage_layers(spec.num_layers)
    layers = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    u = pipeline.ulysses
    heads = -(-spec.num_heads // u)
    weights = transformer_params(spec) * layers / spec.num_layers * dtype_bytes
    kv_tokens = buffer_tokens(spec, stream_tokens, pipeline, pipeline.patches)
    buffers = (2.0 * layers * kv_tokens * heads * spec.head_dim * dtype_bytes * batch
               if pipeline.patches > 1 else 0.0)
    image, text = split_streams(spec, stream_tokens)
    per_patch = patch_tokens(image, pipeline.patches, u) + -(-text // u) * u
    # The warm-up step streams the whole sequence as one patch: the larger transient.
    whole = patch_tokens(image, 1, u) + -(-text // u) * u
    activations = max(_activations(spec, q // u, q, heads, dtype_bytes, batch)
                      for q in (per_patch, whole) if pipeline.warmup or q == per_patch)
    return RankMemory(weights, buffers, activations)


def check_fits(memory: RankMemory, memory_gb: float, layout_name: str, machine: str) -> None:
    """Refuse a layout whose ranks need more than the device holds (one line); a device
    whose memory is not known (0) refuses nothing.

    Raises:
        LayoutError: the layout does not fit.
    """
    if memory_gb and memory.total_bytes > memory_gb * 1e9:
        raise LayoutError(
            f"layout {layout_name} does not fit: a rank needs {memory.total_bytes / 1e9:.1f} GB "
            f"(weights {memory.weights_bytes / 1e9:.1f}, buffers {memory.buffer_bytes / 1e9:.1f}"
            f", activations {memory.activation_bytes / 1e9:.1f}), a {machine} device holds "
            f"{memory_gb:g} GB")
