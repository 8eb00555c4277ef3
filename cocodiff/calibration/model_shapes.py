"""The shapes calibrate times: a model's layer on one Ulysses rank, and the tiny models whose
real blocks it can build."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cocodiff.calibration.options import CalibrationError
from cocodiff.runtime.model_names import built_tiny_config, model_size, model_spec, tiny_name
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
    tiny = tiny_name(model)
    if tiny is None:
        return None
    if Path(model).is_dir():
        for candidate in (Path(model) / "transformer" / "config.json",
                          Path(model) / "config.json"):
            if candidate.is_file():
                return read_json(candidate, "model config", CalibrationError)
        return None
    return built_tiny_config(tiny)
