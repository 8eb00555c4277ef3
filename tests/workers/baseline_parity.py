"""One rank of the diffusers-baseline parity check: for each tiny model, the whole
pipeline's final latents under diffusers' own Ulysses context parallelism
(``cocodiff.runtime.baseline``, as ``cocodiff run --schedule diffusers`` enables it) equal
the single-process pipeline's, in float32 with atol = rtol = 1e-5, and diffusers really
ran its Ulysses all-to-alls (so the parallel path was taken, not a silent fallback).

Usage: baseline_parity.py MODEL...

Rank 0 prints one line per model with the largest difference; exits 0 when everything
matches, prints each mismatch and exits 1 otherwise.
"""

import sys

import torch
from diffusers.models import attention_dispatch
from ending import exit_rank

from cocodiff.runtime.baseline import enable_diffusers_ulysses
from cocodiff.runtime.pipelines import run_pipeline
from cocodiff.runtime.tiny import TINY_DEFAULTS, build_tiny
from transports.registry import create_transport

STEPS = 2


def latents(pipe, model):
    defaults = TINY_DEFAULTS[model]
    with torch.no_grad():
        return run_pipeline(pipe, "a red cat", STEPS, defaults.width, defaults.height,
                            defaults.frames, seed=1,
                            max_sequence_length=defaults.max_sequence_length)


class CountingAllToAll:
    """Wraps diffusers' Ulysses all-to-all and counts the calls."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def check(transport, model):
    expected = latents(build_tiny(model), model)
    pipe = build_tiny(model)
    enable_diffusers_ulysses(pipe, transport)
    counter = CountingAllToAll(attention_dispatch._all_to_all_single)
    attention_dispatch._all_to_all_single = counter
    try:
        actual = latents(pipe, model)
    finally:
        attention_dispatch._all_to_all_single = counter.inner
    failures = []
    if counter.calls == 0:
        failures.append("diffusers ran no Ulysses all-to-all")
    try:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    except AssertionError as error:
        failures.append(str(error))
    if transport.rank == 0:
        print(f"baseline-parity diffusers {transport.world_size} ranks {model}: max abs diff "
              f"{(actual - expected).abs().max().item():.1e}, {counter.calls} all-to-alls",
              flush=True)
    for failure in failures:
        print(f"rank {transport.rank}: {model}: {failure}", flush=True)
    return not failures


def main():
    transport = create_transport("torch")
    try:
        results = [check(transport, model) for model in sys.argv[1:]]
    finally:
        transport.close()
    return 0 if all(results) else 1


if __name__ == "__main__":
    exit_rank(main())
