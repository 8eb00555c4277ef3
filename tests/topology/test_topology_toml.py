"""Topology files: round trips, presets as bases, and one clear line for every mistake."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import topology
from topology import (
    PRESETS,
    DeviceRates,
    LinkSpec,
    TopologyError,
    TopologySpec,
    build_topology,
    dump_topology,
    get_preset,
    load_topology,
    resolve_topology,
)

QUAD_TILE = """
name = "quad-tile"

[nodes]
count = 2
gpus = 4
tiles_per_gpu = 4
nics = 4

[tile]
tflops = 200
memory_gbps = 800.0

[links.tile]
bandwidth_gbps = 400.0
latency_us = 1

[links.gpu]
bandwidth_gbps = 100.0
latency_us = 1.0
fabric = "switch"

[links.host]
bandwidth_gbps = 64.0
latency_us = 1.0

[links.nic]
bandwidth_gbps = 50.0
latency_us = 1.0

[fabric]
latency_us = 2.0
"""

# A minimal valid file; the bad-input cases below edit it one key at a time.
GOOD = """
name = "cluster"

[nodes]
count = 2
gpus = 2
tiles_per_gpu = 1
nics = 1

[tile]
tflops = 1.0
memory_gbps = 10.0

[links.gpu]
bandwidth_gbps = 5.0
latency_us = 10.0
fabric = "switch"

[links.host]
bandwidth_gbps = 10.0
latency_us = 0.0

[links.nic]
bandwidth_gbps = 0.125
latency_us = 50.0
"""


def write(tmp_path: Path, text: str, name: str = "cluster.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def edit(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new, 1)


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("num_nodes", [1, 4])
def test_preset_round_trip(tmp_path: Path, name: str, num_nodes: int) -> None:
    spec = get_preset(name, num_nodes)
    assert load_topology(write(tmp_path, dump_topology(spec))) == spec


def test_quad_tile_file(tmp_path: Path) -> None:
    spec = load_topology(write(tmp_path, QUAD_TILE, "quad.toml"))
    assert (spec.num_nodes, spec.gpus_per_node, spec.tiles_per_gpu) == (2, 4, 4)
    assert spec.tile_tflops == 200.0 and isinstance(spec.tile_tflops, float)
    assert spec.port_link == LinkSpec(800.0, 0.0)  # default: the tile's memory rate
    built = build_topology(spec)
    assert len(built.tiles) == 32
    # 4 tiles per GPU: every pair of them is linked directly.
    tile_links = [link for link, _, _, kind in built.links() if kind == "tile"]
    assert len(tile_links) == 2 * 4 * (4 * 3)
    assert built.route("n0.g0.t0", "n0.g0.t3") == (("n0.g0.t0", "n0.g0.t3"),)
    assert load_topology(write(tmp_path, dump_topology(spec), "again.toml")) == spec


def test_num_nodes_argument_overrides_count(tmp_path: Path) -> None:
    path = write(tmp_path, QUAD_TILE, "quad.toml")
    assert load_topology(path, num_nodes=5).num_nodes == 5
    assert resolve_topology(str(path), 3).num_nodes == 3
    with pytest.raises(TopologyError, match="positive integer, got 0"):
        load_topology(path, num_nodes=0)


def test_name_defaults_to_file_stem(tmp_path: Path) -> None:
    spec = load_topology(write(tmp_path, GOOD.replace('name = "cluster"', ""), "lab.toml"))
    assert spec.name == "lab"
    assert spec.fabric_latency_us == 0.0


def test_preset_base_with_overrides(tmp_path: Path) -> None:
    text = 'preset = "aurora"\n[nodes]\ncount = 3\n[links.gpu]\nbandwidth_gbps = 28.0\n'
    spec = load_topology(write(tmp_path, text, "fast.toml"))
    aurora = get_preset("aurora", 3)
    assert spec == dataclasses.replace(aurora, gpu_link=LinkSpec(28.0, aurora.gpu_link.latency_us))


def test_preset_base_drops_links_the_shape_lost(tmp_path: Path) -> None:
    text = 'preset = "aurora"\nname = "one-tile"\n[nodes]\ntiles_per_gpu = 1\ngpus = 1\n'
    spec = load_topology(write(tmp_path, text))
    assert spec.tile_link is None and spec.gpu_link is None
    assert spec.gpu_fabric == "all-to-all"  # kept, and it round-trips
    assert load_topology(write(tmp_path, dump_topology(spec), "again.toml")) == spec


def test_single_gpu_file_without_nics(tmp_path: Path) -> None:
    text = """
[nodes]
gpus = 1
[tile]
tflops = 1
memory_gbps = 5
[links.host]
bandwidth_gbps = 5
latency_us = 0
"""
    spec = load_topology(write(tmp_path, text, "laptop.toml"))
    assert spec.num_nodes == 1 and spec.nics_per_node == 0
    assert build_topology(spec).tiles == ("n0.g0.t0",)
    assert load_topology(write(tmp_path, dump_topology(spec), "again.toml")) == spec


def test_format_document_examples_load(tmp_path: Path) -> None:
    doc = (Path(topology.__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", doc, flags=re.S)
    assert len(blocks) == 4
    specs = [load_topology(write(tmp_path, block, f"ex{i}.toml")) for i, block in enumerate(blocks)]
    assert specs[0] == get_preset("aurora", 8)
    assert specs[1].gpu_link == LinkSpec(28.0, 3.0)
    # [device] over the preset's rates: the one key given replaces that rate.
    h100 = get_preset("dgx-h100", 1).device
    assert specs[2].device == dataclasses.replace(h100, gemm_tflops=650.0)
    assert specs[3].tiles_per_gpu == 4
    for spec in specs:
        build_topology(spec)


@st.composite
def specs(draw) -> TopologySpec:
    number = st.floats(0.001, 1e6, allow_nan=False, allow_infinity=False)
    latency = st.floats(0.0, 1e3, allow_nan=False, allow_infinity=False)
    num_nodes = draw(st.integers(1, 100))
    gpus = draw(st.integers(1, 8))
    tiles = draw(st.integers(1, 4))
    return TopologySpec(
        # A valid spec's name has a visible character (a blank one is refused: see
        # the 'blank name' case below).
        name=draw(st.text(min_size=1, max_size=12).filter(str.strip)),
        num_nodes=num_nodes,
        gpus_per_node=gpus,
        tiles_per_gpu=tiles,
        nics_per_node=draw(st.integers(1 if num_nodes > 1 else 0, 16)),
        tile_tflops=draw(number),
        tile_memory_gbps=draw(number),
        tile_link=LinkSpec(draw(number), draw(latency)) if tiles > 1 else None,
        gpu_link=LinkSpec(draw(number), draw(latency)) if gpus > 1 else None,
        gpu_fabric=draw(st.sampled_from(("all-to-all", "switch"))),
        port_link=LinkSpec(draw(number), draw(latency)),
        host_link=LinkSpec(draw(number), draw(latency)),
        nic_link=LinkSpec(draw(number), draw(latency)),
        fabric_latency_us=draw(latency),
        # Kernel rates of its own (a calibration's [device]), or none.
        device=draw(st.none() | device_rates(number, latency)),
    )


@st.composite
def device_rates(draw, number, latency) -> DeviceRates:
    lengths = sorted(draw(st.sets(st.integers(1, 1 << 20), min_size=1, max_size=5)))
    return DeviceRates(
        name=draw(st.text(min_size=1, max_size=12)), gemm_tflops=draw(number),
        gemm_fixed_us=draw(latency), attention_tflops=tuple((n, draw(number)) for n in lengths),
        memory_gbps=draw(number), sm_count=draw(st.integers(1, 256)), launch_us=draw(latency),
        host_us=draw(latency), compiled_launch_us=draw(latency), compiled_host_us=draw(latency),
        attention_query_factor=tuple(
            (n, draw(st.floats(0.5, 4.0))) for n in
            sorted(draw(st.sets(st.integers(1, 1 << 20), max_size=3)))))


@settings(max_examples=80, deadline=None)
@given(specs())
def test_dump_load_round_trip(tmp_path_factory, spec: TopologySpec) -> None:
    path = tmp_path_factory.mktemp("rt") / "spec.toml"
    path.write_text(dump_topology(spec), encoding="utf-8")
    assert load_topology(path) == spec


# -- bad input: one line naming the value, key and file ------------------------------------

BAD_CASES = {
    "unknown top key": (
        "bogus = 1\n" + GOOD,
        r"unknown key 'bogus' in the top level of .*cluster\.toml \(valid: preset, name",
    ),
    "unknown link key": (
        edit("bandwidth_gbps = 5.0", "bandwith_gbps = 5.0"),
        r"unknown key 'bandwith_gbps' in \[links\.gpu\] of .*cluster\.toml "
        r"\(valid: bandwidth_gbps, latency_us, fabric\)",
    ),
    "unknown link name": (
        GOOD + "\n[links.pcie]\nbandwidth_gbps = 1.0\n",
        r"unknown key 'pcie' in \[links\] .*\(valid: tile, gpu, port, host, nic\)",
    ),
    "bool is not a number": (
        edit("tflops = 1.0", "tflops = true"),
        r"expected a number for tile\.tflops of .*cluster\.toml, got boolean true",
    ),
    "string is not a number": (
        edit("latency_us = 10.0", 'latency_us = "10"'),
        r"expected a number for links\.gpu\.latency_us of .*got string '10'",
    ),
    "float count": (
        edit("gpus = 2", "gpus = 2.0"),
        r"expected an integer for nodes\.gpus of .*cluster\.toml, got float 2\.0",
    ),
    "bool count": (
        edit("nics = 1", "nics = true"),
        r"expected an integer for nodes\.nics of .*got boolean true",
    ),
    "table expected": (
        'tile = "fast"\n' + edit("[tile]\ntflops = 1.0\nmemory_gbps = 10.0", ""),
        r"expected a table for \[tile\] of .*cluster\.toml, got string 'fast'",
    ),
    "missing gpus": (
        edit("gpus = 2\n", ""),
        r"missing key gpus in \[nodes\] of .*cluster\.toml",
    ),
    "missing tile table": (
        edit("[tile]\ntflops = 1.0\nmemory_gbps = 10.0", ""),
        r"missing table \[tile\] of .*cluster\.toml",
    ),
    "missing link key": (
        edit("bandwidth_gbps = 5.0\n", ""),
        r"missing key bandwidth_gbps in \[links\.gpu\] of .*cluster\.toml",
    ),
    "missing host link": (
        edit("[links.host]\nbandwidth_gbps = 10.0\nlatency_us = 0.0", ""),
        r"missing table \[links\.host\] of .*cluster\.toml",
    ),
    "missing nic link": (
        edit("[links.nic]\nbandwidth_gbps = 0.125\nlatency_us = 50.0", ""),
        r"missing table \[links\.nic\] of .*cluster\.toml",
    ),
    "zero nodes": (
        edit("count = 2", "count = 0"),
        r"non-positive count 0 in nodes\.count of .*cluster\.toml",
    ),
    "negative gpus": (
        edit("gpus = 2", "gpus = -1"),
        r"non-positive count -1 in nodes\.gpus of ",
    ),
    "negative nics": (
        edit("nics = 1", "nics = -2"),
        r"negative count -2 in nodes\.nics of ",
    ),
    "negative bandwidth": (
        edit("bandwidth_gbps = 5.0", "bandwidth_gbps = -3.0"),
        r"^negative bandwidth -3\.0 GB/s in \[links\.gpu\] of .*cluster\.toml$",
    ),
    "zero bandwidth": (
        edit("bandwidth_gbps = 0.125", "bandwidth_gbps = 0"),
        r"zero bandwidth 0\.0 GB/s in \[links\.nic\] of .*cluster\.toml",
    ),
    "negative latency": (
        edit("latency_us = 50.0", "latency_us = -1.0"),
        r"negative latency -1\.0 us in \[links\.nic\] of .*cluster\.toml",
    ),
    "nan": (
        edit("tflops = 1.0", "tflops = nan"),
        r"compute rate nan TF/s is not finite in tile\.tflops of .*cluster\.toml",
    ),
    "inf": (
        edit("bandwidth_gbps = 10.0", "bandwidth_gbps = inf"),
        r"bandwidth inf GB/s is not finite in \[links\.host\]",
    ),
    "negative fabric latency": (
        GOOD + "\n[fabric]\nlatency_us = -0.5\n",
        r"negative latency -0\.5 us in fabric\.latency_us of .*cluster\.toml",
    ),
    "zero memory": (
        edit("memory_gbps = 10.0", "memory_gbps = 0.0"),
        r"zero memory bandwidth 0\.0 GB/s in tile\.memory_gbps of ",
    ),
    "unknown fabric": (
        edit('fabric = "switch"', 'fabric = "mesh"'),
        r"unknown GPU fabric 'mesh' in links\.gpu\.fabric of .*cluster\.toml "
        r"\(valid: all-to-all, switch\)",
    ),
    "fabric not a string": (
        edit('fabric = "switch"', "fabric = 3"),
        r"expected a string for links\.gpu\.fabric of .*got integer 3",
    ),
    "huge count": (
        edit("count = 2", "count = 2000000"),
        r"too many tiles: 2000000 nodes x 2 GPUs x 1 tiles = 4000000 > 1000000",
    ),
    "huge integer": (
        edit("tflops = 1.0", "tflops = 9223372036854775807"),
        r"compute rate 9\.22\d*e\+18 TF/s in tile\.tflops of .* is above 1 ZFLOP/s",
    ),
    "subnormal bandwidth": (
        edit("bandwidth_gbps = 5.0", "bandwidth_gbps = 5e-324"),
        r"bandwidth 5e-324 GB/s in \[links\.gpu\] of .* is below 1 B/s",
    ),
    "bandwidth past any machine": (
        edit("bandwidth_gbps = 5.0", "bandwidth_gbps = 1e308"),
        r"bandwidth 1e\+308 GB/s in \[links\.gpu\] of .* is above 1 EB/s",
    ),
    "tiny compute rate": (
        edit("tflops = 1.0", "tflops = 1e-300"),
        r"compute rate 1e-300 TF/s in tile\.tflops of .* is below 1 MFLOP/s",
    ),
    "latency of centuries": (
        edit("latency_us = 10.0", "latency_us = 1e300"),
        r"latency 1e\+300 us in \[links\.gpu\] of .* is above 1 s",
    ),
    "blank name": (
        edit('name = "cluster"', 'name = " "'),
        r"topology name must be a non-empty string, got ' '",
    ),
    "no NICs between nodes": (
        edit("nics = 1", "nics = 0"),
        r"no route from n0\.g0\.t0 to n1\.g0\.t0: 2 nodes but no NICs "
        r"\(nodes\.nics of .*cluster\.toml is 0\)",
    ),
    "no GPU link": (
        edit('[links.gpu]\nbandwidth_gbps = 5.0\nlatency_us = 10.0\nfabric = "switch"\n', ""),
        r"no route from n0\.g0\.t0 to n0\.g1\.t0: 2 GPUs per node but no GPU link "
        r"\(\[links\.gpu\] of .*cluster\.toml\)",
    ),
    "no tile link": (
        edit("tiles_per_gpu = 1", "tiles_per_gpu = 2"),
        r"no route from n0\.g0\.t0 to n0\.g0\.t1: 2 tiles per GPU but no tile link "
        r"\(\[links\.tile\] of .*cluster\.toml\)",
    ),
    "tile link without a second tile": (
        GOOD + "\n[links.tile]\nbandwidth_gbps = 1.0\nlatency_us = 1.0\n",
        r"\[links\.tile\] of .*cluster\.toml sets a link but \[nodes\] has tiles_per_gpu = 1",
    ),
    "unknown preset": (
        'preset = "frontier"\n',
        r"unknown preset 'frontier' in .*cluster\.toml "
        r"\(valid: a100-nvlink, aurora, cluster, cluster-local, dgx-a100, dgx-h100, "
        r"l40-pcie\)",
    ),
    "empty name": (
        edit('name = "cluster"', 'name = ""'),
        r"topology name must be a non-empty string, got ''",
    ),
    "syntax error": (
        edit("gpus = 2", "gpus = = 2"),
        r"invalid TOML in .*cluster\.toml: .*\(at line 6, column 8\)",
    ),
    "duplicate table": (
        GOOD + "\n[nodes]\ngpus = 3\n",
        r"invalid TOML in .*cluster\.toml",
    ),
    "empty file": ("", r"empty topology file .*cluster\.toml"),
    "only comments": ("# nothing here\n", r"empty topology file"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input(tmp_path: Path, case: str) -> None:
    text, pattern = BAD_CASES[case]
    path = write(tmp_path, text)
    with pytest.raises(TopologyError, match=pattern) as info:
        load_topology(path)
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"no topology file .*nope\.toml"):
        load_topology(tmp_path / "nope.toml")


def test_directory_and_binary_files(tmp_path: Path) -> None:
    directory = tmp_path / "dir.toml"
    directory.mkdir()
    with pytest.raises(TopologyError, match="cannot read topology file"):
        load_topology(directory)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00name")
    with pytest.raises(TopologyError, match="not UTF-8 text"):
        load_topology(binary)


def test_huge_integer_out_of_float_range(tmp_path: Path) -> None:
    # tomllib accepts integers of any size; float() of this one would overflow.
    path = write(tmp_path, edit("tflops = 1.0", "tflops = 1" + "0" * 400))
    with pytest.raises(TopologyError, match=r"number 10+ out of range in tile\.tflops of "):
        load_topology(path)


def test_dump_refuses_invalid_spec() -> None:
    bad = dataclasses.replace(get_preset("aurora"), gpu_fabric="torus")
    with pytest.raises(TopologyError, match="unknown GPU fabric 'torus'"):
        dump_topology(bad)
