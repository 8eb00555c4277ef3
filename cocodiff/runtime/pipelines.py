"""Load, run and decode diffusers pipelines in one process.

This is the single-process reference: the Ulysses runtime swaps the transformer's attention
processors and must reproduce exactly what ``run_pipeline`` returns here.

Only local files are read (``HF_HUB_OFFLINE=1``, ``local_files_only=True``) and only safetensors
weights are loaded (``use_safetensors=True``): never a pickle.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path

# huggingface_hub reads this when it is first imported (by diffusers, below): set it first.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import diffusers  # noqa: E402
import torch  # noqa: E402
from diffusers import DiffusionPipeline  # noqa: E402
from packaging.version import Version  # noqa: E402
from PIL import Image  # noqa: E402

from cocodiff.models import (  # noqa: E402
    TINY_MARKER,
    TINY_MODELS,
    read_tiny_marker,
    runtime_classes,
    tiny_model,
)
from cocodiff.runtime.families import runtime_family  # noqa: E402
from cocodiff.runtime.tiny import build_tiny  # noqa: E402
from cocodiff.util.jsonfile import read_json  # noqa: E402

# diffusers 0.42 renamed from_pretrained's torch_dtype to dtype (the old name warns).
_DTYPE_KWARG = "dtype" if Version(diffusers.__version__) >= Version("0.42") else "torch_dtype"
# The CPU allocator's alignment (c10 uses 64 bytes); see _realign_tensors.
_ALIGNMENT_BYTES = 64

StepCallback = Callable[[int, int], None]
"""Called after each denoising step as ``callback(steps_done, num_steps)``."""


class ModelLoadError(ValueError):
    """A model name or directory that cannot be loaded; the message is one line."""


def load_pipeline(model: str, dtype: torch.dtype = torch.float32) -> DiffusionPipeline:
    """Loads a tiny built-in model or a local diffusers pipeline directory.

    Args:
        model: a ``TINY_MODELS`` name, or a directory holding ``model_index.json``.
        dtype: dtype of the pipeline's modules.

    Returns:
        The pipeline on CPU with its progress bar off.

    Raises:
        ModelLoadError: ``model`` is neither a tiny name nor a loadable pipeline directory, or
            the runtime cannot parallelise its transformer class.
    """
    if model in TINY_MODELS:
        return build_tiny(model, dtype)
    path = Path(model)
    if not path.is_dir():
        raise ModelLoadError(
            f"model {model!r} is neither a tiny model ({', '.join(TINY_MODELS)}) "
            "nor an existing directory"
        )
    index_path = path / "model_index.json"
    if not index_path.is_file():
        raise ModelLoadError(f"{path} has no model_index.json: not a diffusers pipeline directory")
    index = read_json(index_path, "pipeline index", ModelLoadError)
    try:
        transformer_class = index["transformer"][1]
    except (KeyError, IndexError, TypeError) as err:
        raise ModelLoadError(
            f"{index_path} names no transformer: not a Diffusion Transformer pipeline"
        ) from err
    if transformer_class not in runtime_classes():
        raise ModelLoadError(
            f"unsupported transformer class {transformer_class!r} in {index_path}; "
            f"supported: {', '.join(runtime_classes())}"
        )
    try:
        pipe = DiffusionPipeline.from_pretrained(
            path, use_safetensors=True, local_files_only=True, **{_DTYPE_KWARG: dtype}
        )
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        raise ModelLoadError(f"cannot load {path}: {first_line}") from err
    _realign_tensors(pipe)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _realign_tensors(pipe: DiffusionPipeline) -> None:
    """Copies every loaded weight into freshly allocated (64-byte aligned) memory.

    safetensors hands back tensors at arbitrary offsets in the file buffer, and CPU GEMM
    kernels round differently depending on the alignment of their operands: without this copy
    a loaded pipeline differs from the freshly built one in the last bits.
    """
    for component in pipe.components.values():
        if not isinstance(component, torch.nn.Module):
            continue
        with torch.no_grad():
            for tensor in [*component.parameters(), *component.buffers()]:
                if tensor.data_ptr() % _ALIGNMENT_BYTES:
                    tensor.data = tensor.data.clone()


# Written beside an exported tiny model, so that loading the directory back also brings
# the tiny model's default size and text length (and so the same output), and the
# simulator the text length (cocodiff.models.load_model_spec).


def export_tiny(name: str, directory: str | os.PathLike[str]) -> Path:
    """Saves a tiny model as a diffusers pipeline directory (safetensors weights).

    Args:
        name: a ``TINY_MODELS`` name.
        directory: where to write; created if missing.

    Returns:
        The directory, which ``load_pipeline`` loads back with identical weights.
    """
    path = Path(directory)
    build_tiny(name).save_pretrained(path, safe_serialization=True)
    tiny = tiny_model(name)
    marker = {"tiny_model": name, "text_tokens": tiny.max_sequence_length,
              "vae_scale": tiny.vae_scale}
    (path / TINY_MARKER).write_text(json.dumps(marker))
    return path


def tiny_name_of(model: str) -> str | None:
    """The tiny model ``model`` is: a tiny name, or a directory exported from one."""
    if model in TINY_MODELS:
        return model
    name = (read_tiny_marker(model) or {}).get("tiny_model")
    return name if name in TINY_MODELS else None


def run_pipeline(
    pipe: DiffusionPipeline,
    prompt: str,
    steps: int,
    width: int,
    height: int,
    frames: int = 1,
    seed: int = 0,
    callback: StepCallback | None = None,
    *,
    max_sequence_length: int | None = None,
) -> torch.Tensor:
    """Runs a text-to-image (or -video) pipeline in this process and returns its final latents.

    The initial noise comes from a CPU ``torch.Generator`` seeded with ``seed``, so the same
    arguments give the same latents in every process. The pipeline decodes nothing
    (``output_type="latent"``); use ``decode`` for pixels.

    Args:
        pipe: a pipeline from ``load_pipeline``.
        prompt: the text prompt.
        steps: number of denoising steps.
        width: image width in pixels.
        height: image height in pixels.
        frames: video frames; must be 1 for image pipelines.
        seed: seed of the initial noise.
        callback: called as ``callback(steps_done, steps)`` after each step.
        max_sequence_length: text tokens to pad / truncate the prompt to; None keeps the
            pipeline's default (tiny models: their record's ``max_sequence_length``).

    Returns:
        float32 latents on the pipeline's device, in the VAE's layout, not yet un-scaled:
        (batch, channels, height/8, width/8) for AutoencoderKL pipelines, (batch, channels,
        latent_frames, height/8, width/8) for the 3D VAEs of Qwen-Image (1 frame) and Wan.
        Packed 2x2 token latents (FLUX, Qwen-Image) are unpacked.

    Raises:
        ValueError: ``frames`` is not 1 for an image pipeline, or ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    params = inspect.signature(pipe.__call__).parameters
    kwargs: dict[str, object] = {}
    if "num_frames" in params:
        kwargs["num_frames"] = frames
    elif frames != 1:
        raise ValueError(f"{type(pipe).__name__} makes images: frames must be 1, got {frames}")
    # Generate exactly the requested size, and keep the prompt text as given.
    if "use_resolution_binning" in params:
        kwargs["use_resolution_binning"] = False
    if "clean_caption" in params:
        kwargs["clean_caption"] = False
    if max_sequence_length is not None:
        kwargs["max_sequence_length"] = max_sequence_length
    if callback is not None and "callback_on_step_end" in params:

        def on_step_end(_pipe, step_index, _timestep, callback_kwargs):
            callback(step_index + 1, steps)
            return callback_kwargs

        kwargs["callback_on_step_end"] = on_step_end
    elif callback is not None:  # the older API, e.g. PixArt

        def on_step(step_index, _timestep, _latents):
            callback(step_index + 1, steps)

        kwargs.update(callback=on_step, callback_steps=1)

    generator = torch.Generator(device="cpu").manual_seed(seed)
    # Inference mode, not only the pipeline's own no_grad: no autograd bookkeeping on any
    # tensor (version counters, views), 10% less CPU per forward of a small model on 1 core,
    # the same values. Calibrate times the blocks in this mode, as a step runs them.
    with torch.inference_mode():
        latents = pipe(
            prompt=prompt,
            num_inference_steps=steps,
            width=width,
            height=height,
            generator=generator,
            output_type="latent",
            return_dict=False,
            **kwargs,
        )[0]
        if latents.ndim == 3 and hasattr(pipe, "_unpack_latents"):
            # (b, h/16 * w/16, c * 4) -> (b, c, h/8, w/8), or (b, c, 1, h/8, w/8) for Qwen-Image
            latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
    # A normal tensor again (a copy made outside the mode): callers may change it in place.
    return latents.float().clone()


def diffusers_latents(pipe: DiffusionPipeline, latents: torch.Tensor) -> torch.Tensor:
    """``run_pipeline``'s latents as the pipeline itself returns them with
    ``output_type="latent"``: FLUX's and Qwen-Image's packed 2x2 tokens packed again
    (``(b, c, h, w)`` or ``(b, c, 1, h, w)`` -> ``(b, h/2 * w/2, c * 4)``, the pipeline's
    own ``_pack_latents``), other layouts as they are; in the pipeline's dtype."""
    if hasattr(pipe, "_pack_latents") and hasattr(pipe, "_unpack_latents"):
        batch, channels, height, width = latents.shape[0], latents.shape[1], *latents.shape[-2:]
        latents = pipe._pack_latents(latents.contiguous(), batch, channels, height, width)
    return latents.to(pipe.dtype)


def decode(pipe: DiffusionPipeline, latents: torch.Tensor) -> Image.Image | list[Image.Image]:
    """Decodes ``run_pipeline`` latents to pixels, as the pipeline itself would.

    Args:
        pipe: the pipeline that produced ``latents``.
        latents: the tensor ``run_pipeline`` returned (first batch item is decoded).

    Returns:
        A PIL image, or for video pipelines the list of PIL frames.

    Raises:
        ModelSpecError: the runtime has no family for the pipeline's transformer.
    """
    family = runtime_family(type(pipe.transformer).__name__)
    with torch.no_grad():
        return family.decode(pipe, latents.to(pipe.device))
