"""The machine graph: presets, routes, tiers, folding and placement."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topology import (
    PRESETS,
    TIERS,
    LinkSpec,
    Placement,
    Topology,
    TopologyError,
    TopologySpec,
    build_topology,
    get_preset,
    resolve_topology,
)
from topology.presets import cluster


@pytest.fixture(scope="module")
def aurora2() -> Topology:
    return build_topology(get_preset("aurora", num_nodes=2))


def kinds(topology: Topology, route) -> list[str]:
    return [topology.link_attrs(link)[2] for link in route]


# -- presets ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("num_nodes", [None, 1, 3])
def test_every_preset_builds(name: str, num_nodes: int | None) -> None:
    spec = get_preset(name, num_nodes)
    topology = build_topology(spec)
    if num_nodes is not None:
        assert topology.num_nodes == num_nodes
    assert len(topology.tiles) == spec.num_nodes * spec.gpus_per_node * spec.tiles_per_gpu
    assert ("fabric" in topology.graph) == (spec.num_nodes > 1)


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(TopologyError, match=r"unknown topology preset 'frontier'.*aurora"):
        get_preset("frontier")


@pytest.mark.parametrize("num_nodes", [0, -1, 1.5, True, "2"])
def test_preset_refuses_bad_node_counts(num_nodes) -> None:
    with pytest.raises(TopologyError, match="number of nodes must be a positive integer"):
        get_preset("aurora", num_nodes)


def test_with_nodes_replaces_only_the_count() -> None:
    spec = get_preset("aurora")
    assert spec.with_nodes(4) == dataclasses.replace(spec, num_nodes=4)
    with pytest.raises(TopologyError, match="got 0"):
        spec.with_nodes(0)


def test_cluster_latencies_sum_to_the_requested_figures() -> None:
    topology = build_topology(cluster(num_nodes=2, intra_latency_us=30.0, inter_latency_us=80.0))
    intra = topology.route("n0.g0.t0", "n0.g1.t0")
    inter = topology.route("n0.g0.t0", "n1.g1.t0")
    assert topology.route_latency_us(intra) == pytest.approx(30.0)
    assert topology.route_latency_us(inter) == pytest.approx(80.0)
    assert topology.link_attrs(("n0.nic0", "fabric"))[0] == 0.125


def test_cluster_with_one_rank_per_node_has_no_gpu_link() -> None:
    spec = get_preset("cluster")
    one = cluster(num_nodes=3, ranks_per_node=1)
    assert one.gpu_link is None and spec.gpu_link is not None
    assert len(build_topology(one).tiles) == 3


# -- graph ------------------------------------------------------------------------------


def test_aurora_two_nodes_counts(aurora2: Topology) -> None:
    assert len(aurora2.tiles) == 24
    assert aurora2.tiles_per_node == 12 and aurora2.num_nodes == 2
    assert aurora2.tiles[:3] == ("n0.g0.t0", "n0.g0.t1", "n0.g1.t0")
    assert aurora2.tiles[12] == "n1.g0.t0"
    # Per node: host + 6 GPUs + 12 tiles + 8 NICs; plus the fabric.
    assert aurora2.graph.number_of_nodes() == 2 * (1 + 6 + 12 + 8) + 1
    by_kind: dict[str, int] = {}
    for _, _, _, kind in aurora2.links():
        by_kind[kind] = by_kind.get(kind, 0) + 1
    per_node = {
        "tile": 6 * 2,  # one tile pair per GPU, 2 directions
        "port": 12 * 2,
        "gpu": 15 * 2,  # 6 choose 2 Xe Links
        "host": 6 * 2,
        "nic": 8 * 2 + 8 * 2,  # host <-> NIC and NIC <-> fabric
    }
    assert by_kind == {kind: 2 * count for kind, count in per_node.items()}
    assert aurora2.graph.number_of_edges() == 220


def test_vertex_and_edge_attributes(aurora2: Topology) -> None:
    graph = aurora2.graph
    assert graph.nodes["n1"]["kind"] == "node"
    assert graph.nodes["n1.g3"]["kind"] == "gpu"
    assert graph.nodes["n1.g3.t1"]["kind"] == "tile"
    assert graph.nodes["n1.nic7"]["kind"] == "nic"
    assert graph.nodes["fabric"]["kind"] == "switch"
    edge = graph.edges["n0.g0", "n0.g1"]
    assert (edge["bandwidth_gbps"], edge["latency_us"], edge["kind"]) == (15.0, 3.0, "gpu")
    assert aurora2.link_attrs(("n0", "n0.nic2")) == (25.0, 0.0, "nic")
    assert aurora2.link_attrs(("n0.nic2", "fabric")) == (25.0, 1.0, "nic")
    with pytest.raises(TopologyError, match="no link"):
        aurora2.link_attrs(("n0.g0", "n1.g0"))


@pytest.mark.parametrize("name,num_nodes", [("aurora", 3), ("dgx-h100", 2), ("aurora", 1)])
def test_the_graph_holds_the_links_in_the_simulators_order(name: str, num_nodes: int) -> None:
    # The links are laid out without networkx and the graph built from them on first use:
    # its edges are the link table's, in the same order (the order networkx gives a graph
    # built link by link, which the simulator's network and busiest_link follow).
    topology = build_topology(get_preset(name, num_nodes))
    graph = topology.graph
    assert list(graph.edges) == list(topology.link_table().links)
    for u, v, data in graph.edges(data=True):
        assert topology.link_attrs((u, v)) == (data["bandwidth_gbps"], data["latency_us"],
                                               data["kind"])
    assert all("kind" in attrs and "node" in attrs for _, attrs in graph.nodes(data=True))
    assert topology.graph is graph  # built once


def test_a_simulation_needs_no_networkx() -> None:
    code = (
        "import sys; from topology import build_topology, get_preset; "
        "t = build_topology(get_preset('aurora', 2)); t.route('n0.g0.t0', 'n1.g5.t1'); "
        "t.link_table(); assert 'networkx' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_switch_fabric_has_node_switch() -> None:
    topology = build_topology(get_preset("dgx-h100", 2))
    assert topology.graph.nodes["n1.sw"]["kind"] == "switch"
    assert topology.graph.number_of_edges() == 2 * (8 * 2 + 8 * 2 + 8 * 2 + 16 * 2)
    route = topology.route("n0.g2.t0", "n0.g5.t0")
    assert route == (
        ("n0.g2.t0", "n0.g2"),
        ("n0.g2", "n0.sw"),
        ("n0.sw", "n0.g5"),
        ("n0.g5", "n0.g5.t0"),
    )


# -- routes -------------------------------------------------------------------------------


def test_route_same_tile_is_empty(aurora2: Topology) -> None:
    assert aurora2.route("n0.g0.t0", "n0.g0.t0") == ()
    assert aurora2.route_latency_us(()) == 0.0


def test_route_intra_gpu(aurora2: Topology) -> None:
    route = aurora2.route("n1.g2.t1", "n1.g2.t0")
    assert route == (("n1.g2.t1", "n1.g2.t0"),)
    assert kinds(aurora2, route) == ["tile"]
    assert aurora2.tier("n1.g2.t1", "n1.g2.t0") == "intra-gpu"
    assert aurora2.route_latency_us(route) == 2.0


def test_route_intra_node(aurora2: Topology) -> None:
    route = aurora2.route("n0.g0.t1", "n0.g4.t0")
    assert route == (("n0.g0.t1", "n0.g0"), ("n0.g0", "n0.g4"), ("n0.g4", "n0.g4.t0"))
    assert kinds(aurora2, route) == ["port", "gpu", "port"]
    assert aurora2.tier("n0.g0.t1", "n0.g4.t0") == "intra-node"


def test_route_inter_node(aurora2: Topology) -> None:
    route = aurora2.route("n0.g0.t1", "n1.g4.t0")
    assert route == (
        ("n0.g0.t1", "n0.g0"),
        ("n0.g0", "n0"),
        ("n0", "n0.nic1"),
        ("n0.nic1", "fabric"),
        ("fabric", "n1.nic0"),  # local index 8 -> NIC 8 % 8 = 0
        ("n1.nic0", "n1"),
        ("n1", "n1.g4"),
        ("n1.g4", "n1.g4.t0"),
    )
    assert kinds(aurora2, route) == ["port", "host", "nic", "nic", "nic", "nic", "host", "port"]
    assert aurora2.tier("n0.g0.t1", "n1.g4.t0") == "inter-node"
    # 2 x (port 0 + host 1 + host-NIC 0 + NIC 1) + fabric 1.5
    assert aurora2.route_latency_us(route) == pytest.approx(5.5)


def test_routes_are_memoised_and_deterministic(aurora2: Topology) -> None:
    first = aurora2.route("n0.g1.t0", "n1.g5.t1")
    assert aurora2.route("n0.g1.t0", "n1.g5.t1") is first
    fresh = build_topology(get_preset("aurora", 2))
    assert fresh.route("n0.g1.t0", "n1.g5.t1") == first


def test_tiers_constant_and_local_copy_is_no_tier(aurora2: Topology) -> None:
    assert TIERS == ("intra-gpu", "intra-node", "inter-node")
    with pytest.raises(TopologyError, match="to itself"):
        aurora2.tier("n0.g0.t0", "n0.g0.t0")


def test_unknown_tile_is_named(aurora2: Topology) -> None:
    with pytest.raises(TopologyError, match=r"unknown tile 'n2\.g0\.t0'"):
        aurora2.route("n0.g0.t0", "n2.g0.t0")
    with pytest.raises(TopologyError, match="unknown tile 'gpu0'"):
        aurora2.node_of("gpu0")


def test_nic_round_robin(aurora2: Topology) -> None:
    nics = [aurora2.nic_of(tile) for tile in aurora2.tiles[12:]]
    assert nics == [f"n1.nic{k}" for k in (0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3)]
    assert [aurora2.local_index(tile) for tile in aurora2.tiles[12:]] == list(range(12))
    assert aurora2.node_of("n1.g5.t1") == 1
    assert aurora2.gpu_of("n1.g5.t1") == "n1.g5"


def test_nic_of_without_nics() -> None:
    spec = dataclasses.replace(get_preset("aurora"), nics_per_node=0)
    with pytest.raises(TopologyError, match="has no NICs"):
        build_topology(spec).nic_of("n0.g0.t0")


def test_fold_link(aurora2: Topology) -> None:
    assert aurora2.fold_link(("n1.g2", "n1.g3")) == ("n0.g2", "n0.g3")
    assert aurora2.fold_link(("fabric", "n1.nic4")) == ("fabric", "n0.nic4")
    assert aurora2.fold_link(("n1", "n1.nic4")) == ("n0", "n0.nic4")
    assert aurora2.fold_link(("n0.g0.t0", "n0.g0.t1")) == ("n0.g0.t0", "n0.g0.t1")
    with pytest.raises(TopologyError, match="no link"):
        aurora2.fold_link(("n1.g2", "fabric"))
    # Every folded link exists and keeps its attributes.
    for link, bandwidth_gbps, latency_us, kind in aurora2.links():
        folded = aurora2.fold_link(link)
        assert aurora2.link_attrs(folded) == (bandwidth_gbps, latency_us, kind)


def test_folded_route_is_the_route_with_every_link_folded() -> None:
    # Memoised by halves across the fabric: the same as folding the route link by link.
    topology = build_topology(get_preset("aurora", 4))
    tiles = [tile for tile in topology.tiles if tile.endswith(("g0.t0", "g3.t1", "g5.t1"))]
    for period in (1, 2):
        for src in tiles:
            for dst in tiles:
                expected = tuple(topology.fold_link(link, period)
                                 for link in topology.route(src, dst))
                assert topology.folded_route(src, dst, period) == expected


def test_fold_with_ten_nodes_keeps_prefixes_apart() -> None:
    topology = build_topology(get_preset("cluster", 12))
    assert topology.fold_link(("n11.g1", "n11")) == ("n0.g1", "n0")
    assert topology.fold_link(("n1.g1", "n1")) == ("n0.g1", "n0")


def test_build_refuses_invalid_spec() -> None:
    bad = dataclasses.replace(get_preset("aurora"), gpu_link=LinkSpec(-3.0, 1.0))
    with pytest.raises(TopologyError, match=r"negative bandwidth -3.0 GB/s in gpu_link"):
        build_topology(bad)
    with pytest.raises(TopologyError, match="no route from n0.g0.t0 to n1.g0.t0"):
        build_topology(dataclasses.replace(get_preset("cluster"), nics_per_node=0))


# -- placement ----------------------------------------------------------------------------


def test_node_major_placement(aurora2: Topology) -> None:
    placement = Placement.node_major(aurora2)
    assert placement.num_ranks == 24
    assert placement.tile_of(0) == "n0.g0.t0"
    assert placement.tile_of(1) == "n0.g0.t1"
    assert placement.tile_of(13) == "n1.g0.t1"
    assert placement.rank_of("n1.g0.t1") == 13
    assert placement.node_of(11) == 0 and placement.node_of(12) == 1
    assert placement.ranks_per_node == 12
    assert placement.nodes == (0, 1)
    assert placement.is_node_symmetric(aurora2)
    assert placement.representative(13) == 1
    assert placement.representative(5) == 5


def test_partial_placement(aurora2: Topology) -> None:
    placement = Placement.node_major(aurora2, 14)
    assert placement.tiles[-1] == "n1.g0.t1"
    assert placement.ranks_per_node == 12
    assert placement.ranks_on_node(1) == 2 and placement.ranks_on_node(5) == 0
    assert not placement.is_node_symmetric(aurora2)
    assert Placement.node_major(aurora2, 5).is_node_symmetric(aurora2)


def test_symmetric_partial_nodes(aurora2: Topology) -> None:
    # Six ranks on each node, on the same local tiles: symmetric under a node shift.
    tiles = aurora2.tiles[:6] + aurora2.tiles[12:18]
    assert Placement(tiles).is_node_symmetric(aurora2)
    # Same counts, different local tiles on node 1: not symmetric.
    shuffled = aurora2.tiles[:6] + aurora2.tiles[13:19]
    assert not Placement(shuffled).is_node_symmetric(aurora2)
    # Node 1 first: rank 0 is not on node 0.
    assert not Placement(aurora2.tiles[12:] + aurora2.tiles[:12]).is_node_symmetric(aurora2)


@pytest.mark.parametrize("num_ranks", [0, 25, -1])
def test_node_major_refuses_bad_rank_counts(aurora2: Topology, num_ranks: int) -> None:
    with pytest.raises(TopologyError, match=rf"cannot place {num_ranks} ranks.*24 tiles"):
        Placement.node_major(aurora2, num_ranks)


def test_placement_refuses_bad_tiles(aurora2: Topology) -> None:
    with pytest.raises(TopologyError, match="more than one rank"):
        Placement(("n0.g0.t0", "n0.g0.t0"))
    with pytest.raises(TopologyError, match="bad tile name 'gpu0'"):
        Placement(("gpu0",))
    with pytest.raises(TopologyError, match="at least one rank"):
        Placement(())
    placement = Placement(("n0.g0.t0",))
    with pytest.raises(TopologyError, match="rank 1 out of range"):
        placement.tile_of(1)
    with pytest.raises(TopologyError, match="no rank runs on tile"):
        placement.rank_of("n0.g0.t1")


def test_placement_is_hashable_data(aurora2: Topology) -> None:
    a = Placement.node_major(aurora2, 4)
    b = Placement(("n0.g0.t0", "n0.g0.t1", "n0.g1.t0", "n0.g1.t1"))
    assert a == b and hash(a) == hash(b)


# -- resolve and imports ------------------------------------------------------------------


def test_resolve_topology(tmp_path) -> None:
    assert resolve_topology("aurora", 2) == get_preset("aurora", 2)
    with pytest.raises(TopologyError, match=r"unknown topology 'nope'.*aurora.*\.toml"):
        resolve_topology("nope", None)
    with pytest.raises(TopologyError, match="no topology file"):
        resolve_topology(str(tmp_path / "missing.toml"), None)


def test_import_is_light() -> None:
    code = (
        "import sys, topology; "
        "bad = [m for m in ('torch', 'sim', 'transports', 'cocodiff', 'simpy') "
        "if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- property: every pair of tiles has a contiguous route over existing links -------------


@st.composite
def small_specs(draw) -> TopologySpec:
    num_nodes = draw(st.integers(1, 3))
    gpus = draw(st.integers(1, 3))
    tiles = draw(st.integers(1, 3))
    nics = draw(st.integers(1 if num_nodes > 1 else 0, 3))
    link = st.builds(
        LinkSpec,
        st.floats(0.01, 1000.0, allow_nan=False),
        st.floats(0.0, 10.0, allow_nan=False),
    )
    return TopologySpec(
        name="random",
        num_nodes=num_nodes,
        gpus_per_node=gpus,
        tiles_per_gpu=tiles,
        nics_per_node=nics,
        tile_tflops=1.0,
        tile_memory_gbps=1.0,
        tile_link=draw(link) if tiles > 1 else None,
        gpu_link=draw(link) if gpus > 1 else None,
        gpu_fabric=draw(st.sampled_from(("all-to-all", "switch"))),
        port_link=draw(link),
        host_link=draw(link),
        nic_link=draw(link),
        fabric_latency_us=draw(st.floats(0.0, 5.0)),
    )


@settings(max_examples=60, deadline=None)
@given(small_specs())
def test_every_pair_has_a_contiguous_route(spec: TopologySpec) -> None:
    topology = build_topology(spec)
    for src in topology.tiles:
        for dst in topology.tiles:
            route = topology.route(src, dst)
            if src == dst:
                assert route == ()
                continue
            assert route[0][0] == src and route[-1][1] == dst
            for (_, v), (u, _) in zip(route, route[1:], strict=False):
                assert v == u
            assert all(topology.graph.has_edge(*link) for link in route)
            assert len(set(route)) == len(route)
            tier = topology.tier(src, dst)
            assert tier in TIERS
            assert ("fabric" in {v for _, v in route}) == (tier == "inter-node")
            latency = sum(topology.link_attrs(link)[1] for link in route)
            if tier == "inter-node":
                latency += spec.fabric_latency_us
            assert topology.route_latency_us(route) == pytest.approx(latency)
            folded = tuple(topology.fold_link(link) for link in route)
            assert all(topology.graph.has_edge(*link) for link in folded)
