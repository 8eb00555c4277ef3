"""Does the compute model predict a real block on this device? The check of calibrate's
compute half, on an accelerator (or the CPU).

    python bench/device_block.py --model flux1-dev --resolution 1024 --dtype bfloat16 \\
        --json results/device_block.json
    python bench/device_block.py --small --json block.json     # a CPU's quick check

Three measurements, one run:

1. The kernel microbenchmarks calibrate fits the kernel model's rates on
   (:mod:`cocodiff.calibration.kernel_bench`: GEMMs at the layer's shapes, attention by
   sequence length, elementwise work by bytes, a launch, the host's time per ATen op in a
   stack of module calls), on the device, and the rates fitted to them alone
   (:mod:`cocodiff.calibration.kernel_fit`); the ATen ops the blocks dispatch per layer,
   counted (:mod:`cocodiff.calibration.dispatch`), give the model's host term.
2. The roofline microbenchmarks of ``measure_compute`` (the layer's projections, MLP,
   attention and an adaLN norm at the rank's shapes).
3. The model's real transformer blocks, built from its config with random weights and run
   as a rank of ``--world`` Ulysses ranks runs them (the runtime's processors over a
   transport that moves nothing), the device synchronised at each block's start and end.

It prints each model's price of one layer beside the blocks' measured time per layer: the
kernel model (:mod:`cocodiff.kernels`, eager) at the rates measured here, the same model at
``--rates`` (a preset's rates, ``h100-sxm``, or a topology file's ``[device]``, e.g. what
calibrate wrote), and the roofline of :mod:`cocodiff.cost` at ``measure_compute``'s rates.
Nothing is fitted to the blocks. A registry model (``flux1-dev``) is built with its block
lists cut by their greatest common divisor (FLUX: 19 double and 38 single blocks -> 1 and
2), so the blocks timed keep the model's mix of block kinds. On an accelerator times are
the wall clock with the device synchronised; on the CPU the process's CPU time (as
calibrate's).
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
                        help="device rates to predict the blocks with beside the ones "
                        "measured here: a preset's (topology.DEVICES) or a topology file's "
                        "[device] (calibrate's output); eager mode (docs/compute-model.md)")
    parser.add_argument("--small", action="store_true",
                        help="a quick check on a CPU: tiny-flux in float32 unless --model / "
                        "--dtype say otherwise, two short rounds of everything")
    args = parser.parse_args(argv)
    if args.small:
        given = set(argv if argv is not None else sys.argv[1:])
        args.model = args.model if "--model" in given else "tiny-flux"
        args.dtype = args.dtype if "--dtype" in given else "float32"
        args.rounds, args.round_s = 2, 0.03
    return args


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


def kernel_launches_per_layer(spec, shape) -> float:
    """Kernels the kernel model counts in one layer, eager."""
    from cocodiff import kernels
    from cocodiff.cost import OPS, op_cost

    return sum(kernels.launches(kernel, "eager") for op in OPS
               for kernel in op_cost(spec, op, shape).kernels)


def named_rates(name: str):
    """A preset's device rates by name, or a topology file's (its ``[device]``, else its
    preset's device)."""
    from topology import DEVICES, TopologyError, load_topology

    if name in DEVICES:
        return DEVICES[name]
    if not name.endswith(".toml"):
        raise SystemExit(f"device_block: unknown device rates {name!r} "
                         f"(valid: {', '.join(sorted(DEVICES))}, or a topology file)")
    try:
        rates = load_topology(name).device
    except TopologyError as exc:
        raise SystemExit(f"device_block: {exc}") from None
    if rates is None:
        raise SystemExit(f"device_block: {name} has no device rates ([device] or [tile] device)")
    return rates


def kernel_model_layer_s(spec, shape, rates_name: str, ops_per_layer: float | None = None
                         ) -> float:
    """One layer at ``shape`` by the kernel model (cocodiff.kernels) with the named
    device's rates, eager, the blocks' dispatched ATen ops ``ops_per_layer`` (counted;
    else the family's table): what a rank's real blocks should take on that device."""
    from cocodiff.calibration.kernel_bench import kernel_layer_seconds

    return kernel_layer_seconds(spec, shape, named_rates(rates_name),
                                ops_per_layer=ops_per_layer)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from cocodiff.calibration.blocks import build_transformer, time_blocks
    from cocodiff.calibration.compute import layer_roofline_seconds, measure_compute
    from cocodiff.calibration.dispatch import runtime_ops_per_block
    from cocodiff.calibration.kernel_bench import fit_points, kernel_layer_seconds, time_kernels
    from cocodiff.calibration.model_shapes import layer_shapes, model_tokens
    from cocodiff.runtime.quiet import quiet_libraries
    from cocodiff.schedules import DTYPE_BYTES
    from cocodiff.schedules.ulysses import head_split, layer_shape
    from transports.torch_dist import default_device

    quiet_libraries()
    named_rates(args.rates)  # a bad --rates is refused before anything is timed
    device = torch.device(args.device) if args.device else default_device(0)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # The CPU clock is the process's CPU time, every thread's: a second intra-op
        # thread spinning beside the first doubled the blocks' and the host stack's times
        # (docs/compute-model.md). One core, as the model prices a rank.
        torch.set_num_threads(1)
    spec, tokens, image = model_tokens(args.model, None, args.resolution)
    streams = (image, tokens - image)
    shapes = layer_shapes(args.model, None, args.resolution, args.world)
    began = time.perf_counter()
    kernel_points = time_kernels(shapes, args.dtype, device, max(1, args.rounds),
                                 min(0.03, args.round_s))
    fitted = fit_points(kernel_points, device)
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
    del transformer
    # What the blocks dispatch per layer, counted on a fresh copy (not timed): the host
    # term of the kernel model (docs/compute-model.md, "eager host").
    per_block, sizes = runtime_ops_per_block(config, streams, args.world, args.dtype, device)
    ops = sum(per_block[attr] * n for attr, n in sizes.items()) / sum(sizes.values())
    kernel_s = kernel_model_layer_s(spec, cost_shape, args.rates, ops)
    measured_rates_s = kernel_layer_seconds(spec, cost_shape, fitted.rates, ops_per_layer=ops)
    launches = kernel_launches_per_layer(spec, cost_shape)
    record = {
        "device": str(device),
        "device_name": (getattr(torch, device.type).get_device_name(device)
                        if device.type != "cpu" else "cpu"),
        "torch": torch.__version__,
        "model": args.model, "dtype": args.dtype, "world": args.world,
        "tokens": {"image": image, "text": tokens - image},
        "blocks_timed": timing.blocks, "block_lists_cut": cut,
        "clock": "wall, device synchronised" if device.type != "cpu" else "process CPU",
        "threads": torch.get_num_threads(),
        "microbenchmark": {"tflops": tflops, "memory_gbps": memory_gbps,
                           "op_seconds": op_seconds},
        "predicted_layer_s": predicted_s,
        "measured_layer_s": measured_s,
        "error": predicted_s / measured_s - 1,
        "kernel_model": {"rates": args.rates, "mode": "eager", "layer_s": kernel_s,
                         "error": kernel_s / measured_s - 1},
        "kernel_model_measured_rates": {
            "mode": "eager", "layer_s": measured_rates_s,
            "error": measured_rates_s / measured_s - 1, **fitted.to_json(),
            "points": kernel_points.to_json()},
        "measured_blocks": {"layer_s": timing.layer_s, "layer_wall_s": timing.layer_wall_s,
                            "outside_blocks_wall_s": timing.outside_blocks_wall_s},
        # Why eager blocks can take longer than their kernels: what they dispatch.
        "dispatch": {"aten_ops_per_layer": ops, "aten_ops_per_block": per_block,
                     "kernel_model_launches_per_layer": launches,
                     "measured_s_per_op": measured_s / ops,
                     "bare_launch_s_measured_here": fitted.rates.compiled_launch_us * 1e-6,
                     "host_s_per_op_measured_here": kernel_points.host_op_us * 1e-6,
                     "host_stack_ops": kernel_points.host_stack_ops},
        "seconds": time.perf_counter() - began,
    }
    print(f"{record['device_name']} ({device}), torch {torch.__version__}, {args.model} "
          f"{args.dtype}, {image}+{tokens - image} tokens, rank of {args.world}")
    print(f"  microbenchmarks: {tflops:.3g} TFLOP/s (matrix products), "
          f"{memory_gbps:.3g} GB/s (elementwise)")
    print(f"  per layer: cost model {predicted_s * 1e3:.3f} ms, measured {measured_s * 1e3:.3f} "
          f"ms over {timing.blocks} real blocks, error {record['error']:+.1%}")
    rates = fitted.rates
    print(f"  kernel microbenchmarks: GEMM {rates.gemm_tflops:.3g} TFLOP/s + "
          f"{rates.gemm_fixed_us:.2f} us, attention {rates.attention_tflops[-1][1]:.3g} TFLOP/s "
          f"at {rates.attention_tflops[-1][0]} tokens, elementwise {rates.memory_gbps:.3g} GB/s "
          f"+ {rates.compiled_launch_us:.2f} us per launch")
    print(f"  kernel model (rates measured here, eager): {measured_rates_s * 1e3:.3f} ms, error "
          f"{record['kernel_model_measured_rates']['error']:+.1%}")
    print(f"  kernel model ({args.rates}, eager): {kernel_s * 1e3:.3f} ms, error "
          f"{record['kernel_model']['error']:+.1%}")
    print(f"  dispatch: {ops:.0f} ATen ops per layer ({launches:.0f} kernel launches), "
          f"{measured_s / ops * 1e6:.2f} us of the measured layer per op; host per op as "
          f"model code issues them {kernel_points.host_op_us:.2f} us (a module stack of "
          f"{kernel_points.host_stack_ops} ops), a bare op {rates.compiled_launch_us:.2f} us")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))
    torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
