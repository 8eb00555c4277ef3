"""`cocodiff run --save-latents`: diffusers' own latent format by default (what the
pipeline returns with output_type="latent", FLUX and Qwen-Image packed 2x2), checked
against the unmodified diffusers pipeline; `--latents-format unpacked` the VAE's layout."""

from __future__ import annotations

import pytest
import torch

from cocodiff.commands.cli import main
from cocodiff.runtime.pipelines import load_pipeline
from cocodiff.runtime.tiny import TINY_DEFAULTS

PROMPT = "a lighthouse on a cliff at dawn"


def _diffusers_latents(model: str, steps: int) -> torch.Tensor:
    """The reference: diffusers' pipeline, called directly, output_type="latent"."""
    pipe = load_pipeline(model)
    defaults = TINY_DEFAULTS[model]
    return pipe(prompt=PROMPT, num_inference_steps=steps, width=defaults.width,
                height=defaults.height, generator=torch.Generator("cpu").manual_seed(0),
                max_sequence_length=defaults.max_sequence_length, output_type="latent",
                return_dict=False)[0]


@pytest.mark.parametrize(("model", "packed_ndim"), [("tiny-flux", 3), ("tiny-sd3", 4)])
def test_saved_latents_are_what_diffusers_returns(tmp_path, model, packed_ndim):
    saved = tmp_path / "latents.pt"
    assert main(["run", "--model", model, "--steps", "2", "--quiet", "--prompt", PROMPT,
                 "--save-latents", str(saved)]) == 0
    latents = torch.load(saved, weights_only=True)
    reference = _diffusers_latents(model, 2)
    assert latents.ndim == packed_ndim and latents.dtype == reference.dtype
    torch.testing.assert_close(latents, reference, rtol=1e-5, atol=1e-6)


def test_unpacked_format_is_the_vae_layout(tmp_path):
    saved = tmp_path / "latents.pt"
    assert main(["run", "--steps", "1", "--quiet", "--save-latents", str(saved),
                 "--latents-format", "unpacked"]) == 0
    latents = torch.load(saved, weights_only=True)
    pipe = load_pipeline("tiny-flux")
    defaults = TINY_DEFAULTS["tiny-flux"]
    assert latents.ndim == 4  # (batch, channels, height/8, width/8)
    assert latents.shape[-2:] == (defaults.height // pipe.vae_scale_factor,
                                  defaults.width // pipe.vae_scale_factor)
    packed = pipe._pack_latents(latents, *latents.shape)
    torch.testing.assert_close(packed, _diffusers_latents("tiny-flux", 1), rtol=1e-5, atol=1e-6)


def test_bad_latents_format_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--latents-format", "nope"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err
