"""DiT models: their shape (:mod:`.spec`), one record per family owning every per-model
fact (:mod:`.families`, builders in :mod:`.configs`), and models by name or path
(:mod:`.registry`).

This package must stay importable without torch or diffusers: the simulator CLI uses it.
"""

from cocodiff.models.families import (
    DEFAULT_PROMPT,
    FAMILIES,
    TINY_MODELS,
    ModelFamily,
    Preset,
    TinyModel,
    check_family,
    family_of_class,
    load_object,
    runtime_classes,
    spec_from_config,
    tiny_model,
)
from cocodiff.models.registry import (
    REGISTRY,
    TINY_MARKER,
    TINY_NAMES,
    load_model_spec,
    read_tiny_marker,
)
from cocodiff.models.spec import (
    MAX_FRAMES,
    MAX_MLP_RATIO,
    MAX_PIXELS,
    MAX_SPEC,
    ModelSpec,
    ModelSpecError,
    parse_resolution,
)

__all__ = [
    "DEFAULT_PROMPT",
    "FAMILIES",
    "MAX_FRAMES",
    "MAX_MLP_RATIO",
    "MAX_PIXELS",
    "MAX_SPEC",
    "REGISTRY",
    "TINY_MARKER",
    "TINY_MODELS",
    "TINY_NAMES",
    "ModelFamily",
    "ModelSpec",
    "ModelSpecError",
    "Preset",
    "TinyModel",
    "check_family",
    "family_of_class",
    "load_model_spec",
    "load_object",
    "parse_resolution",
    "read_tiny_marker",
    "runtime_classes",
    "spec_from_config",
    "tiny_model",
]
