"""Topology files: a machine written in TOML.

A file describes one node and how many of them there are; every node is identical::

    # optional: start from a preset and override only what differs
    preset = "aurora"
    name = "aurora"            # label for reports (default: the preset's, else the file stem)

    [nodes]
    count = 8                  # nodes (default 1; ``num_nodes`` given to the loader wins)
    gpus = 6                   # GPUs per node (required)
    tiles_per_gpu = 2          # tiles (stacks) per GPU, one rank each (default 1)
    nics = 8                   # NICs per node (default 0: single node only)

    [tile]
    tflops = 256.0             # dense bf16 TFLOP/s of one tile (required)
    memory_gbps = 1000.0       # HBM GB/s of one tile (required)
    step_overhead_us = 4500.0  # compute per denoising step outside the transformer's blocks
                               # (embedders, norm_out/proj_out, scheduler), at one core on a
                               # host; once per step per rank (default 0: not charged)
    step_overhead_sequence_us = 9000.0  # what that work adds per whole sample's sequence a
                               # rank carries: charged x its share (1/P under Ulysses over
                               # P ranks, 1/u in a PipeFusion stage of u; default 0)
    device = "h100-sxm"        # kernel rates of the tile (topology.DEVICES; "roofline": none,
                               # price compute by tflops and memory_gbps; default: the
                               # preset's, else none)
    memory_gb = 80.0           # device memory of one tile, GB; the planner refuses layouts
                               # that do not fit (default 0: not known, nothing refused)

    [device]                   # optional: the tile's kernel rates written out (what
                               # `cocodiff calibrate` measured; topology.DeviceRates). Each
                               # key replaces that rate of [tile] device's (or the preset's)
                               # rates; without either, every key is required
    name = "calibrated-cpu"
    gemm_tflops = 0.1          # matrix products' achieved TFLOP/s (slope of t = F / R + t0)
    gemm_fixed_us = 2.6        # a matrix product's fixed time t0, us
    attention_tflops = [[20, 0.0056], [80, 0.029]]  # (sequence length, TFLOP/s), ascending
    attention_query_factor = [[10, 1.2], [80, 1.0]]  # optional: (query tokens, time factor)
                               # of attention with fewer queries than keys (default: none)
    memory_gbps = 6.9          # elementwise kernels' GB/s
    sm_count = 1               # units thread blocks spread over (SMs; 1 on a CPU)
    launch_us = 1.5            # device time per kernel launch, us
    host_us = 0.0              # host CPU time to issue one op, us (0: the device is the host)
    compiled_launch_us = 1.5   # the same under torch.compile
    compiled_host_us = 0.0

    [links.tile]               # every two tiles of one GPU; required iff tiles_per_gpu > 1
    bandwidth_gbps = 185.0     # GB/s per direction
    latency_us = 2.0

    [links.gpu]                # GPU <-> GPU; required iff gpus > 1
    bandwidth_gbps = 15.0      # per GPU pair ("all-to-all") or per GPU switch port ("switch")
    latency_us = 3.0           # per link crossed: "switch" routes cross two
    fabric = "all-to-all"      # or "switch" (default)

    [links.port]               # tile <-> its GPU (default: the tile's memory_gbps, 0 us)
    [links.host]               # GPU <-> node host, PCIe (required)
    [links.nic]                # one NIC <-> fabric switch; required iff nics > 0
                               # (with nics = 0 it defaults to the host link, unused)

    [fabric]
    latency_us = 1.5           # inter-node switch traversal (default 0)

    [host]                     # optional: the CPU the ranks share (topology.spec.HostSpec)
    cores = 2                  # cores of one host (required in the table)
    ranks_per_host = 4         # consecutive ranks per host (default: every rank on one host)
    compute_core_demand = 1.0  # cores a rank's compute occupies: 1 CPU ranks, 0 accelerators
    call_cpu_us = 300.0        # CPU per exchange call (each TAPA phase is one; default 0)
    call_wait_us = 500.0       # a call done while every core is busy waits this (no CPU; default 0)
    follow_wait_us = 100.0     # a call made straight after another waits this (no CPU; default 0)
    wake_cpu_us = 150.0        # of call_cpu_us, spent only waking a rank blocked on it (default 0)
    codec_cpu_us = 80.0        # CPU of V-Major's codec per selective message, each end (default 0)
    phase_cpu_us = 100.0       # CPU per TAPA phase beyond its call's price (default 0)
    diffusers_call_cpu_us = 450.0  # CPU per call of diffusers' baseline (default: call_cpu_us)
    message_cpu_us = 30.0      # CPU per message sent or received in an exchange (default 0)
    copy_gbps = 2.0            # GB/s one core moves exchange bytes (default: bytes are free)
    busy_poll = false          # a rank blocked on an exchange spins on a core (MPI progress)
    late_peer_first = false    # a pair exchange moves a late rank's data before the other's
    compute_among_calls = 1.2  # compute's CPU among exchange calls over alone (default 1)
    transfer_cores = 0.5       # cores lost to transfers across nodes while one runs (default 0)

Without ``[host]`` every rank has its own device and free message handling.

Every ``[links.*]`` table takes ``bandwidth_gbps`` (> 0) and ``latency_us`` (>= 0). Numbers
may be integers or floats, never booleans; counts are integers. With ``preset``, a table
or key that is left out keeps the preset's value, and a link the new shape no longer has
(``tiles_per_gpu = 1`` on an Aurora base drops its tile link) is dropped with it; a
``[links.gpu]`` table holding only ``fabric`` is allowed for one GPU per node, so that
every spec round-trips through :func:`dump_topology`.

Every problem raises :class:`TopologyError` with one line naming the value, the key and
the file. See the "Topology files" section of README.md for complete examples.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from topology.errors import TopologyError
from topology.presets import DEVICES, PRESETS
from topology.spec import (
    HOST_FIELDS,
    DeviceRates,
    HostSpec,
    LinkSpec,
    TopologySpec,
    check_device_rates,
    check_num_nodes,
    validate_spec,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

_TOP_KEYS = ("preset", "name", "nodes", "tile", "links", "fabric", "host", "device")
_NODES_KEYS = ("count", "gpus", "tiles_per_gpu", "nics")
_TILE_KEYS = ("tflops", "memory_gbps", "step_overhead_us", "step_overhead_sequence_us",
              "device", "memory_gb")
_LINK_NAMES = ("tile", "gpu", "port", "host", "nic")
_LINK_KEYS = ("bandwidth_gbps", "latency_us")
_GPU_LINK_KEYS = (*_LINK_KEYS, "fabric")
_FABRIC_KEYS = ("latency_us",)
_DEVICE_NUMBERS = ("gemm_tflops", "gemm_fixed_us", "memory_gbps", "launch_us", "host_us",
                   "compiled_launch_us", "compiled_host_us")
_DEVICE_KEYS = ("name", *_DEVICE_NUMBERS, "sm_count", "attention_tflops",
                "attention_query_factor")

# Spec field -> (TOML table, key or None for a whole link table).
_FIELD_KEYS: dict[str, tuple[str, str | None]] = {
    "num_nodes": ("nodes", "count"),
    "gpus_per_node": ("nodes", "gpus"),
    "tiles_per_gpu": ("nodes", "tiles_per_gpu"),
    "nics_per_node": ("nodes", "nics"),
    "tile_tflops": ("tile", "tflops"),
    "tile_memory_gbps": ("tile", "memory_gbps"),
    "tile_step_overhead_us": ("tile", "step_overhead_us"),
    "tile_step_overhead_sequence_us": ("tile", "step_overhead_sequence_us"),
    "device": ("tile", "device"),
    "tile_memory_gb": ("tile", "memory_gb"),
    "tile_link": ("links.tile", None),
    "gpu_link": ("links.gpu", None),
    "gpu_fabric": ("links.gpu", "fabric"),
    "port_link": ("links.port", None),
    "host_link": ("links.host", None),
    "nic_link": ("links.nic", None),
    "fabric_latency_us": ("fabric", "latency_us"),
    **{f"host.{key}": ("host", key) for key in HOST_FIELDS},
}


def load_topology(path: str | Path, num_nodes: int | None = None) -> TopologySpec:
    """Read and validate a topology file.

    Args:
        path: the ``.toml`` file.
        num_nodes: overrides ``[nodes] count`` when given.

    Returns:
        The validated spec.

    Raises:
        TopologyError: a missing, unreadable, unparsable or invalid file; one line
            naming the file, the key and the value.
    """
    path = Path(path)
    if num_nodes is not None:
        check_num_nodes(num_nodes)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise TopologyError(f"no topology file {path}") from None
    except UnicodeDecodeError as err:
        raise TopologyError(f"topology file {path} is not UTF-8 text: {err.reason}") from None
    except OSError as err:
        raise TopologyError(f"cannot read topology file {path}: {err.strerror}") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise TopologyError(f"invalid TOML in {path}: {err}") from None
    except RecursionError:  # tomllib recurses once per nesting level of arrays and tables
        raise TopologyError(f"invalid TOML in {path}: nested too deeply") from None
    if not doc:
        raise TopologyError(f"empty topology file {path}: expected at least [nodes] and [tile]")
    return _Loader(doc, str(path), path.stem).spec(num_nodes)


def dump_topology(spec: TopologySpec) -> str:
    """The TOML text of ``spec``; ``load_topology`` of it gives ``spec`` back.

    Raises:
        TopologyError: ``spec`` is invalid.
    """
    validate_spec(spec)
    lines = [
        '# CoCoDiff topology file (format: README.md, "Topology files")',
        f"name = {_toml_string(spec.name)}",
        "",
        "[nodes]",
        f"count = {spec.num_nodes}",
        f"gpus = {spec.gpus_per_node}",
        f"tiles_per_gpu = {spec.tiles_per_gpu}",
        f"nics = {spec.nics_per_node}",
        "",
        "[tile]",
        f"tflops = {_toml_float(spec.tile_tflops)}",
        f"memory_gbps = {_toml_float(spec.tile_memory_gbps)}",
    ]
    if spec.tile_step_overhead_us:  # 0 is the default: files without it stay as they were
        lines.append(f"step_overhead_us = {_toml_float(spec.tile_step_overhead_us)}")
    if spec.tile_step_overhead_sequence_us:
        lines.append("step_overhead_sequence_us = "
                     f"{_toml_float(spec.tile_step_overhead_sequence_us)}")
    device = spec.device
    preset_device = device is not None and DEVICES.get(device.name) == device
    if device is not None and preset_device:
        lines.append(f"device = {_toml_string(device.name)}")
    if spec.tile_memory_gb:  # 0 (not known) is the default
        lines.append(f"memory_gb = {_toml_float(spec.tile_memory_gb)}")

    def link_table(name: str, link: LinkSpec | None, extra: str = "") -> None:
        if link is None and not extra:
            return
        lines.extend(["", f"[links.{name}]"])
        if link is not None:
            lines.append(f"bandwidth_gbps = {_toml_float(link.bandwidth_gbps)}")
            lines.append(f"latency_us = {_toml_float(link.latency_us)}")
        if extra:
            lines.append(extra)

    link_table("tile", spec.tile_link)
    # "switch" is the default fabric: only say so when there is a GPU link to describe.
    fabric = f"fabric = {_toml_string(spec.gpu_fabric)}"
    if spec.gpu_link is None and spec.gpu_fabric == "switch":
        fabric = ""
    link_table("gpu", spec.gpu_link, fabric)
    link_table("port", spec.port_link)
    link_table("host", spec.host_link)
    link_table("nic", spec.nic_link)
    lines.extend(["", "[fabric]", f"latency_us = {_toml_float(spec.fabric_latency_us)}"])
    if spec.host is not None:
        lines.extend(_host_lines(spec.host))
    if device is not None and not preset_device:
        lines.extend(device_lines(device))
    lines.append("")
    return "\n".join(lines)


def device_lines(rates: DeviceRates) -> list[str]:
    """The ``[device]`` table of ``rates`` (every key: it loads without a base device)."""
    def pairs(table: tuple[tuple[int, float], ...]) -> str:
        return "[" + ", ".join(f"[{key}, {_toml_float(value)}]" for key, value in table) + "]"

    lines = ["", "[device]", f"name = {_toml_string(rates.name)}",
             *(f"{key} = {_toml_float(getattr(rates, key))}" for key in _DEVICE_NUMBERS),
             f"sm_count = {rates.sm_count}", f"attention_tflops = {pairs(rates.attention_tflops)}"]
    if rates.attention_query_factor:
        lines.append(f"attention_query_factor = {pairs(rates.attention_query_factor)}")
    return lines


def _host_lines(host: HostSpec) -> list[str]:
    lines = ["", "[host]", f"cores = {_toml_float(host.cores)}"]
    if host.ranks_per_host is not None:
        lines.append(f"ranks_per_host = {host.ranks_per_host}")
    lines.append(f"compute_core_demand = {_toml_float(host.compute_core_demand)}")
    if host.call_cpu_us:
        lines.append(f"call_cpu_us = {_toml_float(host.call_cpu_us)}")
    if host.call_wait_us:
        lines.append(f"call_wait_us = {_toml_float(host.call_wait_us)}")
    if host.follow_wait_us:
        lines.append(f"follow_wait_us = {_toml_float(host.follow_wait_us)}")
    if host.wake_cpu_us:
        lines.append(f"wake_cpu_us = {_toml_float(host.wake_cpu_us)}")
    if host.codec_cpu_us:
        lines.append(f"codec_cpu_us = {_toml_float(host.codec_cpu_us)}")
    if host.phase_cpu_us:
        lines.append(f"phase_cpu_us = {_toml_float(host.phase_cpu_us)}")
    if host.diffusers_call_cpu_us is not None:
        lines.append(f"diffusers_call_cpu_us = {_toml_float(host.diffusers_call_cpu_us)}")
    lines.append(f"message_cpu_us = {_toml_float(host.message_cpu_us)}")
    if host.copy_gbps is not None:
        lines.append(f"copy_gbps = {_toml_float(host.copy_gbps)}")
    lines.append(f"busy_poll = {'true' if host.busy_poll else 'false'}")
    if host.late_peer_first:
        lines.append("late_peer_first = true")
    if host.compute_among_calls != 1.0:
        lines.append(f"compute_among_calls = {_toml_float(host.compute_among_calls)}")
    if host.transfer_cores:
        lines.append(f"transfer_cores = {_toml_float(host.transfer_cores)}")
    return lines


class _Loader:
    """Turns one parsed document into a spec, checking each key where it is read."""

    def __init__(self, doc: dict[str, Any], file: str, stem: str) -> None:
        self.doc = doc
        self.file = file
        self.stem = stem

    def where(self, table: str | None, key: str | None = None) -> str:
        """``"nodes.count of f.toml"`` for a key, ``"[links.gpu] of f.toml"`` for a table."""
        if table is None:
            return f"{key} of {self.file}"
        if key is None:
            return f"[{table}] of {self.file}"
        return f"{table}.{key} of {self.file}"

    def spec(self, num_nodes: int | None) -> TopologySpec:
        doc = self.doc
        self.check_keys(doc, None, _TOP_KEYS)
        base = self.base()
        name = self.string(doc, None, "name")
        if name is None:
            name = base.name if base is not None else self.stem

        nodes = self.table(doc, "nodes", required=base is None)
        self.check_keys(nodes, "nodes", _NODES_KEYS)
        count = self.count(nodes, "nodes", "count", base.num_nodes if base else 1, 1)
        if num_nodes is not None:
            count = num_nodes
        gpus = self.count(nodes, "nodes", "gpus", base.gpus_per_node if base else None, 1)
        tiles = self.count(nodes, "nodes", "tiles_per_gpu", base.tiles_per_gpu if base else 1, 1)
        nics = self.count(nodes, "nodes", "nics", base.nics_per_node if base else 0, 0)

        tile = self.table(doc, "tile", required=base is None)
        self.check_keys(tile, "tile", _TILE_KEYS)
        tflops = self.number(tile, "tile", "tflops", base.tile_tflops if base else None)
        memory_gbps = self.number(
            tile, "tile", "memory_gbps", base.tile_memory_gbps if base else None
        )
        step_overhead_us = self.number(
            tile, "tile", "step_overhead_us", base.tile_step_overhead_us if base else 0.0
        )
        step_overhead_sequence_us = self.number(
            tile, "tile", "step_overhead_sequence_us",
            base.tile_step_overhead_sequence_us if base else 0.0)
        memory_gb = self.number(tile, "tile", "memory_gb", base.tile_memory_gb if base else 0.0)
        # The tile's kernel rates (cocodiff.kernels) by device name; "roofline" drops a
        # preset's, pricing compute by tflops and memory_gbps alone.
        device_name = self.string(tile, "tile", "device")
        if device_name is None:
            device = base.device if base else None
        elif device_name == "roofline":
            device = None
        elif device_name in DEVICES:
            device = DEVICES[device_name]
        else:
            raise TopologyError(
                f"unknown device {device_name!r} in {self.where('tile', 'device')} "
                f"(valid: {', '.join(sorted(DEVICES))}, roofline)"
            )
        if "device" in self.doc and device_name == "roofline":
            raise TopologyError(f"{self.where('tile', 'device')} is \"roofline\" but "
                                f"{self.where('device')} sets kernel rates: keep one")
        device = self.device(device)

        links = self.table(doc, "links")
        self.check_keys(links, "links", _LINK_NAMES)
        link_tables = {}
        for link_name in _LINK_NAMES:
            table = self.table(links, f"links.{link_name}", key=link_name)
            keys = _GPU_LINK_KEYS if link_name == "gpu" else _LINK_KEYS
            self.check_keys(table, f"links.{link_name}", keys)
            link_tables[link_name] = table

        tile_link = self.optional_link(
            link_tables["tile"],
            "tile",
            tiles > 1,
            base.tile_link if base else None,
            f"tiles_per_gpu = {tiles}",
        )
        gpu_table = link_tables["gpu"]
        fabric_name = self.string(gpu_table, "links.gpu", "fabric")
        if fabric_name is None:
            fabric_name = base.gpu_fabric if base else "switch"
        gpu_link = self.optional_link(
            {k: v for k, v in gpu_table.items() if k != "fabric"},
            "gpu",
            gpus > 1,
            base.gpu_link if base else None,
            f"gpus = {gpus}",
        )
        port_link = self.link(
            link_tables["port"], "port", base.port_link if base else LinkSpec(memory_gbps, 0.0)
        )
        host_link = self.link(link_tables["host"], "host", base.host_link if base else None)
        nic_default = base.nic_link if base else (host_link if nics == 0 else None)
        nic_link = self.link(link_tables["nic"], "nic", nic_default)

        fabric = self.table(doc, "fabric")
        self.check_keys(fabric, "fabric", _FABRIC_KEYS)
        fabric_latency = self.number(
            fabric, "fabric", "latency_us", base.fabric_latency_us if base else 0.0
        )

        host = self.host(base.host if base else None)

        spec = TopologySpec(
            name=name,
            num_nodes=count,
            gpus_per_node=gpus,
            tiles_per_gpu=tiles,
            nics_per_node=nics,
            tile_tflops=tflops,
            tile_memory_gbps=memory_gbps,
            tile_link=tile_link,
            gpu_link=gpu_link,
            gpu_fabric=fabric_name,
            port_link=port_link,
            host_link=host_link,
            nic_link=nic_link,
            fabric_latency_us=fabric_latency,
            host=host,
            tile_step_overhead_us=step_overhead_us,
            tile_step_overhead_sequence_us=step_overhead_sequence_us,
            device=device,
            tile_memory_gb=memory_gb,
        )
        locations = {field: self.where(*table_key) for field, table_key in _FIELD_KEYS.items()}
        validate_spec(spec, locations)
        return spec

    # -- pieces -----------------------------------------------------------------------

    def base(self) -> TopologySpec | None:
        preset = self.string(self.doc, None, "preset")
        if preset is None:
            return None
        factory = PRESETS.get(preset)
        if factory is None:
            raise TopologyError(
                f"unknown preset {preset!r} in {self.file} (valid: {', '.join(sorted(PRESETS))})"
            )
        return factory()

    def device(self, base: DeviceRates | None) -> DeviceRates | None:
        """The ``[device]`` table over ``base`` (``[tile] device``'s or the preset's
        rates): each key given replaces that rate; without a base every key is needed."""
        table = self.table(self.doc, "device")
        self.check_keys(table, "device", _DEVICE_KEYS)
        if not table:
            return base
        where = self.where("device")
        name = self.string(table, "device", "name")
        values: dict[str, Any] = {
            "name": name if name is not None else (base.name if base else "custom")}
        for key in _DEVICE_NUMBERS:
            values[key] = self.number(table, "device", key,
                                      getattr(base, key) if base else None)
        values["sm_count"] = self.count(table, "device", "sm_count",
                                        base.sm_count if base else None, 1)
        attention = table.get("attention_tflops")
        if attention is None:
            if base is None:
                raise TopologyError(f"missing key attention_tflops in {where}")
            values["attention_tflops"] = base.attention_tflops
        else:
            values["attention_tflops"] = self.pairs(attention, "attention_tflops",
                                                    "[[length, TFLOP/s], ...]")
        factors = table.get("attention_query_factor")
        values["attention_query_factor"] = (
            (base.attention_query_factor if base else ()) if factors is None else
            self.pairs(factors, "attention_query_factor", "[[query tokens, factor], ...]"))
        rates = DeviceRates(**values)
        check_device_rates(rates, where)
        return rates

    def pairs(self, value: object, key: str, shape: str) -> tuple[tuple[int, float], ...]:
        """``[[int, number], ...]`` of ``[device] key`` as a tuple of pairs."""
        pairs = []
        for pair in value if isinstance(value, list) else [None]:
            if (not isinstance(pair, list) or len(pair) != 2
                    or isinstance(pair[0], bool) or not isinstance(pair[0], int)
                    or isinstance(pair[1], bool) or not isinstance(pair[1], (int, float))):
                raise TopologyError(f"expected {shape} for {self.where('device', key)}, got "
                                    f"{_describe(value)}")
            pairs.append((pair[0], float(pair[1])))
        return tuple(pairs)

    def host(self, default: HostSpec | None) -> HostSpec | None:
        """The ``[host]`` table over the preset's host (if any); None without either."""
        table = self.table(self.doc, "host")
        self.check_keys(table, "host", HOST_FIELDS)
        if not table:
            return default
        base = default or HostSpec(cores=table.get("cores", 0))
        ranks = table.get("ranks_per_host", base.ranks_per_host)
        if ranks is not None:
            ranks = self.count(table, "host", "ranks_per_host", base.ranks_per_host, 1)
        copy_gbps = table.get("copy_gbps", base.copy_gbps)
        if copy_gbps is not None:
            copy_gbps = self.number(table, "host", "copy_gbps", base.copy_gbps)
        diffusers_call = table.get("diffusers_call_cpu_us", base.diffusers_call_cpu_us)
        if diffusers_call is not None:
            diffusers_call = self.number(table, "host", "diffusers_call_cpu_us",
                                         base.diffusers_call_cpu_us)
        return HostSpec(
            cores=self.number(table, "host", "cores", default.cores if default else None),
            ranks_per_host=ranks,
            compute_core_demand=self.number(table, "host", "compute_core_demand",
                                            base.compute_core_demand),
            call_cpu_us=self.number(table, "host", "call_cpu_us", base.call_cpu_us),
            call_wait_us=self.number(table, "host", "call_wait_us", base.call_wait_us),
            follow_wait_us=self.number(table, "host", "follow_wait_us", base.follow_wait_us),
            wake_cpu_us=self.number(table, "host", "wake_cpu_us", base.wake_cpu_us),
            codec_cpu_us=self.number(table, "host", "codec_cpu_us", base.codec_cpu_us),
            phase_cpu_us=self.number(table, "host", "phase_cpu_us", base.phase_cpu_us),
            diffusers_call_cpu_us=diffusers_call,
            message_cpu_us=self.number(table, "host", "message_cpu_us", base.message_cpu_us),
            copy_gbps=copy_gbps,
            busy_poll=self.flag(table, "host", "busy_poll", base.busy_poll),
            late_peer_first=self.flag(table, "host", "late_peer_first", base.late_peer_first),
            compute_among_calls=self.number(table, "host", "compute_among_calls",
                                            base.compute_among_calls),
            transfer_cores=self.number(table, "host", "transfer_cores", base.transfer_cores),
        )

    def flag(self, doc: dict[str, Any], table: str, key: str, default: bool) -> bool:
        value = doc.get(key, default)
        if not isinstance(value, bool):
            raise TopologyError(f"expected true or false for {self.where(table, key)}, got "
                                f"{_describe(value)}")
        return value

    def check_keys(self, doc: dict[str, Any], table: str | None, valid: tuple[str, ...]) -> None:
        for key in doc:
            if key not in valid:
                place = self.where(table) if table else f"the top level of {self.file}"
                raise TopologyError(f"unknown key {key!r} in {place} (valid: {', '.join(valid)})")

    def table(
        self, doc: dict[str, Any], name: str, *, key: str | None = None, required: bool = False
    ) -> dict[str, Any]:
        value = doc.get(key or name)
        if value is None:
            if required:
                raise TopologyError(f"missing table {self.where(name)}")
            return {}
        if not isinstance(value, dict):
            raise TopologyError(f"expected a table for {self.where(name)}, got {_describe(value)}")
        return value

    def string(self, doc: dict[str, Any], table: str | None, key: str) -> str | None:
        value = doc.get(key)
        if value is not None and not isinstance(value, str):
            raise TopologyError(
                f"expected a string for {self.where(table, key)}, got {_describe(value)}"
            )
        return value

    def count(
        self, doc: dict[str, Any], table: str, key: str, default: int | None, minimum: int
    ) -> int:
        value = doc.get(key, default)
        if value is None:
            raise TopologyError(f"missing key {key} in [{table}] of {self.file}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise TopologyError(
                f"expected an integer for {self.where(table, key)}, got {_describe(value)}"
            )
        if value < minimum:
            problem = "non-positive" if minimum == 1 else "negative"
            raise TopologyError(f"{problem} count {value} in {self.where(table, key)}")
        return value

    def number(self, doc: dict[str, Any], table: str, key: str, default: float | None) -> float:
        value = doc.get(key, default)
        if value is None:
            raise TopologyError(f"missing key {key} in [{table}] of {self.file}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TopologyError(
                f"expected a number for {self.where(table, key)}, got {_describe(value)}"
            )
        if isinstance(value, int) and abs(value) > 1e300:  # float() would overflow
            raise TopologyError(f"number {value} out of range in {self.where(table, key)}")
        return float(value)

    def link(self, table: dict[str, Any], name: str, default: LinkSpec | None) -> LinkSpec:
        where = f"links.{name}"
        if not table and default is None:
            raise TopologyError(
                f"missing table {self.where(where)} (keys: bandwidth_gbps, latency_us)"
            )
        return LinkSpec(
            bandwidth_gbps=self.number(
                table, where, "bandwidth_gbps", default.bandwidth_gbps if default else None
            ),
            latency_us=self.number(
                table, where, "latency_us", default.latency_us if default else None
            ),
        )

    def optional_link(
        self,
        table: dict[str, Any],
        name: str,
        needed: bool,
        default: LinkSpec | None,
        shape: str,
    ) -> LinkSpec | None:
        """A tile or GPU link: present iff the node has two of the parts it joins."""
        if not needed:
            if table:
                raise TopologyError(
                    f"{self.where(f'links.{name}')} sets a link but [nodes] has {shape}"
                )
            return None  # a preset's link that the new shape no longer has is dropped
        if not table and default is None:
            return None  # validate_spec then names the tiles that cannot reach each other
        return self.link(table, name, default)


def _describe(value: object) -> str:
    kind = {
        bool: "boolean",
        int: "integer",
        float: "float",
        str: "string",
        list: "array",
        dict: "table",
    }.get(type(value), type(value).__name__)
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (dict, list)):
        return kind
    return f"{kind} {value!r}"


def _toml_float(value: float) -> str:
    """A TOML float that reads back as exactly ``value``: repr is round-trip exact and
    valid TOML for finite floats (``1e-05``, ``2.5e+20``)."""
    return repr(float(value))


def _toml_string(value: str) -> str:
    """A TOML basic string: escape quote, backslash and control characters."""
    out = ['"']
    for char in value:
        code = ord(char)
        if char == '"':
            out.append('\\"')
        elif char == "\\":
            out.append("\\\\")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04X}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)
