"""Transports by name: ``create_transport("torch")``, ``"mpi"``, or ``"auto"``.

Factories import their backend on call, so importing this module (and ``transports``) costs
neither torch nor mpi4py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transports.base import Transport
from transports.launch import MPIEXEC, detect_launch, mpi4py_available

AUTO = "auto"


def _torch(**kwargs: Any) -> Transport:
    from transports.torch_dist import TorchTransport

    return TorchTransport(**kwargs)


def _mpi(**kwargs: Any) -> Transport:
    from transports.mpi import MpiTransport

    return MpiTransport(**kwargs)


TRANSPORTS: dict[str, Callable[..., Transport]] = {
    "torch": _torch,
    "mpi": _mpi,
    # "sim": the simulated backend (sim/-backed) registers its factory here.
}


def auto_transport_name() -> str:
    """``"mpi"`` when launched by mpiexec and mpi4py imports, else ``"torch"``."""
    if detect_launch().launcher == MPIEXEC and mpi4py_available():
        return "mpi"
    return "torch"


def create_transport(name: str, **kwargs: Any) -> Transport:
    """Build the transport registered as ``name`` (or pick one with ``"auto"``).

    Args:
        name: a key of :data:`TRANSPORTS`, or ``"auto"``.
        **kwargs: passed to the backend's constructor.

    Raises:
        ValueError: ``name`` is not registered.
    """
    if name == AUTO:
        name = auto_transport_name()
    if name not in TRANSPORTS:
        valid = ", ".join([*sorted(TRANSPORTS), AUTO])
        raise ValueError(f"unknown transport {name!r}; valid: {valid}")
    return TRANSPORTS[name](**kwargs)
