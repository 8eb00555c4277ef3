"""The ``cocodiff`` command line.

User errors (an unknown preset, a malformed topology file, ``--nodes 0``, ...) print
one line on stderr and exit with code 2; no output file is written unless the whole
command succeeded.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from cocodiff.commands.calibrate import add_calibrate_arguments, calibrate_command
from cocodiff.commands.doctor import add_doctor_arguments, doctor_command
from cocodiff.commands.plan import add_plan_arguments, plan_command
from cocodiff.commands.run import add_run_arguments, run_command
from cocodiff.commands.simulate import add_simulate_arguments, simulate_command
from cocodiff.commands.validate import add_validate_arguments, validate_command
from cocodiff.models import TINY_NAMES
from cocodiff.runtime.quiet import quiet_third_party
from cocodiff.util.errors import CocodiffError, one_line

EXIT_USAGE = 2


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line, not the usage text plus the error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="cocodiff",
        description="Topology-aware Ulysses sequence parallelism for Diffusion Transformers.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    simulate = commands.add_parser(
        "simulate",
        help="simulate a DiT's denoising step on a machine, schedule by schedule",
        description="Simulate denoising steps of a DiT under Ulysses sequence parallelism on "
        "a machine topology: step time, exposed communication, traffic per link tier, and "
        "each schedule's speedup over flat Ulysses; or the paper's grid with --sweep.",
    )
    add_simulate_arguments(simulate, positive_int)
    simulate.set_defaults(handler=simulate_command)

    plan = commands.add_parser(
        "plan",
        help="rank every Ulysses x Ring x batch layout and schedule by simulated step time",
        description="Simulate every valid parallel layout (Ulysses degree x Ring degree x "
        "batch/CFG degree = ranks, Ulysses degree at most the head count; Ulysses on the fast "
        "tiers or the Ring there) under each schedule on a machine, and print the best few "
        "with their predicted step times and the links' lower bound for their exchanges.",
    )
    add_plan_arguments(plan, positive_int)
    plan.set_defaults(handler=plan_command)

    run = commands.add_parser(
        "run",
        help="run a diffusers model Ulysses-parallel (under mpiexec or torchrun)",
        description="Generate with a diffusers DiT, Ulysses-parallel over every rank of the "
        "launch: `mpiexec -n N cocodiff run ...` or `torchrun --nproc-per-node N -m cocodiff "
        "run ...`; single-process without a launcher.",
    )
    add_run_arguments(run, positive_int)
    run.set_defaults(handler=run_command)

    calibrate = commands.add_parser(
        "calibrate",
        help="measure compute and link rates here and write a topology TOML",
        description="Measure this machine's compute rate for a model's layer and each link "
        "tier's latency and bandwidth (exchange sweeps on the real transport), and write the "
        "topology TOML the simulator uses. Under a launcher it measures the launched ranks "
        "(nodes = hostname + network namespace); without one it launches itself on local "
        "ranks.",
    )
    add_calibrate_arguments(calibrate, positive_int)
    calibrate.set_defaults(handler=calibrate_command)

    validate = commands.add_parser(
        "validate", help="run schedules for real, simulate the same plans, print the error",
        description="Under the launcher (mpiexec, torchrun, or the emulated cluster), run "
        "schedules and layouts for real, interleaved over rounds; simulate the same plans on "
        "a calibrated topology; print measured and predicted steps, the error per row and "
        "the planner's pick against the measured best.")
    add_validate_arguments(validate, positive_int)
    validate.set_defaults(handler=validate_command)

    collective = commands.add_parser(
        "collective",
        help="simulate a collective microbenchmark (nccl-tests style: time, algbw, busbw)",
        description="Simulate one all-to-all per size on a machine, flat or as TAPA's "
        "phases, under its collective model, and print the time, algbw and busbw per size "
        "(nccl-tests conventions).",
    )
    from cocodiff.commands.collective import add_collective_arguments, collective_command

    add_collective_arguments(collective, positive_int)
    collective.set_defaults(handler=collective_command)

    doctor = commands.add_parser(
        "doctor",
        help="check a launch before a run: devices, backends, launcher, a tiny all-to-all",
        description="Run under the launcher a job will use (`mpiexec -n N cocodiff doctor`, "
        "`torchrun --nproc-per-node N -m cocodiff doctor`, or plain): every rank reports its "
        "torch build, the devices it sees and the one it takes, the collective backends, "
        "the launcher and the rank grid it implies; all ranks run a tiny all-to-all, checked "
        "and timed; rank 0 prints one table per node. Exits 1 with one line on what is "
        "wrong.",
    )
    add_doctor_arguments(doctor, positive_int)
    doctor.set_defaults(handler=doctor_command)

    export = commands.add_parser(
        "export-tiny",
        help="save a built-in tiny model as a diffusers directory",
        description="Save a built-in tiny model (random weights from a fixed seed; tiny-digits: "
        "its trained weights) as a diffusers pipeline directory that `cocodiff run --model "
        "DIR` loads back.",
    )
    export.add_argument("name", help=f"one of {', '.join(TINY_NAMES)}")
    export.add_argument("directory", type=Path, help="where to write it")
    export.set_defaults(handler=_cmd_export_tiny)
    for command in commands.choices.values():
        command.add_argument(
            "--verbose", action="store_true",
            help="also show the warnings of the libraries underneath (transformers, diffusers, "
            "torch), silenced by default")
    return parser


def _cmd_export_tiny(args: argparse.Namespace) -> int:
    from cocodiff.runtime.quiet import quiet_libraries
    from cocodiff.util.atomic import check_output_directory

    # Checked before diffusers is imported: it takes seconds and warns as it loads.
    if args.name not in TINY_NAMES:
        raise CocodiffError(f"unknown tiny model {args.name!r}; valid: {', '.join(TINY_NAMES)}")
    check_output_directory(args.directory)
    quiet_libraries()  # before the import below, which warns as it loads
    from cocodiff.runtime.pipelines import export_tiny

    export_tiny(args.name, args.directory)
    print(f"saved {args.name} to {args.directory}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a user error is one line on stderr and exit code 2.

    The one place where errors become messages: every command (and any added later)
    gets the same guarantees without handling them itself.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    quiet_third_party(show=args.verbose)  # before any library loads and warns
    _printable_stdout()
    try:
        return args.handler(args)
    except CocodiffError as error:
        return _fail(args.command, str(error))
    except UnicodeError as error:
        # Before ValueError, which it is: "error: utf-8" (its first argument) says nothing.
        return _fail(args.command, _encoding_message(error))
    except (ValueError, FileNotFoundError, KeyError) as error:
        # Validation errors raised at the boundary by topology/, cocodiff.models and the
        # schedulers all derive from ValueError and carry a one-line message.
        message = error.args[0] if error.args else repr(error)
        return _fail(args.command, str(message))
    except OSError as error:
        # A path the file system refuses (too long, not a directory, read-only, full)
        # that no earlier check caught: the file and the system's reason.
        where = f"{error.filename}: " if error.filename is not None else ""
        return _fail(args.command, f"{where}{error.strerror or error}")


def _printable_stdout() -> None:
    """Print what stdout's encoding cannot show as backslash escapes, not a crash.

    Names come from the file system (a topology file's stem, a model directory) and may
    hold bytes that are not UTF-8 (Python keeps them as surrogates); a strict stdout,
    as under a desktop locale, would fail on them after all the work was done.
    """
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="backslashreplace")


def _encoding_message(error: UnicodeError) -> str:
    if isinstance(error, (UnicodeEncodeError, UnicodeDecodeError)):
        verb = "encode" if isinstance(error, UnicodeEncodeError) else "decode"
        return (f"cannot {verb} {error.object[error.start:error.end]!r} as {error.encoding}: "
                f"{error.reason}")
    return f"text encoding: {error}"


def _fail(command: str, message: str) -> int:
    print(f"cocodiff {command}: error: {one_line(message)}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
