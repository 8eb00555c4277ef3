"""Does the cost model predict a real block on this device? The compute half of calibration,
on an accelerator (or the CPU).

    python bench/device_block.py --model flux1-dev --resolution 1024 --dtype bfloat16 \\
        --json results/device_block.json

Two measurements, one run:

1. The microbenchmarks calibrate takes its rates from (``measure_compute``: the layer's
   projections, MLP, attention and an adaLN norm at the rank's shapes), on the device.
2. The model's real transformer blocks, built from its config with random weights and run
   as a rank of ``--world`` Ulysses ranks runs them (the runtime's processors over a
   transport that moves nothing), the device synchronised at each block's start and end.

It prints what :mod:`cocodiff.cost` charges one layer at the microbenchmarks' rates (the
roofline the simulator uses) against the blocks' measured time per layer: the error of the
cost model itself, before any communication. Nothing is fitted: the rates come only from the
microbenchmarks. A registry model (``flux1-dev``) is built with its block lists cut by their
greatest common divisor (FLUX: 19 double and 38 single blocks -> 1 and 2), so the blocks
timed keep the model's mix of block kinds. On an accelerator times are the wall clock with
the device synchronised; on the CPU the process's CPU time (as calibrate's).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="flux1-dev",
                        help="a registry model (flux1-dev) or a tiny one (tiny-flux)")
    parser.add_argument("--resolution", default=None, help="PIXELS or WIDTHxHEIGHT")
    parser.add_argument("--world", type=int, default=1,
                        help="time the share of one rank of this many Ulysses ranks")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--device", default=None,
                        help="cuda, xpu, cpu... (default: the accelerator, else the CPU)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-s", type=float, default=0.3,
                        help="seconds per timed round of block forwards")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--rates", default="h100-sxm",
                        help="the kernel model's device rates to predict the blocks with "
                        "(topology.DEVICES; docs/compute-model.md), in eager mode")
    return parser.parse_args(argv)


def model_config(model: str) -> tuple[dict, bool]:
    """``(transformer config, cut)``: a tiny model's own config, or a registry model's with
    its block lists cut by their greatest common divisor (``cut`` True)."""
    from cocodiff.calibration.model_shapes import tiny_transformer_config
    from cocodiff.models.families import FAMILIES

    tiny = tiny_transformer_config(model)
    if tiny is not None:
        return tiny, False
    for family in FAMILIES.values():
        for preset in family.presets:
            if preset.name == model:
                config = {"_class_name": family.transformer_classes[0], **preset.config}
                counts = {key: value for key, value in config.items()
                          if key.startswith("num_") and key.endswith("layers") and value}
                divisor = math.gcd(*counts.values())
                return config | {key: value // divisor for key, value in counts.items()}, True
    raise SystemExit(f"device_block: unknown model {model!r}")


def kernel_model_layer_s(spec, shape, rates_name: str) -> float:
    """One layer at ``shape`` by the kernel model (cocodiff.kernels) with the named
    device's rates, eager: what a rank's real blocks should take on that device."""
    from cocodiff import kernels
    from cocodiff.cost import OPS, op_cost
    from topology import DEVICES

    if rates_name not in DEVICES:
        raise SystemExit(f"device_block: unknown device rates {rates_name!r} "
                         f"(valid: {', '.join(sorted(DEVICES))})")
    rates = DEVICES[rates_name]
    return sum(kernels.device_seconds(op_cost(spec, op, shape).kernels, rates, "eager")
               for op in OPS if op_cost(spec, op, shape).kernels)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from cocodiff.calibration.blocks import build_transformer, time_blocks
    from cocodiff.calibration.compute import layer_roofline_seconds, measure_compute
    from cocodiff.calibration.model_shapes import layer_shapes, model_tokens
    from cocodiff.runtime.quiet import quiet_libraries
    from cocodiff.schedules import DTYPE_BYTES
    from cocodiff.schedules.ulysses import head_split, layer_shape
    from transports.torch_dist import default_device

    quiet_libraries()
    device = torch.device(args.device) if args.device else default_device(0)
    spec, tokens, image = model_tokens(args.model, None, args.resolution)
    streams = (image, tokens - image)
    shapes = layer_shapes(args.model, None, args.resolution, args.world)
    began = time.perf_counter()
    flops, memory, op_seconds = measure_compute(shapes, args.dtype, rounds=args.rounds,
                                                device=device)
    tflops, memory_gbps = flops / 1e12, memory / 1e9
    config, cut = model_config(args.model)
    transformer = build_transformer(config)
    timing = time_blocks(transformer, streams, args.world, 0, args.dtype, args.rounds,
                         args.round_s, device=device)
    measured_s = timing.layer_wall_s if device.type != "cpu" else timing.layer_s
    cost_shape = layer_shape(head_split(spec, args.world, streams), 0, DTYPE_BYTES[args.dtype])
    predicted_s = layer_roofline_seconds(spec, cost_shape, tflops, memory_gbps)
    kernel_s = kernel_model_layer_s(spec, cost_shape, args.rates)
    record = {
        "device": str(device),
        "device_name": (getattr(torch, device.type).get_device_name(device)
                        if device.type != "cpu" else "cpu"),
        "torch": torch.__version__,
        "model": args.model, "dtype": args.dtype, "world": args.world,
        "tokens": {"image": image, "text": tokens - image},
        "blocks_timed": timing.blocks, "block_lists_cut": cut,
        "clock": "wall, device synchronised" if device.type != "cpu" else "process CPU",
        "microbenchmark": {"tflops": tflops, "memory_gbps": memory_gbps,
                           "op_seconds": op_seconds},
        "predicted_layer_s": predicted_s,
        "measured_layer_s": measured_s,
        "error": predicted_s / measured_s - 1,
        "kernel_model": {"rates": args.rates, "mode": "eager", "layer_s": kernel_s,
                         "error": kernel_s / measured_s - 1},
        "measured_blocks": {"layer_s": timing.layer_s, "layer_wall_s": timing.layer_wall_s,
                            "outside_blocks_wall_s": timing.outside_blocks_wall_s},
        "seconds": time.perf_counter() - began,
    }
    print(f"{record['device_name']} ({device}), torch {torch.__version__}, {args.model} "
          f"{args.dtype}, {image}+{tokens - image} tokens, rank of {args.world}")
    print(f"  microbenchmarks: {tflops:.3g} TFLOP/s (matrix products), "
          f"{memory_gbps:.3g} GB/s (elementwise)")
    print(f"  per layer: cost model {predicted_s * 1e3:.3f} ms, measured {measured_s * 1e3:.3f} "
          f"ms over {timing.blocks} real blocks, error {record['error']:+.1%}")
    print(f"  kernel model ({args.rates}, eager): {kernel_s * 1e3:.3f} ms, error "
          f"{record['kernel_model']['error']:+.1%}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
