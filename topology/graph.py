"""The machine as a directed graph, and the routes bytes take through it.

Vertices (attribute ``kind``; node-scoped vertices also carry ``node``):

    ``n{n}``            "node"    node n's host (CPU, PCIe root)
    ``n{n}.g{g}``       "gpu"     GPU g of node n
    ``n{n}.g{g}.t{t}``  "tile"    tile t of that GPU; a rank runs on a tile
    ``n{n}.nic{k}``     "nic"     NIC k of node n
    ``n{n}.sw``         "switch"  the node's GPU switch (gpu_fabric "switch", > 1 GPU)
    ``fabric``          "switch"  the inter-node fabric (only with more than one node)

Every physical link is two directed edges (one per direction, each with the full
``bandwidth_gbps``), with attributes ``bandwidth_gbps``, ``latency_us`` and ``kind``:

    "tile"  tile <-> every other tile of its GPU      (spec.tile_link)
    "port"  tile <-> its GPU                          (spec.port_link)
    "gpu"   GPU <-> GPU ("all-to-all") or GPU <-> n.sw ("switch")  (spec.gpu_link)
    "host"  GPU <-> its node's host                   (spec.host_link)
    "nic"   host <-> NIC (the NIC's bandwidth, no latency) and NIC <-> fabric
            (spec.nic_link)

Routes are fixed (no multipath): see :meth:`Topology.route`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from topology.errors import TopologyError
from topology.spec import LinkSpec, TopologySpec, validate_spec

if TYPE_CHECKING:
    import networkx as nx

TIERS = ("intra-gpu", "intra-node", "inter-node")
"""Link tiers a tile-to-tile transfer can stay within, fastest first."""

LINK_KINDS = ("tile", "gpu", "port", "host", "nic")

FABRIC = "fabric"

Link = tuple[str, str]
Route = tuple[Link, ...]

# Routes are memoised per topology. Bounded so that an all-pairs sweep of a huge machine
# (1152 Aurora tiles -> 1.3 M pairs) cannot hold every route at once.
_ROUTE_CACHE_SIZE = 1 << 18


class LinkTable(NamedTuple):
    """Every directed link in one order, with its position and its capacity (bytes/s):
    what a simulation's network is built on (``sim.network.Network``), made once per
    topology (a 4,096-node Aurora has 450,560 links and a planner run simulates dozens of
    times)."""

    links: tuple[tuple[Hashable, Hashable], ...]
    positions: dict[tuple[Hashable, Hashable], int]  # link -> its place in ``links``
    bytes_per_s: np.ndarray  # read-only


class Topology:
    """A validated machine: its spec, its graph, and fast routing over it.

    Build one with :func:`build_topology`. All lookups are precomputed or memoised, as
    the simulator calls them for every message.

    Attributes:
        spec: the machine description it was built from.
        graph: the directed link graph (see the module docstring).
        tiles: every tile, node-major then GPU-major: ``n0.g0.t0, n0.g0.t1, n0.g1.t0, ...``.
        num_nodes: nodes in the machine.
        tiles_per_node: tiles in one node.
    """

    __slots__ = (
        "spec",
        "_vertices",
        "_graph",
        "tiles",
        "num_nodes",
        "tiles_per_node",
        "_tile_info",
        "_link_attrs",
        "_fold",
        "_up",
        "_down",
        "route",
        "route_latency_us",
        "_fold_links",
        "link_table",
    )

    route: Callable[[str, str], Route]
    route_latency_us: Callable[[Route], float]
    _fold_links: Callable[[Route, int], Route]
    link_table: Callable[[], LinkTable]

    def __init__(self, spec: TopologySpec, vertices: dict[str, tuple[str, int | None]],
                 links: dict[Link, tuple[float, float, str]], tiles: tuple[str, ...]) -> None:
        self.spec = spec
        self._vertices = vertices
        self._graph: nx.DiGraph | None = None
        self.tiles = tiles
        self.num_nodes = spec.num_nodes
        self.tiles_per_node = spec.tiles_per_node
        # tile -> (node, gpu name, local index, nic name or None)
        self._tile_info: dict[str, tuple[int, str, int, str | None]] = {}
        for tile in tiles:
            node_part, gpu_part, tile_part = tile.split(".")
            node, gpu, index = int(node_part[1:]), int(gpu_part[1:]), int(tile_part[1:])
            local = gpu * spec.tiles_per_gpu + index
            nic = f"n{node}.nic{local % spec.nics_per_node}" if spec.nics_per_node else None
            self._tile_info[tile] = (node, f"{node_part}.{gpu_part}", local, nic)
        self._link_attrs = links  # (bandwidth_gbps, latency_us, kind) by directed link
        folded_vertex = {v: _fold_vertex(v) for v in vertices}
        self._fold: dict[Link, Link] = {
            link: (folded_vertex[link[0]], folded_vertex[link[1]]) for link in self._link_attrs
        }
        # Half routes between a tile and the fabric, shared by every inter-node route.
        self._up: dict[str, Route] = {}
        self._down: dict[str, Route] = {}
        if spec.num_nodes > 1:
            # validate_spec guarantees NICs when there is more than one node.
            for tile, (node_index, gpu_name, _, nic_name) in self._tile_info.items():
                host, nic = f"n{node_index}", cast(str, nic_name)
                up = ((tile, gpu_name), (gpu_name, host), (host, nic), (nic, FABRIC))
                self._up[tile] = up
                self._down[tile] = ((FABRIC, nic), (nic, host), (host, gpu_name), (gpu_name, tile))
        # Per-instance caches (an lru_cache on the methods would be shared by all
        # instances and keep them alive).
        self.route = lru_cache(maxsize=_ROUTE_CACHE_SIZE)(self._route)
        self.route_latency_us = lru_cache(maxsize=_ROUTE_CACHE_SIZE)(self._route_latency_us)
        self._fold_links = lru_cache(maxsize=_ROUTE_CACHE_SIZE)(
            lambda links, period_nodes: tuple(self.fold_link(link, period_nodes)
                                              for link in links))
        self.link_table = lru_cache(maxsize=1)(self._link_table)

    @property
    def graph(self) -> nx.DiGraph:
        """The machine as a networkx graph (the module docstring), built on first use:
        the simulator reads the links from their table, and a graph of 4,096 Aurora
        nodes (450,560 links) took longer to build than a simulation to run."""
        if self._graph is None:
            import networkx as nx  # a quarter of a second to import: only when asked for

            graph = nx.DiGraph(name=self.spec.name)
            graph.add_nodes_from((name, {"kind": kind, "node": node})
                                 for name, (kind, node) in self._vertices.items())
            graph.add_edges_from((u, v, {"bandwidth_gbps": bandwidth, "latency_us": latency,
                                         "kind": kind})
                                 for (u, v), (bandwidth, latency, kind)
                                 in self._link_attrs.items())
            self._graph = graph
        return self._graph

    def __repr__(self) -> str:
        return (
            f"Topology({self.spec.name!r}, {self.num_nodes} nodes x {self.tiles_per_node} "
            f"tiles, {self.graph.number_of_edges()} directed links)"
        )

    # -- routing ----------------------------------------------------------------------

    def _route(self, src_tile: str, dst_tile: str) -> Route:
        """The directed links a byte from ``src_tile`` to ``dst_tile`` crosses, in order.

        Same tile: ``()``. Same GPU: the direct tile link. Same node:
        tile -> GPU -> GPU -> tile ("all-to-all") or tile -> GPU -> n.sw -> GPU -> tile
        ("switch"). Other node: tile -> GPU -> host -> NIC -> fabric -> NIC -> host ->
        GPU -> tile, leaving through the source tile's NIC and arriving through the
        destination tile's NIC (see :meth:`nic_of`). Deterministic and memoised.

        Raises:
            TopologyError: a tile that is not in this topology.
        """
        src_node, src_gpu, _, _ = self._info(src_tile)
        dst_node, dst_gpu, _, _ = self._info(dst_tile)
        if src_tile == dst_tile:
            return ()
        if src_gpu == dst_gpu:
            return ((src_tile, dst_tile),)
        if src_node == dst_node:
            if self.spec.gpu_fabric == "switch":
                switch = f"n{src_node}.sw"
                middle: Route = ((src_gpu, switch), (switch, dst_gpu))
            else:
                middle = ((src_gpu, dst_gpu),)
            return ((src_tile, src_gpu), *middle, (dst_gpu, dst_tile))
        return self._up[src_tile] + self._down[dst_tile]

    def _route_latency_us(self, route: Route) -> float:
        """Sum of the route's link latencies, plus ``fabric_latency_us`` if it crosses
        the fabric. Memoised; ``route`` must come from :meth:`route`."""
        attrs = self._link_attrs
        total = 0.0
        crosses_fabric = False
        for link in route:
            total += attrs[link][1]
            if link[1] == FABRIC:
                crosses_fabric = True
        if crosses_fabric:
            total += self.spec.fabric_latency_us
        return total

    def tier(self, src_tile: str, dst_tile: str) -> str:
        """The slowest tier of :data:`TIERS` a transfer between two tiles uses.

        Raises:
            TopologyError: ``src_tile == dst_tile`` (a local copy is on no tier; callers
                skip it), or an unknown tile.
        """
        src_node, src_gpu, _, _ = self._info(src_tile)
        dst_node, dst_gpu, _, _ = self._info(dst_tile)
        if src_tile == dst_tile:
            raise TopologyError(f"no tier from tile {src_tile} to itself (a local copy)")
        if src_gpu == dst_gpu:
            return "intra-gpu"
        if src_node == dst_node:
            return "intra-node"
        return "inter-node"

    # -- tiles ------------------------------------------------------------------------

    def node_of(self, tile: str) -> int:
        """The node index of ``tile``."""
        return self._info(tile)[0]

    def gpu_of(self, tile: str) -> str:
        """The GPU vertex of ``tile`` (``"n0.g1"``)."""
        return self._info(tile)[1]

    def local_index(self, tile: str) -> int:
        """The index of ``tile`` within its node: ``gpu * tiles_per_gpu + tile``."""
        return self._info(tile)[2]

    def nic_of(self, tile: str) -> str:
        """The NIC that ``tile``'s inter-node traffic leaves and arrives through.

        Round robin: local index modulo ``nics_per_node``, so with Aurora's 12 tiles and
        8 NICs, tiles 0-7 use NICs 0-7 and tiles 8-11 share NICs 0-3.

        Raises:
            TopologyError: the topology has no NICs.
        """
        nic = self._info(tile)[3]
        if nic is None:
            raise TopologyError(f"topology {self.spec.name!r} has no NICs (tile {tile})")
        return nic

    def _info(self, tile: str) -> tuple[int, str, int, str | None]:
        info = self._tile_info.get(tile)
        if info is None:
            raise TopologyError(
                f"unknown tile {tile!r}: topology {self.spec.name!r} has tiles "
                f"{self.tiles[0]} .. {self.tiles[-1]} (n<node>.g<gpu>.t<tile>)"
            )
        return info

    # -- links ------------------------------------------------------------------------

    def link_attrs(self, link: Link) -> tuple[float, float, str]:
        """``(bandwidth_gbps, latency_us, kind)`` of a directed link.

        Raises:
            TopologyError: no such link.
        """
        attrs = self._link_attrs.get(link)
        if attrs is None:
            raise TopologyError(f"no link {link!r} in topology {self.spec.name!r}")
        return attrs

    def links(self) -> Iterator[tuple[Link, float, float, str]]:
        """Every directed link as ``(link, bandwidth_gbps, latency_us, kind)``."""
        for link, (bandwidth_gbps, latency_us, kind) in self._link_attrs.items():
            yield link, bandwidth_gbps, latency_us, kind

    def _link_table(self) -> LinkTable:
        links = tuple(self._link_attrs)
        bytes_per_s = np.array([self._link_attrs[link][0] * 1e9 for link in links])
        bytes_per_s.flags.writeable = False
        return LinkTable(links, {link: i for i, link in enumerate(links)},  # type: ignore[misc]
                         bytes_per_s)

    def fold_link(self, link: Link, period_nodes: int = 1) -> Link:
        """The same link on node ``k mod period_nodes``: with the default, node 0.

        All nodes are identical, so traffic invariant under a shift by ``period_nodes``
        whole nodes can be simulated on nodes ``0..period_nodes-1`` only (``fabric`` is
        its own image).

        Raises:
            TopologyError: no such link.
        """
        if period_nodes == 1:
            folded = self._fold.get(link)
        elif link in self._link_attrs:
            folded = (_fold_vertex(link[0], period_nodes), _fold_vertex(link[1], period_nodes))
        else:
            folded = None
        if folded is None:
            raise TopologyError(f"no link {link!r} in topology {self.spec.name!r}")
        return folded

    def folded_route(self, src_tile: str, dst_tile: str, period_nodes: int) -> Route:
        """:meth:`route` with every link folded (:meth:`fold_link`). The folded halves
        of a route across the fabric are memoised per tile, not per pair: the simulator
        folds the route of every message of an output gather, which reaches every rank
        of the machine, once per simulated rank and simulation."""
        if self._tile_info[src_tile][0] != self._tile_info[dst_tile][0]:
            return (self._fold_links(self._up[src_tile], period_nodes)
                    + self._fold_links(self._down[dst_tile], period_nodes))
        return self._fold_links(self.route(src_tile, dst_tile), period_nodes)


def build_topology(spec: TopologySpec) -> Topology:
    """Validate ``spec`` and build its machine: vertices, links, tiles (the graph itself
    on first use, :attr:`Topology.graph`).

    Raises:
        TopologyError: the spec is invalid (see :func:`topology.spec.validate_spec`).
    """
    validate_spec(spec)
    # Vertex -> (kind, node), and source -> destination -> (bandwidth, latency, kind), in
    # the order a networkx DiGraph built the same way would list them (its edge order is
    # the simulator's link order).
    vertices: dict[str, tuple[str, int | None]] = {}
    succ: dict[str, dict[str, tuple[float, float, str]]] = {}
    tiles: list[str] = []

    def vertex(name: str, kind: str, node: int | None) -> None:
        vertices[name] = (kind, node)
        succ[name] = {}

    def link(u: str, v: str, bandwidth_gbps: float, latency_us: float, kind: str) -> None:
        succ[u][v] = succ[v][u] = (bandwidth_gbps, latency_us, kind)

    def spec_link(u: str, v: str, link_spec: LinkSpec, kind: str) -> None:
        link(u, v, link_spec.bandwidth_gbps, link_spec.latency_us, kind)

    for n in range(spec.num_nodes):
        host = f"n{n}"
        vertex(host, "node", n)
        gpus = [f"{host}.g{g}" for g in range(spec.gpus_per_node)]
        for gpu in gpus:
            vertex(gpu, "gpu", n)
            spec_link(gpu, host, spec.host_link, "host")
            gpu_tiles = [f"{gpu}.t{t}" for t in range(spec.tiles_per_gpu)]
            for tile in gpu_tiles:
                vertex(tile, "tile", n)
                spec_link(tile, gpu, spec.port_link, "port")
            for i, a in enumerate(gpu_tiles):
                for b in gpu_tiles[i + 1 :]:
                    spec_link(a, b, spec.tile_link, "tile")  # type: ignore[arg-type]
            tiles.extend(gpu_tiles)
        if spec.gpu_link is not None:
            if spec.gpu_fabric == "switch":
                switch = f"{host}.sw"
                vertex(switch, "switch", n)
                for gpu in gpus:
                    spec_link(gpu, switch, spec.gpu_link, "gpu")
            else:
                for i, a in enumerate(gpus):
                    for b in gpus[i + 1 :]:
                        spec_link(a, b, spec.gpu_link, "gpu")
        for k in range(spec.nics_per_node):
            nic = f"{host}.nic{k}"
            vertex(nic, "nic", n)
            link(host, nic, spec.nic_link.bandwidth_gbps, 0.0, "nic")
    if spec.num_nodes > 1:
        vertex(FABRIC, "switch", None)
        for n in range(spec.num_nodes):
            for k in range(spec.nics_per_node):
                spec_link(f"n{n}.nic{k}", FABRIC, spec.nic_link, "nic")
    links = {(u, v): attrs for u, targets in succ.items() for v, attrs in targets.items()}
    return Topology(spec, vertices, links, tuple(tiles))


def _fold_vertex(vertex: str, period_nodes: int = 1) -> str:
    if vertex == FABRIC:
        return vertex
    node, dot, rest = vertex.partition(".")
    return f"n{int(node[1:]) % period_nodes}{dot}{rest}"
