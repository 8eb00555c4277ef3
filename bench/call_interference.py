"""What exchange calls cost beside a model's real blocks: a check of calibrate's loaded
loops against calls placed where a step places them (docs/host-model.md).

Run under torchrun, every rank on this machine:

    torchrun --nproc-per-node 4 bench/call_interference.py --model DIR --resolution 256 \\
        --topology calibrated.toml --json results/call_interference.json

Every rank runs the model's transformer on its local shard (as calibrate times it), in
three loops, every rank at once, 3 rounds, the median round:

* the forward alone;
* the forward with 4 world all-to-all calls around each block (2 before, 2 after) and
  one after the forward: a flat step's 4 exchanges per layer and its output gather;
* the forward, then as many calls back to back.

It prints each loop's CPU and wall time per iteration and, with ``--topology`` (a
calibrated TOML with a ``[host]`` table), what that table charges for the calls
(``calls x (call_cpu_us + messages x message_cpu_us)``, bytes at ``copy_gbps``) beside
the CPU the calls added. No step of the runtime runs here: the plan, its executor and its
packing are not in these loops.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

EXCHANGES_PER_BLOCK = 4
BYTES_PER_PEER = 8 * 1024  # the small model's Q/K/V rows to one peer, about


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a tiny model or an exported directory")
    parser.add_argument("--resolution", default="256")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--topology", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from cocodiff.calibration.blocks import block_timing, build_transformer
    from cocodiff.calibration.model_shapes import model_tokens, tiny_transformer_config
    from transports.registry import create_transport

    transport = create_transport("torch")
    world, rank = transport.world_size, transport.rank
    config = tiny_transformer_config(args.model)
    if config is None:
        raise SystemExit(f"cannot build the transformer of {args.model}")
    _spec, tokens, image = model_tokens(args.model, None, args.resolution)
    transformer = build_transformer(config)
    build_inputs, lists = block_timing(type(transformer).__name__)
    inputs = build_inputs(transformer.config, math.ceil(image / world),
                          math.ceil((tokens - image) / world), torch.float32)
    blocks = [block for attr in lists for block in getattr(transformer, attr)]
    rows = BYTES_PER_PEER // 1024
    splits = [0 if member == rank else rows for member in range(world)]
    send = torch.empty((sum(splits), 1024), dtype=torch.uint8)

    def call() -> None:
        transport.all_to_all(send, splits, splits, transport.world).wait()

    calls = EXCHANGES_PER_BLOCK * len(blocks) + 1

    def forward() -> None:
        transformer(**inputs, return_dict=False)

    def interleaved() -> None:
        forward()  # with the hooks below in place
        call()

    def back_to_back() -> None:
        forward()
        for _ in range(calls):
            call()

    def around(_module, *_args) -> None:
        for _ in range(EXCHANGES_PER_BLOCK // 2):
            call()

    def loop(body) -> tuple[float, float]:
        transport.barrier()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(args.iterations):
            body()
        transport.barrier()
        return ((time.process_time() - cpu) / args.iterations,
                (time.perf_counter() - wall) / args.iterations)

    samples: dict[str, list[tuple[float, float]]] = {"alone": [], "interleaved": [],
                                                     "back_to_back": []}
    with torch.inference_mode():
        for _ in range(args.rounds):
            samples["alone"].append(loop(forward))
            hooks = [hook for block in blocks for hook in (
                block.register_forward_pre_hook(around), block.register_forward_hook(around))]
            samples["interleaved"].append(loop(interleaved))
            for hook in hooks:
                hook.remove()
            samples["back_to_back"].append(loop(back_to_back))
    mine = {name: {"cpu_s": statistics.median(c for c, _ in values),
                   "wall_s": statistics.median(w for _, w in values)}
            for name, values in samples.items()}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        report = _report(everyone, calls, world, args)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2))
    transport.close()


def _report(everyone: list, calls: int, world: int, args) -> dict:
    loops = {name: {"cpu_s": statistics.mean(r[name]["cpu_s"] for r in everyone),
                    "wall_s": max(r[name]["wall_s"] for r in everyone)}
             for name in everyone[0]}
    print(f"{world} ranks, {calls} world calls of {BYTES_PER_PEER // 1024} KiB per peer per "
          f"iteration (mean CPU over ranks, slowest wall):")
    for name, values in loops.items():
        print(f"  {name:13s} CPU {values['cpu_s'] * 1e3:7.2f} ms   wall "
              f"{values['wall_s'] * 1e3:7.2f} ms")
    report = {"ranks": everyone, "loops": loops, "calls": calls,
              "bytes_per_peer": BYTES_PER_PEER}
    for name in ("interleaved", "back_to_back"):
        added = (loops[name]["cpu_s"] - loops["alone"]["cpu_s"]) / calls
        report[f"{name}_cpu_per_call_s"] = added
        print(f"  {name}: the calls added {added * 1e6:.0f} us of CPU each")
    if args.topology is not None:
        from topology import load_topology

        host = load_topology(args.topology).host
        if host is not None:
            messages = 2 * (world - 1)
            charged = host.exchange_cpu_s(messages, messages * BYTES_PER_PEER, calls=1)
            report["charged_cpu_per_call_s"] = charged
            print(f"  {args.topology} charges {charged * 1e6:.0f} us per call "
                  f"({host.call_cpu_us:.0f} per call + {messages} x "
                  f"{host.message_cpu_us:.0f} per message + bytes)")
    return report


if __name__ == "__main__":
    main()
