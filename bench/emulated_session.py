"""One rank of a benchmark session: every case, round after round, in one launch.

``bench/emulated_layouts.py`` starts this once per emulated cluster. It is a thin loop
over :func:`cocodiff.validation.generate` (what ``cocodiff validate`` runs for each case:
load the pipeline, parallelise it, generate, time each step between step callbacks),
writing files for the caller instead of a report. ``bench/emulated_speedup.py`` runs
``cocodiff validate`` itself.

Usage: emulated_session.py MODEL_DIR RESOLUTION STEPS LAYOUT DTYPE REPEATS SCHEDULES OUT_DIR

A schedule may name a Ulysses x Ring x batch layout after ``@`` (``flat@U4xR2xB1``,
``tapa@U2xR4xB1/ring-inner``); its latents file has ``/`` read as ``_``.

Rank 0 writes ``OUT_DIR/session.json`` (every run's step times and communication wait)
and, for round 1 of each schedule, ``OUT_DIR/latents-<schedule>.pt`` (float32 runs
only). A schedule the runtime refuses (same error on every rank, before any collective)
is recorded as skipped with its message.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cocodiff.validation import parse_layout_name  # noqa: F401  (tests and callers read it here)

SEED = 0


def main() -> int:
    model, resolution, steps, layout, dtype_name, repeats, schedules, out_dir = sys.argv[1:]
    from cocodiff.runtime.quiet import quiet_libraries

    quiet_libraries()
    import torch

    from cocodiff.commands.run import rank_grid
    from cocodiff.runtime.pipelines import tiny_name_of
    from cocodiff.runtime.tiny import TINY_DEFAULTS
    from cocodiff.util.errors import CocodiffError
    from cocodiff.validation import Case, RunSetup, generate, round_order
    from transports.registry import create_transport

    transport = create_transport("torch", timeout_s=300.0)
    out = Path(out_dir)
    dtype = getattr(torch, dtype_name)
    tiny = tiny_name_of(model)
    size = int(resolution)
    setup = RunSetup(model, dtype, int(steps), (size, size, 1),
                     TINY_DEFAULTS[tiny].max_sequence_length if tiny else None,
                     rank_grid(layout, transport.world_size), SEED)
    names = schedules.split(",")
    runs: list[dict] = []
    skipped: dict[str, str] = {}
    try:
        for repeat in range(int(repeats)):
            for name in round_order(names, repeat):
                if name in skipped:
                    continue
                schedule, _, layout_name = name.partition("@")
                try:
                    case = Case(schedule, parse_layout_name(layout_name) if layout_name
                                else None)
                    generation = generate(setup, transport, case)
                except CocodiffError as error:
                    skipped[name] = str(error)
                    continue
                runs.append({"schedule": name, "repeat": repeat,
                             "step_times_s": generation.step_times_s,
                             "comm_s": generation.comm_s})
                if transport.rank == 0:
                    print(f"{name} round {repeat + 1}: "
                          f"{' '.join(f'{t * 1e3:.0f}' for t in generation.step_times_s)} ms",
                          flush=True)
                    if repeat == 0 and dtype == torch.float32:
                        torch.save(generation.latents,
                                   out / f"latents-{name.replace('/', '_')}.pt")
        if transport.rank == 0:
            (out / "session.json").write_text(json.dumps({"runs": runs, "skipped": skipped},
                                                         indent=2))
        transport.barrier()
    finally:
        transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
