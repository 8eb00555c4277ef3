"""The diffusers model families the runtime can parallelise, keyed by transformer class."""

from __future__ import annotations

from cocodiff.runtime.families.base import Family
from cocodiff.runtime.families.flux import FLUX

FAMILIES: dict[str, Family] = {family.transformer_class: family for family in (FLUX,)}

__all__ = ["FAMILIES", "Family"]
