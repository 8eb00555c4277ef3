"""What one PipeFusion patch costs on this machine, beside what the simulator charges for it.

Each block of a tiny FLUX model is timed (one process, one thread) on the image tokens of one
patch out of M, with the whole joint text, as a pipelined step calls it, except that its
attention stays within the patch (a pipelined step attends to the whole sequence's K/V:
``bench/pipefusion_attention.py`` times that); beside it, the FLOPs of the plan's patch
layer (``cocodiff.schedules.pipefusion``, attention against the whole sequence included),
which is what the compute model charges in proportion to (the blocks' effective rate).
Both are printed as ratios to M = 1: a measured ratio near 1 where the FLOPs' is about 1/M
means a patch costs nearly a whole layer here (per-op dispatch dominates a tiny model on a
CPU), which the simulator does not charge (docs/pipefusion.md, "In validate"). A
microbenchmark: nothing is fitted to it.

    python bench/pipefusion_patch_cost.py --json results/pipefusion_patch_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

FLUX = "FluxTransformer2DModel"


def _parse_patches(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--patches must be positive integers, got {text!r}") from None
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"--patches must be positive integers, got {text!r}")
    return sorted(set(values) | {1})


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def patch_layer(spec, image_tokens: int, text_tokens: int, patches: int) -> list:
    """The compute steps of one layer of one patch in the plan (one stage, one rank)."""
    from cocodiff.layout import PipelineLayout
    from cocodiff.plan.steps import Compute
    from cocodiff.schedules import PlanOptions, RankGrid
    from cocodiff.schedules.pipefusion import plan_pipefusion

    plan = plan_pipefusion(spec, RankGrid.line(1), (image_tokens, text_tokens),
                           PipelineLayout(1, 1, patches, 0), PlanOptions(dtype="float32"),
                           patches=patches, ring_from=0)
    layer = next(layer for layer in plan.program(0).layers
                 if any(isinstance(step, Compute) for step in layer.steps))
    return [step for step in layer.steps if isinstance(step, Compute)]


def time_blocks(transformer, image_tokens: int, text_tokens: int, repeats: int,
                calls: int) -> float:
    """Median seconds of one call of every block in turn, over ``repeats`` runs of
    ``calls`` calls each."""
    import torch

    config = transformer.config
    dim = config.num_attention_heads * config.attention_head_dim
    tokens = text_tokens + image_tokens
    hidden = torch.randn(1, image_tokens, dim)
    text = torch.randn(1, text_tokens, dim)
    temb = torch.randn(1, dim)
    # Rotary values do not change the work: cos 1, sin 0 over the call's tokens.
    rotary = (torch.ones(tokens, config.attention_head_dim),
              torch.zeros(tokens, config.attention_head_dim))
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]

    def once() -> None:
        for block in blocks:
            block(hidden_states=hidden, encoder_hidden_states=text, temb=temb,
                  image_rotary_emb=rotary)

    samples = []
    with torch.no_grad():
        for _ in range(max(2, calls // 4)):  # warm caches and allocator
            once()
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                once()
            samples.append((time.perf_counter() - start) / calls / len(blocks))
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipefusion_patch_cost", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--model", default="tiny-flux", help="a tiny FLUX model (default "
                        "tiny-flux)")
    parser.add_argument("--patches", type=_parse_patches, default=[1, 2, 4],
                        help="patch counts M, comma-separated (1 is always added; default "
                        "1,2,4)")
    parser.add_argument("--repeats", type=_positive, default=7,
                        help="timed runs per patch count, the median kept (default 7)")
    parser.add_argument("--calls", type=_positive, default=50,
                        help="calls of every block per timed run (default 50)")
    parser.add_argument("--topology", type=Path, default=None,
                        help="a calibrated topology (cocodiff calibrate): also print what its "
                        "compute model charges a patch's layer (cocodiff.cost.compute_seconds, "
                        "the tile's kernel rates when it has them)")
    parser.add_argument("--json", type=Path, default=Path("results/pipefusion_patch_cost.json"))
    args = parser.parse_args(argv)

    from cocodiff.runtime.quiet import quiet_libraries

    quiet_libraries()
    import torch

    from cocodiff.runtime.model_names import model_size, model_spec
    from cocodiff.runtime.pipelines import load_pipeline
    from cocodiff.runtime.tiny import TINY_DEFAULTS

    if args.model not in TINY_DEFAULTS:
        parser.error(f"--model must be a tiny model, got {args.model!r}")
    torch.set_num_threads(1)  # one rank's share of a core, as the runs have it
    transformer = load_pipeline(args.model, torch.float32).transformer
    if type(transformer).__name__ != FLUX:
        parser.error(f"--model {args.model} is a {type(transformer).__name__}; this times "
                     "FLUX blocks (tiny-flux)")
    spec = model_spec(args.model)
    width, height, frames = model_size(args.model, None)
    image = spec.image_tokens(width, height, frames)
    text = TINY_DEFAULTS[args.model].max_sequence_length
    uneven = [m for m in args.patches if image % m]
    if uneven:
        parser.error(f"--patches {uneven[0]} does not divide the {image} image tokens")
    tile = None
    if args.topology is not None:
        from topology import load_topology

        tile = load_topology(args.topology)
    rows = []
    for patches in args.patches:
        steps = patch_layer(spec, image, text, patches)
        row = {"patches": patches, "image_tokens": image // patches, "text_tokens": text,
               "measured_s": time_blocks(transformer, image // patches, text, args.repeats,
                                         args.calls),
               "plan_flops": sum(step.cost.flops for step in steps)}
        if tile is not None:
            from cocodiff.cost import compute_seconds

            row["charged_s"] = sum(compute_seconds(step.cost, tile) for step in steps)
        rows.append(row)
    whole = rows[0]
    print(f"{args.model}: one block call per patch, {text} text tokens with every patch "
          "(one thread; ratios to the whole image)")
    charged = " charged ms (ratio)" if tile is not None else ""
    print(f" M  image tokens   measured ms   measured ratio   FLOPs ratio{charged}")
    for row in rows:
        row["measured_ratio"] = row["measured_s"] / whole["measured_s"]
        row["flops_ratio"] = row["plan_flops"] / whole["plan_flops"]
        line = (f"{row['patches']:2d}  {row['image_tokens']:12d}   {row['measured_s'] * 1e3:11.3f}"
                f"   {row['measured_ratio']:14.2f}   {row['flops_ratio']:11.2f}")
        if tile is not None:
            row["charged_ratio"] = row["charged_s"] / whole["charged_s"]
            line += f" {row['charged_s'] * 1e3:10.3f} ({row['charged_ratio']:.2f})"
        print(line)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"model": args.model, "threads": 1,
                                     "topology": None if tile is None else str(args.topology),
                                     "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
