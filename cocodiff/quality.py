"""How far a lossy run (V-Major) is from the exact one: PSNR and SSIM of the decoded
images, and the largest absolute difference of the final latents."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

# SSIM as Wang et al. (2004) define it: an 11-tap Gaussian window of sigma 1.5 and
# these stabilising constants, per channel, averaged.
SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03


def psnr_db(reference: torch.Tensor, test: torch.Tensor, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB; ``inf`` for identical inputs."""
    mse = torch.mean((reference.double() - test.double()) ** 2).item()
    return math.inf if mse == 0 else 10.0 * math.log10(data_range**2 / mse)


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    return g / g.sum()


def ssim(reference: torch.Tensor, test: torch.Tensor, data_range: float = 1.0) -> float:
    """Mean structural similarity of two images ``(N, C, H, W)`` (or ``(C, H, W)``),
    over the positions where the window fits (no padding). Images smaller than the
    window use the largest odd window that fits."""
    x = reference.double().reshape(-1, 1, *reference.shape[-2:])
    y = test.double().reshape(-1, 1, *test.shape[-2:])
    size = min(SSIM_WINDOW, *x.shape[-2:])
    size -= 1 - size % 2  # odd
    g = _gaussian_window(size, SSIM_SIGMA)
    window = (g[:, None] * g[None, :])[None, None]  # (1, 1, size, size)

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, window)

    c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2
    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x**2
    var_y = blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    index = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)
             / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2)))
    return index.mean().item()


def image_tensor(image: Any) -> torch.Tensor:
    """A PIL image, or a list of them (video frames) -> ``(N, C, H, W)`` in [0, 1]."""
    frames = image if isinstance(image, list) else [image]
    arrays = [torch.frombuffer(bytearray(f.convert("RGB").tobytes()), dtype=torch.uint8)
              .view(f.height, f.width, 3) for f in frames]
    return torch.stack(arrays).permute(0, 3, 1, 2).double() / 255.0


@dataclass(frozen=True, slots=True)
class Quality:
    """A lossy result against the exact one.

    Args:
        psnr_db: of the decoded image (inf: identical).
        ssim: of the decoded image (1: identical).
        latent_max_abs_error: largest difference of the final latents.
    """

    psnr_db: float
    ssim: float
    latent_max_abs_error: float

    def to_json(self) -> dict[str, Any]:
        # JSON has no infinity: identical images are reported as such, with a null PSNR.
        out = asdict(self)
        if math.isinf(self.psnr_db):
            out["psnr_db"] = None
        out["identical_image"] = math.isinf(self.psnr_db)
        return out

    def summary(self) -> str:
        psnr = "inf (identical)" if math.isinf(self.psnr_db) else f"{self.psnr_db:.2f} dB"
        return (f"PSNR {psnr}, SSIM {self.ssim:.4f}, max |latent error| "
                f"{self.latent_max_abs_error:.3g}")


def compare(reference_latents: torch.Tensor, latents: torch.Tensor, reference_image: Any,
            image: Any) -> Quality:
    """The quality of (``latents``, ``image``) against the exact reference."""
    error = (latents.double() - reference_latents.double()).abs().max().item()
    a, b = image_tensor(reference_image), image_tensor(image)
    return Quality(psnr_db(a, b), ssim(a, b), error)


@dataclass(frozen=True, slots=True)
class ClassAgreement:
    """What a classifier reads in the exact and the lossy image of one generation.

    Args:
        exact_class: the class read in the exact plan's image.
        lossy_class: the class read in the lossy (V-Major) image.
        requested_class: the class the prompt asked for, or None if it names none.
    """

    exact_class: int
    lossy_class: int
    requested_class: int | None

    @property
    def agree(self) -> bool:
        return self.exact_class == self.lossy_class

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "agree": self.agree}

    def summary(self) -> str:
        asked = ("" if self.requested_class is None
                 else f" (the prompt asked for {self.requested_class})")
        verdict = "agree" if self.agree else "DISAGREE"
        return (f"classifier reads {self.exact_class} in the exact image and {self.lossy_class} "
                f"in this one: {verdict}{asked}")
