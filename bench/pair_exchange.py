"""Every repeat of a pair exchange, as calibrate's pair sweep times them: does a pair move
both directions at once at every size?

Run with 2 ranks on 2 nodes of the emulated cluster (as root):

    python -m bench.cluster run --nodes 2 --ranks-per-node 1 --gbit 0.2 -- \\
        python bench/pair_exchange.py --json results/pair_exchange.json

Each size is exchanged ``--repeats`` times through the transport's all-to-all (the call
calibrate times: ``cocodiff.calibration.exchanges``), each after a 1-row exchange that
lines the two ranks up; rank 0 prints every time and the payload rate it means (each rank
sends the size and receives it). Measured on 2026-11-25 over gloo at 0.2 Gbit/s: from
64 KiB up, a varying share of the exchanges took twice as long as the others (one
direction after the other; 1 MiB: 44 or 86 ms); a raw TCP connection carrying both
directions at once kept 98% of the rate (``python -m bench.cluster selftest``). Hence
calibrate's pair sweep stops near the sizes a step sends (docs/validate.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_KIB = "64,256,1024,4096"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-kib", default=DEFAULT_KIB,
                        help=f"message sizes each way, KiB (default {DEFAULT_KIB})")
    parser.add_argument("--repeats", type=int, default=8, help="exchanges per size (default 8)")
    parser.add_argument("--transport", default="torch", help="torch (gloo) or mpi")
    parser.add_argument("--json", type=Path, default=None, help="write every time here")
    args = parser.parse_args()
    import torch

    from cocodiff.calibration.exchanges import timed_exchange
    from cocodiff.calibration.options import ROW_BYTES
    from transports.registry import create_transport

    transport = create_transport(args.transport)
    if transport.world_size != 2:
        sys.exit(f"pair_exchange: run 2 ranks, not {transport.world_size}")
    group = transport.world
    rows = []
    for kib in (int(part) for part in args.sizes_kib.split(",")):
        num_bytes = kib * 1024
        timed_exchange(transport, group, num_bytes, torch)  # warm-up
        times = []
        for _ in range(args.repeats):
            timed_exchange(transport, group, ROW_BYTES, torch)  # line up
            times.append(timed_exchange(transport, group, num_bytes, torch)[0])
        rows.append({"kib": kib, "seconds": times, "median_s": statistics.median(times),
                     "payload_gbit_at_min": num_bytes * 8 / min(times) / 1e9,
                     "payload_gbit_at_median": num_bytes * 8 / statistics.median(times) / 1e9})
        if transport.rank == 0:
            print(f"{kib:5d} KiB each way: " + " ".join(f"{t * 1e3:.1f}" for t in times)
                  + f" ms; {rows[-1]['payload_gbit_at_min']:.3f} Gbit/s at the fastest, "
                  f"{rows[-1]['payload_gbit_at_median']:.3f} at the median", flush=True)
    if transport.rank == 0 and args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"transport": transport.name, "rows": rows}, indent=1))
    transport.barrier()
    transport.close()


if __name__ == "__main__":
    main()
