"""One rank of a benchmark session: every schedule, round after round, in one launch.

``bench/emulated_speedup.py`` starts this once per emulated cluster (as it would start
``cocodiff run``), so that the schedules run interleaved on the same warm processes and
connections, and the ~15 s of imports and rendezvous of a launch is paid once, not once
per run. Each run is what ``cocodiff run`` does: load the pipeline, parallelise it (our
schedules with :func:`cocodiff.runtime.parallel.parallelize`, a baseline with
:data:`cocodiff.runtime.baseline.BASELINES`), run it and time each step as the time between
step callbacks.

Usage: emulated_session.py MODEL_DIR RESOLUTION STEPS LAYOUT DTYPE REPEATS SCHEDULES OUT_DIR

A schedule may name a Ulysses x Ring x batch layout after ``@`` (``flat@U4xR2xB1``,
``tapa@U2xR4xB1/ring-inner``): it runs as ``cocodiff run --ulysses 4 --ring 2
[--ring-inner]`` does (``bench/emulated_layouts.py``); its latents file has ``/`` read
as ``_``.

Rank 0 writes ``OUT_DIR/session.json`` (every run's step times and communication wait)
and, for round 1 of each schedule, ``OUT_DIR/latents-<schedule>.pt`` (float32 runs
only). A schedule the runtime refuses (same error on every rank, before any collective)
is recorded as skipped with its message.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

PROMPT = "a lighthouse on a cliff at dawn"  # cocodiff run's default
SEED = 0


def main() -> int:
    model, resolution, steps, layout, dtype_name, repeats, schedules, out_dir = sys.argv[1:]
    import torch
    import transformers
    from diffusers.utils import logging as diffusers_logging

    transformers.logging.set_verbosity_error()
    diffusers_logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()

    from cocodiff.commands.run import rank_grid
    from cocodiff.runtime.baseline import BASELINES
    from cocodiff.runtime.hybrid import parallelize_hybrid
    from cocodiff.runtime.parallel import parallelize
    from cocodiff.runtime.pipelines import load_pipeline, run_pipeline, tiny_name_of
    from cocodiff.runtime.tiny import TINY_DEFAULTS
    from cocodiff.util.errors import CocodiffError
    from transports.registry import create_transport

    transport = create_transport("torch", timeout_s=300.0)
    out = Path(out_dir)
    dtype = getattr(torch, dtype_name)
    size = int(resolution)
    tiny = tiny_name_of(model)
    text_tokens = TINY_DEFAULTS[tiny].max_sequence_length if tiny else None
    frames = 1
    grid = rank_grid(layout, transport.world_size)
    names = schedules.split(",")
    runs: list[dict] = []
    skipped: dict[str, str] = {}
    try:
        for repeat in range(int(repeats)):
            # Rotate the order every round: no schedule always follows the same one.
            order = names[repeat % len(names):] + names[:repeat % len(names)]
            for name in order:
                if name in skipped:
                    continue
                pipe = load_pipeline(model, dtype)
                schedule, _, layout_name = name.partition("@")
                try:
                    parallel = parse_layout_name(layout_name) if layout_name else None
                    if schedule in BASELINES:
                        runtime = BASELINES[schedule](pipe, transport)
                    elif parallel is not None and not parallel.is_pure_ulysses:
                        runtime = parallelize_hybrid(pipe, transport, schedule, parallel, grid)
                    else:
                        runtime = parallelize(pipe, transport, schedule, grid)
                except CocodiffError as error:
                    skipped[name] = str(error)
                    continue
                step_times: list[float] = []
                transport.barrier()
                last = time.perf_counter()

                def on_step(done: int, total: int, step_times: list[float] = step_times) -> None:
                    nonlocal last
                    now = time.perf_counter()
                    step_times.append(now - last)
                    last = now

                start_generation = getattr(runtime, "start_generation", None)
                if start_generation is not None:  # V-Major's ratio schedule spans the steps
                    start_generation(int(steps))
                with torch.no_grad():
                    latents = run_pipeline(pipe, PROMPT, int(steps), size, size, frames, SEED,
                                           on_step, max_sequence_length=text_tokens)
                runs.append({"schedule": name, "repeat": repeat, "step_times_s": step_times,
                             "comm_s": runtime.comm_s})
                if transport.rank == 0:
                    print(f"{name} round {repeat + 1}: "
                          f"{' '.join(f'{t * 1e3:.0f}' for t in step_times)} ms", flush=True)
                    if repeat == 0 and dtype == torch.float32:
                        torch.save(latents.detach().cpu(),
                                   out / f"latents-{name.replace('/', '_')}.pt")
                del pipe, runtime, latents
                gc.collect()
        if transport.rank == 0:
            (out / "session.json").write_text(json.dumps({"runs": runs, "skipped": skipped},
                                                         indent=2))
        transport.barrier()
    finally:
        transport.close()
    return 0


def parse_layout_name(text: str):
    """``U4xR2xB1`` or ``U4xR2xB1/ring-inner`` (:attr:`ParallelLayout.name`) -> the
    layout."""
    import re

    from cocodiff.commands.plan import RING_INNER_ORDER
    from cocodiff.layout import DEFAULT_ORDER, ParallelLayout
    from cocodiff.util.errors import CocodiffError

    match = re.fullmatch(r"U(\d+)xR(\d+)xB(\d+)(/ring-inner)?", text)
    if match is None:
        raise CocodiffError(f"not a layout name (U4xR2xB1[/ring-inner]): {text!r}")
    ulysses, ring, batch = (int(group) for group in match.groups()[:3])
    order = RING_INNER_ORDER if match.group(4) else DEFAULT_ORDER
    return ParallelLayout(ulysses, ring, batch, order)


if __name__ == "__main__":
    sys.exit(main())
