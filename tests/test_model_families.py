"""The model family records: each complete, each lookup through them, unknown names
refused in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cocodiff.models import (
    FAMILIES,
    REGISTRY,
    TINY_MODELS,
    ModelSpecError,
    family_of_class,
    load_model_spec,
    load_object,
    runtime_classes,
    spec_from_config,
    tiny_model,
)
from cocodiff.models.families import GENERIC_TRANSFORMER_CLASS


@pytest.mark.parametrize("family", FAMILIES.values(), ids=list(FAMILIES))
def test_every_record_is_complete(family) -> None:
    assert family.transformer_classes, f"{family.name}: no transformer class"
    assert family.presets, f"{family.name}: no preset the simulator knows it by"
    for preset in family.presets:
        spec = REGISTRY[preset.name]
        assert spec.family == family.name, f"{preset.name}: its builder says {spec.family}"
        assert spec.name == preset.name
    for class_name in family.transformer_classes:
        assert family_of_class(class_name) is family
    # A family the runtime cannot parallelise has no tiny model to run.
    assert family.runtime is not None or not family.tiny_models
    for tiny in family.tiny_models:
        assert TINY_MODELS[tiny.name] is tiny
        assert tiny.width > 0 and tiny.height > 0 and tiny.frames > 0
        assert tiny.max_sequence_length > 0 and tiny.prompt and tiny.vae_scale > 0


def test_family_names_are_unique_and_claim_distinct_classes() -> None:
    classes = [c for f in FAMILIES.values() for c in f.transformer_classes]
    assert len(classes) == len(set(classes))
    assert GENERIC_TRANSFORMER_CLASS not in classes
    names = [preset.name for f in FAMILIES.values() for preset in f.presets]
    assert len(names) == len(set(names)) == len(REGISTRY)
    assert not set(names) & set(TINY_MODELS)


def test_records_name_real_diffusers_classes_and_their_context_parallel_plans() -> None:
    diffusers = pytest.importorskip("diffusers")
    for family in FAMILIES.values():
        for class_name in family.transformer_classes:
            cls = getattr(diffusers, class_name)
            assert bool(getattr(cls, "_cp_plan", None)) == family.diffusers_context_parallel, (
                f"{class_name}: the record says diffusers_context_parallel="
                f"{family.diffusers_context_parallel}"
            )


def test_runtime_parts_the_records_name_resolve() -> None:
    pytest.importorskip("diffusers")
    from cocodiff.runtime.families import Family, runtime_family

    for family in FAMILIES.values():
        if family.runtime is not None:
            adapter = load_object(family.runtime)
            assert isinstance(adapter, Family)
            assert "hidden_states" in adapter.batch_arguments
            assert callable(adapter.decode)
            for class_name in family.transformer_classes:
                assert runtime_family(class_name) is adapter
        for tiny in family.tiny_models:
            assert callable(load_object(tiny.build))
            if tiny.reader is not None:
                assert callable(load_object(tiny.reader))
    assert set(runtime_classes()) == {
        c for f in FAMILIES.values() if f.runtime for c in f.transformer_classes}


def test_the_generic_class_resolves_by_norm_type() -> None:
    config = {"_class_name": GENERIC_TRANSFORMER_CLASS, "num_layers": 28,
              "num_attention_heads": 16, "attention_head_dim": 72, "patch_size": 2}
    assert spec_from_config({**config, "norm_type": "ada_norm_single"}).family == "pixart"
    assert spec_from_config({**config, "norm_type": "ada_norm_zero"}).family == "dit"
    with pytest.raises(ModelSpecError, match="norm_type' of a Transformer2DModel must be one "
                                             "of ada_norm_single, ada_norm_zero"):
        spec_from_config({**config, "norm_type": "layer_norm"})


@pytest.mark.parametrize(
    ("lookup", "message"),
    [
        (lambda: family_of_class("UNet2DConditionModel"),
         "unsupported transformer class 'UNet2DConditionModel'; supported: "
         "FluxTransformer2DModel, "),
        (lambda: tiny_model("tiny-nope"), "unknown tiny model 'tiny-nope'; choose one of "
                                          "tiny-flux, "),
        (lambda: load_model_spec("nope"), "unknown model 'nope'; registry names: flux1-dev, "),
    ],
)
def test_an_unknown_model_is_one_clear_line(lookup, message) -> None:
    with pytest.raises(ModelSpecError) as info:
        lookup()
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_the_runtime_refuses_a_family_it_cannot_parallelise_in_one_line() -> None:
    pytest.importorskip("diffusers")
    from cocodiff.runtime.families import runtime_family

    with pytest.raises(ModelSpecError, match=r"^unsupported transformer class "
                                             r"Flux2Transformer2DModel; supported: Flux"):
        runtime_family("Flux2Transformer2DModel")


def test_an_unknown_model_on_the_command_line_exits_2_with_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cocodiff", "simulate", "--model", "nope", "--nodes", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown model 'nope'" in lines[0], result.stderr
