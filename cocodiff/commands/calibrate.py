"""``cocodiff calibrate``: its flags, and the handler that runs a calibration under a
launcher (or launches one) and writes the topology file. The measuring lives in
:mod:`cocodiff.calibration`; this is the only calibrate module that parses arguments."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the calibration's modules load when a calibration runs, not per command
    from cocodiff.calibration import CalibrateOptions


def add_calibrate_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    parser.add_argument("--model", default="tiny-flux",
                        help="whose layer to time: a tiny model (tiny-flux...), a registry name "
                        "or a diffusers model directory / config.json (default: tiny-flux)")
    parser.add_argument("--tokens", type=positive_int, default=None,
                        help="attention sequence length (default: the model's at --resolution)")
    parser.add_argument("--resolution", default=None,
                        help="PIXELS or WIDTHxHEIGHT giving the tokens (default: the model's)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--nodes", type=positive_int, default=None,
                        help="nodes to describe when every rank is on one machine and "
                        "namespace (default: the nodes detected, else 2 when self-launched)")
    parser.add_argument("--ranks-per-node", type=positive_int, default=2,
                        help="ranks per node when self-launched without a launcher (default 2)")
    parser.add_argument("--inter-gbps", type=float, default=None,
                        help="take the inter-node link rate (GB/s) from here instead of "
                        "measuring it, e.g. an emulated cluster's tc rate")
    parser.add_argument("--inter-latency-us", type=float, default=20.0,
                        help="inter-node latency (us) used with --inter-gbps (default 20)")
    parser.add_argument("--max-kib", type=positive_int, default=4096,
                        help="largest message in the sweeps, KiB (default 4096; the pair "
                        "sweep stops sooner, at 4 x the model's largest step message and "
                        "256 KiB at least, once the link's rate shows)")
    parser.add_argument("--transport", default="auto", help="auto, torch or mpi")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a rank waits for its peers (and a self-launched job may "
                        "run) before giving up (default 120)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes and repeats (a few seconds of measuring)")
    parser.add_argument("--fit-patterns", action="store_true",
                        help="also fit the collective model on a step's exchange patterns "
                        "(they are always timed and checked against the simulator); "
                        "experimental: on the emulated cluster it read hosts' fixed costs "
                        "as bandwidth (docs/validate.md)")
    parser.add_argument("--strict", action="store_true",
                        help="refuse (exit 2, nothing written) when calibrate's own check says "
                        "predictions from the topology will not hold: the simulator missing "
                        "its loops of the model's forward and exchange calls, or a machine "
                        "busy or drifting while measured (default: write it and say so in "
                        "one line)")
    parser.add_argument("--output", type=Path, default=Path("cluster.toml"),
                        help="topology TOML to write (default: cluster.toml)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write every measurement as JSON here")


def options_from_args(args: argparse.Namespace) -> CalibrateOptions:
    """The parsed flags as the calibration's options."""
    from cocodiff.calibration import CalibrateOptions

    return CalibrateOptions(
        model=args.model, tokens=args.tokens, resolution=args.resolution, dtype=args.dtype,
        nodes=args.nodes, ranks_per_node=args.ranks_per_node, inter_gbps=args.inter_gbps,
        inter_latency_us=args.inter_latency_us, max_kib=args.max_kib, transport=args.transport,
        timeout_s=args.timeout, quick=args.quick, fit_patterns=args.fit_patterns,
        strict=args.strict, output=args.output, json=args.json)


def calibrate_command(args: argparse.Namespace) -> int:
    """The ``cocodiff calibrate`` handler: calibrate under a launcher, or launch itself."""
    from cocodiff.calibration import (
        CalibrationError,
        calibrate,
        check_options,
        self_launch,
        write_outputs,
    )
    from cocodiff.calibration.collect import gather_floats
    from transports.launch import detect_launch
    from transports.torch_dist import default_device

    options = options_from_args(args)
    check_options(options)
    # Both raise LaunchError (a ValueError: one line, exit 2): a one-rank world under PALS,
    # an XPU build of torch that sees no XPU. Before any rank waits for another.
    launch = detect_launch()
    default_device(launch.local_rank)
    if not launch.is_distributed:
        return self_launch(options)
    from transports.registry import TRANSPORTS, auto_transport_name, create_transport

    name = auto_transport_name() if options.transport == "auto" else options.transport
    if name not in TRANSPORTS:
        create_transport(name)  # raises the registry's one-line error
    transport_options = {"timeout_s": options.timeout_s} if name == "torch" else {}
    transport = create_transport(name, **transport_options)
    refusal = ""
    try:
        result = calibrate(transport, options)
        if transport.rank == 0:
            try:
                write_outputs(result, options)
            except CalibrationError as error:  # --strict: nothing written
                refusal = str(error)
        # Rank 0's word reaches every rank: all exit alike, none waits for a file.
        refused = gather_floats(transport, [float(bool(refusal))])[0][0] > 0
        transport.barrier()
    finally:
        transport.close()
    if refusal:
        raise CalibrationError(refusal)  # one line, from rank 0 only
    return 2 if refused else 0
