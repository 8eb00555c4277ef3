"""The shapes calibrate times: a model's layer on one Ulysses rank, and the tiny models whose
real blocks it can build."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cocodiff.calibration.options import CalibrationError
from cocodiff.models import read_tiny_marker
from cocodiff.util.jsonfile import read_json


@dataclass(frozen=True, slots=True)
class LayerShapes:
    """The shapes one Ulysses rank computes in one layer.

    Attributes:
        model: the model's name.
        total_tokens: attention sequence length ``S``.
        local_tokens: tokens a rank holds, ``ceil(S / P)``.
        local_heads: heads a rank attends over, ``ceil(H / P)``.
        head_dim: channels per head.
        hidden_size: model width ``d``.
        mlp_ratio: MLP width over ``d``.
    """

    model: str
    total_tokens: int
    local_tokens: int
    local_heads: int
    head_dim: int
    hidden_size: int
    mlp_ratio: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def layer_shapes(model: str, tokens: int | None, resolution: str | None, world: int
                 ) -> LayerShapes:
    """The per-rank layer shapes of ``model`` at ``tokens`` (or its tokens at
    ``resolution``, or at its default size) on ``world`` Ulysses ranks.

    ``model`` is a tiny model name (``tiny-flux``...), a directory exported from one, a
    registry name (``flux1-dev``...) or a diffusers config / model directory.
    """
    spec, tokens, _image = model_tokens(model, tokens, resolution)
    return LayerShapes(
        model=spec.name,
        total_tokens=tokens,
        local_tokens=math.ceil(tokens / world),
        local_heads=max(1, math.ceil(spec.num_heads / world)),
        head_dim=spec.head_dim,
        hidden_size=spec.hidden_size,
        mlp_ratio=spec.mlp_ratio,
    )


def model_spec(model: str):
    """The :class:`~cocodiff.models.ModelSpec` of ``model`` (a tiny model's name, a
    directory exported from one, a registry name or a diffusers config / model
    directory), named and sized as the plans of ``cocodiff plan``, ``simulate`` and
    ``run`` record it: a tiny model with its pipeline's text length and VAE scale."""
    from cocodiff.models import load_model_spec, spec_from_config

    tiny = _tiny_name(model)
    if tiny is None or Path(model).is_dir():
        spec = load_model_spec(model)
    else:  # a built-in tiny model by name: its config, its pipeline's VAE
        from cocodiff.runtime.tiny import TINY_DEFAULTS

        spec = dataclasses.replace(spec_from_config(_tiny_transformer_config(tiny), name=tiny),
                                   vae_scale=TINY_DEFAULTS[tiny].vae_scale)
    if tiny is not None and spec.text_tokens:
        from cocodiff.runtime.tiny import TINY_DEFAULTS

        spec = dataclasses.replace(spec, text_tokens=TINY_DEFAULTS[tiny].max_sequence_length)
    return spec


def model_size(model: str, resolution: str | None = None, frames: int | None = None
               ) -> tuple[int, int, int]:
    """``(width, height, frames)`` that ``plan``, ``simulate``, ``run`` and ``validate``
    give ``model`` where ``resolution`` (``PIXELS`` or ``WIDTHxHEIGHT``) or ``frames`` is
    None: a tiny model's own size (tiny-flux: 128 px), else 1024 px and one frame. One
    default for all of them: ``plan`` once assumed 1024 px for tiny-flux where ``run``
    generated 128, and their plans differed."""
    from cocodiff.models import parse_resolution

    tiny = _tiny_name(model)
    if tiny is not None:
        from cocodiff.runtime.tiny import default_resolution

        width, height, default_frames = default_resolution(tiny)
    else:
        width, height, default_frames = 1024, 1024, 1
    if resolution is not None:
        width, height = parse_resolution(resolution)
    return width, height, default_frames if frames is None else frames


def model_tokens(model: str, tokens: int | None, resolution: str | None):
    """``(spec, attention tokens, image tokens)`` of ``model`` at ``tokens`` (or its tokens at
    ``resolution``, or at its default size); with ``tokens`` given, the text stream keeps
    the model's text tokens and the image stream has the rest."""
    spec = model_spec(model)
    if tokens is None:
        # A resolution given means one frame (calibrate has no --frames).
        tokens = spec.sequence_tokens(*model_size(model, resolution,
                                                  1 if resolution is not None else None))
    return spec, tokens, max(1, tokens - spec.text_tokens)


def tiny_transformer_config(model: str) -> dict[str, Any] | None:
    """The transformer config of a tiny model (a built-in name or a directory exported
    from one, e.g. an enlarged one), or None for any other model: calibrate builds and
    times the real blocks of small models only (a full-size model's weights on every
    rank would not fit)."""
    tiny = _tiny_name(model)
    if tiny is None:
        return None
    if Path(model).is_dir():
        for candidate in (Path(model) / "transformer" / "config.json",
                          Path(model) / "config.json"):
            if candidate.is_file():
                return read_json(candidate, "model config", CalibrationError)
        return None
    return _tiny_transformer_config(tiny)


def _tiny_transformer_config(tiny: str) -> dict[str, Any]:
    """The transformer config of a built-in tiny model (built quietly, weights discarded)."""
    from cocodiff.runtime.quiet import quiet_libraries

    quiet_libraries()
    from cocodiff.runtime.tiny import TINY_MODELS

    if tiny not in TINY_MODELS:
        raise CalibrationError(f"unknown tiny model {tiny!r}; valid: {', '.join(TINY_MODELS)}")
    transformer = TINY_MODELS[tiny]().transformer
    # An in-memory config lacks the "_class_name" a saved config.json has.
    return {"_class_name": type(transformer).__name__, **dict(transformer.config)}


def _tiny_name(model: str) -> str | None:
    if model.startswith("tiny-"):
        return model
    name = (read_tiny_marker(model) or {}).get("tiny_model")
    return name if isinstance(name, str) else None
