"""Trains ``tiny-digits`` on scikit-learn's bundled 8x8 digits and writes its weights.

    pip install scikit-learn          # only this script needs it
    python -m cocodiff.commands.train_digits              # writes cocodiff/runtime/weights/...
    python -m cocodiff.commands.train_digits --out w.safetensors --json train.json

Deterministic: one thread, deterministic algorithms, every random draw from seeded
generators, so a rerun on the same torch build writes the same bytes. Three models, in
order: the classifier (on 8 x 8 ink), the VAE (reconstruction of 32 x 32 images), then
the PixArt transformer on the VAE's latents (epsilon prediction on the pipeline
scheduler's 1000-step linear betas, the prompt dropped to "" one time in ten so that the
pipeline's classifier-free guidance has an unconditional branch). The T5 text encoder
stays as built (seeded random weights): the transformer learns to read its embeddings of
"0" ... "9". 20% of the digits, stratified, are held out; the classifier's accuracy on
them is reported, and so are the VAE's reconstruction and the pipeline's samples read by
the classifier.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler
from safetensors.torch import save_file

from cocodiff.quality import psnr_db
from cocodiff.runtime.digits import (
    DIGIT_MAX,
    NUM_CLASSES,
    UPSAMPLE,
    DigitClassifier,
    build_architecture,
    digit_prompt,
    pooled_ink,
)
from cocodiff.runtime.tiny import TEXT_MAX_TOKENS

SEED = 0
HELD_OUT_FRACTION = 0.2
UNCONDITIONAL_FRACTION = 0.1


@dataclass(frozen=True, slots=True)
class Budget:
    """Optimiser steps and batch sizes of the three trainings."""

    classifier_steps: int = 1500
    vae_steps: int = 600
    transformer_steps: int = 2500
    batch_size: int = 64
    learning_rate: float = 1e-3


def load_digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """sklearn's digits as ink in [0, 1]: (train x, train y, held-out x, held-out y).

    The split is stratified and seeded: the last 20% of each class in a seeded shuffle.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    ink = torch.tensor(data.images, dtype=torch.float32) / DIGIT_MAX  # (1797, 8, 8)
    labels = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SEED))
    train, held = [], []
    for digit in range(NUM_CLASSES):
        members = order[labels[order] == digit]
        cut = round(len(members) * (1 - HELD_OUT_FRACTION))
        train.append(members[:cut])
        held.append(members[cut:])
    train_idx, held_idx = torch.cat(train).sort().values, torch.cat(held).sort().values
    return ink[train_idx], labels[train_idx], ink[held_idx], labels[held_idx]


def to_pixels(ink: torch.Tensor) -> torch.Tensor:
    """``(N, 8, 8)`` ink in [0, 1] -> ``(N, 3, 32, 32)`` images in [-1, 1] (VAE input)."""
    # (N, 8, 8) -> (N, 1, 32, 32): nearest upsampling, undone by pooled_ink
    image = F.interpolate(ink[:, None], scale_factor=UPSAMPLE, mode="nearest")
    return (image * 2 - 1).expand(-1, 3, -1, -1).contiguous()


def _batches(count: int, batch_size: int, steps: int, generator: torch.Generator):
    """``steps`` index batches drawn from seeded permutations (epochs)."""
    order = torch.empty(0, dtype=torch.int64)
    for _ in range(steps):
        if len(order) < batch_size:
            order = torch.cat([order, torch.randperm(count, generator=generator)])
        yield order[:batch_size]
        order = order[batch_size:]


def train_classifier(x: torch.Tensor, y: torch.Tensor, budget: Budget,
                     generator: torch.Generator) -> DigitClassifier:
    model = DigitClassifier()
    optimiser = torch.optim.Adam(model.parameters(), lr=budget.learning_rate, weight_decay=1e-4)
    for index in _batches(len(y), budget.batch_size, budget.classifier_steps, generator):
        # Noise on the ink: generated digits are not as clean as the scans.
        noisy = x[index] + 0.1 * torch.randn(x[index].shape, generator=generator)
        loss = F.cross_entropy(model(noisy), y[index])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return model.eval()


def accuracy(model: DigitClassifier, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).double().mean().item()


def train_vae(vae, pixels: torch.Tensor, budget: Budget, generator: torch.Generator,
              kl_weight: float = 1e-5) -> None:
    vae.train()
    optimiser = torch.optim.Adam(vae.parameters(), lr=budget.learning_rate)
    for index in _batches(len(pixels), budget.batch_size, budget.vae_steps, generator):
        batch = pixels[index]
        posterior = vae.encode(batch).latent_dist
        latent = posterior.mean + posterior.std * torch.randn(posterior.mean.shape,
                                                              generator=generator)
        reconstruction = vae.decode(latent).sample
        loss = F.mse_loss(reconstruction, batch) + kl_weight * posterior.kl().mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    vae.eval()


def _text_embeddings(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """T5 embeddings and masks of "0" ... "9" then "": ``(11, L, 32)``, ``(11, L)``."""
    prompts = [digit_prompt(d) for d in range(NUM_CLASSES)] + [""]
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                                max_sequence_length=TEXT_MAX_TOKENS)
    return embeds, mask


def train_transformer(pipe, latents: torch.Tensor, labels: torch.Tensor, budget: Budget,
                      generator: torch.Generator, ema_decay: float = 0.999):
    """Epsilon prediction; returns the exponential moving average of the weights."""
    transformer = pipe.transformer.train()
    ema = copy.deepcopy(transformer).eval().requires_grad_(False)
    noise_schedule = DDPMScheduler.from_config(pipe.scheduler.config)
    embeds, mask = _text_embeddings(pipe)
    optimiser = torch.optim.AdamW(transformer.parameters(), lr=budget.learning_rate,
                                  weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LinearLR(optimiser, 0.01, 1.0, total_iters=200)
    for index in _batches(len(labels), budget.batch_size, budget.transformer_steps, generator):
        clean = latents[index]
        noise = torch.randn(clean.shape, generator=generator)
        t = torch.randint(0, noise_schedule.config.num_train_timesteps, (len(index),),
                          generator=generator)
        drop = torch.rand(len(index), generator=generator) < UNCONDITIONAL_FRACTION
        text = torch.where(drop, NUM_CLASSES, labels[index])  # row NUM_CLASSES is ""
        prediction = transformer(noise_schedule.add_noise(clean, noise, t),
                                 encoder_hidden_states=embeds[text],
                                 encoder_attention_mask=mask[text], timestep=t,
                                 return_dict=False)[0]
        loss = F.mse_loss(prediction, noise)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        warmup.step()
        with torch.no_grad():
            for averaged, live in zip(ema.parameters(), transformer.parameters(), strict=True):
                averaged.lerp_(live, 1 - ema_decay)
    return ema


def sample_digits(pipe, digits: list[int], steps: int, seed: int = 0) -> torch.Tensor:
    """Generates one image per digit in one batch: ``(N, 3, 32, 32)`` in [0, 1]."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        images = pipe(prompt=[digit_prompt(d) for d in digits], num_inference_steps=steps,
                      width=pipe.vae.config.sample_size, height=pipe.vae.config.sample_size,
                      generator=generator, output_type="pt", use_resolution_binning=False,
                      max_sequence_length=TEXT_MAX_TOKENS, clean_caption=False).images
    return images.float()


def train(budget: Budget, out: Path, sample_steps: int = 20, samples_per_digit: int = 10) -> dict:
    """Trains everything, writes ``out`` and returns the report.

    Runs on one thread with deterministic algorithms; the caller's settings are restored.
    ``samples_per_digit`` (0: none) samples of each digit are generated and read at the end.
    """
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            return _train(budget, out, sample_steps, samples_per_digit)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _train(budget: Budget, out: Path, sample_steps: int, samples_per_digit: int) -> dict:
    generator = torch.Generator().manual_seed(SEED)
    x_train, y_train, x_held, y_held = load_digits_split()
    report: dict = {"budget": asdict(budget)}
    report["train_images"], report["held_out_images"] = len(y_train), len(y_held)
    started = time.process_time()

    classifier = train_classifier(x_train, y_train, budget, generator)
    report["classifier_held_out_accuracy"] = accuracy(classifier, x_held, y_held)
    print(f"classifier: held-out accuracy {report['classifier_held_out_accuracy']:.3f}",
          flush=True)

    pipe = build_architecture()
    train_vae(pipe.vae, to_pixels(x_train), budget, generator)
    with torch.no_grad():
        held_pixels = to_pixels(x_held)
        decoded = pipe.vae.decode(pipe.vae.encode(held_pixels).latent_dist.mode()).sample
        decoded = ((decoded + 1) / 2).clamp(0, 1)
        latents = pipe.vae.encode(to_pixels(x_train)).latent_dist.mode()
    report["vae_held_out_psnr_db"] = psnr_db((held_pixels + 1) / 2, decoded)
    report["classifier_on_vae_reconstructions"] = accuracy(classifier, pooled_ink(decoded),
                                                           y_held)
    # As Stable Diffusion does: scale latents to unit variance for the diffusion model.
    scaling = 1.0 / latents.std().item()
    pipe.vae.register_to_config(scaling_factor=scaling)
    report["vae_scaling_factor"] = scaling
    print(f"vae: held-out PSNR {report['vae_held_out_psnr_db']:.1f} dB, classifier on "
          f"reconstructions {report['classifier_on_vae_reconstructions']:.3f}", flush=True)

    pipe.transformer = train_transformer(pipe, latents * scaling, y_train, budget, generator)
    report["train_cpu_s"] = time.process_time() - started

    if samples_per_digit:
        digits = [d for d in range(NUM_CLASSES) for _ in range(samples_per_digit)]
        images = sample_digits(pipe, digits, sample_steps)
        read = accuracy(classifier, pooled_ink(images), torch.tensor(digits))
        report["samples_read_as_requested"] = read
        print(f"samples: {read:.0%} of {len(digits)} read as the requested digit "
              f"({sample_steps} steps)", flush=True)
    print(f"training: {report['train_cpu_s']:.0f} s of CPU", flush=True)

    state = {}
    for name, module in (("transformer", pipe.transformer), ("vae", pipe.vae),
                         ("text_encoder", pipe.text_encoder), ("classifier", classifier)):
        # Copies: T5 ties its input embedding to ``shared``, and safetensors refuses
        # tensors that share memory (loading sets both from equal copies).
        state.update({f"{name}.{k}": v.detach().clone().contiguous()
                      for k, v in module.state_dict().items()})
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out), metadata={"vae": json.dumps({"scaling_factor": scaling}),
                                         "report": json.dumps(report)})
    return report
