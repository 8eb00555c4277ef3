"""``cocodiff run``: one denoising job on every rank of a launch.

Single process, under ``mpiexec -n N`` or under ``torchrun --nproc-per-node N``: every
rank loads the same model, the transformer is parallelised over the transport, and
rank 0 shows progress and writes the outputs (each written whole or not at all).
Errors that every rank hits the same way (a bad model directory) are printed once, by
rank 0; every rank exits non-zero.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from cocodiff.errors import CocodiffError

DTYPES = ("float32", "bfloat16")


class RankFailure(CocodiffError):
    """Something that stops the job on every rank."""


def add_run_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    parser.add_argument("--model", default="tiny-flux",
                        help="tiny-flux, tiny-sd3, tiny-qwen, tiny-wan, tiny-pixart, or a local "
                        "diffusers pipeline directory (default: tiny-flux)")
    parser.add_argument("--prompt", default="a lighthouse on a cliff at dawn",
                        help="the text prompt")
    parser.add_argument("--steps", type=positive_int, default=4, help="denoising steps (default 4)")
    parser.add_argument("--resolution", default=None,
                        help="PIXELS or WIDTHxHEIGHT (default: the model's)")
    parser.add_argument("--frames", type=positive_int, default=None,
                        help="video frames (video models; default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial noise")
    parser.add_argument("--schedule", default="flat", help="plan schedule (default: flat)")
    parser.add_argument("--transport", default="auto",
                        help="auto, torch or mpi (auto: mpi under mpiexec when mpi4py is "
                        "installed, else torch)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds a rank waits for its peers before giving up (default 60)")
    parser.add_argument("--output", type=Path, default=None, help="write the image here (PNG)")
    parser.add_argument("--json", type=Path, default=None, help="write timings as JSON here")
    parser.add_argument("--save-latents", type=Path, default=None,
                        help="write the final latents here (torch.save of one tensor)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run_command(args: argparse.Namespace) -> int:
    from transports.launch import detect_launch

    launch = detect_launch()
    is_root = launch.rank == 0
    try:
        return _run(args, launch)
    except CocodiffError as error:
        _report(is_root, str(error))
        return 2
    except (ValueError, FileNotFoundError) as error:
        _report(is_root, str(error.args[0] if error.args else error))
        return 2
    except Exception as error:  # a peer died, a timeout: say so on every rank that saw it
        print(f"cocodiff run: rank {launch.rank}: {type(error).__name__}: "
              f"{str(error).splitlines()[0] if str(error) else ''}", file=sys.stderr)
        return 1


def _report(is_root: bool, message: str) -> None:
    if is_root:
        print(f"cocodiff run: error: {message}", file=sys.stderr)


def _run(args: argparse.Namespace, launch) -> int:
    from cocodiff.schedules import get_schedule

    get_schedule(args.schedule)  # fail before the expensive imports
    for path in (args.output, args.json, args.save_latents):
        if path is not None and not path.parent.is_dir():
            raise CocodiffError(f"output directory {path.parent} does not exist (for {path})")
    if args.timeout <= 0:
        raise CocodiffError(f"--timeout must be positive, got {args.timeout}")

    import torch
    import transformers
    from diffusers.utils import logging as diffusers_logging

    # Library chatter (tokenizer length notes, deprecations) would drown the one line
    # a user needs; errors still surface as exceptions.
    transformers.logging.set_verbosity_error()
    diffusers_logging.set_verbosity_error()

    from cocodiff.runtime.parallel import parallelize
    from cocodiff.runtime.pipelines import load_pipeline, run_pipeline, tiny_name_of
    from cocodiff.runtime.tiny import TINY_DEFAULTS
    from transports.registry import TRANSPORTS, auto_transport_name, create_transport

    name = auto_transport_name() if args.transport == "auto" else args.transport
    if name not in TRANSPORTS:
        create_transport(name)  # raises the registry's one-line error
    transport = None
    if launch.is_distributed:
        options = {"timeout_s": args.timeout} if name == "torch" else {}
        transport = create_transport(name, **options)
    try:
        if transport is not None:
            _agree_on_arguments(transport, sys.argv[1:])
        dtype = getattr(torch, args.dtype)
        pipe = load_pipeline(args.model, dtype)
        tiny = tiny_name_of(args.model)
        width, height, frames = _size(args, tiny)
        # Tiny models use short prompts; real ones keep their pipeline's default length.
        text_tokens = TINY_DEFAULTS[tiny].max_sequence_length if tiny else None
        runtime = parallelize(pipe, transport, args.schedule) if transport else None
        step_times: list[float] = []
        with _progress(is_root=launch.rank == 0 and not args.quiet, steps=args.steps) as advance:
            last = time.perf_counter()
            started = last

            def on_step(done: int, total: int) -> None:
                nonlocal last
                now = time.perf_counter()
                step_times.append(now - last)
                last = now
                advance()

            latents = run_pipeline(pipe, args.prompt, args.steps, width, height, frames,
                                   args.seed, on_step, max_sequence_length=text_tokens)
            total_s = time.perf_counter() - started
        if launch.rank == 0:
            _write_outputs(args, pipe, latents, {
                "model": args.model,
                "num_ranks": launch.world_size,
                "schedule": args.schedule,
                "transport": transport.name if transport else "none",
                "steps": args.steps,
                "resolution": [width, height],
                "frames": frames,
                "step_times_s": step_times,
                "total_s": total_s,
                "comm_s": runtime.comm_s if runtime else 0.0,
                "output": str(args.output) if args.output else None,
            })
        if transport is not None:
            transport.barrier()
    finally:
        if transport is not None:
            transport.close()
    return 0


def _size(args: argparse.Namespace, tiny: str | None) -> tuple[int, int, int]:
    from cocodiff.models import parse_resolution
    from cocodiff.runtime.tiny import default_resolution

    width, height, frames = default_resolution(tiny) if tiny else (1024, 1024, 1)
    if args.resolution is not None:
        width, height = parse_resolution(args.resolution)
    if args.frames is not None:
        frames = args.frames
    return width, height, frames


def _agree_on_arguments(transport, argv: list[str]) -> None:
    """Every rank must run the same command: compare a digest of the arguments."""
    import torch

    from cocodiff.runtime.exchange import all_gather_rows

    digest = hashlib.sha256("\0".join(argv).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    everyone = all_gather_rows(transport, mine).flatten().tolist()
    differing = [rank for rank, value in enumerate(everyone) if value != everyone[0]]
    if differing:
        raise RankFailure(
            f"ranks disagree on arguments: ranks {differing} differ from rank 0"
        )


class _progress:
    """A rich progress bar over denoising steps on rank 0; nothing elsewhere."""

    def __init__(self, is_root: bool, steps: int) -> None:
        self._enabled = is_root
        self._steps = steps
        self._bar: Any = None

    def __enter__(self):
        if not self._enabled:
            return lambda: None
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn("denoising"), BarColumn(), TextColumn("{task.completed}/"
                             "{task.total}"), TimeElapsedColumn(), transient=False)
        self._bar.start()
        task = self._bar.add_task("steps", total=self._steps)
        return lambda: self._bar.advance(task)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


def _write_outputs(args: argparse.Namespace, pipe, latents, record: dict) -> None:
    import torch

    from cocodiff.atomic import atomic_write, atomic_write_text
    from cocodiff.runtime.pipelines import decode

    if args.save_latents:
        atomic_write(args.save_latents, lambda tmp: torch.save(latents.detach().cpu(), tmp))
    if args.output:
        image = decode(pipe, latents)
        if isinstance(image, list):  # video: the frames side by side
            from PIL import Image

            strip = Image.new("RGB", (image[0].width * len(image), image[0].height))
            for index, frame in enumerate(image):
                strip.paste(frame, (index * frame.width, 0))
            image = strip
        atomic_write(args.output, lambda tmp: image.save(tmp, format="PNG"))
    if args.json:
        atomic_write_text(args.json, json.dumps(record, indent=2))
