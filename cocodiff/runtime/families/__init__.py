"""The diffusers model families the runtime can parallelise, keyed by transformer class."""

from __future__ import annotations

from cocodiff.runtime.families.base import Family
from cocodiff.runtime.families.flux import FLUX
from cocodiff.runtime.families.sd3 import SD3

FAMILIES: dict[str, Family] = {family.transformer_class: family for family in (FLUX, SD3)}

__all__ = ["FAMILIES", "Family"]
