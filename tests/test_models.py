"""Model specs: token counts, config adapters, registry vs. real configs, loading, errors."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cocodiff.models import (
    FAMILIES,
    REGISTRY,
    ModelSpecError,
    check_family,
    load_model_spec,
    parse_resolution,
    spec_from_config,
)

CONFIGS = Path(__file__).parent / "data" / "configs"


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text(encoding="utf-8"))


def test_registry_names() -> None:
    assert set(REGISTRY) == {
        "flux1-dev",
        "flux2-dev",
        "sd35-large",
        "qwen-image",
        "wan21-14b",
        "pixart-sigma",
        "dit-xl-2",
    }
    for name, spec in REGISTRY.items():
        assert spec.name == name
        assert spec.family in FAMILIES


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_registry_equals_real_config(name: str) -> None:
    assert spec_from_config(_config(name), name=name) == REGISTRY[name]


@pytest.mark.parametrize(
    ("name", "layers", "heads", "hidden"),
    [
        ("flux1-dev", 57, 24, 3072),
        ("flux2-dev", 56, 48, 6144),
        ("sd35-large", 38, 38, 2432),
        ("qwen-image", 60, 24, 3072),
        ("wan21-14b", 40, 40, 5120),
        ("pixart-sigma", 28, 16, 1152),
        ("dit-xl-2", 28, 16, 1152),
    ],
)
def test_registry_shapes(name: str, layers: int, heads: int, hidden: int) -> None:
    spec = REGISTRY[name]
    assert (spec.num_layers, spec.num_heads, spec.hidden_size) == (layers, heads, hidden)


def test_flux_tokens_at_1024() -> None:
    flux = REGISTRY["flux1-dev"]
    assert flux.image_tokens(1024, 1024) == 4096
    assert flux.sequence_tokens(1024, 1024) == 4096 + 512


def test_wan_480p_81_frames_is_32760_tokens() -> None:
    wan = REGISTRY["wan21-14b"]
    assert wan.latent_frames(81) == 21
    assert wan.image_tokens(832, 480, frames=81) == 21 * 30 * 52 == 32_760
    # Text is attended through cross-attention, so nothing joins the sequence.
    assert wan.sequence_tokens(832, 480, frames=81) == 32_760
    assert wan.cross_attention_tokens == 512


def test_sd35_tokens_at_1536() -> None:
    sd35 = REGISTRY["sd35-large"]
    assert sd35.image_tokens(1536, 1536) == 96 * 96 == 9216
    assert sd35.sequence_tokens(1536, 1536) == 9216 + 333


@pytest.mark.parametrize(
    ("name", "size", "expected"),
    [
        ("qwen-image", 768, 48 * 48 + 512),
        ("flux2-dev", 2304, 144 * 144 + 512),
        ("pixart-sigma", 1024, 64 * 64),
        ("dit-xl-2", 256, 16 * 16),
    ],
)
def test_sequence_tokens(name: str, size: int, expected: int) -> None:
    assert REGISTRY[name].sequence_tokens(size, size) == expected


def test_width_and_height_are_not_swapped() -> None:
    flux = REGISTRY["flux1-dev"]
    assert flux.image_tokens(1024, 512) == 64 * 32
    assert flux.image_tokens(1024, 528) == 64 * 33


@pytest.mark.parametrize("size", [(1000, 1024), (1024, 1000), (8, 16)])
def test_resolution_must_tile(size: tuple[int, int]) -> None:
    with pytest.raises(ModelSpecError, match=r"not a multiple of 16 \(vae_scale 8 x patch 2\)"):
        REGISTRY["flux1-dev"].image_tokens(*size)


@pytest.mark.parametrize("size", [(0, 1024), (1024, -16)])
def test_resolution_must_be_positive(size: tuple[int, int]) -> None:
    with pytest.raises(ModelSpecError, match="must be a positive integer"):
        REGISTRY["sd35-large"].check_resolution(*size)


def test_image_model_takes_one_frame() -> None:
    with pytest.raises(ModelSpecError, match="flux1-dev is an image model: frames must be 1"):
        REGISTRY["flux1-dev"].image_tokens(1024, 1024, frames=5)


def test_video_frames_must_be_4k_plus_1() -> None:
    wan = REGISTRY["wan21-14b"]
    assert wan.image_tokens(832, 480, frames=1) == 30 * 52
    with pytest.raises(ModelSpecError, match=r"needs frames = 4k \+ 1 \(e\.g\. 81\), got 80"):
        wan.image_tokens(832, 480, frames=80)
    with pytest.raises(ModelSpecError, match="frames must be a positive integer, got 0"):
        wan.latent_frames(0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1024", (1024, 1024)), ("832x480", (832, 480)), (" 1536X768 ", (1536, 768))],
)
def test_parse_resolution(text: str, expected: tuple[int, int]) -> None:
    assert parse_resolution(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "0", "-16", "1x2x3", "832x", "1.5", "0x480"])
def test_parse_resolution_rejects(text: str) -> None:
    with pytest.raises(ModelSpecError, match="bad resolution .*expected WIDTH or WIDTHxHEIGHT"):
        parse_resolution(text)


# --- spec_from_config ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "class_name"),
    [("pixart-sigma", "PixArtTransformer2DModel"), ("dit-xl-2", "DiTTransformer2DModel")],
)
def test_new_class_names_match_legacy_transformer_2d(name: str, class_name: str) -> None:
    config = _config(name) | {"_class_name": class_name}
    assert spec_from_config(config, name=name) == REGISTRY[name]


def test_flux_token_patch_ignores_config_patch_size() -> None:
    # The pipeline packs 2x2 latents before the transformer; patch_size shapes proj_out only.
    assert spec_from_config(_config("flux1-dev")).patch_size == 2


def test_flux2_swiglu_counts_as_one_and_a_half_ratio() -> None:
    config = _config("flux2-dev")
    assert spec_from_config(config).mlp_ratio == 4.5
    del config["mlp_ratio"]  # diffusers' default is 3.0
    assert spec_from_config(config).mlp_ratio == 4.5
    assert spec_from_config(config | {"mlp_ratio": 4}).mlp_ratio == 6.0


def test_sd3_medium_without_qk_norm() -> None:
    config = _config("sd35-large") | {"qk_norm": None}
    spec = spec_from_config(config)
    assert not spec.has_qk_norm and not spec.has_rope


def test_wan_i2v_attends_to_image_context_too() -> None:
    config = _config("wan21-14b") | {"added_kv_proj_dim": 5120, "image_dim": 1280}
    assert spec_from_config(config).cross_attention_tokens == 512 + 257


def test_default_name() -> None:
    assert spec_from_config(_config("dit-xl-2")).name == "custom"


def test_unknown_class_lists_supported() -> None:
    with pytest.raises(
        ModelSpecError,
        match=r"unsupported transformer class 'UNet2DConditionModel'; supported: "
        r"FluxTransformer2DModel, Flux2Transformer2DModel, .*WanTransformer3DModel",
    ):
        spec_from_config({"_class_name": "UNet2DConditionModel"})


def test_missing_class_name() -> None:
    with pytest.raises(ModelSpecError, match="config has no '_class_name' field"):
        spec_from_config({"num_layers": 2})


def test_config_must_be_a_mapping() -> None:
    with pytest.raises(ModelSpecError, match="must be a mapping, got list"):
        spec_from_config([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("flux1-dev", "num_single_layers"),
        ("flux2-dev", "num_attention_heads"),
        ("sd35-large", "patch_size"),
        ("qwen-image", "attention_head_dim"),
        ("wan21-14b", "ffn_dim"),
        ("pixart-sigma", "num_layers"),
        ("dit-xl-2", "patch_size"),
    ],
)
def test_missing_field_is_named(name: str, field: str) -> None:
    config = _config(name)
    del config[field]
    with pytest.raises(ModelSpecError, match=f"config is missing field '{field}'"):
        spec_from_config(config)


@pytest.mark.parametrize("value", ["24", 24.0, True, 0, -2, None])
def test_ill_typed_field_is_named(value: object) -> None:
    config = _config("flux1-dev") | {"num_attention_heads": value}
    with pytest.raises(
        ModelSpecError, match=r"config field 'num_attention_heads' must be a positive integer"
    ):
        spec_from_config(config)


def test_ill_typed_mlp_ratio() -> None:
    with pytest.raises(ModelSpecError, match="config field 'mlp_ratio' must be a positive number"):
        spec_from_config(_config("flux2-dev") | {"mlp_ratio": "3"})


@pytest.mark.parametrize("patch", [2, [1, 2], [1, 2, "2"], None])
def test_wan_patch_must_be_a_triple(patch: object) -> None:
    with pytest.raises(ModelSpecError, match=r"config field 'patch_size' must be \[t, h, w\]"):
        spec_from_config(_config("wan21-14b") | {"patch_size": patch})


def test_wan_temporal_patch_is_refused() -> None:
    with pytest.raises(ModelSpecError, match=r"'patch_size' \[2, 2, 2\] is unsupported"):
        spec_from_config(_config("wan21-14b") | {"patch_size": [2, 2, 2]})


def test_transformer_2d_needs_a_known_norm_type() -> None:
    with pytest.raises(ModelSpecError, match="'norm_type' .* got 'layer_norm'"):
        spec_from_config(_config("dit-xl-2") | {"norm_type": "layer_norm"})


# --- ModelSpec validation --------------------------------------------------------------------


def test_check_family_rejects_unknown_family() -> None:
    assert check_family(REGISTRY["dit-xl-2"]) is REGISTRY["dit-xl-2"]
    with pytest.raises(ModelSpecError, match="unknown model family 'unet'.*valid: flux, flux2"):
        check_family(dataclasses.replace(REGISTRY["dit-xl-2"], family="unet"))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_heads", 0, "num_heads of 'dit-xl-2' must be a positive integer, got 0"),
        ("num_layers", 2.0, "num_layers of 'dit-xl-2' must be a positive integer, got 2.0"),
        ("text_tokens", -1, "text_tokens of 'dit-xl-2' must be a non-negative integer"),
        ("mlp_ratio", 0.0, "mlp_ratio of 'dit-xl-2' must be a positive number"),
    ],
)
def test_spec_rejects_bad_fields(field: str, value: object, message: str) -> None:
    with pytest.raises(ModelSpecError, match=message):
        dataclasses.replace(REGISTRY["dit-xl-2"], **{field: value})


def test_spec_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        REGISTRY["flux1-dev"].num_heads = 1  # type: ignore[misc]


# --- load_model_spec -------------------------------------------------------------------------


def test_load_registry_name() -> None:
    assert load_model_spec("sd35-large") is REGISTRY["sd35-large"]


def test_load_config_file(tmp_path: Path) -> None:
    path = tmp_path / "my-flux" / "config.json"
    path.parent.mkdir()
    shutil.copy(CONFIGS / "flux1-dev.json", path)
    spec = load_model_spec(str(path))
    assert spec == dataclasses.replace(REGISTRY["flux1-dev"], name="my-flux")


def test_load_diffusers_directory(tmp_path: Path) -> None:
    model = tmp_path / "Wan2.1-T2V-14B-Diffusers"
    (model / "transformer").mkdir(parents=True)
    shutil.copy(CONFIGS / "wan21-14b.json", model / "transformer" / "config.json")
    (model / "model_index.json").write_text('{"_class_name": "WanPipeline"}', encoding="utf-8")
    expected = dataclasses.replace(REGISTRY["wan21-14b"], name="Wan2.1-T2V-14B-Diffusers")
    assert load_model_spec(str(model)) == expected
    # The transformer directory itself, and its config.json, name the same model.
    assert load_model_spec(str(model / "transformer")) == expected
    assert load_model_spec(str(model / "transformer" / "config.json")) == expected


def test_load_unknown_name_lists_registry() -> None:
    with pytest.raises(
        ModelSpecError, match=r"unknown model 'flux3'; registry names: flux1-dev, flux2-dev, "
    ):
        load_model_spec("flux3")


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelSpecError, match="model config file not found: .*nope.json"):
        load_model_spec(str(tmp_path / "nope.json"))


def test_load_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelSpecError, match="no transformer/config.json or config.json in"):
        load_model_spec(str(tmp_path))


def test_load_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"_class_name": "FluxTransformer2DModel",', encoding="utf-8")
    with pytest.raises(ModelSpecError,
                       match=r"invalid JSON in model config '.*config.json': .* \(line 1\)"):
        load_model_spec(str(path))


def test_load_non_object_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ModelSpecError, match="must hold a JSON object, got list"):
        load_model_spec(str(path))


def test_load_bad_config_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config("qwen-image") | {"num_layers": "60"}), encoding="utf-8")
    with pytest.raises(
        ModelSpecError,
        match=r"'.*config.json': config field 'num_layers' must be a positive integer, got '60'",
    ):
        load_model_spec(str(path))


def test_errors_are_one_line_value_errors() -> None:
    with pytest.raises(ValueError) as info:
        load_model_spec("flux3")
    assert "\n" not in str(info.value)


def test_no_torch_or_diffusers_at_import() -> None:
    # The simulator CLI imports these modules; torch/diffusers would cost seconds.
    code = (
        "import sys, cocodiff.models, cocodiff.cost; "
        "print(sorted(m for m in ('torch', 'diffusers') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(("tiny", "field"), [("tiny-flux", "text_tokens"),
                                             ("tiny-pixart", "cross_attention_tokens")])
def test_an_exported_tiny_model_keeps_its_prompt_length(tmp_path, tiny, field):
    # The config says nothing of the prompt length; the simulator must use the one the
    # tiny pipeline pads to, so that it replays the runtime's plans byte for byte.
    from cocodiff.runtime.pipelines import export_tiny
    from cocodiff.runtime.tiny import TINY_DEFAULTS

    spec = load_model_spec(str(export_tiny(tiny, tmp_path / tiny)))
    assert getattr(spec, field) == TINY_DEFAULTS[tiny].max_sequence_length


@pytest.mark.parametrize("tiny", ["tiny-pixart", "tiny-digits"])
def test_a_tiny_model_has_the_image_tokens_its_pipeline_makes(tmp_path, tiny):
    # tiny-digits' VAE downsamples 4x where the others' do 8x: the simulator's spec, by
    # name and from an exported directory, must count the tokens the runtime shards
    # (a plan made for 16 tokens was refused by the 64-token runtime).
    from cocodiff.calibration import model_tokens
    from cocodiff.runtime.pipelines import export_tiny, load_pipeline
    from cocodiff.runtime.tiny import TINY_DEFAULTS

    defaults = TINY_DEFAULTS[tiny]
    pipe = load_pipeline(tiny)
    factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)  # diffusers' own rule
    patch = pipe.transformer.config.patch_size
    expected = (defaults.width // factor // patch) * (defaults.height // factor // patch)
    by_name = model_tokens(tiny, None, None)[0]
    exported = load_model_spec(str(export_tiny(tiny, tmp_path / tiny)))
    for spec in (by_name, exported):
        assert spec.image_tokens(defaults.width, defaults.height) == expected
