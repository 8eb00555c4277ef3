"""tiny-digits: the trained pipeline generates the digit it is asked for, its classifier
reads digits, ``cocodiff run --reference`` reports what the classifier reads, and the
training is deterministic."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
import torch
from launching import launcher_prefix, needs_torchrun, run_job

from cocodiff.quality import ClassAgreement
from cocodiff.runtime.digits import (
    DigitReader,
    digit_prompt,
    pooled_ink,
    requested_digit,
)
from cocodiff.runtime.digits_train import Budget, to_pixels, train
from cocodiff.runtime.pipelines import load_pipeline
from cocodiff.runtime.tiny import TINY_DEFAULTS

STEPS = 20
SEEDS = 10  # per digit: 100 samples
AGREEMENT_FLOOR = 0.8


@pytest.mark.slow
def test_tiny_digits_draws_the_requested_digit_under_the_exact_schedule():
    """100 samples (seeds 0..9 of each digit, one batch with a generator per sample, so each
    sample's noise is that of ``cocodiff run --prompt D --seed S``); the classifier reads
    the requested digit in at least 80% of them."""
    pipe = load_pipeline("tiny-digits")
    defaults = TINY_DEFAULTS["tiny-digits"]
    digits = [d for seed in range(SEEDS) for d in range(10)]
    generators = [torch.Generator().manual_seed(seed) for seed in range(SEEDS) for _ in range(10)]
    with torch.no_grad():
        images = pipe(prompt=[digit_prompt(d) for d in digits], num_inference_steps=STEPS,
                      width=defaults.width, height=defaults.height, generator=generators,
                      output_type="pt", use_resolution_binning=False, clean_caption=False,
                      max_sequence_length=defaults.max_sequence_length).images
    read = DigitReader().read(images)
    agreement = (read == torch.tensor(digits)).double().mean().item()
    assert agreement >= AGREEMENT_FLOOR, (agreement, read.tolist())


def test_classifier_reads_the_digits_through_the_pixel_path():
    """pooled_ink undoes the training images' upsampling, and the shipped classifier reads
    clean digits drawn the way generated ones are handed to it."""
    ink = torch.rand(3, 8, 8)
    pixels = (to_pixels(ink) + 1) / 2  # (3, 3, 32, 32) in [0, 1]
    torch.testing.assert_close(pooled_ink(pixels), ink)
    # A vertical bar, as a 1 is drawn in the 8 x 8 digits.
    one = torch.zeros(1, 8, 8)
    one[0, 1:7, 3:5] = 1.0
    assert DigitReader().read((to_pixels(one) + 1) / 2).tolist() == [1]


def test_requested_digit_and_agreement():
    assert [requested_digit(p) for p in ("7", " 0 ", "12", "a cat", "")] == [7, 0, None, None,
                                                                            None]
    same, differ = ClassAgreement(3, 3, 3), ClassAgreement(3, 8, None)
    assert same.agree and not differ.agree
    assert same.to_json() == {"exact_class": 3, "lossy_class": 3, "requested_class": 3,
                              "agree": True}
    assert "DISAGREE" in differ.summary() and "asked" not in differ.summary()


def _digest(path) -> str:
    """Of the weights (the file's metadata also holds the CPU time the training took)."""
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for key, tensor in sorted(load_file(str(path)).items()):
        digest.update(key.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def test_training_is_deterministic(tmp_path):
    pytest.importorskip("sklearn")
    budget = Budget(classifier_steps=3, vae_steps=2, transformer_steps=2, batch_size=8)
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    threads = torch.get_num_threads()
    report = train(budget, first, samples_per_digit=0)
    train(budget, second, samples_per_digit=0)
    assert _digest(first) == _digest(second)
    assert torch.get_num_threads() == threads  # the caller's settings are restored
    assert report["held_out_images"] == 359 and report["train_images"] == 1438
    # What it writes loads as the built-in model loads the shipped file.
    from cocodiff.runtime.digits import build_digits

    assert build_digits(first).vae.config.scaling_factor == report["vae_scaling_factor"]


def test_run_reports_the_digit_it_reads(tmp_path):
    """One process: the exact plan is its own reference, and the classifier agrees."""
    record_path = tmp_path / "run.json"
    job = run_job([sys.executable, "-m", "cocodiff", "run", "--quiet", "--model", "tiny-digits",
                   "--prompt", "7", "--schedule", "cocodiff", "--steps", "4", "--reference",
                   "--json", str(record_path)], tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    classifier = json.loads(record_path.read_text())["quality"]["classifier"]
    assert classifier["requested_class"] == 7 and classifier["agree"], classifier
    assert "classifier reads" in job.stdout


@needs_torchrun
@pytest.mark.multiprocess
def test_vmajor_defaults_on_tiny_digits_report_classifier_agreement(tmp_path):
    record_path = tmp_path / "run.json"
    cmd = [*launcher_prefix("torchrun", 4), "-m", "cocodiff", "run", "--quiet", "--grid",
           "2x2x1", "--model", "tiny-digits", "--prompt", "4", "--schedule", "cocodiff",
           "--steps", str(STEPS), "--reference", "--json", str(record_path)]
    job = run_job(cmd, tmp_path, timeout_s=300)
    assert job.returncode == 0, job.stderr[-3000:]
    record = json.loads(record_path.read_text())
    classifier = record["quality"]["classifier"]
    assert classifier["requested_class"] == 4
    assert set(classifier) == {"exact_class", "lossy_class", "requested_class", "agree"}
    assert 0 < record["vmajor"]["sent_fraction"] < 1
