"""Deterministic transformer inputs for the built-in tiny models: what the parity
tests and ``cocodiff run --reference`` feed a transformer directly."""

from __future__ import annotations

import torch

from cocodiff.runtime.tiny import default_resolution


def transformer_inputs(model: str, transformer: torch.nn.Module, seed: int = 0,
                       batch: int = 1) -> dict:
    """Random but seeded inputs of the right shapes for ``transformer`` (a tiny model)."""
    generator = torch.Generator().manual_seed(seed)
    config = transformer.config
    width, height, _frames = default_resolution(model)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    name = type(transformer).__name__
    if name == "FluxTransformer2DModel":
        h, w = height // 16, width // 16
        text = 7  # not a multiple of the rank count: exercises padding
        img_ids = torch.stack(
            torch.meshgrid(torch.zeros(1), torch.arange(float(h)), torch.arange(float(w)), indexing="ij"), -1
        ).reshape(h * w, 3).float()
        return {
            "hidden_states": randn(batch, h * w, config.in_channels),
            "encoder_hidden_states": randn(batch, text, config.joint_attention_dim),
            "pooled_projections": randn(batch, config.pooled_projection_dim),
            "timestep": torch.full((batch,), 0.5),
            "guidance": torch.full((batch,), 3.5) if config.guidance_embeds else None,
            "img_ids": img_ids,
            "txt_ids": torch.zeros(text, 3),
        }
    raise ValueError(f"no probe inputs for {name}")
