"""``python -m bench.cluster``: run a command on an emulated multi-node cluster.

    # 2 nodes x 2 ranks, 1 Gbit/s between nodes: a Ulysses run across the namespaces
    python -m bench.cluster run --nodes 2 --ranks-per-node 2 --gbit 1 --transport torch \\
        --topology emulated.toml -- python -m cocodiff run --model tiny-flux --steps 2

    # measure the same cluster for the simulator
    python -m bench.cluster run --nodes 2 --gbit 1 -- python -m cocodiff calibrate \\
        --output cluster.toml

    # check the shaping: a timed transfer between two nodes and one inside a node
    python -m bench.cluster selftest --gbit 1

    # remove namespaces left by a cluster whose owner was killed with SIGKILL
    python -m bench.cluster cleanup

The cluster exists only while the command runs; it is removed afterwards, also when the
command fails or the run is interrupted (Ctrl-C, SIGTERM). Needs root, ``ip`` and ``tc``.
Exit codes: 0 success, 1 the job failed, 2 the cluster could not be built or bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.cluster.jobs import JOB_RUNNERS, JobFailed, run_job
from bench.cluster.netns import (
    ClusterError,
    ClusterInterrupted,
    ClusterSpec,
    EmulatedCluster,
    cluster_label,
    remove_stale,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster",
                                     description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="build a cluster, run a command on every rank, "
                              "remove the cluster")
    add_cluster_arguments(run)
    run.add_argument("--transport", default="torch", choices=sorted(JOB_RUNNERS),
                     help="how ranks are started: torch (one process per rank, torchrun "
                     "variables, gloo) or mpi (MPICH hydra across the namespaces)")
    run.add_argument("--timeout", type=float, default=600.0,
                     help="seconds the whole job may take (default 600)")
    run.add_argument("--topology", type=Path, default=None,
                     help="also write the topology TOML describing the cluster here")
    run.add_argument("--logs", type=Path, default=None,
                     help="directory for every rank's output (default: a temporary one)")
    run.add_argument("job", nargs=argparse.REMAINDER,
                     help="-- then the command every rank runs")
    run.set_defaults(handler=_cmd_run)

    selftest = commands.add_parser("selftest", help="build a cluster and measure a transfer "
                                   "between two nodes and inside one")
    add_cluster_arguments(selftest)
    selftest.add_argument("--seconds", type=float, default=0.5,
                          help="roughly how long the inter-node transfer takes (default 0.5)")
    selftest.set_defaults(handler=_cmd_selftest)

    describe = commands.add_parser("describe", help="write the topology TOML of a cluster "
                                   "shape without building it")
    add_cluster_arguments(describe)
    describe.add_argument("output", type=Path)
    describe.set_defaults(handler=_cmd_describe)

    cleanup = commands.add_parser("cleanup", help="remove namespaces left by dead clusters")
    cleanup.add_argument("--all", action="store_true",
                         help="also those of clusters whose owner is still running")
    cleanup.set_defaults(handler=_cmd_cleanup)
    return parser


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node (default 2)")
    parser.add_argument("--gbit", type=float, default=1.0,
                        help="inter-node link rate, Gbit/s per direction (default 1)")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="inter-node one-way delay, ms (needs the netem qdisc; default 0)")


def spec_of(args: argparse.Namespace) -> ClusterSpec:
    return ClusterSpec(args.nodes, args.ranks_per_node, args.gbit, args.delay_ms)


def _cmd_run(args: argparse.Namespace) -> int:
    job = list(args.job)
    if job and job[0] == "--":
        job = job[1:]
    if not job:
        raise ClusterError("no command given: put it after --")
    spec = spec_of(args)
    with EmulatedCluster(spec) as cluster:
        if args.topology is not None:
            cluster.write_topology(args.topology)
        print(f"cluster {cluster.name}: {cluster_label(spec)}, nodes "
              + ", ".join(f"{n.namespace}={n.address}" for n in cluster.nodes), flush=True)
        try:
            result = run_job(cluster, job, args.transport, timeout_s=args.timeout,
                             log_dir=args.logs)
        finally:
            traffic = cluster.link_bytes()
        sys.stdout.write(result.output(0))
        print(f"job done in {result.wall_s:.1f} s over {args.transport}; bytes on each node's "
              "shaped link (out, in): "
              + ", ".join(f"n{k}={out}/{inn}" for k, (out, inn) in traffic.items())
              + f"; logs in {result.log_dir}")
    return 0


def _cmd_selftest(args: argparse.Namespace) -> int:
    from bench.cluster.transfer import measure_transfer

    spec = spec_of(args)
    if spec.num_nodes < 2:
        raise ClusterError("selftest needs at least 2 nodes")
    num_bytes = max(1 << 20, int(spec.inter_payload_gbps * 1e9 * args.seconds))
    with EmulatedCluster(spec) as cluster:
        n0, n1 = cluster.nodes[:2]
        inter = measure_transfer(cluster, n0, n1, num_bytes)
        both = measure_transfer(cluster, n0, n1, num_bytes, both_ways=True)
        intra = measure_transfer(cluster, n0, n0, num_bytes)
    expected = spec.inter_payload_gbps * 8
    print(f"{cluster_label(spec)}: node 0 -> node 1 {inter.payload_gbit:.3f} Gbit/s of payload "
          f"(tbf {spec.inter_gbit:g} Gbit/s = {expected:.3f} of TCP payload, "
          f"{inter.payload_gbit / expected:.0%}); both ways at once on one connection "
          f"{both.payload_gbit:.3f} each ({both.payload_gbit / expected:.0%}); inside node 0 "
          f"{intra.payload_gbit:.3f} Gbit/s over loopback ({intra.link_bytes} bytes on the "
          "shaped link)")
    return 0


def _cmd_describe(args: argparse.Namespace) -> int:
    from bench.cluster.netns import describe, topology_notes, write_topology_file

    spec = spec_of(args)
    write_topology_file(args.output, describe(spec), topology_notes(spec, {}))
    print(f"wrote {args.output}")
    return 0


def _cmd_cleanup(args: argparse.Namespace) -> int:
    removed = remove_stale(include_live=args.all)
    print(f"removed {len(removed)} namespace(s)" + (": " + ", ".join(removed) if removed else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except JobFailed as error:
        print(f"bench.cluster {args.command}: job failed: {error}", file=sys.stderr)
        return 1
    except ClusterError as error:
        print(f"bench.cluster {args.command}: error: {error}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, ClusterInterrupted) as error:
        print(f"bench.cluster {args.command}: {error or 'interrupted'}; cluster removed",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
