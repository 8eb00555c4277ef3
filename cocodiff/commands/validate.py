"""``cocodiff validate``: does the simulator hold on this machine?

Under the launcher of the user's choice (``mpiexec -n N cocodiff validate ...``,
``torchrun --nproc-per-node N -m cocodiff validate ...``, or across the emulated cluster
with ``python -m bench.cluster run``), with a topology (``--topology FILE.toml`` from
``cocodiff calibrate``), every rank runs the chosen schedules and layouts for real,
interleaved, the order rotated every round, ``--rounds`` times; rank 0 simulates the
plans that ran and prints, per row, the measured step (the median over rounds of each
run's median step, the first step left out; min-max over rounds), the predicted step
and the error (predicted / measured - 1), then the planner's pick against the measured
best, with the rounds' 95% intervals; after ``--rounds`` it adds rounds (up to
``--max-rounds``; by default 10, and past 10 while the rounds have taken under
:data:`ROUND_BUDGET_S`) while a row's interval neither resolves its error nor is within
``--precision``, or the pick's interval against the best straddles 5%, says why it
stopped, and marks a row whose interval is wider than its error. The logic is
:mod:`cocodiff.validation`.

Failures never hang the job: every wait on a peer is bounded by ``--timeout``, and a
rank that fails ends the job as ``cocodiff run`` does.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from cocodiff.commands.plan import COLLECTIVE_HELP, calibration_beside, collective_source
from cocodiff.commands.run import MAX_TIMEOUT_S, run_on_every_rank
from cocodiff.util.errors import CocodiffError

DEFAULT_SCHEDULES = "flat,tapa,vfirst,cocodiff,diffusers"
# Rounds at most by default, unless rounds are short: then more, while the rounds so far
# took under ROUND_BUDGET_S, up to ROUND_CEILING. On the emulated cluster a round of the
# enlarged model takes minutes and 10 rounds are the cap. On one host (tiny-flux, 4 ranks
# on 2 cores under torchrun) a round of the five schedules takes ~5 s, and 10 rounds of 3
# measured steps left the pick's verdict unresolved in 3 of 4 runs (flat and TAPA, one
# plan there, measured 8% apart); 40 rounds narrow its interval from about +-28% to +-6%
# (2026-11-29, docs/validate.md).
DEFAULT_MAX_ROUNDS = 10
ROUND_BUDGET_S = 180.0
ROUND_CEILING = 100
DTYPES = ("float32", "bfloat16")


def add_validate_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    parser.add_argument("--topology", default=None, metavar="PRESET|FILE.toml",
                        help="the machine the simulator predicts with: a `cocodiff calibrate` "
                        "TOML (or a preset); its ranks must be the launch's (default: the "
                        "uncalibrated `cluster` preset shaped as the nodes the launch spans)")
    parser.add_argument("--nodes", type=positive_int, default=None,
                        help="nodes of a preset topology (default: the file's, or the nodes "
                        "the launch spans)")
    parser.add_argument("--collective", default="auto", metavar="auto|NAME|FILE.json",
                        help=COLLECTIVE_HELP)
    parser.add_argument("--model", default="tiny-flux",
                        help="a tiny model's name or a local diffusers pipeline directory")
    parser.add_argument("--resolution", default=None,
                        help="PIXELS or WIDTHxHEIGHT (default: the model's)")
    parser.add_argument("--steps", type=positive_int, default=4,
                        help="denoising steps per run, at least 2: the first is left out "
                        "(default 4)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="rounds over every case, the order rotated each round (default 3)")
    parser.add_argument("--max-rounds", type=positive_int, default=None,
                        help="after --rounds, keep adding rounds up to this many while a "
                        "row's 95%% interval neither resolves its error (the prediction "
                        "outside it) nor is within --precision, or the planner's pick "
                        "against the measured best straddles 5%% (default "
                        f"{DEFAULT_MAX_ROUNDS}, or --rounds if more, and past that, up to "
                        f"{ROUND_CEILING}, while the rounds have taken under "
                        f"{ROUND_BUDGET_S:.0f} s; equal to --rounds: no extra round)")
    parser.add_argument("--precision", type=float, default=0.03,
                        help="a row whose 95%% interval is this narrow, as a fraction of its "
                        "step, needs no more rounds whatever its error (default 0.03: "
                        "+-3%%)")
    parser.add_argument("--schedules", default=DEFAULT_SCHEDULES,
                        help="comma-separated: flat, tapa, vfirst, cocodiff, diffusers "
                        "(diffusers' own context parallelism), and pipefusion (on the "
                        f"PipeFusion layouts of --layouts) (default {DEFAULT_SCHEDULES})")
    parser.add_argument("--layouts", default="auto",
                        help="auto, or pure, Ulysses x Ring x batch and PipeFusion layouts, "
                        "e.g. pure,U2xR2xB1,U2xR2xB1/ring-inner,P2xU2xM2/w1 (auto: pure "
                        "Ulysses when the heads split over every rank, else every layout the "
                        "planner considers; for pipefusion, every stage count from 2 with "
                        "as many patches and 1 warm-up step)")
    parser.add_argument("--transport", default="auto",
                        help="auto, torch or mpi (auto: mpi under mpiexec when mpi4py is "
                        "installed, else torch; diffusers runs over torch only)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="activation dtype (default float32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial noise")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the exactness check (float32: one single-process run on "
                        "rank 0, against which every row's round-1 latents are compared)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a rank waits for its peers before giving up "
                        "(default 300)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="write the rows, the planner's pick and the measured best here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def validate_command(args: argparse.Namespace) -> int:
    return run_on_every_rank("validate", lambda launch: _validate(args, launch),
                             usage_errors=(KeyError,))


def _check_arguments(args: argparse.Namespace, launch) -> dict[str, Any]:
    """Everything that can be checked before a transport exists, on every rank (all stop,
    none hangs). Returns the parsed schedules, layouts, topology and collective model."""
    from cocodiff.models import parse_resolution
    from cocodiff.util.atomic import check_output_paths
    from cocodiff.validation import parse_layouts, parse_schedules
    from transports.registry import AUTO, TRANSPORTS, create_transport

    schedules = parse_schedules(args.schedules)
    layouts = parse_layouts(args.layouts)
    if args.steps < 2:
        raise CocodiffError(f"--steps must be at least 2 (the first step is left out), got "
                            f"{args.steps}")
    if args.transport != AUTO and args.transport not in TRANSPORTS:
        create_transport(args.transport)  # the registry's one-line error
    if args.max_rounds is not None and args.max_rounds < args.rounds:
        raise CocodiffError(f"--max-rounds ({args.max_rounds}) is below --rounds "
                            f"({args.rounds})")
    if not (math.isfinite(args.precision) and 0 < args.precision < 1):
        raise CocodiffError(f"--precision must be in (0, 1), got {args.precision}")
    if not (math.isfinite(args.timeout) and 0 < args.timeout <= MAX_TIMEOUT_S):
        raise CocodiffError(f"--timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, "
                            f"got {args.timeout}")
    if args.resolution is not None:
        parse_resolution(args.resolution)
    check_output_paths([args.json])
    collective = collective_source(args.collective, args.topology)
    if not launch.is_distributed:
        raise CocodiffError("validate runs parallel schedules: launch it on 2 or more ranks "
                            "(mpiexec -n N cocodiff validate ..., or torchrun "
                            "--nproc-per-node N -m cocodiff validate ...)")
    described = None
    if args.topology is not None:
        from topology import resolve_topology

        described = resolve_topology(args.topology, args.nodes)
        ranks = described.num_nodes * described.gpus_per_node * described.tiles_per_gpu
        if ranks != launch.world_size:
            raise CocodiffError(f"the topology {args.topology} has {ranks} ranks "
                                f"({described.num_nodes} node(s)), the launch "
                                f"{launch.world_size}")
    elif args.nodes is not None:
        raise CocodiffError("--nodes shapes a preset topology: give --topology too")
    return {"schedules": schedules, "layouts": layouts, "described": described,
            "collective": collective}


def _validate(args: argparse.Namespace, launch) -> int:
    checked = _check_arguments(args, launch)
    from cocodiff.runtime.quiet import quiet_libraries

    quiet_libraries()  # before torch and diffusers, which warn as they load
    import torch

    from cocodiff.calibration.neighbours import foreign_share, snapshot
    from cocodiff.models import spec_from_config
    from cocodiff.runtime.faults import fault_from_env, install_faults
    from cocodiff.runtime.job import StepProgress, agree_on_arguments
    from cocodiff.runtime.model_names import model_size
    from cocodiff.runtime.nodes import launched_grid
    from cocodiff.runtime.pipelines import load_pipeline, tiny_name_of
    from cocodiff.runtime.tiny import TINY_DEFAULTS
    from cocodiff.schedules import RankGrid
    from cocodiff.validation import (
        Measurements,
        RunSetup,
        blocks_layer_s,
        generate,
        machine_drift,
        make_cases,
        predict_case,
        reference_latents,
        round_order,
    )
    from topology import Placement, build_topology
    from topology.presets import cluster
    from transports.registry import create_transport
    from transports.sim import collective_model_for

    is_root = launch.rank == 0
    fault = fault_from_env()  # COCODIFF_FAULT (tests): one rank misbehaves, as in `run`
    transport = create_transport(args.transport, timeout_s=args.timeout)
    try:
        faulty, step_fault = install_faults(fault, transport, launch.rank)
        assert faulty is not None  # a transport given is a transport returned
        transport = faulty
        agree_on_arguments(transport, [*sys.argv[1:]])
        launched = launched_grid(transport)
        launched_shape = launched.shape if launched is not None else (1, launch.world_size, 1)
        described = checked["described"]
        if described is None:  # uncalibrated: the cluster preset as the launch sits
            described = cluster(num_nodes=launched_shape[0],
                                ranks_per_node=launched_shape[1] * launched_shape[2])
        topology = build_topology(described)
        grid = RankGrid.from_placement(topology, Placement.node_major(topology))
        notes = []
        if checked["described"] is None:
            notes.append("no --topology: the uncalibrated `cluster` preset (run `cocodiff "
                         "calibrate` and pass its TOML)")
        verdict = _calibration_verdict(args.topology)
        if verdict:
            notes.append(f"calibrate's verdict on this topology: {verdict}")
        if launched is not None and tuple(launched_shape) != tuple(grid.shape):
            notes.append(f"the launch spans {'x'.join(map(str, launched_shape))} (nodes x "
                         f"ranks x 1), the topology says {'x'.join(map(str, grid.shape))}: "
                         "the ranks run as the topology places them")
        dtype = getattr(torch, args.dtype)
        tiny = tiny_name_of(args.model)
        pipe = load_pipeline(args.model, dtype)
        transformer = pipe.transformer
        spec = spec_from_config({"_class_name": type(transformer).__name__,
                                 **dict(transformer.config)}, name=type(transformer).__name__)
        del pipe, transformer
        cases = make_cases(checked["schedules"], checked["layouts"], launch.world_size,
                           spec.num_heads, spec.num_layers)
        width, height, frames = model_size(args.model, args.resolution)
        setup = RunSetup(args.model, dtype, args.steps, (width, height, frames),
                         TINY_DEFAULTS[tiny].max_sequence_length if tiny else None, grid,
                         args.seed)
        reference = None
        if is_root and args.dtype == "float32" and not args.no_reference:
            reference = reference_latents(setup)
        transport.barrier()

        # The machine's compute now, at the start and the end, against the calibration's.
        machine = [blocks_layer_s(args.model, args.resolution, args.dtype, transport)]
        rounds_began = snapshot()  # what other processes do with the cores meanwhile
        measurements = Measurements()
        collective = checked["collective"][0] or collective_model_for(topology.spec.name)
        predictions: dict = {}  # rank 0's, by case: the plans do not change between rounds

        def predicted(case) -> float | None:
            if case not in predictions:
                predictions[case] = predict_case(case, measurements, topology, collective)
            found = predictions[case]
            return None if found is None else found["predicted_step_s"]

        progress = StepProgress(is_root=is_root and not args.quiet,
                                steps=args.rounds * len(cases) * args.steps, label="validate")
        with progress as show_step:
            steps_done = 0

            def advance() -> None:
                nonlocal steps_done
                steps_done += 1
                show_step()
                if step_fault is not None:  # counts the steps of every run
                    step_fault.after_step(steps_done)

            rounds, began = 0, time.perf_counter()
            while rounds == 0 or _another_round(transport, args, measurements, cases, rounds,
                                                predicted if is_root else None,
                                                time.perf_counter() - began):
                if rounds >= args.rounds:
                    progress.grow(len(cases) * args.steps)
                for case in round_order(cases, rounds):
                    if case.name not in measurements.skipped:
                        try:
                            measurements.add(case, rounds,
                                             generate(setup, transport, case, advance))
                            continue
                        except CocodiffError as error:  # refused alike on every rank
                            measurements.skipped[case.name] = str(error)
                    for _ in range(args.steps):
                        show_step()
                rounds += 1
        rounds_s = time.perf_counter() - began
        foreign = foreign_share(transport, rounds_began)
        machine.append(blocks_layer_s(args.model, args.resolution, args.dtype, transport))
        if is_root:
            report = _report(args, cases, measurements, topology, checked, grid, spec,
                             (width, height, frames), transport.name, reference, notes,
                             (rounds, rounds_s),
                             {**machine_drift(machine, _calibrated_layer_s(args.topology)),
                              "foreign_share": foreign},
                             predictions)
            _print(report)
            if args.json is not None:
                from cocodiff.util.atomic import atomic_write_text

                atomic_write_text(args.json, json.dumps(report, indent=2))
        transport.barrier()
    finally:
        transport.close()
    return 0


def max_rounds(args: argparse.Namespace) -> int:
    """The rounds cap: ``--max-rounds``, by default :data:`DEFAULT_MAX_ROUNDS` (or
    ``--rounds`` when more); past it by default only while rounds are short
    (:func:`within_budget`)."""
    return args.max_rounds if args.max_rounds is not None else max(args.rounds,
                                                                   DEFAULT_MAX_ROUNDS)


def within_budget(args: argparse.Namespace, rounds: int, elapsed_s: float) -> bool:
    """Whether round ``rounds + 1`` is within the cap: below :func:`max_rounds`, or, with
    no ``--max-rounds`` given, below :data:`ROUND_CEILING` while the rounds so far took
    under :data:`ROUND_BUDGET_S` (short steps, whose rounds cost seconds)."""
    if rounds < max_rounds(args):
        return True
    return (args.max_rounds is None and rounds < ROUND_CEILING
            and elapsed_s < ROUND_BUDGET_S)


def _another_round(transport, args: argparse.Namespace, measurements, cases,
                   rounds: int, predicted=None, elapsed_s: float = 0.0) -> bool:
    """Whether the ranks run round ``rounds + 1``: always up to ``--rounds``; then, within
    the cap (:func:`within_budget`, ``elapsed_s`` the rounds' seconds so far), while one of
    rank 0's rows can still gain from a round (:func:`cocodiff.validation.rows_to_resolve`;
    ``predicted(case)``: its predicted step, on rank 0; without it, only the rows' spread
    against ``--precision`` counts). Rank 0 decides, as it reports; every rank takes its
    word (its clock decides the budget too: the ranks' clocks differ)."""
    if rounds < args.rounds:
        return True
    if not within_budget(args, rounds, 0.0):  # the same on every rank: no collective
        return False
    import torch

    from cocodiff.runtime.exchange import all_gather_rows
    from cocodiff.validation import rows_to_resolve

    wanted = (within_budget(args, rounds, elapsed_s)
              and bool(rows_to_resolve(measurements, cases, predicted or (lambda case: None),
                                       args.precision)))
    mine = torch.tensor([int(wanted)], dtype=torch.int64)
    return bool(all_gather_rows(transport, mine)[0].item())


def rounds_stop(args: argparse.Namespace, rounds: int, rows: list[dict[str, Any]],
                pick_resolved: bool = True, elapsed_s: float | None = None
                ) -> dict[str, Any]:
    """Why the rounds stopped: ``reason`` (``resolved``: no row needs another;
    ``max_rounds``: the cap, with rows unresolved; ``no_extra_rounds``: the cap was
    ``--rounds``), the rows left unresolved (and the planner's pick, when its interval
    against the measured best straddles 5%: ``pick_resolved`` false), the rounds'
    seconds (``elapsed_s``, when given) and a sentence."""
    from cocodiff.validation import PICK

    unresolved = [f"{row['schedule']}@{row['layout']}" for row in rows
                  if row.get("precision_95") is None
                  or (row["precision_95"] > args.precision and not row.get("error_resolved"))]
    if not pick_resolved:
        unresolved.append(PICK)
    cap = max_rounds(args)
    if not unresolved:
        reason, text = "resolved", (f"every row's 95% interval resolves its error or is within "
                                    f"+-{args.precision:.0%}, and the pick's verdict is resolved")
    elif cap <= args.rounds:
        reason, text = "no_extra_rounds", (f"--max-rounds {cap} asked for no round past "
                                           f"--rounds; unresolved: {', '.join(unresolved)}")
    elif args.max_rounds is None and elapsed_s is not None:
        reason, text = "max_rounds", (
            f"the default cap, {cap} rounds and past that {ROUND_BUDGET_S:.0f} s of rounds "
            f"(up to {ROUND_CEILING}; these took {elapsed_s:.0f} s), with "
            f"{', '.join(unresolved)} unresolved; --max-rounds N runs up to N")
    else:
        reason, text = "max_rounds", (f"the cap, --max-rounds {cap}, with "
                                      f"{', '.join(unresolved)} unresolved")
    return {"reason": reason, "rounds": rounds, "max_rounds": cap, "unresolved": unresolved,
            "text": text, **({} if elapsed_s is None else {"elapsed_s": elapsed_s})}


def _calibrated_layer_s(topology: str | None) -> float | None:
    """calibrate's time per layer of the model's blocks (``compute.block.layer_s`` in the
    JSON beside the topology TOML: :func:`calibration_beside`), or None."""
    beside = calibration_beside(topology)
    if beside is None:
        return None
    try:
        return float(json.loads(beside.read_text())["compute"]["block"]["layer_s"])
    except (ValueError, KeyError, TypeError):  # not calibrate's JSON, or no blocks timed
        return None


def _calibration_verdict(topology: str | None) -> str | None:
    """calibrate's reasons, when its verdict (``verdict`` in the JSON beside the topology:
    :mod:`cocodiff.calibration.verdict`) was that predictions from it will not hold."""
    beside = calibration_beside(topology)
    if beside is None:
        return None
    try:
        verdict = json.loads(beside.read_text()).get("verdict") or {}
    except (ValueError, AttributeError):  # not calibrate's JSON
        return None
    if verdict.get("holds") is not False:
        return None
    return "predictions will not hold: " + "; ".join(map(str, verdict.get("reasons", ())))


def _report(args, cases, measurements, topology, checked, grid, spec, size, transport_name,
            reference, notes, rounds_run, machine, predictions=None) -> dict[str, Any]:
    from dataclasses import asdict

    from cocodiff.validation import EXACT_ATOL, layouts_json, summarise
    from topology import dump_topology
    from transports.sim import collective_model_for

    rounds, elapsed_s = rounds_run
    collective, source = checked["collective"]
    used = collective or collective_model_for(topology.spec.name)
    summary = summarise(cases, measurements, topology, used, reference, predictions)
    for name, message in measurements.skipped.items():
        notes.append(f"{name} skipped: the runtime refused it ({message})")
    exactness = None
    if reference is not None:
        checked_rows = [row for row in summary["rows"] if row.get("exact_schedule")]
        exactness = {"reference": "single process", "dtype": args.dtype, "atol": EXACT_ATOL,
                     "checked": [f"{row['schedule']}@{row['layout']}" for row in checked_rows],
                     "passed": all(row["exact"] for row in checked_rows)}
    return {
        **summary,
        "model": {"name": args.model, "spec": asdict(spec)},
        "resolution": list(size[:2]),
        "frames": size[2],
        "num_ranks": grid.num_ranks,
        "grid": list(grid.shape),
        "transport": transport_name,
        "dtype": args.dtype,
        "steps": args.steps,
        "rounds": rounds,
        "max_rounds": max_rounds(args),
        "precision_target": args.precision,
        "rounds_stop": rounds_stop(args, rounds, summary["rows"],
                                   summary.get("pick_resolved", True), elapsed_s),
        "layouts": layouts_json(cases),
        "calibration": {"topology": args.topology or "cluster (preset, uncalibrated)",
                        "topology_toml": dump_topology(topology.spec),
                        "collective": used.to_json(), "collective_source": source},
        "exactness": exactness,
        "machine": machine,
        "skipped": measurements.skipped,
        "runs": measurements.runs,
        "notes": notes,
    }


def pick_verdict(report: dict[str, Any]) -> str:
    """How much slower the pick measured than the best, with the rounds' 95% interval, and
    whether that is within 5% (and whether the rounds can tell)."""
    text = f"{report['pick_slower_than_best']:+.1%}"
    interval = report.get("pick_slower_95")
    if interval is not None and interval != [0.0, 0.0]:
        text += f" (95%: {interval[0]:+.1%} to {interval[1]:+.1%})"
    text += ", within 5%" if report["pick_within_5pct"] else ", NOT within 5%"
    if not report.get("pick_resolved", True):
        text += " (unresolved: the interval straddles 5%; more rounds can tell)"
    return text


# Past this drift of the blocks' time from the calibration's, validate says recalibrate.
DRIFT_WARNING = 0.10


def machine_text(machine: dict[str, Any]) -> str:
    """The blocks' time per layer at the validation's start and end against calibrate's,
    and the other processes' share of the cores during the rounds (a CPU time per layer
    does not move when a neighbour takes cores: the steps' wall time does)."""
    from cocodiff.calibration.neighbours import foreign_text

    text = _blocks_text(machine)
    share = machine.get("foreign_share")
    if share is not None:
        text += f"; other processes used {share:.0%} of the cores during the rounds"
        if foreign_text(share) is not None:
            text += " (the measured steps are slower than this machine's: validate again " \
                    "on a quiet machine)"
    return text


def _blocks_text(machine: dict[str, Any]) -> str:
    timed = [value for value in machine["layer_s"] if value is not None]
    if not timed:
        return "the model's blocks: not timed here (calibrate does not time this model)"
    text = f"the model's blocks, every rank at once: {timed[0] * 1e3:.2f} ms of CPU per layer"
    if len(timed) > 1:
        text += f" at the start, {timed[-1] * 1e3:.2f} at the end"
    if machine["drift"] is None:
        return text + " (no calibration JSON with the blocks beside the topology)"
    text += (f"; calibrate measured {machine['calibrated_layer_s'] * 1e3:.2f}: "
             f"{machine['drift']:+.0%}")
    if abs(machine["drift"]) > DRIFT_WARNING:
        text += " (the machine is not the one calibrated: calibrate again before judging)"
    return text


def error_text(error: float | None, resolved: bool | None) -> str:
    """A row's error as printed: marked when its interval is wider than the error."""
    if error is None:
        return "-"
    return f"{error:+.1%}" + (" (unresolved)" if resolved is False else "")


def _print(report: dict[str, Any]) -> None:
    from rich.table import Table

    from cocodiff.util.console import plain_console

    table = Table(title=f"{report['model']['name']} on {report['num_ranks']} ranks "
                  f"({'x'.join(map(str, report['grid']))}), {report['transport']}, "
                  f"{report['steps']} steps x {report['rounds']} round(s), first step left out")
    for column in ("schedule", "layout", "measured step (min-max)", "95%", "predicted",
                   "error"):
        table.add_column(column, justify="left" if column in ("schedule", "layout")
                         else "right")
    for row in report["rows"]:
        predicted, error, precision = row["predicted_step_s"], row["error"], \
            row.get("precision_95")
        table.add_row(row["schedule"], row["layout"],
                      f"{row['measured_step_s'] * 1e3:.2f} ms ({row['min_step_s'] * 1e3:.2f}-"
                      f"{row['max_step_s'] * 1e3:.2f})",
                      "-" if precision is None else f"+-{precision:.1%}",
                      "-" if predicted is None else f"{predicted * 1e3:.2f} ms",
                      error_text(error, row.get("error_resolved")))
    console = plain_console()
    console.print(table)
    if any(row.get("error_resolved") is False for row in report["rows"]):
        console.print("unresolved: the row's 95% interval is wider than its error (the "
                      "prediction lies inside it); more rounds can tell")
    stop = report.get("rounds_stop")
    if stop is not None:
        console.print(f"rounds: {stop['rounds']} (stopped: {stop['text']})")
    pick, best = report["planner_pick"], report["measured_best"]
    if pick is not None:
        console.print(f"planner's pick: {pick['schedule']} {pick['layout']} (predicted "
                      f"{pick['predicted_step_s'] * 1e3:.2f} ms, measured "
                      f"{pick['measured_step_s'] * 1e3:.2f} ms); measured best: "
                      f"{best['schedule']} {best['layout']} ({best['measured_step_s'] * 1e3:.2f}"
                      f" ms): {pick_verdict(report)}")
    if "median_abs_error" in report:
        console.print(f"median |error| {report['median_abs_error']:.1%}; within 15%: "
                      f"{report['within_15pct']:.0%} of rows, within 20%: "
                      f"{report['within_20pct']:.0%}")
    exactness = report["exactness"]
    if exactness is not None:
        diffs = ", ".join(f"{row['schedule']}@{row['layout']} {row['max_abs_diff']:.1e}"
                          for row in report["rows"] if "max_abs_diff" in row)
        console.print(f"final latents against one single-process run (round 1): {diffs}; "
                      f"exact schedules within {exactness['atol']:g}: "
                      f"{'yes' if exactness['passed'] else 'NO'}")
    console.print(machine_text(report["machine"]))
    console.print(f"collective model: {report['calibration']['collective_source']}")
    for note in report["notes"]:
        console.print(f"note: {note}")
