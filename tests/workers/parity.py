"""One rank of the parity checks, for each model and each schedule in turn:

1. the Ulysses-parallel transformer's output equals the single-process output;
2. what the runtime did in one attention call (compute ops in order, bytes of each
   exchange) is exactly the plan's attention steps for this rank;
3. the whole pipeline's final latents equal the single-process pipeline's.

All in float32 with atol = rtol = 1e-5.

Usage: parity.py TRANSPORT LAYOUT CASES MODEL[:HEADS]... [+ CASES MODEL...]...

LAYOUT is NODESxGPUSxTILES (as ``cocodiff run --grid``) or "line" (the runtime's
default). CASES is a comma-separated list of SCHEDULE[/CHUNKS] (SCHEDULE/CHUNKS pipelines
the phases in CHUNKS chunks) or of hybrid layouts UxRxB[i]/SCHEDULE (checked by
hybrid_parity.py). MODEL:HEADS builds the tiny model's transformer with HEADS attention
heads (same config otherwise, seeded weights), so that more ranks than the tiny models' 4
heads can split them. ``+`` starts another group of cases and models in the same job:
each launch costs every rank its imports (seconds on a small machine), so one job checks
all the groups of one rank count. Rank 0 prints one line per model and case with the
largest differences; exits 0 when everything matches, prints each mismatch and exits 1
otherwise.
"""

import sys

import torch
from diffusers import DiffusionPipeline
from ending import exit_rank
from probe import transformer_inputs

from cocodiff.commands.run import rank_grid
from cocodiff.plan.steps import Compute, Exchange
from cocodiff.runtime.backend import StepRecord
from cocodiff.runtime.parallel import parallelize
from cocodiff.runtime.pipelines import run_pipeline
from cocodiff.runtime.tiny import SEED, TINY_DEFAULTS, build_tiny
from cocodiff.schedules import PlanOptions
from transports.registry import create_transport

STEPS = 2


def pipeline_latents(pipe, model):
    defaults = TINY_DEFAULTS[model]
    return run_pipeline(pipe, "a red cat", STEPS, defaults.width, defaults.height,
                        defaults.frames, seed=1,
                        max_sequence_length=defaults.max_sequence_length)


def expected_records(layer):
    return [
        StepRecord("compute", step.op, 0) if isinstance(step, Compute)
        else StepRecord("exchange", step.tensor, step.send_bytes)
        for step in layer.attention
        if isinstance(step, (Compute, Exchange))
    ]


def build(model: str) -> DiffusionPipeline:
    """The tiny pipeline ``name`` or, for ``name:HEADS``, with a HEADS-head transformer."""
    name, _, heads = model.partition(":")
    pipe = build_tiny(name)
    if heads:
        config = {**pipe.transformer.config, "num_attention_heads": int(heads)}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)  # every rank builds the same weights
            pipe.transformer = type(pipe.transformer).from_config(config).eval()
    return pipe


def check_schedules(transport, grid, schedules, model):
    name = model.partition(":")[0]
    pipe = build(model)
    inputs = transformer_inputs(name, pipe.transformer)
    with torch.no_grad():
        expected_out = pipe.transformer(**inputs, return_dict=False)[0]
        expected_latents = pipeline_latents(pipe, name)
    ok = True
    for schedule in schedules:
        failures = []
        pipe = build(model)  # parallelize hooks a pipeline for good: a fresh one each
        with torch.no_grad():
            scheduler, _, chunks = schedule.partition("/")
            runtime = parallelize(pipe, transport, scheduler, grid,
                                  options=PlanOptions(chunks=int(chunks or 1)))
            runtime.records = []
            actual_out = pipe.transformer(**inputs, return_dict=False)[0]
            layer = runtime.plan.program(transport.rank).layers[0]
            first_call = runtime.records[: len(expected_records(layer))]
            if first_call != expected_records(layer):
                failures.append(f"runtime steps {first_call} != plan {expected_records(layer)}")
            runtime.records = None
            actual_latents = pipeline_latents(pipe, name)
        compared = [("transformer output", actual_out, expected_out),
                    ("pipeline latents", actual_latents, expected_latents)]
        label = (f"parity {transport.name} {transport.world_size} ranks "
                 f"{'x'.join(map(str, runtime.grid.shape))} {schedule} {model}")
        ok = report(transport, label, compared, failures) and ok
    return ok


def report(transport, label: str, compared, failures: list[str]) -> bool:
    """Check each (what, actual, expected) within atol = rtol = 1e-5. Rank 0 prints
    ``label`` with the largest differences; every rank prints its mismatches (and
    ``failures`` found before). Returns whether everything matched."""
    diffs = []
    for what, actual, expected in compared:
        diffs.append(f"{what} {(actual - expected).abs().max().item():.1e}")
        try:
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        except AssertionError as error:
            failures.append(f"{what}: {error}")
    if transport.rank == 0:
        print(f"{label}: max abs diff {', '.join(diffs)}", flush=True)
    for failure in failures:
        print(f"rank {transport.rank}: {label}: {failure}", flush=True)
    return not failures


def groups(args: list[str]) -> list[tuple[list[str], list[str]]]:
    """``CASES MODEL... + CASES MODEL...`` as (cases, models) pairs."""
    found, group = [], []
    for arg in [*args, "+"]:
        if arg != "+":
            group.append(arg)
            continue
        cases, *models = group
        found.append((cases.split(","), models))
        group = []
    return found


def is_hybrid(case: str) -> bool:
    """``UxRxB[i]/SCHEDULE`` (a hybrid layout) rather than ``SCHEDULE[/CHUNKS]``."""
    return "x" in case.partition("/")[0]


def main(check=None):
    """``TRANSPORT LAYOUT CASES MODEL... [+ CASES MODEL...]``: check each group's models'
    cases with ``check``, or by default hybrid layouts with hybrid_parity.py's check and
    schedules with this module's."""
    transport_name, layout, *rest = sys.argv[1:]
    transport = create_transport(transport_name)
    try:
        grid = rank_grid(None if layout == "line" else layout, transport.world_size)
        results = []
        for cases, models in groups(rest):
            checker = check or check_schedules
            if check is None and any(map(is_hybrid, cases)):
                assert all(map(is_hybrid, cases)), f"a group mixes hybrid cases: {cases}"
                from hybrid_parity import check as checker  # it imports this module
            results += [checker(transport, grid, cases, model) for model in models]
    finally:
        transport.close()
    return 0 if all(results) else 1


if __name__ == "__main__":
    exit_rank(main())
