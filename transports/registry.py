"""Transports by name: ``create_transport("torch")``, ``"mpi"``, or ``"auto"``.

Factories import their backend on call, so importing this module (and ``transports``) costs
neither torch nor mpi4py.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.util import find_spec
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
    """``"torch"`` when this rank's device has a collective backend of its own (nccl on
    CUDA, xccl or oneCCL's ccl on XPU: device memory moves without host staging); else
    ``"mpi"`` when launched by mpiexec and mpi4py imports (mpi4py stages device tensors
    through host memory); else ``"torch"`` (gloo).

    Raises:
        LaunchError: the launch or the device is wrong (:func:`detect_launch`,
            :func:`transports.torch_dist.default_device`).
    """
    launch = detect_launch()
    if launch.is_distributed and find_spec("torch") is not None:
        from transports.torch_dist import device_backend

        if device_backend(launch) is not None:
            return "torch"
    if launch.launcher == MPIEXEC and mpi4py_available():
        return "mpi"
    return "torch"


def create_transport(name: str, **kwargs: Any) -> Transport:
    """Build the transport registered as ``name`` (or pick one with ``"auto"``).

    Args:
        name: a key of :data:`TRANSPORTS`, or ``"auto"``.
        **kwargs: passed to the backend's constructor; ``timeout_s=None`` means the
            backend's default.

    Raises:
        ValueError: ``name`` is not registered.
    """
    if name == AUTO:
        name = auto_transport_name()
    if name not in TRANSPORTS:
        valid = ", ".join([*sorted(TRANSPORTS), AUTO])
        raise ValueError(f"unknown transport {name!r}; valid: {valid}")
    if kwargs.get("timeout_s", 0) is None:
        del kwargs["timeout_s"]  # the backend's own default (longer for xccl)
    return TRANSPORTS[name](**kwargs)
