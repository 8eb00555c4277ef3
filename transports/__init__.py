"""Communication backends behind one interface (see :mod:`transports.base`).

The backends themselves (:class:`TorchTransport`, :class:`MpiTransport`) are imported on
first use, so ``import transports`` costs neither torch nor mpi4py.
"""

from typing import Any

from transports.base import (
    CompletedHandle,
    Group,
    Handle,
    Transport,
    TransportError,
    VirtualBuffer,
)
from transports.launch import LaunchInfo, detect_launch
from transports.registry import TRANSPORTS, create_transport

__all__ = [
    "TRANSPORTS",
    "CompletedHandle",
    "Group",
    "Handle",
    "LaunchInfo",
    "MpiTransport",
    "TorchTransport",
    "Transport",
    "TransportError",
    "VirtualBuffer",
    "create_transport",
    "detect_launch",
]

_LAZY = {"TorchTransport": "transports.torch_dist", "MpiTransport": "transports.mpi"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'transports' has no attribute {name!r}")
