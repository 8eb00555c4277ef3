"""The diffusers model families the runtime can parallelise, keyed by transformer class."""

from __future__ import annotations

from cocodiff.runtime.families.base import Family
from cocodiff.runtime.families.flux import FLUX
from cocodiff.runtime.families.pixart import PIXART
from cocodiff.runtime.families.qwen import QWEN
from cocodiff.runtime.families.sd3 import SD3
from cocodiff.runtime.families.wan import WAN

FAMILIES: dict[str, Family] = {
    family.transformer_class: family for family in (FLUX, SD3, PIXART, WAN, QWEN)
}

__all__ = ["FAMILIES", "Family"]
