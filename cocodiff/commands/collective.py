"""``cocodiff collective``: an all-to-all microbenchmark in simulation, as nccl-tests runs
one on a machine: per size, the simulated time, algbw and busbw (nccl-tests convention,
:mod:`cocodiff.simulator.collective`).

Everything is validated before any simulation runs; the JSON file is written only once
every row exists.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from cocodiff.commands.plan import COLLECTIVE_HELP
from cocodiff.util.errors import CocodiffError

OPS = ("all-to-all",)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 10**3, "KIB": 1 << 10, "M": 1 << 20, "MB": 10**6,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30}
_SIZE = re.compile(r"\s*([-+]?\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
# More bytes than any device holds: a typo, not a benchmark.
MAX_BYTES = 1 << 40


def parse_sizes(text: str) -> list[int]:
    """``"1MiB,2MiB,4MiB"`` -> bytes. Units: B, K/KiB, M/MiB, G/GiB (powers of 2), KB,
    MB, GB (powers of 10); none means bytes.

    Raises:
        CocodiffError: an unparsable size, a size <= 0 or beyond :data:`MAX_BYTES`.
    """
    sizes = []
    for item in text.split(","):
        match = _SIZE.fullmatch(item)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise CocodiffError(f"cannot parse size {item.strip()!r} in --bytes (e.g. 4096, "
                                "64KiB, 1MiB, 2GB)")
        num_bytes = float(match.group(1)) * _UNITS[unit]
        if not num_bytes.is_integer() or not 0 < num_bytes <= MAX_BYTES:
            raise CocodiffError(f"--bytes {item.strip()!r}: sizes must be a whole number of "
                                f"bytes in 1..{MAX_BYTES}")
        sizes.append(int(num_bytes))
    return sizes


def add_collective_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    parser.add_argument("--topology", default="aurora",
                        help="a preset (aurora, dgx-h100, cluster) or a topology TOML file "
                        "(default: aurora)")
    parser.add_argument("--nodes", type=positive_int, default=None,
                        help="number of nodes; one rank per tile (default: the preset's or "
                        "file's)")
    parser.add_argument("--op", default="all-to-all",
                        help=f"the collective: {', '.join(OPS)} (default: all-to-all)")
    parser.add_argument("--bytes", default="1MiB,2MiB,4MiB",
                        help="bytes per rank (nccl-tests' size), comma-separated, e.g. "
                        "1MiB,2MiB,4MiB (default)")
    parser.add_argument("--schedule", default="flat",
                        help="flat (every block sent directly) or tapa (topology-aligned "
                        "phases); default: flat")
    parser.add_argument("--collective", default="auto", metavar="auto|NAME|FILE.json",
                        help=COLLECTIVE_HELP)
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")


def collective_command(args: argparse.Namespace) -> int:
    from cocodiff.commands.plan import collective_arg
    from cocodiff.simulator.collective import SCHEDULES, simulate_all_to_all
    from cocodiff.util.atomic import atomic_write_text, check_output_paths
    from topology import build_topology, resolve_topology
    from transports.sim import collective_model_for

    check_output_paths((args.json,))
    if args.op not in OPS:
        raise CocodiffError(f"unknown --op {args.op!r}; valid: {', '.join(OPS)}")
    if args.schedule not in SCHEDULES:
        raise CocodiffError(f"unknown --schedule {args.schedule!r}; valid: "
                            f"{', '.join(SCHEDULES)}")
    sizes = parse_sizes(args.bytes)
    collective = collective_arg(args)
    topology = build_topology(resolve_topology(args.topology, args.nodes))
    ranks = len(topology.tiles)
    if ranks < 2:
        raise CocodiffError(f"an all-to-all needs at least 2 ranks; {topology.spec.name} has "
                            f"{ranks}")
    too_small = [size for size in sizes if size < ranks]
    if too_small:
        raise CocodiffError(f"--bytes {too_small[0]}: less than one byte for each of "
                            f"{ranks} ranks")
    model = collective or collective_model_for(topology.spec.name)
    rows = [simulate_all_to_all(topology, size, args.schedule, model) for size in sizes]
    spec = topology.spec
    print(f"# {args.op} ({args.schedule}) on {spec.name}, {spec.num_nodes} node(s), {ranks} "
          f"ranks; collective model {model.describe()}")
    print("# busbw = algbw x (n-1)/n, algbw = bytes per rank / time (nccl-tests)")
    print(f"# {'size (B)':>12} {'time (us)':>11} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    for row in rows:
        print(f"  {row.bytes_per_rank:>12} {row.time_s * 1e6:>11.1f} {row.algbw_gbps:>13.2f} "
              f"{row.busbw_gbps:>13.2f}")
    if args.json:
        atomic_write_text(args.json, json.dumps({
            "op": args.op, "topology": spec.name, "collective_model": model.to_json(),
            "rows": [row.to_json() for row in rows]}, indent=2))
    return 0
