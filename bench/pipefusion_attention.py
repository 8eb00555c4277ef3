"""A PipeFusion patch's attention beside a Ulysses rank's of the same FLOPs, as the runtime
calls them, on this machine's CPU.

A pipelined step attends each patch's queries (its image rows and the whole text) against
the K/V of the whole sequence over all heads; a rank of Ulysses degree U attends all the
queries over 1/U of the heads. At U = M the two do the same FLOPs; calibrate times the
patch's whole attention step against the Ulysses call for the kernel model's query factor
(``attention_query_factor``, docs/compute-model.md). Each is timed (one
thread, process CPU) through diffusers' ``dispatch_attention_fn`` on (batch, tokens, heads,
head size) tensors, as ``cocodiff.runtime`` calls it, and as a contiguous
``scaled_dot_product_attention``, as calibrate times attention. A microbenchmark: nothing
is fitted to it (docs/pipefusion.md, "On the emulated cluster").

    python bench/pipefusion_attention.py --json results/pipefusion_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _positive_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(value < 2 for value in values):
        raise argparse.ArgumentTypeError(f"expected integers of at least 2, got {text!r}")
    return sorted(set(values))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def cpu_seconds(call, repeats: int, calls: int) -> float:
    """Median process-CPU seconds of one ``call`` over ``repeats`` runs of ``calls``."""
    for _ in range(2):  # warm caches and the allocator
        call()
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            call()
        samples.append((time.process_time() - start) / calls)
    return statistics.median(samples)


def time_shape(queries: int, keys: int, heads: int, head_dim: int, repeats: int,
               calls: int) -> dict[str, float]:
    """One attention shape through the runtime's call and as calibrate times it."""
    import torch
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from torch.nn import functional as F

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, heads, head_dim, generator=gen)
               for n in (queries, keys, keys))
    qc, kc, vc = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    with torch.inference_mode():
        runtime = cpu_seconds(lambda: dispatch_attention_fn(q, k, v), repeats, calls)
        contiguous = cpu_seconds(lambda: F.scaled_dot_product_attention(qc, kc, vc), repeats,
                                 calls)
    flops = 4.0 * queries * keys * heads * head_dim
    return {"queries": queries, "keys": keys, "heads": heads, "flops": flops,
            "runtime_s": runtime, "contiguous_s": contiguous}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipefusion_attention",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--image-tokens", type=_positive, default=1024,
                        help="image tokens of the whole sequence (default 1024: the enlarged "
                        "tiny-flux at 512 px)")
    parser.add_argument("--text-tokens", type=_positive, default=16,
                        help="text tokens, with every patch (default 16)")
    parser.add_argument("--heads", type=_positive, default=8, help="attention heads (default 8)")
    parser.add_argument("--head-dim", type=_positive, default=32,
                        help="channels per head (default 32)")
    parser.add_argument("--patches", type=_positive_list, default=[2, 4],
                        help="patch counts M, each set beside Ulysses U = M (default 2,4)")
    parser.add_argument("--repeats", type=_positive, default=7,
                        help="timed runs per shape, the median kept (default 7)")
    parser.add_argument("--calls", type=_positive, default=20,
                        help="calls per timed run (default 20)")
    parser.add_argument("--json", type=Path, default=Path("results/pipefusion_attention.json"))
    args = parser.parse_args(argv)
    for m in args.patches:
        if args.image_tokens % m or args.heads % m:
            parser.error(f"--patches {m} does not divide the {args.image_tokens} image tokens "
                         f"and the {args.heads} heads")

    import torch

    torch.set_num_threads(1)  # one rank's share of a core, as the runs have it
    tokens = args.image_tokens + args.text_tokens
    rows = []
    print(f"{tokens} tokens, {args.heads} heads x {args.head_dim}; process CPU ms per call, "
          "one thread (the runtime's call / contiguous, as calibrate times it)")
    print(" M   patch: queries  runtime  contig.   Ulysses U=M: heads  runtime  contig."
          "   patch / Ulysses")
    for m in args.patches:
        patch = time_shape(args.image_tokens // m + args.text_tokens, tokens, args.heads,
                           args.head_dim, args.repeats, args.calls)
        ulysses = time_shape(tokens, tokens, args.heads // m, args.head_dim, args.repeats,
                             args.calls)
        row = {"patches": m, "patch": patch, "ulysses": ulysses,
               "runtime_ratio": patch["runtime_s"] / ulysses["runtime_s"],
               "contiguous_ratio": patch["contiguous_s"] / ulysses["contiguous_s"],
               "flops_ratio": patch["flops"] / ulysses["flops"]}
        rows.append(row)
        print(f"{m:2d}  {patch['queries']:14d} {patch['runtime_s'] * 1e3:8.3f} "
              f"{patch['contiguous_s'] * 1e3:8.3f}   {ulysses['heads']:17d} "
              f"{ulysses['runtime_s'] * 1e3:8.3f} {ulysses['contiguous_s'] * 1e3:8.3f}   "
              f"{row['runtime_ratio']:.2f} ({row['contiguous_ratio']:.2f} contig.; FLOPs "
              f"{row['flops_ratio']:.2f})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"image_tokens": args.image_tokens,
                                     "text_tokens": args.text_tokens, "heads": args.heads,
                                     "head_dim": args.head_dim, "threads": 1, "rows": rows},
                                    indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
