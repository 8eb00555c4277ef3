"""The machine as a graph: presets, TOML files, routing and rank placement."""

from __future__ import annotations

from topology.errors import TopologyError
from topology.graph import TIERS, Topology, build_topology
from topology.placement import Placement
from topology.presets import DEVICES, PRESETS, get_preset
from topology.spec import COMPUTE_MODES, DeviceRates, HostSpec, LinkSpec, TopologySpec
from topology.toml_format import dump_topology, load_topology

__all__ = [
    "COMPUTE_MODES",
    "DEVICES",
    "PRESETS",
    "TIERS",
    "DeviceRates",
    "HostSpec",
    "LinkSpec",
    "Placement",
    "Topology",
    "TopologyError",
    "TopologySpec",
    "build_topology",
    "dump_topology",
    "get_preset",
    "load_topology",
    "resolve_topology",
]


def resolve_topology(name_or_path: str, num_nodes: int | None = None) -> TopologySpec:
    """A preset by name, or a topology file by a path ending in ``.toml``.

    Args:
        name_or_path: a key of :data:`PRESETS` or a ``.toml`` path.
        num_nodes: nodes in the machine; ``None`` keeps the preset's or file's count.

    Raises:
        TopologyError: neither a preset nor a ``.toml`` path (the message lists the
            presets), or anything :func:`get_preset` / :func:`load_topology` raises.
    """
    if isinstance(name_or_path, str) and name_or_path in PRESETS:
        return get_preset(name_or_path, num_nodes)
    if str(name_or_path).endswith(".toml"):
        return load_topology(name_or_path, num_nodes)
    raise TopologyError(
        f"unknown topology {name_or_path!r}: expected a preset "
        f"({', '.join(sorted(PRESETS))}) or a path to a .toml file"
    )
