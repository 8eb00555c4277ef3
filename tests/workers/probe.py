"""Deterministic transformer inputs for the built-in tiny models: what the parity
workers feed a transformer directly.

Shapes are what the tiny pipelines give their transformer, with one stream per model
whose length is not a multiple of 2 or 4 ranks, so the split pads: 7 joint text tokens
(FLUX, SD3, Qwen-Image), 7 x 7 image tokens (PixArt: 112 px), 3 x 3 x 5 video tokens
(Wan: 9 frames of 80 x 48 px). Masks mark trailing padding, as a batched prompt has.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cocodiff.runtime.tiny import default_resolution

TEXT_TOKENS = 7  # joint-attention text: not a multiple of the rank count
CROSS_TOKENS = 16  # cross-attention text (PixArt, Wan): replicated, never split
PADDED_TEXT = 2  # trailing text tokens a mask marks as padding

Randn = Callable[..., torch.Tensor]


def transformer_inputs(model: str, transformer: torch.nn.Module, seed: int = 0,
                       batch: int = 1) -> dict:
    """Random but seeded inputs of the right shapes for ``transformer`` (a tiny model)."""
    name = type(transformer).__name__
    if name not in _INPUTS:
        raise ValueError(f"no probe inputs for {name}; known: {', '.join(sorted(_INPUTS))}")
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    width, height, _frames = default_resolution(model)
    return _INPUTS[name](transformer.config, randn, width, height, batch)


def _text_mask(batch: int, tokens: int) -> torch.Tensor:
    """(B, tokens) keep-mask whose last ``PADDED_TEXT`` tokens are padding."""
    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[:, tokens - PADDED_TEXT:] = 0
    return mask


def _flux(config, randn: Randn, width: int, height: int, batch: int) -> dict:
    h, w = height // 16, width // 16  # 8x VAE, 2x2 packing
    img_ids = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(float(h)), torch.arange(float(w)),
                       indexing="ij"), -1
    ).reshape(h * w, 3).float()
    return {
        "hidden_states": randn(batch, h * w, config.in_channels),
        "encoder_hidden_states": randn(batch, TEXT_TOKENS, config.joint_attention_dim),
        "pooled_projections": randn(batch, config.pooled_projection_dim),
        "timestep": torch.full((batch,), 0.5),
        "guidance": torch.full((batch,), 3.5) if config.guidance_embeds else None,
        "img_ids": img_ids,
        "txt_ids": torch.zeros(TEXT_TOKENS, 3),
    }


def _sd3(config, randn: Randn, width: int, height: int, batch: int) -> dict:
    return {
        "hidden_states": randn(batch, config.in_channels, height // 8, width // 8),
        "encoder_hidden_states": randn(batch, TEXT_TOKENS, config.joint_attention_dim),
        "pooled_projections": randn(batch, config.pooled_projection_dim),
        "timestep": torch.full((batch,), 500.0),
    }


def _qwen(config, randn: Randn, width: int, height: int, batch: int) -> dict:
    h, w = height // 16, width // 16  # 8x VAE, 2x2 packing
    return {
        "hidden_states": randn(batch, h * w, config.in_channels),
        "encoder_hidden_states": randn(batch, TEXT_TOKENS, config.joint_attention_dim),
        "encoder_hidden_states_mask": _text_mask(batch, TEXT_TOKENS),
        "timestep": torch.full((batch,), 0.5),
        "img_shapes": [[(1, h, w)]] * batch,
    }


def _pixart(config, randn: Randn, width: int, height: int, batch: int) -> dict:
    latent = 2 * 7  # 112 px: 7 x 7 image tokens
    return {
        "hidden_states": randn(batch, config.in_channels, latent, latent),
        "encoder_hidden_states": randn(batch, CROSS_TOKENS, config.caption_channels),
        "encoder_attention_mask": _text_mask(batch, CROSS_TOKENS),
        "timestep": torch.full((batch,), 500.0),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
    }


def _wan(config, randn: Randn, width: int, height: int, batch: int) -> dict:
    # 9 frames of 80 x 48 px -> 3 x 6 x 10 latents -> 3 x 3 x 5 tokens
    return {
        "hidden_states": randn(batch, config.in_channels, 3, 6, 10),
        "encoder_hidden_states": randn(batch, CROSS_TOKENS, config.text_dim),
        "timestep": torch.full((batch,), 500.0),
    }


_INPUTS: dict[str, Callable[..., dict]] = {
    "FluxTransformer2DModel": _flux,
    "SD3Transformer2DModel": _sd3,
    "QwenImageTransformer2DModel": _qwen,
    "PixArtTransformer2DModel": _pixart,
    "WanTransformer3DModel": _wan,
}
