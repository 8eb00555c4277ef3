"""A DiT's shape: the few numbers of a Diffusion Transformer that Ulysses cost depends on.

A :class:`ModelSpec` says how many attention layers a model has, how its heads are shaped,
how many tokens a given resolution becomes, and how many text tokens join (or are attended
through cross-attention by) the image tokens. Specs are derived from diffusers configs by
the family records (:mod:`cocodiff.models.families`), which also say where each fact
comes from.

This module must stay importable without torch or diffusers: the simulator CLI uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

# Upper bounds of what a spec may say: an order of magnitude past any real DiT (the largest
# here: 60 layers, 48 heads, head dim 128, MLP ratio 4.5, 81 frames). Beyond them the input
# is a typo or garbage, and the simulator would take hours (or overflow) on it.
MAX_SPEC = {
    "num_layers": 1024,
    "num_heads": 1024,
    "head_dim": 1024,
    "patch_size": 64,
    "vae_scale": 64,
    "temporal_vae_scale": 64,
    "text_tokens": 1 << 20,
    "cross_attention_tokens": 1 << 20,
    "output_channels": 1 << 16,
}
MAX_MLP_RATIO = 64.0
MAX_PIXELS = 1 << 16  # per side of an image or video frame
MAX_FRAMES = 1 << 16


class ModelSpecError(ValueError):
    """A model name, config file or config field the user got wrong.

    The message is one line and names the offending value (and the file and key where there
    is one), so a CLI can print it as is and exit non-zero.
    """


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of one Diffusion Transformer, as far as Ulysses cost is concerned.

    Attributes:
        name: short name (a preset's name, or the model directory's name).
        family: a :data:`cocodiff.models.families.FAMILIES` key (checked by
            :func:`~cocodiff.models.families.check_family` where a spec is read from a file).
        num_layers: transformer blocks with self or joint attention (FLUX.1: 19 double-stream
            + 38 single-stream = 57).
        num_heads: attention heads per layer.
        head_dim: channels per head.
        text_tokens: text tokens that join the attention sequence (joint attention); 0 for
            cross-attention or unconditional models.
        cross_attention_tokens: text (and image-prompt) tokens attended through
            cross-attention; 0 otherwise.
        patch_size: latent pixels per token side (FLUX's 2x2 packing counts as 2).
        vae_scale: image pixels per latent pixel, per side.
        temporal_vae_scale: video frames per latent frame (1 for image models).
        mlp_ratio: two-GEMM-equivalent MLP width over the model width (module docstring).
        has_qk_norm: Q and K are RMS/layer-normalised per head before attention.
        has_rope: Q and K get rotary position embeddings (else positions are added to the
            patch embedding once, before the first layer).
        output_channels: values the transformer's output projection gives per image token
            (``proj_out``'s width: latent channels x the config's patch area), what the
            runtime's output gather moves; 0: not known (a spec written by hand, or read
            from a plan file older than the field), and no gather is simulated.
        double_stream_share: the share of FLUX's blocks that are double-stream, the
            model's first ones (the rest are single-stream; they cost differently per
            token, and a pipeline stage holds its own); a share, not a count, so that a
            spec shortened to a few layers keeps its mean layer; None: not FLUX, or not
            known (the cost model then takes FLUX.1's 19 of 57).
    """

    name: str
    family: str
    num_layers: int
    num_heads: int
    head_dim: int
    text_tokens: int
    cross_attention_tokens: int
    patch_size: int
    vae_scale: int = 8
    temporal_vae_scale: int = 1
    mlp_ratio: float = 4.0
    has_qk_norm: bool = True
    has_rope: bool = True
    output_channels: int = 0
    double_stream_share: float | None = None

    def __post_init__(self) -> None:
        # The family is checked where a spec comes from outside the family records
        # (cocodiff.models.families.check_family; a plan file's spec): the records build
        # specs, so this module cannot look them up.
        for field_name in (
            "num_layers",
            "num_heads",
            "head_dim",
            "patch_size",
            "vae_scale",
            "temporal_vae_scale",
        ):
            value = getattr(self, field_name)
            if not _is_int(value) or value < 1:
                raise ModelSpecError(
                    f"{field_name} of {self.name!r} must be a positive integer, got {value!r}"
                )
        for field_name in ("text_tokens", "cross_attention_tokens", "output_channels"):
            value = getattr(self, field_name)
            if not _is_int(value) or value < 0:
                raise ModelSpecError(
                    f"{field_name} of {self.name!r} must be a non-negative integer, got {value!r}"
                )
        for field_name, limit in MAX_SPEC.items():
            if getattr(self, field_name) > limit:
                raise ModelSpecError(
                    f"{field_name} of {self.name!r} is {getattr(self, field_name)}, more than "
                    f"{limit}: no DiT is that large"
                )
        share = self.double_stream_share
        if share is not None and not (_is_number(share) and 0 <= share <= 1):
            raise ModelSpecError(
                f"double_stream_share of {self.name!r} must be a number from 0 to 1, "
                f"got {share!r}"
            )
        if not _is_number(self.mlp_ratio) or self.mlp_ratio <= 0:
            raise ModelSpecError(
                f"mlp_ratio of {self.name!r} must be a positive number, got {self.mlp_ratio!r}"
            )
        if not self.mlp_ratio <= MAX_MLP_RATIO:  # inf included
            raise ModelSpecError(
                f"mlp_ratio of {self.name!r} is {self.mlp_ratio!r}, more than {MAX_MLP_RATIO:g}"
            )

    def double_stream(self, layer: int) -> bool | None:
        """Whether layer ``layer`` (0-based) is a double-stream block; None where the
        spec does not say."""
        if self.double_stream_share is None:
            return None
        return layer < round(self.double_stream_share * self.num_layers)

    @property
    def hidden_size(self) -> int:
        """Model width ``d`` = ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def is_video(self) -> bool:
        """Whether the model denoises video (its VAE compresses time)."""
        return self.temporal_vae_scale > 1

    def check_resolution(self, width: int, height: int) -> None:
        """Raise :class:`ModelSpecError` unless ``width x height`` pixels tile into tokens.

        Both must be positive multiples of ``vae_scale * patch_size`` (16 for every model
        here): the pipelines would otherwise silently resize the image.
        """
        multiple = self.vae_scale * self.patch_size
        for label, value in (("width", width), ("height", height)):
            if not _is_int(value) or value < 1:
                raise ModelSpecError(f"{label} must be a positive integer, got {value!r}")
        if width % multiple or height % multiple:
            raise ModelSpecError(
                f"resolution {width}x{height} is not a multiple of {multiple} "
                f"(vae_scale {self.vae_scale} x patch {self.patch_size}) for {self.name}"
            )

    def latent_frames(self, frames: int = 1) -> int:
        """Latent frames for ``frames`` video frames (1 for an image model).

        Raises:
            ModelSpecError: ``frames`` is not 1 for an image model, or for a video model not
                of the form ``temporal_vae_scale * k + 1`` (Wan: 1, 5, ..., 81).
        """
        if not _is_int(frames) or frames < 1:
            raise ModelSpecError(f"frames must be a positive integer, got {frames!r}")
        if frames > MAX_FRAMES:
            raise ModelSpecError(f"frames {frames} is more than {MAX_FRAMES}")
        if not self.is_video:
            if frames != 1:
                raise ModelSpecError(
                    f"{self.name} is an image model: frames must be 1, got {frames}"
                )
            return 1
        if (frames - 1) % self.temporal_vae_scale:
            raise ModelSpecError(
                f"{self.name} needs frames = {self.temporal_vae_scale}k + 1 (e.g. 81), got {frames}"
            )
        return (frames - 1) // self.temporal_vae_scale + 1

    def image_tokens(self, width: int, height: int, frames: int = 1) -> int:
        """Image (or video) tokens for ``width x height`` pixels and ``frames`` frames.

        Raises:
            ModelSpecError: the resolution or frame count does not tile into tokens.
        """
        self.check_resolution(width, height)
        per_token = self.vae_scale * self.patch_size
        return self.latent_frames(frames) * (width // per_token) * (height // per_token)

    def sequence_tokens(self, width: int, height: int, frames: int = 1) -> int:
        """The attention sequence Ulysses splits: image tokens plus joined text tokens."""
        return self.image_tokens(width, height, frames) + self.text_tokens


def parse_resolution(text: str) -> tuple[int, int]:
    """Parse ``"1024"`` (square) or ``"832x480"`` (width x height) into ``(width, height)``.

    Only the syntax and range are checked here; whether the size tiles into a model's
    tokens is :meth:`ModelSpec.check_resolution`'s job.

    Raises:
        ModelSpecError: ``text`` is not one or two integers in ``[1, MAX_PIXELS]`` joined by
            ``x``.
    """
    parts = text.strip().lower().split("x")
    try:
        values = [int(part) for part in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or any(value < 1 for value in values):
        raise ModelSpecError(
            f"bad resolution {text!r}: expected WIDTH or WIDTHxHEIGHT in pixels, e.g. 1024 or "
            f"832x480"
        )
    if any(value > MAX_PIXELS for value in values):
        raise ModelSpecError(f"resolution {text!r} is over {MAX_PIXELS} pixels per side")
    width, height = values if len(values) == 2 else (values[0], values[0])
    return width, height


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


