"""Which node each rank of a launch runs on, found by the ranks themselves.

A node is a host and a network namespace: the ranks of one namespace of the emulated
cluster (``bench/cluster``) share a hostname with every other namespace but not a
loopback. ``cocodiff run`` takes its rank grid from this when ``--grid`` is not given,
and ``cocodiff calibrate`` measures each tier between the nodes found.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Sequence

from cocodiff.util.errors import CocodiffError


class PlacementError(CocodiffError):
    """The ranks do not sit node-major on equal nodes."""


def node_key() -> int:
    """Same value on ranks of one node: hostname and network namespace."""
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    digest = hashlib.sha256(f"{socket.gethostname()}|{netns}".encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def detect_nodes(transport) -> list[int]:
    """Node index of every rank, numbered in order of first appearance (collective)."""
    import torch

    from cocodiff.runtime.exchange import all_gather_rows

    keys = all_gather_rows(transport, torch.tensor([node_key()], dtype=torch.int64))
    first: dict[int, int] = {}
    return [first.setdefault(key, len(first)) for key in keys.flatten().tolist()]


def node_major_shape(node_of: Sequence[int]) -> tuple[int, int]:
    """(nodes, ranks per node) of ranks placed node-major on equal nodes.

    Raises:
        PlacementError: any other placement.
    """
    num_nodes = max(node_of) + 1
    per_node = len(node_of) // num_nodes
    expected = [r // per_node for r in range(len(node_of))]
    if len(node_of) % num_nodes or list(node_of) != expected:
        raise PlacementError(
            f"ranks are not placed node-major with equal nodes (node of each rank: "
            f"{list(node_of)}); the cluster topology needs R consecutive ranks per node"
        )
    return num_nodes, per_node


def launched_grid(transport):
    """The nodes the launch spans (host and network namespace), one GPU per rank, as a
    rank grid; None when every rank is on one node (collective).

    Raises:
        PlacementError: the ranks are not node-major on equal nodes.
    """
    from cocodiff.schedules import RankGrid

    num_nodes, per_node = node_major_shape(detect_nodes(transport))
    if num_nodes == 1:
        return None
    return RankGrid((num_nodes, per_node, 1), tuple(range(transport.world_size)))
