"""``cocodiff doctor``: check a launch before a run (the checks:
:mod:`cocodiff.runtime.doctor`); rank 0 prints one table per node.

Exit codes: 0 when every check passed and the all-to-all delivered every byte; 1 with
one line on stderr naming what is wrong otherwise (2 for bad flags, as every command).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from cocodiff.runtime.doctor import (
    DEVICE_VARS,
    LAUNCH_VARS,
    DoctorProblem,
    RankFacts,
    check_environment,
    check_job,
    gather_facts,
    open_transport,
    rank_facts,
    tiny_all_to_all,
)
from cocodiff.util.errors import CocodiffError

EXIT_PROBLEM = 1


def add_doctor_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    parser.add_argument("--transport", default="auto",
                        help="the transport to test: auto (torch.distributed where the device "
                        "has its own collective backend, nccl or xccl; else MPI under mpiexec "
                        "with mpi4py; else torch.distributed over gloo), torch or mpi")
    parser.add_argument("--timeout", type=positive_int, default=None,
                        help="seconds a rank waits for its peers before failing (default 60; "
                        "600 over xccl, whose set-up at scale is slow)")
    parser.add_argument("--kib", type=positive_int, default=4,
                        help="KiB each rank sends each peer in the all-to-all (default 4)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write every rank's facts and the all-to-all timing here")


def doctor_command(args: argparse.Namespace) -> int:
    from cocodiff.util.atomic import check_output_paths
    from cocodiff.util.errors import one_line
    from transports.base import TransportError
    from transports.launch import LaunchError
    from transports.registry import AUTO, TRANSPORTS

    check_output_paths((args.json,))  # bad flags: CocodiffError, exit 2 (cocodiff.commands.cli)
    if args.transport != AUTO and args.transport not in TRANSPORTS:
        raise CocodiffError(f"unknown transport {args.transport!r}; valid: "
                            f"{', '.join([*sorted(TRANSPORTS), AUTO])}")
    try:
        return _doctor(args)
    except (DoctorProblem, TransportError, LaunchError) as error:
        # Every rank that fails says so (the failing one may not be rank 0).
        print(f"cocodiff doctor: error: {one_line(str(error))}", file=sys.stderr, flush=True)
        return EXIT_PROBLEM


def _doctor(args: argparse.Namespace) -> int:
    from cocodiff.util.atomic import atomic_write_text
    from transports.launch import detect_launch

    try:
        launch = detect_launch()
    except ValueError as error:
        raise DoctorProblem(f"launcher environment: {error}") from None
    check_environment(os.environ, launch)
    facts = rank_facts(launch)
    transport = open_transport(args.transport, args.timeout, launch)
    try:
        every = gather_facts(transport, facts)
        timing = tiny_all_to_all(transport, args.kib * 1024)
    finally:
        transport.close()
    if facts.rank != 0:
        try:
            check_job(every)
        except DoctorProblem:
            return EXIT_PROBLEM  # every rank found the same: rank 0 says it once
        return 0
    check_job(every)
    backend = getattr(transport, "backend", None)
    print_report(every, timing, f"{transport.name}/{backend}" if backend else transport.name)
    if args.json:
        atomic_write_text(args.json, json.dumps(
            {"ranks": [asdict(f) for f in every], "all_to_all": timing}, indent=2))
    return 0


def print_report(every: list[RankFacts], timing: dict, transport_name: str) -> None:
    from rich.table import Table

    from cocodiff.util.console import plain_console

    # Host names and launcher variables are the user's text, never rich markup.
    console = plain_console(width=None if sys.stdout.isatty() else 160)
    order: dict[int, int] = {}
    for f in every:
        order.setdefault(f.node_key, len(order))
    nodes = [[f for f in every if order[f.node_key] == n] for n in range(len(order))]
    for index, ranks in enumerate(nodes):
        first = ranks[0]
        table = Table(title=f"node {index} ({first.host}): {len(ranks)} rank(s); torch "
                      f"{first.torch_version} ({first.torch_build}); devices seen: "
                      f"{first.devices}", title_justify="left")
        for column in ("rank", "local", "device taken", "backends", "launcher variables"):
            table.add_column(column, justify="right" if column in ("rank", "local") else "left")
        for f in ranks:
            variables = " ".join(f"{k}={v}" for k, v in f.env if k in LAUNCH_VARS) or "-"
            taken = (f"{f.device} = {f.device_identity}"
                     if f.device_identity and f.device_identity != f.device else f.device)
            table.add_row(str(f.rank), str(f.local_rank), taken, ", ".join(f.backends),
                          variables)
        console.print(table)
    per_node = {len(ranks) for ranks in nodes}
    grid = (f"{len(nodes)} node(s) x {per_node.pop()} rank(s) per node" if len(per_node) == 1
            else f"{len(nodes)} nodes with {sorted(len(r) for r in nodes)} ranks (uneven)")
    device_vars = sorted({f"{k}={v}" for f in every for k, v in f.env if k in DEVICE_VARS})
    console.print(f"launcher: {every[0].launcher}; rank grid: {grid} = {len(every)} ranks"
                  + (f"; device variables: {' '.join(device_vars)}" if device_vars else ""))
    console.print(f"all-to-all over {timing['ranks']} rank(s) through {transport_name}: "
                  f"{timing['bytes_per_peer']} bytes per peer, every byte correct, median "
                  f"{timing['median_s_slowest_rank'] * 1e3:.3f} ms (slowest rank, "
                  f"{timing['repeats']} repeats)")
    console.print("doctor: all checks passed")
