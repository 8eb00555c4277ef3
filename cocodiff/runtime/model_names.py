"""What a model argument means to every command (``plan``, ``simulate``, ``run``,
``validate``, ``calibrate``): its spec and its default size. A registry name or a
diffusers config / directory is read as :mod:`cocodiff.models` reads it; a built-in tiny
model (or a directory exported from one) is what its builder makes, with its pipeline's
text length, VAE scale and size, so that every command's plan of it is the same.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

# The runtime's tiny models are imported where a tiny model is asked for: the simulator's
# commands read registry models without torch.
from cocodiff.models import (
    ModelSpecError,
    load_model_spec,
    parse_resolution,
    read_tiny_marker,
    spec_from_config,
)


def model_spec(model: str):
    """The :class:`~cocodiff.models.ModelSpec` of ``model`` (a tiny model's name, a
    directory exported from one, a registry name or a diffusers config / model
    directory), named and sized as the plans of ``cocodiff plan``, ``simulate`` and
    ``run`` record it: a tiny model with its pipeline's text length and VAE scale."""
    tiny = tiny_name(model)
    if tiny is None or Path(model).is_dir():
        spec = load_model_spec(model)
    else:  # a built-in tiny model by name: its config, its pipeline's VAE
        from cocodiff.runtime.tiny import TINY_DEFAULTS

        spec = dataclasses.replace(spec_from_config(built_tiny_config(tiny), name=tiny),
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
    tiny = tiny_name(model)
    if tiny is not None:
        from cocodiff.runtime.tiny import default_resolution

        width, height, default_frames = default_resolution(tiny)
    else:
        width, height, default_frames = 1024, 1024, 1
    if resolution is not None:
        width, height = parse_resolution(resolution)
    return width, height, default_frames if frames is None else frames


def built_tiny_config(tiny: str) -> dict[str, Any]:
    """The transformer config of a built-in tiny model (built quietly, weights discarded)."""
    from cocodiff.runtime.quiet import quiet_libraries

    quiet_libraries()
    from cocodiff.runtime.tiny import TINY_MODELS

    if tiny not in TINY_MODELS:
        raise ModelSpecError(f"unknown tiny model {tiny!r}; valid: {', '.join(TINY_MODELS)}")
    transformer = TINY_MODELS[tiny]().transformer
    # An in-memory config lacks the "_class_name" a saved config.json has.
    return {"_class_name": type(transformer).__name__, **dict(transformer.config)}


def tiny_name(model: str) -> str | None:
    """The built-in tiny model ``model`` names (itself, or the one a directory was
    exported from), or None."""
    if model.startswith("tiny-"):
        return model
    name = (read_tiny_marker(model) or {}).get("tiny_model")
    return name if isinstance(name, str) else None
