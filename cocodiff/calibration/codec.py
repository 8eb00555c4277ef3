"""V-Major's codec on this machine: what one selective message costs a rank's CPU at each
end (the sender choosing the blocks that changed most and packing them with their indices,
the receiver writing them into its copy: :class:`cocodiff.runtime.vmajor.SelectiveCodec`),
the host's ``codec_cpu_us``.

Measured on every rank at once, as calibrate measures compute (process CPU time, so a core
shared with other ranks does not inflate it: the simulator shares the cores), on the V
message a rank sends one member in flat Ulysses (the rank's tokens of the member's heads),
half its blocks chosen. The cost is mostly the dozen small tensor operations per message,
so it moves little with the message's size (a TAPA phase forwards several such rows): on
this 2-core machine an encode and a decode together took 75-85 us for 34 to 68 blocks of
16- and 32-wide heads, one rank alone; calibrate's figure per end on the emulated clusters
was 37-49 us.
"""

from __future__ import annotations

import statistics
import time

from cocodiff.calibration.collect import gather_floats
from cocodiff.calibration.model_shapes import LayerShapes

# Encode-decode pairs per round, and rounds (the median round is kept).
CODEC_MESSAGES = 100
CODEC_ROUNDS = 3
# The share of the blocks a timed message sends (V-Major's planned ratios run 0.3-0.7).
CODEC_FRACTION = 0.5


def measure_codec_cpu_s(transport, shapes: LayerShapes, dtype: str) -> float:
    """CPU seconds of one message at one end (an encode and a decode, halved), the median
    over ranks of each rank's median round (collective)."""
    import torch

    from cocodiff.plan.vblocks import block_tokens
    from cocodiff.runtime.vmajor import VMajorCache

    torch_dtype = getattr(torch, dtype)
    tokens = shapes.local_tokens
    row_shape = (1, tokens, shapes.head_dim)  # (samples, tokens, head_dim) per head
    gen = torch.Generator().manual_seed(transport.rank)
    # Two versions of the rows, so every step has changes to choose from.
    versions = [torch.randn(shapes.local_heads, *row_shape, generator=gen).to(torch_dtype)
                for _ in range(2)]
    blocks_per_row = tokens // block_tokens(tokens)
    cache = VMajorCache()

    def message(step: int) -> None:
        codec = cache.codec("v", step, 0, 0, CODEC_FRACTION, blocks_per_row)
        payload = codec.encode(0, 1, versions[step % 2])
        codec.decode(0, 1, payload, shapes.local_heads, row_shape, torch_dtype)

    message(0)  # the first message sends every block and fills the copies
    step = 1
    rounds = []
    for _ in range(CODEC_ROUNDS):
        transport.barrier()
        began = time.process_time()
        for _ in range(CODEC_MESSAGES):
            message(step)
            step += 1
        rounds.append((time.process_time() - began) / (2 * CODEC_MESSAGES))
    return statistics.median(row[0] for row in
                             gather_floats(transport, [statistics.median(rounds)]))
