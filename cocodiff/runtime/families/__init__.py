"""The runtime's adapters of the diffusers model families it can parallelise.

Which family a transformer class belongs to, and whether the runtime has an adapter for
it, is the family record's to say (:mod:`cocodiff.models.families`).
"""

from __future__ import annotations

from cocodiff.models import ModelSpecError, family_of_class, load_object, runtime_classes
from cocodiff.runtime.families.base import Family


def runtime_family(transformer_class: str) -> Family:
    """The runtime's adapter for a diffusers transformer class.

    Raises:
        ModelSpecError: no family claims the class, or the runtime cannot parallelise
            its family (the message lists the classes it can).
    """
    try:
        adapter = family_of_class(transformer_class).runtime
    except ModelSpecError:  # no family at all: the same message as a family without one
        adapter = None
    if adapter is None:
        raise ModelSpecError(f"unsupported transformer class {transformer_class}; supported: "
                             f"{', '.join(runtime_classes())}")
    return load_object(adapter)


__all__ = ["Family", "runtime_family"]
