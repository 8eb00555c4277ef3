"""One record per model family: every per-model fact the engine needs, in one place.

A :class:`ModelFamily` names the diffusers transformer class(es) of the family, the builder
that turns their ``config.json`` into a :class:`~cocodiff.models.spec.ModelSpec`, the
named presets the simulator knows (as config fields, so the spec comes from the same
builder), the runtime's adapter (where the token streams enter and leave the model, how
its attention runs, which forward arguments carry the batch, how latents are decoded),
whether diffusers' own context parallelism (the ``diffusers`` baseline) covers it, and
its built-in tiny models. Adding a family is one new record in :data:`FAMILIES`.

The runtime's parts need torch and diffusers, which the simulator must not import, so a
record names them as ``"module:attribute"`` strings, imported on use (:func:`load_object`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cocodiff.models import configs
from cocodiff.models.configs import Adapter
from cocodiff.models.spec import ModelSpec, ModelSpecError

# What `cocodiff run` asks for when no --prompt is given (tiny-digits: a digit).
DEFAULT_PROMPT = "a lighthouse on a cliff at dawn"
# Text tokens the tiny models' pipelines pad the prompt to: short, so that the joint
# (text + image) sequence stays short and divisible by 4.
TINY_TEXT_TOKENS = 16
# Hub checkpoints older than diffusers 0.28 (DiT-XL-2, PixArt) name this generic class;
# diffusers picks the real one from the config's norm_type (its _CLASS_REMAPPING_DICT),
# and so do we (ModelFamily.norm_type).
GENERIC_TRANSFORMER_CLASS = "Transformer2DModel"


@dataclass(frozen=True, slots=True)
class TinyModel:
    """A built-in tiny model (random or shipped weights, built offline) and its defaults.

    Attributes:
        name: the name users give (``tiny-flux``).
        build: ``"module:function"`` returning the diffusers pipeline (float32, CPU).
        width: default image width in pixels.
        height: default image height in pixels.
        frames: default video frames (1 for image models).
        max_sequence_length: text tokens the pipeline pads / truncates the prompt to.
        prompt: the prompt used when none is given.
        vae_scale: image pixels per latent pixel, per side (the simulator's spec needs it:
            tiny-digits' VAE downsamples 4x, where every other family's does 8x).
        reader: ``"module:class"`` of a classifier that reads what the output shows
            (tiny-digits: the digit), or None.
    """

    name: str
    build: str
    width: int
    height: int
    frames: int = 1
    max_sequence_length: int = TINY_TEXT_TOKENS
    prompt: str = DEFAULT_PROMPT
    vae_scale: int = 8
    reader: str | None = None


@dataclass(frozen=True, slots=True)
class Preset:
    """A real model the simulator knows by name: the fields of its diffusers
    ``transformer/config.json`` that the family's builder reads (``tests/data/configs``
    holds the whole files; ``tests/test_models.py`` checks they give the same spec)."""

    name: str
    config: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """Everything the engine knows about one model family.

    Attributes:
        name: the family's name (``ModelSpec.family``).
        transformer_classes: the diffusers transformer class names of the family (a
            config's ``_class_name``).
        spec_from_config: ``(config, name) -> ModelSpec``.
        presets: the real models of the family the simulator knows by name.
        norm_type: the ``norm_type`` by which a :data:`GENERIC_TRANSFORMER_CLASS` config
            means this family; None when no such checkpoint exists.
        runtime: ``"module:attribute"`` of the runtime's adapter
            (:class:`cocodiff.runtime.families.base.Family`); None: the runtime cannot
            parallelise the family (the simulator still can).
        diffusers_context_parallel: diffusers has a context-parallel plan (``_cp_plan``)
            for the family, so ``run --schedule diffusers`` can run it.
        tiny_models: the family's built-in tiny models.
        block_inputs: ``"module:attribute"`` of ``(config, image_tokens, text_tokens,
            dtype) -> keyword arguments`` of the whole transformer, by which ``cocodiff
            calibrate`` times the family's real blocks as the runtime runs them; None: it
            cannot.
        timed_blocks: the transformer's block lists that calibration times.
    """

    name: str
    transformer_classes: tuple[str, ...]
    spec_from_config: Adapter
    presets: tuple[Preset, ...] = ()
    norm_type: str | None = None
    runtime: str | None = None
    diffusers_context_parallel: bool = False
    tiny_models: tuple[TinyModel, ...] = ()
    block_inputs: str | None = None
    timed_blocks: tuple[str, ...] = ()


def _tiny(name: str, builder: str, **defaults: Any) -> TinyModel:
    """A tiny model whose builder is ``builder`` in the random-weight builders' module, or
    ``"module:function"`` elsewhere (tiny-digits: its trained weights' module)."""
    path = builder if ":" in builder else f"cocodiff.runtime.tiny.builders:{builder}"
    return TinyModel(name, path, **defaults)


def _adapter(module: str, attribute: str) -> str:
    return f"cocodiff.runtime.families.{module}:{attribute}"


# Tiny image models: 128 x 128 pixels -> 16 x 16 latents -> 8 x 8 = 64 image tokens.
_FAMILY_LIST = (
    ModelFamily(
        name="flux",
        transformer_classes=("FluxTransformer2DModel",),
        spec_from_config=configs.flux,
        presets=(Preset("flux1-dev", {"num_layers": 19, "num_single_layers": 38,
                                      "num_attention_heads": 24, "attention_head_dim": 128,
                                      "in_channels": 64}),),
        runtime=_adapter("flux", "FLUX"),
        diffusers_context_parallel=True,
        tiny_models=(_tiny("tiny-flux", "build_flux", width=128, height=128),),
        block_inputs="cocodiff.calibration.blocks:flux_inputs",
        timed_blocks=("transformer_blocks", "single_transformer_blocks"),
    ),
    ModelFamily(
        name="flux2",
        transformer_classes=("Flux2Transformer2DModel",),
        spec_from_config=configs.flux2,
        presets=(Preset("flux2-dev", {"num_layers": 8, "num_single_layers": 48,
                                      "num_attention_heads": 48, "attention_head_dim": 128,
                                      "mlp_ratio": 3.0, "in_channels": 128}),),
        diffusers_context_parallel=True,
    ),
    ModelFamily(
        name="sd3",
        transformer_classes=("SD3Transformer2DModel",),
        spec_from_config=configs.sd3,
        presets=(Preset("sd35-large", {"num_layers": 38, "num_attention_heads": 38,
                                       "attention_head_dim": 64, "patch_size": 2,
                                       "qk_norm": "rms_norm", "in_channels": 16}),),
        runtime=_adapter("sd3", "SD3"),
        tiny_models=(_tiny("tiny-sd3", "build_sd3", width=128, height=128),),
    ),
    ModelFamily(
        name="qwen-image",
        transformer_classes=("QwenImageTransformer2DModel",),
        spec_from_config=configs.qwen_image,
        presets=(Preset("qwen-image", {"num_layers": 60, "num_attention_heads": 24,
                                       "attention_head_dim": 128, "patch_size": 2,
                                       "out_channels": 16}),),
        runtime=_adapter("qwen", "QWEN"),
        diffusers_context_parallel=True,
        tiny_models=(_tiny("tiny-qwen", "build_qwen", width=128, height=128),),
    ),
    ModelFamily(
        name="wan",
        transformer_classes=("WanTransformer3DModel",),
        spec_from_config=configs.wan,
        presets=(Preset("wan21-14b", {"num_layers": 40, "num_attention_heads": 40,
                                      "attention_head_dim": 128, "patch_size": [1, 2, 2],
                                      "ffn_dim": 13824, "in_channels": 16}),),
        runtime=_adapter("wan", "WAN"),
        diffusers_context_parallel=True,
        # 5 frames -> 2 latent frames; 64 x 64 -> 8 x 8 latents -> 2 x 4 x 4 = 32 tokens.
        tiny_models=(_tiny("tiny-wan", "build_wan", width=64, height=64, frames=5),),
    ),
    ModelFamily(
        name="pixart",
        transformer_classes=("PixArtTransformer2DModel",),
        spec_from_config=configs.pixart,
        presets=(Preset("pixart-sigma", {"num_layers": 28, "num_attention_heads": 16,
                                         "attention_head_dim": 72, "patch_size": 2,
                                         "out_channels": 8}),),
        norm_type="ada_norm_single",
        runtime=_adapter("pixart", "PIXART"),
        tiny_models=(
            _tiny("tiny-pixart", "build_pixart", width=128, height=128),
            # 32 x 32 pixels -> 8 x 8 latents -> 64 image tokens (patch size 1).
            _tiny("tiny-digits", "cocodiff.runtime.digits:build_digits", width=32, height=32,
                  prompt="3", vae_scale=4, reader="cocodiff.runtime.digits:DigitReader"),
        ),
    ),
    ModelFamily(
        name="dit",
        transformer_classes=("DiTTransformer2DModel",),
        spec_from_config=configs.dit,
        presets=(Preset("dit-xl-2", {"num_layers": 28, "num_attention_heads": 16,
                                     "attention_head_dim": 72, "patch_size": 2,
                                     "out_channels": 8}),),
        norm_type="ada_norm_zero",
    ),
)

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in _FAMILY_LIST}
TINY_MODELS: dict[str, TinyModel] = {
    tiny.name: tiny for family in _FAMILY_LIST for tiny in family.tiny_models
}


def transformer_classes() -> tuple[str, ...]:
    """Every transformer class name some family claims, the generic one last."""
    return (*(c for f in FAMILIES.values() for c in f.transformer_classes),
            GENERIC_TRANSFORMER_CLASS)


def runtime_classes() -> tuple[str, ...]:
    """The transformer classes the runtime can parallelise."""
    return tuple(c for f in FAMILIES.values() if f.runtime for c in f.transformer_classes)


def family_of_class(class_name: object, config: Mapping[str, Any] | None = None) -> ModelFamily:
    """The family of a diffusers transformer class (a :data:`GENERIC_TRANSFORMER_CLASS`
    is resolved by ``config``'s ``norm_type``).

    Raises:
        ModelSpecError: no family claims the class (the message lists those that do).
    """
    for family in FAMILIES.values():
        if class_name in family.transformer_classes:
            return family
    if class_name == GENERIC_TRANSFORMER_CLASS:
        norm_type = (config or {}).get("norm_type")
        by_norm = {f.norm_type: f for f in FAMILIES.values() if f.norm_type}
        if isinstance(norm_type, str) and norm_type in by_norm:
            return by_norm[norm_type]
        raise ModelSpecError(
            f"config field 'norm_type' of a {GENERIC_TRANSFORMER_CLASS} must be one of "
            f"{', '.join(by_norm)} ({', '.join(f.name for f in by_norm.values())}), "
            f"got {norm_type!r}"
        )
    raise ModelSpecError(
        f"unsupported transformer class {class_name!r}; supported: "
        f"{', '.join(transformer_classes())}"
    )


def spec_from_config(config: Mapping[str, Any], name: str = "custom"):
    """Derive a :class:`~cocodiff.models.spec.ModelSpec` from a diffusers transformer
    config (``config.json``), through its family's builder.

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
    return family_of_class(class_name, config).spec_from_config(config, name)


def check_family(spec: ModelSpec) -> ModelSpec:
    """``spec``, if its family is one of :data:`FAMILIES` (a spec read from a file).

    Raises:
        ModelSpecError: it is not (the message lists those that are).
    """
    if spec.family not in FAMILIES:
        raise ModelSpecError(f"unknown model family {spec.family!r} for {spec.name!r}; "
                             f"valid: {', '.join(FAMILIES)}")
    return spec


def tiny_model(name: str) -> TinyModel:
    """The tiny model called ``name``.

    Raises:
        ModelSpecError: no tiny model is called so (the message lists those that are).
    """
    if name not in TINY_MODELS:
        raise ModelSpecError(f"unknown tiny model {name!r}; choose one of {', '.join(TINY_MODELS)}")
    return TINY_MODELS[name]


def load_object(path: str) -> Any:
    """The attribute a record names as ``"module:attribute"`` (imported now)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)
