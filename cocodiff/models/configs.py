"""diffusers transformer configs -> :class:`ModelSpec`: one builder per model family.

Each builder reads the fields its family's ``transformer/config.json`` has; the family
record (:mod:`cocodiff.models.families`) names the builder.

Facts that are not in the transformer config and come from the diffusers pipelines instead:

- Token grid. FLUX.1, FLUX.2 and Qwen-Image pipelines pack 2x2 latent pixels into one token
  *outside* the transformer (``_pack_latents`` / ``_patchify_latents``), so their token patch
  is 2 whatever the config's ``patch_size`` says (that field only shapes ``proj_out``).
  SD3, PixArt, DiT and Wan patchify inside the transformer with the config's ``patch_size``
  (Wan's is ``(t, h, w) = (1, 2, 2)``). Every VAE here is 8x spatially; Wan's is 4x in time:
  ``(frames - 1) / 4 + 1`` latent frames.
- Text length (the pipelines' ``max_sequence_length`` defaults, diffusers 0.42):
  FLUX.1 512 T5 tokens and FLUX.2 512 Mistral tokens, both padded to that length and joined
  to the attention sequence; SD3 77 CLIP + 256 T5 = 333 joined tokens; Qwen-Image 512 joined
  tokens, which is the pipeline's cap: it does not pad, so a short prompt gives fewer;
  Wan 512 UMT5 tokens (padded) and PixArt-Sigma 300 T5 tokens, both attended through
  cross-attention; DiT is class-conditional (no text).
- Output width. ``proj_out`` gives ``out_channels`` (``in_channels`` when null) times the
  config's patch area per token, in every family here (FLUX's config patch is 1: its
  packing happens outside). PixArt's and DiT's ``out_channels`` of 8 carry the learned
  variance, which their pipelines drop only after the transformer.
- MLP width. ``mlp_ratio`` is the hidden width, in units of the model width, of a two-GEMM
  ``d -> r*d -> d`` MLP with the same FLOPs. FLUX.2's SwiGLU MLP of ratio 3 has three
  ``d x 3d`` matrices (gate, up, down), so it counts as 4.5. Wan's is ``ffn_dim / dim``.

This module must stay importable without torch or diffusers: the simulator CLI uses it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from cocodiff.models.spec import MAX_MLP_RATIO, ModelSpec, ModelSpecError, _is_int, _is_number

# Tokens a FLUX-style pipeline packs together per side, outside the transformer.
_PACKED_PATCH = 2
# Image tokens of Wan2.1 I2V's CLIP image context (ViT-H/14 at 224 px: 16 * 16 + 1),
# attended next to the text when the config has ``added_kv_proj_dim``.
_WAN_I2V_IMAGE_TOKENS = 257

Adapter = Callable[[Mapping[str, Any], str], ModelSpec]


def flux(config: Mapping[str, Any], name: str) -> ModelSpec:
    # Double-stream and single-stream blocks both run one joint attention over text + image.
    return ModelSpec(
        name=name,
        output_channels=_output_channels(config),
        family="flux",
        num_layers=_positive_int(config, "num_layers") + _positive_int(config, "num_single_layers"),
        num_heads=_positive_int(config, "num_attention_heads"),
        head_dim=_positive_int(config, "attention_head_dim"),
        text_tokens=512,
        cross_attention_tokens=0,
        patch_size=_PACKED_PATCH,
        double_stream_share=_positive_int(config, "num_layers") / (
            _positive_int(config, "num_layers") + _positive_int(config, "num_single_layers")),
    )


def flux2(config: Mapping[str, Any], name: str) -> ModelSpec:
    swiglu_ratio = _positive_number(config, "mlp_ratio", default=3.0)  # diffusers' default
    return ModelSpec(
        name=name,
        output_channels=_output_channels(config),
        family="flux2",
        num_layers=_positive_int(config, "num_layers") + _positive_int(config, "num_single_layers"),
        num_heads=_positive_int(config, "num_attention_heads"),
        head_dim=_positive_int(config, "attention_head_dim"),
        text_tokens=512,
        cross_attention_tokens=0,
        patch_size=_PACKED_PATCH,
        mlp_ratio=1.5 * swiglu_ratio,  # gate + up + down: three d x r*d matrices
    )


def sd3(config: Mapping[str, Any], name: str) -> ModelSpec:
    # SD3.5-medium's dual_attention_layers (a second, image-only attention in the first 13
    # blocks) are not modelled; SD3.5-large has none.
    return ModelSpec(
        name=name,
        output_channels=_output_channels(config),
        family="sd3",
        num_layers=_positive_int(config, "num_layers"),
        num_heads=_positive_int(config, "num_attention_heads"),
        head_dim=_positive_int(config, "attention_head_dim"),
        text_tokens=77 + 256,  # CLIP-L/G (77) + T5 (max_sequence_length 256)
        cross_attention_tokens=0,
        patch_size=_positive_int(config, "patch_size"),
        has_qk_norm=config.get("qk_norm") is not None,  # None in SD3, "rms_norm" in SD3.5
        has_rope=False,
    )


def qwen_image(config: Mapping[str, Any], name: str) -> ModelSpec:
    return ModelSpec(
        name=name,
        output_channels=_output_channels(config),
        family="qwen-image",
        num_layers=_positive_int(config, "num_layers"),
        num_heads=_positive_int(config, "num_attention_heads"),
        head_dim=_positive_int(config, "attention_head_dim"),
        text_tokens=512,  # the pipeline's max_sequence_length cap (module docstring)
        cross_attention_tokens=0,
        patch_size=_PACKED_PATCH,
    )


def wan(config: Mapping[str, Any], name: str) -> ModelSpec:
    patch = config.get("patch_size")
    if (
        not isinstance(patch, list | tuple)
        or len(patch) != 3
        or not all(_is_int(p) and p > 0 for p in patch)
    ):
        raise ModelSpecError(f"config field 'patch_size' must be [t, h, w], got {patch!r}")
    if patch[0] != 1 or patch[1] != patch[2]:
        raise ModelSpecError(
            f"config field 'patch_size' {list(patch)} is unsupported: need [1, p, p]"
        )
    num_heads = _positive_int(config, "num_attention_heads")
    head_dim = _positive_int(config, "attention_head_dim")
    # Bounded before dividing: a huge ffn_dim would overflow the float division.
    ffn_dim = _positive_int(config, "ffn_dim")
    if ffn_dim > MAX_MLP_RATIO * num_heads * head_dim:
        raise ModelSpecError(
            f"config field 'ffn_dim' {ffn_dim} is more than {MAX_MLP_RATIO:g} x the model width "
            f"{num_heads * head_dim}"
        )
    image_context = 0 if config.get("added_kv_proj_dim") is None else _WAN_I2V_IMAGE_TOKENS
    return ModelSpec(
        name=name,
        output_channels=_output_channels(config),
        family="wan",
        num_layers=_positive_int(config, "num_layers"),
        num_heads=num_heads,
        head_dim=head_dim,
        text_tokens=0,
        cross_attention_tokens=512 + image_context,
        patch_size=patch[1],
        temporal_vae_scale=4,
        mlp_ratio=ffn_dim / (num_heads * head_dim),
        # WanAttention always norms Q and K: diffusers (0.42) never passes the config's
        # qk_norm on to it, so the field does not decide.
        has_qk_norm=True,
    )


def _plain_dit(config: Mapping[str, Any], name: str, family: str,
               cross_attention_tokens: int) -> ModelSpec:
    """The original DiT layout: self-attention without Q/K norm or RoPE (positions are
    added once to the patch embedding), optionally cross-attention to text."""
    return ModelSpec(
        name=name,
        output_channels=_output_channels(config),
        family=family,
        num_layers=_positive_int(config, "num_layers"),
        num_heads=_positive_int(config, "num_attention_heads"),
        head_dim=_positive_int(config, "attention_head_dim"),
        text_tokens=0,
        cross_attention_tokens=cross_attention_tokens,
        patch_size=_positive_int(config, "patch_size"),
        has_qk_norm=False,
        has_rope=False,
    )


def pixart(config: Mapping[str, Any], name: str) -> ModelSpec:
    # 300: PixArt-Sigma's max_sequence_length (Alpha used 120).
    return _plain_dit(config, name, "pixart", cross_attention_tokens=300)


def dit(config: Mapping[str, Any], name: str) -> ModelSpec:
    return _plain_dit(config, name, "dit", cross_attention_tokens=0)


def _positive_int(config: Mapping[str, Any], key: str) -> int:
    if key not in config:
        raise ModelSpecError(f"config is missing field {key!r} ({config.get('_class_name')})")
    value = config[key]
    if not _is_int(value) or value < 1:
        raise ModelSpecError(f"config field {key!r} must be a positive integer, got {value!r}")
    return value


def _output_channels(config: Mapping[str, Any]) -> int:
    """``proj_out``'s width (module docstring); 0 when the config has no ``in_channels``."""
    channels = config.get("out_channels") or config.get("in_channels")
    if channels is None:
        return 0
    if not _is_int(channels) or channels < 1:
        raise ModelSpecError(f"config field 'out_channels' / 'in_channels' must be a positive "
                             f"integer, got {channels!r}")
    patch = config.get("patch_size") or 1
    sides = list(patch) if isinstance(patch, list | tuple) else [patch]
    if not sides or not all(_is_int(side) and side > 0 for side in sides):
        raise ModelSpecError(f"config field 'patch_size' must be a positive integer or a list "
                             f"of them, got {patch!r}")
    area = math.prod(sides) if isinstance(patch, list | tuple) else patch * patch
    return channels * area


def _positive_number(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if not _is_number(value) or value <= 0:
        raise ModelSpecError(f"config field {key!r} must be a positive number, got {value!r}")
    if value > 1e300:  # an int this large would overflow float()
        raise ModelSpecError(f"config field {key!r} {value!r} is out of range")
    return float(value)
