"""Models by name: the presets of every family, model directories and config files on
disk, and the marker an exported tiny model carries.

This module must stay importable without torch or diffusers: the simulator CLI uses it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from cocodiff.models.families import FAMILIES, TINY_MODELS, spec_from_config
from cocodiff.models.spec import ModelSpec, ModelSpecError, _is_int
from cocodiff.util.jsonfile import read_json
from cocodiff.util.paths import path_problem

# The presets of every family by name; each equals spec_from_config() of the model's real
# transformer/config.json (tests/data/configs/<name>.json; tests/test_models.py checks it).
REGISTRY: dict[str, ModelSpec] = {
    preset.name: family.spec_from_config(preset.config, preset.name)
    for family in FAMILIES.values()
    for preset in family.presets
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
# The built-in tiny models' names, for commands that check a name without importing diffusers.
TINY_NAMES = tuple(TINY_MODELS)


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
