"""Latents -> pixels as each family's pipeline decodes them (its VAE and image or video
processor), for the first sample of ``run_pipeline``'s latents."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image


def decode_kl(pipe: Any, latents: torch.Tensor) -> Image.Image:
    """AutoencoderKL pipelines (FLUX, SD3, PixArt): un-scale, un-shift, decode."""
    config = pipe.vae.config
    latents = latents / config.scaling_factor + (getattr(config, "shift_factor", None) or 0.0)
    image = pipe.vae.decode(latents.to(pipe.vae.device, pipe.vae.dtype), return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type="pil")[0]


def _unnormalise_3d(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    config = pipe.vae.config
    # (z,) -> (1, z, 1, 1, 1) to broadcast over (b, z, f, h, w)
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.device)
    std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents.device)
    return (latents * std + mean).to(pipe.vae.device, pipe.vae.dtype)


def decode_qwen(pipe: Any, latents: torch.Tensor) -> Image.Image:
    """Qwen-Image's 3D VAE, one frame."""
    # (b, 3, 1, h, w) -> (b, 3, h, w): the single frame
    image = pipe.vae.decode(_unnormalise_3d(pipe, latents), return_dict=False)[0][:, :, 0]
    return pipe.image_processor.postprocess(image, output_type="pil")[0]


def decode_wan(pipe: Any, latents: torch.Tensor) -> list[Image.Image]:
    """Wan's 3D VAE: the video's frames."""
    video = pipe.vae.decode(_unnormalise_3d(pipe, latents), return_dict=False)[0]
    return pipe.video_processor.postprocess_video(video, output_type="pil")[0]
