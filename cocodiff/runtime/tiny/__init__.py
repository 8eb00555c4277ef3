"""Built-in tiny diffusers pipelines (:mod:`.builders`, text side in :mod:`.text`): build
one by name, in any dtype.

Which tiny models exist, their builders and default settings are their family records'
(:data:`cocodiff.models.TINY_MODELS`); this package builds them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from diffusers import DiffusionPipeline
from transformers import PreTrainedModel

from cocodiff.models import DEFAULT_PROMPT, TinyModel, load_object, tiny_model
from cocodiff.models import TINY_MODELS as _RECORDS
from cocodiff.runtime.tiny.builders import SEED
from cocodiff.runtime.tiny.text import TEXT_MAX_TOKENS


def _build(builder: str) -> DiffusionPipeline:
    """The pipeline that ``builder`` (a record's ``"module:function"``) builds."""
    return load_object(builder)()


# Name -> builder and name -> default settings, as the records say. A builder's module is
# imported when it is called, not here: tiny-digits' module builds on this package's
# builders, and importing it here would import it before they are.
TINY_MODELS: dict[str, Callable[[], DiffusionPipeline]] = {
    name: partial(_build, record.build) for name, record in _RECORDS.items()
}
TINY_DEFAULTS: dict[str, TinyModel] = dict(_RECORDS)


def build_tiny(name: str, dtype: torch.dtype = torch.float32) -> DiffusionPipeline:
    """Builds a tiny pipeline with deterministic random weights.

    Args:
        name: a key of ``TINY_MODELS``.
        dtype: dtype of the pipeline's modules: built in float32, then cast the way
            ``from_pretrained(dtype=...)`` casts (modules a class keeps in float32 stay so).

    Returns:
        The pipeline on CPU, modules in eval mode, progress bars off.

    Raises:
        ValueError: ``name`` is not a tiny model.
    """
    tiny_model(name)  # an unknown name: one line naming the valid ones
    pipe = TINY_MODELS[name]()
    pipe.set_progress_bar_config(disable=True)
    if dtype != torch.float32:
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                _cast_as_from_pretrained(component, dtype)
    return pipe


def _cast_as_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Casts floating-point weights to ``dtype``, except the modules the class keeps in float32.

    diffusers keeps ``_keep_in_fp32_modules`` (Wan: rope, time embedder, norms) in float32 for any
    lower dtype; transformers does so only for float16, and ``_keep_in_fp32_modules_strict`` for
    float16 and bfloat16. A weight is kept when one component of its dotted name is listed.
    """
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if isinstance(model, PreTrainedModel):
        keep = keep if dtype == torch.float16 else set()
        keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    for module_name, module in model.named_modules():
        module_keys = set(module_name.split("."))
        for name, param in module.named_parameters(recurse=False):
            if param.is_floating_point() and not keep & (module_keys | {name}):
                param.data = param.data.to(dtype)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point() and not keep & (module_keys | {name}):
                setattr(module, name, buffer.to(dtype))


def default_resolution(name: str) -> tuple[int, int, int]:
    """Returns (width, height, frames) of a tiny model; image-token counts divide by 4."""
    tiny = tiny_model(name)  # an unknown name: one line naming the valid ones
    return tiny.width, tiny.height, tiny.frames


__all__ = ["DEFAULT_PROMPT", "SEED", "TEXT_MAX_TOKENS", "TINY_DEFAULTS", "TINY_MODELS",
           "build_tiny", "default_resolution"]
