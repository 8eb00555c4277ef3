"""Tiny built-in pipelines: build, run, determinism, export/load, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import WanTransformer3DModel  # noqa: E402
from PIL import Image  # noqa: E402

from cocodiff.models import spec_from_config  # noqa: E402
from cocodiff.runtime.pipelines import (  # noqa: E402
    ModelLoadError,
    decode,
    export_tiny,
    load_pipeline,
    run_pipeline,
)
from cocodiff.runtime.tiny import (  # noqa: E402
    TINY_DEFAULTS,
    TINY_MODELS,
    build_tiny,
    default_resolution,
)

PROMPT = "a photo of a red cat sitting under a tree"
STEPS = 2
ULYSSES_RANKS = 4


def _run(pipe, name: str, seed: int = 0, callback=None) -> torch.Tensor:
    d = TINY_DEFAULTS[name]
    return run_pipeline(
        pipe,
        PROMPT,
        STEPS,
        d.width,
        d.height,
        d.frames,
        seed,
        callback,
        max_sequence_length=d.max_sequence_length,
    )


def _first_attention_shapes(pipe, name: str) -> dict[str, tuple[int, ...]]:
    """Shapes of the tensors the transformer's first attention layer receives."""
    attention = next(m for m in pipe.transformer.modules() if hasattr(m, "processor"))
    shapes: dict[str, tuple[int, ...]] = {}

    def record(_module, args, kwargs):
        if not shapes:
            shapes["image"] = tuple(kwargs.get("hidden_states", args[0] if args else None).shape)

    handle = attention.register_forward_pre_hook(record, with_kwargs=True)
    try:
        _run(pipe, name)
    finally:
        handle.remove()
    return shapes


# Digest of every weight of a pipeline; the same source runs in a second process.
_DIGEST_SOURCE = """
import hashlib
import torch


def state_digest(pipe):
    digest = hashlib.sha256()
    for component_name, component in sorted(pipe.components.items()):
        if isinstance(component, torch.nn.Module):
            for key, tensor in sorted(component.state_dict().items()):
                digest.update(f"{component_name}.{key}".encode())
                digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
"""
_namespace: dict[str, object] = {}
exec(_DIGEST_SOURCE, _namespace)
_state_digest = _namespace["state_digest"]


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_tiny_model_runs_deterministically(name: str) -> None:
    first, second = build_tiny(name), build_tiny(name)
    progress: list[tuple[int, int]] = []
    latents = _run(first, name, callback=lambda done, total: progress.append((done, total)))
    assert latents.dtype == torch.float32
    assert torch.isfinite(latents).all()
    assert progress == [(1, STEPS), (2, STEPS)]
    # Same seed, separately built pipeline: bit-identical.
    assert torch.equal(latents, _run(second, name))
    assert not torch.equal(latents, _run(first, name, seed=1))

    width, height, frames = default_resolution(name)
    pixels = decode(first, latents)
    if frames > 1:
        assert len(pixels) == frames
        assert all(frame.size == (width, height) for frame in pixels)
    else:
        assert isinstance(pixels, Image.Image)
        assert pixels.size == (width, height)


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_tiny_model_splits_over_four_ranks(name: str) -> None:
    pipe = build_tiny(name)
    assert pipe.transformer.config.num_attention_heads % ULYSSES_RANKS == 0
    _batch, image_tokens, _dim = _first_attention_shapes(pipe, name)["image"]
    assert image_tokens % ULYSSES_RANKS == 0
    assert 16 <= image_tokens <= 128


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_the_spec_knows_the_width_of_what_the_output_gather_moves(name: str) -> None:
    # The runtime gathers proj_out's output; the simulator sizes that gather by the spec.
    transformer = build_tiny(name).transformer
    spec = spec_from_config({"_class_name": type(transformer).__name__,
                             **dict(transformer.config)})
    assert spec.output_channels == transformer.proj_out.out_features


@pytest.mark.slow
def test_weights_identical_in_another_process() -> None:
    script = _DIGEST_SOURCE + (
        "import json\n"
        "from cocodiff.runtime.tiny import TINY_MODELS, build_tiny\n"
        "print(json.dumps({n: state_digest(build_tiny(n)) for n in TINY_MODELS}))\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True
    )
    other = json.loads(out.stdout.strip().splitlines()[-1])
    assert other == {name: _state_digest(build_tiny(name)) for name in TINY_MODELS}


def test_build_leaves_global_rng_alone() -> None:
    state = torch.get_rng_state()
    build_tiny("tiny-pixart")
    assert torch.equal(state, torch.get_rng_state())


def test_qwen_template_prefix_is_dropped_exactly() -> None:
    pipe = build_tiny("tiny-qwen")
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx


# tiny-digits: trained weights loaded from the package, exported, loaded back.
@pytest.mark.parametrize("name", ["tiny-flux", "tiny-wan", "tiny-digits"])
def test_export_load_round_trip(name: str, tmp_path: Path) -> None:
    directory = export_tiny(name, tmp_path / name)
    assert (directory / "model_index.json").is_file()
    assert not list(directory.rglob("*.bin")), "weights must be safetensors only"
    loaded, built = load_pipeline(str(directory), torch.float32), build_tiny(name)
    assert type(loaded) is type(built)
    assert _state_digest(loaded) == _state_digest(built)
    assert loaded.tokenizer(PROMPT).input_ids == built.tokenizer(PROMPT).input_ids
    assert torch.equal(_run(loaded, name), _run(built, name))
    # The accelerate workaround must not leak.
    assert WanTransformer3DModel._keep_in_fp32_modules


def test_bfloat16_keeps_fp32_modules() -> None:
    pipe = build_tiny("tiny-wan", torch.bfloat16)
    assert pipe.transformer.proj_out.weight.dtype == torch.bfloat16
    assert pipe.transformer.scale_shift_table.dtype == torch.float32  # in _keep_in_fp32_modules
    assert torch.isfinite(_run(pipe, "tiny-wan")).all()


def test_unknown_tiny_name() -> None:
    with pytest.raises(ValueError, match="unknown tiny model 'tiny-nope'; choose one of tiny-flux"):
        build_tiny("tiny-nope")
    with pytest.raises(ValueError, match="unknown tiny model"):
        default_resolution("tiny-nope")


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither a tiny model .* nor an existing directory"):
        load_pipeline(str(tmp_path / "missing"), torch.float32)
    with pytest.raises(ModelLoadError, match="has no model_index.json"):
        load_pipeline(str(tmp_path), torch.float32)
    index = tmp_path / "model_index.json"
    index.write_text(json.dumps({"_class_name": "X", "transformer": ["diffusers", "UNetX"]}))
    with pytest.raises(ModelLoadError, match="unsupported transformer class 'UNetX'"):
        load_pipeline(str(tmp_path), torch.float32)
    index.write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(ModelLoadError, match="names no transformer"):
        load_pipeline(str(tmp_path), torch.float32)
    assert issubclass(ModelLoadError, ValueError)


def test_wan_loads_in_bfloat16_with_its_fp32_modules_kept(tmp_path: Path) -> None:
    pipe = load_pipeline(str(export_tiny("tiny-wan", tmp_path)), torch.bfloat16)
    assert pipe.transformer.proj_out.weight.dtype == torch.bfloat16
    assert pipe.transformer.scale_shift_table.dtype == torch.float32


def test_frames_refused_for_image_model() -> None:
    with pytest.raises(ValueError, match="FluxPipeline makes images: frames must be 1, got 5"):
        run_pipeline(build_tiny("tiny-flux"), PROMPT, STEPS, 128, 128, 5, 0)


def test_load_pipeline_builds_tiny_names() -> None:
    pipe = load_pipeline("tiny-sd3", torch.float32)
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    assert _state_digest(pipe) == _state_digest(build_tiny("tiny-sd3"))
