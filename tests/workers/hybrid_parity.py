"""One rank of the hybrid-layout parity checks, for each model and each case in turn:

1. the parallel transformer's output equals the single-process output (a batch of
   ``batch`` samples, so that a batch degree has something to split);
2. what the runtime did in one attention call (compute ops in order, bytes of each
   exchange, Ring passes included) is exactly the plan's attention steps for this rank;
3. with batch degree 1, the whole pipeline's final latents equal the single-process
   pipeline's.

All in float32 with atol = rtol = 1e-5 (the flat plan's tolerance).

Usage: hybrid_parity.py TRANSPORT LAYOUT CASE[,CASE...] MODEL...

LAYOUT is NODESxGPUSxTILES (as ``cocodiff run --grid``) or "line". A CASE is
``UxRxB[i]/SCHEDULE``: Ulysses, Ring and batch degrees, ``i`` to place the Ring inside
the Ulysses groups (on the fast tiers). Rank 0 prints one line per model and case with
the largest differences; exits 0 when everything matches, prints each mismatch and
exits 1 otherwise.
"""

import torch
from ending import exit_rank
from parity import STEPS, expected_records, main, pipeline_latents, report  # same dir
from probe import transformer_inputs

from cocodiff.layout import RING_INNER_ORDER, ParallelLayout
from cocodiff.runtime.hybrid import parallelize_hybrid
from cocodiff.runtime.tiny import build_tiny


def parse_case(text: str) -> tuple[ParallelLayout, str]:
    degrees, _, schedule = text.partition("/")
    inner = degrees.endswith("i")
    u, r, b = (int(x) for x in degrees.rstrip("i").split("x"))
    order = RING_INNER_ORDER if inner else ("batch", "ring", "ulysses")
    return ParallelLayout(u, r, b, order), schedule


def check(transport, grid, cases, model):
    ok = True
    reference = {}
    for case in cases:
        layout, schedule = parse_case(case)
        failures = []
        if layout.batch not in reference:
            pipe = build_tiny(model)
            inputs = transformer_inputs(model, pipe.transformer, batch=max(2, layout.batch))
            with torch.no_grad():
                reference[layout.batch] = (inputs,
                                           pipe.transformer(**inputs, return_dict=False)[0])
        inputs, expected_out = reference[layout.batch]
        pipe = build_tiny(model)  # parallelize hooks a pipeline for good: a fresh one each
        with torch.no_grad():
            runtime = parallelize_hybrid(pipe, transport, schedule, layout, grid)
            runtime.records = []
            actual_out = pipe.transformer(**inputs, return_dict=False)[0]
            layer = runtime.plan.program(transport.rank).layers[0]
            first_call = runtime.records[: len(expected_records(layer))]
            if first_call != expected_records(layer):
                failures.append(f"runtime steps {first_call} != plan {expected_records(layer)}")
            runtime.records = None
        compared = [("transformer output", actual_out, expected_out)]
        if layout.batch == 1:
            if "latents" not in reference:
                reference["latents"] = pipeline_latents(build_tiny(model), model)
            with torch.no_grad():
                if hasattr(runtime, "start_generation"):
                    runtime.start_generation(STEPS)
                compared.append(("pipeline latents", pipeline_latents(pipe, model),
                                 reference["latents"]))
        label = (f"hybrid {transport.name} {transport.world_size} ranks "
                 f"{'x'.join(map(str, runtime.grid.shape))} {layout.name} {schedule} {model}")
        ok = report(transport, label, compared, failures) and ok
    return ok


if __name__ == "__main__":
    exit_rank(main(check))
