"""``tiny-digits``: a tiny PixArt-Sigma pipeline trained here on scikit-learn's 8x8 digits,
and the digit classifier that reads what it generates.

The prompt is the digit itself ("0" ... "9"). Images are 32 x 32 pixels (the 8 x 8 digits
upsampled 4x, nearest, grey in three channels); the VAE reduces that to an 8 x 8 latent of 4
channels, which the transformer reads as 64 image tokens (patch size 1; 16 per rank on 4
ranks). Every weight (transformer, VAE, the frozen T5 text encoder, the classifier) comes
from ``weights/tiny-digits.safetensors``, which ``python -m
cocodiff.commands.train_digits`` writes; scikit-learn is needed only there.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKL,
    PixArtSigmaPipeline,
    PixArtTransformer2DModel,
)
from PIL import Image
from safetensors.torch import load_file, safe_open
from transformers import T5EncoderModel

from cocodiff.quality import ClassAgreement, image_tensor
from cocodiff.runtime.tiny.builders import _seeded, pixart_scheduler
from cocodiff.runtime.tiny.text import _t5_config, tiny_t5_tokenizer

WEIGHTS_PATH = Path(__file__).with_name("weights") / "tiny-digits.safetensors"
NUM_CLASSES = 10
DIGIT_PX = 8
UPSAMPLE = 4
IMAGE_PX = DIGIT_PX * UPSAMPLE  # 32
LATENT_PX = IMAGE_PX // 4  # the VAE downsamples 4x
NUM_HEADS = 4
HEAD_DIM = 16
NUM_LAYERS = 4
TEXT_DIM = 32
# The components a weights file holds, as key prefixes.
COMPONENTS = ("transformer", "vae", "text_encoder", "classifier")
# sklearn's digits are 4-bit counts of ink, 0..16.
DIGIT_MAX = 16.0


def digit_prompt(digit: int) -> str:
    """The prompt that asks for ``digit``: the numeral itself."""
    return str(digit)


def requested_digit(prompt: str) -> int | None:
    """The digit a prompt asks for, or None if it is not one numeral."""
    text = prompt.strip()
    return int(text) if len(text) == 1 and text.isdigit() else None


def build_architecture(vae_scaling_factor: float = 1.0) -> PixArtSigmaPipeline:
    """The tiny-digits pipeline with seeded random weights (what training starts from)."""
    tokenizer = tiny_t5_tokenizer()
    inner_dim = NUM_HEADS * HEAD_DIM
    transformer = _seeded(
        lambda: PixArtTransformer2DModel(
            num_attention_heads=NUM_HEADS,
            attention_head_dim=HEAD_DIM,
            in_channels=4,
            # No learned variance: out_channels // 2 != 4, so the pipeline keeps all 4.
            out_channels=4,
            num_layers=NUM_LAYERS,
            cross_attention_dim=inner_dim,
            sample_size=LATENT_PX,
            # One token per latent pixel: 8 x 8 = 64 image tokens, one per pixel of the digit.
            patch_size=1,
            caption_channels=TEXT_DIM,
            interpolation_scale=1,
        )
    )
    vae = _seeded(
        lambda: AutoencoderKL(
            in_channels=3,
            out_channels=3,
            # Three blocks: two 2x downsamplings (pipelines read 2 ** (blocks - 1)).
            down_block_types=("DownEncoderBlock2D",) * 3,
            up_block_types=("UpDecoderBlock2D",) * 3,
            block_out_channels=(8, 16, 16),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            # Attention at 8 x 8 buys nothing for 8 x 8 digits and costs training time.
            mid_block_add_attention=False,
            sample_size=IMAGE_PX,
            scaling_factor=vae_scaling_factor,
        )
    )
    return PixArtSigmaPipeline(
        tokenizer=tokenizer,
        text_encoder=_seeded(lambda: T5EncoderModel(_t5_config(tokenizer, TEXT_DIM))),
        vae=vae,
        transformer=transformer,
        scheduler=pixart_scheduler(),
    )


class DigitClassifier(torch.nn.Module):
    """A two-layer perceptron over an image pooled to the digits' 8 x 8 grid."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(DIGIT_PX * DIGIT_PX, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, NUM_CLASSES),
        )

    def forward(self, digits: torch.Tensor) -> torch.Tensor:
        """Logits ``(N, 10)`` of ``(N, 8, 8)`` ink in [0, 1]."""
        return self.net(digits.flatten(1))


def pooled_ink(images: torch.Tensor) -> torch.Tensor:
    """``(N, C, 32, 32)`` pixels in [0, 1] -> ``(N, 8, 8)`` ink in [0, 1].

    The mean over channels and over each 4 x 4 cell: the inverse of the nearest
    upsampling the training images were made with.
    """
    grey = images.double().mean(dim=1, keepdim=True)  # (N, 1, 32, 32)
    return F.avg_pool2d(grey, UPSAMPLE).squeeze(1).float()  # (N, 8, 8)


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    return load_file(str(path)), metadata


def _component(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {key[len(prefix) + 1:]: value for key, value in state.items()
            if key.startswith(prefix + ".")}


def build_digits(path: Path = WEIGHTS_PATH) -> PixArtSigmaPipeline:
    """The trained tiny-digits pipeline.

    Raises:
        FileNotFoundError: no weights file at ``path``.
    """
    state, metadata = _read(path)
    pipe = build_architecture(float(json.loads(metadata["vae"])["scaling_factor"]))
    for name in ("transformer", "vae", "text_encoder"):
        getattr(pipe, name).load_state_dict(_component(state, name), strict=True)
    return pipe


class DigitReader:
    """Reads generated digits: the trained classifier on pooled pixels."""

    def __init__(self, path: Path = WEIGHTS_PATH) -> None:
        state, _ = _read(path)
        self.model = DigitClassifier().eval()
        self.model.load_state_dict(_component(state, "classifier"), strict=True)

    def read(self, images: torch.Tensor) -> torch.Tensor:
        """The digit in each of ``(N, C, 32, 32)`` images in [0, 1]: ``(N,)`` int64."""
        with torch.no_grad():
            return self.model(pooled_ink(images)).argmax(dim=1)


def read_agreement(reader: DigitReader, prompt: str, reference_image: Image.Image,
                   image: Image.Image) -> ClassAgreement:
    """The digits ``reader`` sees in the exact plan's image and in a lossy one."""
    # (2, 3, 32, 32): the exact image, then the lossy one
    exact, lossy = reader.read(torch.cat([image_tensor(reference_image),
                                          image_tensor(image)])).tolist()
    return ClassAgreement(exact, lossy, requested_digit(prompt))

