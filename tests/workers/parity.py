"""One rank of the parity checks, for each model in turn:

1. the Ulysses-parallel transformer's output equals the single-process output;
2. what the runtime did in one attention call (compute ops in order, bytes of each
   exchange) is exactly the plan's attention steps for this rank;
3. the whole pipeline's final latents equal the single-process pipeline's.

All in float32 with atol = rtol = 1e-5. Usage: parity.py TRANSPORT SCHEDULE MODEL...
Exits 0 when everything matches; prints each mismatch and exits 1 otherwise.
"""

import sys

import torch

from cocodiff.plan import Compute, Exchange
from cocodiff.runtime.parallel import StepRecord, parallelize
from cocodiff.runtime.pipelines import run_pipeline
from cocodiff.runtime.probe import transformer_inputs
from cocodiff.runtime.tiny import TINY_DEFAULTS, build_tiny
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


def check(transport, schedule, model):
    failures = []
    pipe = build_tiny(model)
    inputs = transformer_inputs(model, pipe.transformer)
    with torch.no_grad():
        expected_out = pipe.transformer(**inputs, return_dict=False)[0]
        expected_latents = pipeline_latents(pipe, model)
        runtime = parallelize(pipe, transport, schedule)
        runtime.records = []
        actual_out = pipe.transformer(**inputs, return_dict=False)[0]
        layer = runtime.plan.program(transport.rank).layers[0]
        first_call = runtime.records[: len(expected_records(layer))]
        if first_call != expected_records(layer):
            failures.append(f"runtime steps {first_call} != plan {expected_records(layer)}")
        runtime.records = None
        actual_latents = pipeline_latents(pipe, model)
    for what, actual, expected in (("transformer output", actual_out, expected_out),
                                   ("pipeline latents", actual_latents, expected_latents)):
        try:
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        except AssertionError as error:
            failures.append(f"{what}: {error}")
    for failure in failures:
        print(f"rank {transport.rank}: {model} {schedule}: {failure}", flush=True)
    return not failures


def main():
    transport_name, schedule, *models = sys.argv[1:]
    transport = create_transport(transport_name)
    try:
        results = [check(transport, schedule, model) for model in models]
    finally:
        transport.close()
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
