"""An emulated multi-node cluster on one Linux machine, and launching CoCoDiff jobs on it.

See :mod:`bench.cluster.netns` for what is built and how it is removed, and
:mod:`bench.cluster.jobs` for starting ranks across the nodes (torch/gloo or MPI). The
command line is ``python -m bench.cluster --help``.
"""

from bench.cluster.netns import (
    ClusterError,
    ClusterInterrupted,
    ClusterSpec,
    EmulatedCluster,
    Node,
    describe,
    remove_stale,
)

__all__ = [
    "ClusterError",
    "ClusterInterrupted",
    "ClusterSpec",
    "EmulatedCluster",
    "Node",
    "describe",
    "remove_stale",
]
