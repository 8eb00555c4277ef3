"""DiT model specs: the few numbers of a Diffusion Transformer that Ulysses cost depends on.

A :class:`ModelSpec` says how many attention layers a model has, how its heads are shaped,
how many tokens a given resolution becomes, and how many text tokens join (or are attended
through cross-attention by) the image tokens. It is derived from a diffusers
``transformer/config.json`` by :func:`spec_from_config`; :data:`REGISTRY` holds the models
the paper and the project talk about, under short names.

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
- MLP width. ``mlp_ratio`` is the hidden width, in units of the model width, of a two-GEMM
  ``d -> r*d -> d`` MLP with the same FLOPs. FLUX.2's SwiGLU MLP of ratio 3 has three
  ``d x 3d`` matrices (gate, up, down), so it counts as 4.5. Wan's is ``ffn_dim / dim``.

This module must stay importable without torch or diffusers: the simulator CLI uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cocodiff.util.jsonfile import read_json
from cocodiff.util.paths import path_problem

FAMILIES = ("flux", "flux2", "sd3", "qwen-image", "wan", "pixart", "dit")

# Tokens a FLUX-style pipeline packs together per side, outside the transformer.
_PACKED_PATCH = 2
# Image tokens of Wan2.1 I2V's CLIP image context (ViT-H/14 at 224 px: 16 * 16 + 1),
# attended next to the text when the config has ``added_kv_proj_dim``.
_WAN_I2V_IMAGE_TOKENS = 257
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
        name: short name (a :data:`REGISTRY` key, or the model directory's name).
        family: one of :data:`FAMILIES`.
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

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ModelSpecError(
                f"unknown model family {self.family!r} for {self.name!r}; "
                f"valid: {', '.join(FAMILIES)}"
            )
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
        for field_name in ("text_tokens", "cross_attention_tokens"):
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
        if not _is_number(self.mlp_ratio) or self.mlp_ratio <= 0:
            raise ModelSpecError(
                f"mlp_ratio of {self.name!r} must be a positive number, got {self.mlp_ratio!r}"
            )
        if not self.mlp_ratio <= MAX_MLP_RATIO:  # inf included
            raise ModelSpecError(
                f"mlp_ratio of {self.name!r} is {self.mlp_ratio!r}, more than {MAX_MLP_RATIO:g}"
            )

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


# --- diffusers configs -> specs --------------------------------------------------------------

Adapter = Callable[[Mapping[str, Any], str], ModelSpec]


def _flux(config: Mapping[str, Any], name: str) -> ModelSpec:
    # Double-stream and single-stream blocks both run one joint attention over text + image.
    return ModelSpec(
        name=name,
        family="flux",
        num_layers=_positive_int(config, "num_layers") + _positive_int(config, "num_single_layers"),
        num_heads=_positive_int(config, "num_attention_heads"),
        head_dim=_positive_int(config, "attention_head_dim"),
        text_tokens=512,
        cross_attention_tokens=0,
        patch_size=_PACKED_PATCH,
    )


def _flux2(config: Mapping[str, Any], name: str) -> ModelSpec:
    swiglu_ratio = _positive_number(config, "mlp_ratio", default=3.0)  # diffusers' default
    return ModelSpec(
        name=name,
        family="flux2",
        num_layers=_positive_int(config, "num_layers") + _positive_int(config, "num_single_layers"),
        num_heads=_positive_int(config, "num_attention_heads"),
        head_dim=_positive_int(config, "attention_head_dim"),
        text_tokens=512,
        cross_attention_tokens=0,
        patch_size=_PACKED_PATCH,
        mlp_ratio=1.5 * swiglu_ratio,  # gate + up + down: three d x r*d matrices
    )


def _sd3(config: Mapping[str, Any], name: str) -> ModelSpec:
    # SD3.5-medium's dual_attention_layers (a second, image-only attention in the first 13
    # blocks) are not modelled; SD3.5-large has none.
    return ModelSpec(
        name=name,
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


def _qwen_image(config: Mapping[str, Any], name: str) -> ModelSpec:
    return ModelSpec(
        name=name,
        family="qwen-image",
        num_layers=_positive_int(config, "num_layers"),
        num_heads=_positive_int(config, "num_attention_heads"),
        head_dim=_positive_int(config, "attention_head_dim"),
        text_tokens=512,  # the pipeline's max_sequence_length cap (module docstring)
        cross_attention_tokens=0,
        patch_size=_PACKED_PATCH,
    )


def _wan(config: Mapping[str, Any], name: str) -> ModelSpec:
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


def _pixart(config: Mapping[str, Any], name: str) -> ModelSpec:
    # 300: PixArt-Sigma's max_sequence_length (Alpha used 120).
    return _plain_dit(config, name, "pixart", cross_attention_tokens=300)


def _dit(config: Mapping[str, Any], name: str) -> ModelSpec:
    return _plain_dit(config, name, "dit", cross_attention_tokens=0)


# Hub checkpoints older than diffusers 0.28 (DiT-XL-2, PixArt) name the generic class;
# diffusers itself picks the real one from norm_type (_CLASS_REMAPPING_DICT).
_TRANSFORMER_2D_BY_NORM: dict[str, Adapter] = {"ada_norm_zero": _dit, "ada_norm_single": _pixart}


def _transformer_2d(config: Mapping[str, Any], name: str) -> ModelSpec:
    norm_type = config.get("norm_type")
    adapter = _TRANSFORMER_2D_BY_NORM.get(norm_type) if isinstance(norm_type, str) else None
    if adapter is None:
        raise ModelSpecError(
            f"config field 'norm_type' of a Transformer2DModel must be one of "
            f"{', '.join(_TRANSFORMER_2D_BY_NORM)} (DiT, PixArt), got {norm_type!r}"
        )
    return adapter(config, name)


_ADAPTERS: dict[str, Adapter] = {
    "FluxTransformer2DModel": _flux,
    "Flux2Transformer2DModel": _flux2,
    "SD3Transformer2DModel": _sd3,
    "QwenImageTransformer2DModel": _qwen_image,
    "WanTransformer3DModel": _wan,
    "PixArtTransformer2DModel": _pixart,
    "DiTTransformer2DModel": _dit,
    "Transformer2DModel": _transformer_2d,
}


def spec_from_config(config: Mapping[str, Any], name: str = "custom") -> ModelSpec:
    """Derive a :class:`ModelSpec` from a diffusers transformer config (``config.json``).

    Args:
        config: the parsed config; dispatched on its ``_class_name``.
        name: the spec's name.

    Raises:
        ModelSpecError: the class is not supported (the message lists those that are), or a
            field the spec needs is missing or of the wrong type (the message names it).
    """
    if not isinstance(config, Mapping):
        raise ModelSpecError(f"a transformer config must be a mapping, got {type(config).__name__}")
    class_name = config.get("_class_name")
    if class_name is None:
        raise ModelSpecError("config has no '_class_name' field: is it a diffusers config?")
    adapter = _ADAPTERS.get(class_name) if isinstance(class_name, str) else None
    if adapter is None:
        raise ModelSpecError(
            f"unsupported transformer class {class_name!r}; supported: {', '.join(_ADAPTERS)}"
        )
    return adapter(config, name)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive_int(config: Mapping[str, Any], key: str) -> int:
    if key not in config:
        raise ModelSpecError(f"config is missing field {key!r} ({config.get('_class_name')})")
    value = config[key]
    if not _is_int(value) or value < 1:
        raise ModelSpecError(f"config field {key!r} must be a positive integer, got {value!r}")
    return value


def _positive_number(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if not _is_number(value) or value <= 0:
        raise ModelSpecError(f"config field {key!r} must be a positive number, got {value!r}")
    if value > 1e300:  # an int this large would overflow float()
        raise ModelSpecError(f"config field {key!r} {value!r} is out of range")
    return float(value)


# --- the registry ----------------------------------------------------------------------------

# Each entry equals spec_from_config() of the model's real transformer/config.json
# (tests/data/configs/<name>.json; tests/test_models.py checks it).
REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "flux1-dev",
            "flux",
            num_layers=19 + 38,
            num_heads=24,
            head_dim=128,
            text_tokens=512,
            cross_attention_tokens=0,
            patch_size=2,
        ),
        ModelSpec(
            "flux2-dev",
            "flux2",
            num_layers=8 + 48,
            num_heads=48,
            head_dim=128,
            text_tokens=512,
            cross_attention_tokens=0,
            patch_size=2,
            mlp_ratio=4.5,
        ),
        ModelSpec(
            "sd35-large",
            "sd3",
            num_layers=38,
            num_heads=38,
            head_dim=64,
            text_tokens=333,
            cross_attention_tokens=0,
            patch_size=2,
            has_rope=False,
        ),
        ModelSpec(
            "qwen-image",
            "qwen-image",
            num_layers=60,
            num_heads=24,
            head_dim=128,
            text_tokens=512,
            cross_attention_tokens=0,
            patch_size=2,
        ),
        ModelSpec(
            "wan21-14b",
            "wan",
            num_layers=40,
            num_heads=40,
            head_dim=128,
            text_tokens=0,
            cross_attention_tokens=512,
            patch_size=2,
            temporal_vae_scale=4,
            mlp_ratio=13824 / 5120,
        ),
        ModelSpec(
            "pixart-sigma",
            "pixart",
            num_layers=28,
            num_heads=16,
            head_dim=72,
            text_tokens=0,
            cross_attention_tokens=300,
            patch_size=2,
            has_qk_norm=False,
            has_rope=False,
        ),
        ModelSpec(
            "dit-xl-2",
            "dit",
            num_layers=28,
            num_heads=16,
            head_dim=72,
            text_tokens=0,
            cross_attention_tokens=0,
            patch_size=2,
            has_qk_norm=False,
            has_rope=False,
        ),
    )
}


def load_model_spec(name_or_path: str) -> ModelSpec:
    """Look up a registry name, or read a diffusers transformer config from disk.

    Args:
        name_or_path: a :data:`REGISTRY` key; a ``config.json`` path; a diffusers model
            directory holding ``transformer/config.json``; or a transformer directory
            holding ``config.json``.

    Returns:
        The spec; one read from disk is named after its model directory.

    Raises:
        ModelSpecError: an unknown name (the message lists the registry), a missing file,
            unreadable or invalid JSON, a JSON value that is not an object, or a config
            :func:`spec_from_config` refuses (the message is prefixed with the file).
    """
    if name_or_path in REGISTRY:
        return REGISTRY[name_or_path]
    path = Path(name_or_path)
    problem = path_problem(path)
    if problem is not None and path.suffix != ".json" and len(path.parts) <= 1:
        raise ModelSpecError(
            f"unknown model {_shorten(name_or_path)!r}; registry names: {', '.join(REGISTRY)} "
            f"(and not a path: {problem})"
        )
    if problem is not None:
        raise ModelSpecError(f"model path {_shorten(name_or_path)!r} cannot exist: {problem}")
    if path.is_dir():
        candidates = (path / "transformer" / "config.json", path / "config.json")
        found = [candidate for candidate in candidates if candidate.is_file()]
        if not found:
            raise ModelSpecError(
                f"no transformer/config.json or config.json in directory {str(path)!r}"
            )
        path = found[0]
    elif not path.exists():
        if path.suffix == ".json" or len(path.parts) > 1:
            raise ModelSpecError(f"model config file not found: {name_or_path!r}")
        raise ModelSpecError(
            f"unknown model {name_or_path!r}; registry names: {', '.join(REGISTRY)} "
            f"(or give a diffusers directory or config.json path)"
        )
    config = read_json(path, "model config", ModelSpecError)
    if not isinstance(config, dict):
        raise ModelSpecError(f"{str(path)!r} must hold a JSON object, got {type(config).__name__}")
    model_dir = path.parent.parent if path.parent.name == "transformer" else path.parent
    try:
        spec = spec_from_config(config, name=model_dir.resolve().name or "custom")
    except ModelSpecError as err:
        raise ModelSpecError(f"{str(path)!r}: {err}") from None
    return _with_prompt_length(spec, model_dir / TINY_MARKER)


# Written beside an exported tiny model (``cocodiff export-tiny``): its name and the text
# length its pipeline pads the prompt to, which the config does not hold.
TINY_MARKER = "cocodiff_tiny.json"
# The built-in tiny models' names (``cocodiff.runtime.tiny.TINY_MODELS`` builds them), here
# so that commands can check a name without importing diffusers.
TINY_NAMES = ("tiny-flux", "tiny-sd3", "tiny-qwen", "tiny-wan", "tiny-pixart", "tiny-digits")


def _with_prompt_length(spec: ModelSpec, marker: Path) -> ModelSpec:
    """``spec`` with the text tokens an exported tiny model's pipeline really uses, and its
    VAE's scale where the marker records one."""
    content = read_tiny_marker(marker.parent) or {}
    vae_scale = content.get("vae_scale")
    if _is_int(vae_scale) and vae_scale >= 1:
        spec = replace(spec, vae_scale=vae_scale)
    text_tokens = content.get("text_tokens")
    if not _is_int(text_tokens) or text_tokens < 1:
        return spec
    if spec.text_tokens:  # joint attention: the text joins the sequence
        return replace(spec, text_tokens=text_tokens)
    return replace(spec, cross_attention_tokens=text_tokens)


def read_tiny_marker(directory: str | Path) -> dict[str, Any] | None:
    """The :data:`TINY_MARKER` of a model directory, or None when there is none or it is
    not ours (unreadable, not JSON, nested deeply, not an object): the directory is then
    an ordinary diffusers directory."""
    marker = Path(directory) / TINY_MARKER
    if path_problem(marker) is not None or not marker.is_file():
        return None
    try:
        content = read_json(marker, "tiny-model marker", ModelSpecError)
    except ModelSpecError:
        return None
    return content if isinstance(content, dict) else None


def _shorten(text: str, limit: int = 60) -> str:
    """A long user value cut for a message (the message stays readable on one line)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
