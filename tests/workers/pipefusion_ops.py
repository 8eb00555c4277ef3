"""One rank of the PipeFusion dispatch count: the ATen ops each block of this rank's stage
dispatches per call in a pipelined step (one patch through the block), counted with a
``TorchDispatchMode`` between the block's forward pre-hook and its forward hook, as
``cocodiff.calibration.dispatch.ops_per_block`` counts a step's blocks
(``cocodiff.kernels.PIPELINE_DISPATCHED_OPS`` holds the counts).

Usage: pipefusion_ops.py TRANSPORT line CASE[,CASE...] MODEL...

CASE as in pipefusion_parity.py, with a warm-up (``4w1``: 4 stages of one rank; ``2w1``:
2 stages x Ulysses over the rest). Every rank prints one line per block kind it holds:
``ops CASE MODEL KIND COUNT`` (the mean over its pipelined calls; every call of a kind
counts the same).
"""

import os
import sys

import torch
from ending import exit_rank
from parity import main  # same dir
from pipefusion_parity import PIPELINED_STEPS, build, latents, parse_case
from torch.utils._python_dispatch import TorchDispatchMode

from cocodiff.runtime.pipefusion import parallelize_pipefusion

# The block lists of each transformer class, by kind (cocodiff.kernels' names).
KINDS = {"FluxTransformer2DModel": {"double": "transformer_blocks",
                                    "single": "single_transformer_blocks"},
         "SD3Transformer2DModel": {"joint": "transformer_blocks"}}


def pipelined_ops(transport, grid, case, model):
    """``{kind: ATen ops per pipelined block call}`` of this rank's stage."""
    layout = parse_case(case, transport.world_size)
    assert layout.patches > 1, f"{case}: give a warm-up (e.g. {case}w1) to pipeline"
    pipe = build(model)
    transformer = pipe.transformer
    # The blocks themselves, before the runtime wraps its stage's and stands in for the
    # rest: a pipelined step calls these once per patch.
    blocks = {kind: list(getattr(transformer, attr))
              for kind, attr in KINDS[type(transformer).__name__].items()}
    runtime = parallelize_pipefusion(pipe, transport, layout, grid)
    current, counts, calls = [None], {}, {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if current[0] is not None:
                counts[current[0]] = counts.get(current[0], 0) + 1
            return func(*args, **(kwargs or {}))

    def enter(kind):
        def hook(*_):
            # Only a pipelined step's calls (a patch through the block) count.
            current[0] = kind if runtime.pipelined else None
            if current[0] is not None:
                calls[kind] = calls.get(kind, 0) + 1
        return hook

    for kind, modules in blocks.items():
        for module in modules:  # only the stage's own are called
            module.register_forward_pre_hook(enter(kind))
            module.register_forward_hook(lambda *_: current.__setitem__(0, None))
    runtime.start_generation(PIPELINED_STEPS)
    with torch.no_grad(), Count():
        latents(pipe, model.partition(":")[0], PIPELINED_STEPS)
    return {kind: counts.get(kind, 0) / calls[kind] for kind in sorted(calls)}


def check(transport, grid, cases, model):
    for case in cases:
        for kind, count in pipelined_ops(transport, grid, case, model).items():
            # One write per line: the ranks share stdout, and a short write is atomic.
            os.write(sys.stdout.fileno(), f"ops {case} {model} {kind} {count:g}\n".encode())
    return True


if __name__ == "__main__":
    exit_rank(main(check))
