"""One rank of the PipeFusion parity checks (every step synchronous: warm-up = all
steps), for each model and each layout in turn:

1. the transformer's output on stage 0 and the last stage equals the single-process
   output;
2. this rank holds only its stage's blocks (the others are weightless stand-ins);
3. the p2p transfers it ran are the plan's (bytes of each send, in order);
4. the whole pipeline's final latents on stage 0 and the last stage equal the
   single-process pipeline's.

A case ``...wW`` (W synchronous warm-up steps, then pipelined ones streaming N patches,
over PIPELINED_STEPS steps) is lossy against diffusers; for it, instead:

1. the whole pipeline's final latents on stage 0 and the last stage equal the one-process
   serial emulation of the same stale-K/V algorithm (pipefusion_reference.py);
2. they differ from the exact (synchronous) latents: the stale K/V was used.

All in float32 with atol = rtol = 1e-5.

Usage: pipefusion_parity.py TRANSPORT LAYOUT CASE[,CASE...] MODEL...

A CASE is ``N`` (stages; Ulysses inside each over the rest of the ranks) or
``NxU``, either with an optional ``wW``. MODEL:LAYERS builds the tiny model's
transformer with LAYERS blocks of each kind (same config otherwise, seeded weights): the
tiny models have one, too few to split into stages. Rank 0 prints one line per model and
case with the largest differences; exits 0 when everything matches, prints each mismatch
and exits 1 otherwise.
"""

import torch
from ending import exit_rank
from parity import STEPS, main, pipeline_latents, report  # same dir
from pipefusion_reference import StaleKV
from probe import transformer_inputs

from cocodiff.layout import PipelineLayout
from cocodiff.plan.steps import Exchange
from cocodiff.runtime.backend import StepRecord
from cocodiff.runtime.pipefusion import parallelize_pipefusion
from cocodiff.runtime.pipelines import run_pipeline
from cocodiff.runtime.tiny import SEED, TINY_DEFAULTS, build_tiny

# A pipelined case's steps: the warm-up, a pipelined step that sends its patches back
# around the ring, and one that receives them.
PIPELINED_STEPS = 3

# The config fields that count a transformer's blocks, by class.
LAYER_FIELDS = {"FluxTransformer2DModel": ("num_layers", "num_single_layers"),
                "SD3Transformer2DModel": ("num_layers",),
                "PixArtTransformer2DModel": ("num_layers",)}


def build(model: str):
    """The tiny pipeline ``name`` or, for ``name:LAYERS``, with LAYERS blocks of each kind."""
    name, _, layers = model.partition(":")
    pipe = build_tiny(name)
    if layers:
        transformer_class = type(pipe.transformer)
        fields = LAYER_FIELDS[transformer_class.__name__]
        config = {**pipe.transformer.config, **dict.fromkeys(fields, int(layers))}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)  # every rank builds the same weights
            pipe.transformer = transformer_class.from_config(config).eval()
    return pipe


def parse_case(text: str, num_ranks: int) -> PipelineLayout:
    text, _, warmup = text.partition("w")
    stages, _, ulysses = text.partition("x")
    n = int(stages)
    u = int(ulysses) if ulysses else num_ranks // n
    if warmup:  # N patches, as xDiT's default
        return PipelineLayout(n, u, n, int(warmup))
    return PipelineLayout(n, u, 1, STEPS)


def latents(pipe, name, steps):
    defaults = TINY_DEFAULTS[name]
    return run_pipeline(pipe, "a red cat", steps, defaults.width, defaults.height,
                        defaults.frames, seed=1,
                        max_sequence_length=defaults.max_sequence_length)


def check_pipelined(transport, grid, layout, model):
    """A lossy case: the runtime's latents against the serial emulation's."""
    name = model.partition(":")[0]
    failures = []
    with torch.no_grad():
        exact = latents(build(model), name, PIPELINED_STEPS)
        pipe = build(model)
        runtime = parallelize_pipefusion(pipe, transport, layout, grid)
        runtime.start_generation(PIPELINED_STEPS)
        actual = latents(pipe, name, PIPELINED_STEPS)
        reference = build(model)
        emulation = StaleKV(reference.transformer,
                            list(layout.stage_layers(runtime.spec.num_layers)),
                            layout.patches, layout.warmup, layout.ulysses)
        emulation.start_generation()
        expected = latents(reference, name, PIPELINED_STEPS)
    compared = []
    if runtime.is_first or runtime.is_last:
        compared = [("latents vs serial emulation", actual, expected)]
        lossy = (expected - exact).abs().max().item()
        if not lossy > 1e-4:
            failures.append(f"the emulation is within {lossy:.1e} of the exact run: the "
                            "stale K/V was never used")
    label = (f"pipefusion {transport.name} {transport.world_size} ranks {layout.name} "
             f"{model} over {PIPELINED_STEPS} steps")
    return report(transport, label, compared, failures)


def planned_transfers(runtime, rank):
    return [StepRecord("exchange", step.tensor, step.send_bytes)
            for layer in runtime.plan.program(rank).layers for step in layer.attention
            if isinstance(step, Exchange) and step.direction == "p2p"]


def check(transport, grid, cases, model):
    ok = True
    name = model.partition(":")[0]
    pipe = build(model)
    inputs = transformer_inputs(name, pipe.transformer)
    with torch.no_grad():
        expected_out = pipe.transformer(**inputs, return_dict=False)[0]
        expected_latents = pipeline_latents(pipe, name)
    full = sum(p.numel() for p in pipe.transformer.parameters())
    for case in cases:
        layout = parse_case(case, transport.world_size)
        if layout.patches > 1:
            ok = check_pipelined(transport, grid, layout, model) and ok
            continue
        failures = []
        pipe = build(model)  # parallelising hooks a pipeline for good: a fresh one each
        with torch.no_grad():
            runtime = parallelize_pipefusion(pipe, transport, layout, grid)
            held = sum(p.numel() for p in pipe.transformer.parameters())
            if layout.stages > 1 and not held < full:
                failures.append(f"holds {held} parameters, the whole model {full}")
            runtime.records = []
            actual_out = pipe.transformer(**inputs, return_dict=False)[0]
            sent = [r for r in runtime.records if r.name in ("send", "recv")]
            if sent != planned_transfers(runtime, transport.rank):
                failures.append(f"transfers {sent} != plan "
                                f"{planned_transfers(runtime, transport.rank)}")
            runtime.records = None
            runtime.start_generation(STEPS)
            actual_latents = pipeline_latents(pipe, name)
        # Stage 0 and the last stage end with the run's output; middle stages do not.
        if runtime.is_first or runtime.is_last:
            compared = [("transformer output", actual_out, expected_out),
                        ("pipeline latents", actual_latents, expected_latents)]
        else:
            compared = []
        label = (f"pipefusion {transport.name} {transport.world_size} ranks "
                 f"{layout.stages} stages x ulysses {layout.ulysses} {model} "
                 f"(rank 0 holds {held}/{full} parameters)")
        ok = report(transport, label, compared, failures) and ok
    return ok


if __name__ == "__main__":
    exit_rank(main(check))
