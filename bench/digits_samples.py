"""tiny-digits under the exact schedule: how often the classifier reads the requested digit.

Single process, one batch: seeds 0..N-1 of each digit, one generator per sample (each
sample's noise is that of ``cocodiff run --model tiny-digits --prompt D --seed S``), 20
steps. Prints the share read as requested, overall and per digit, and writes a grid of
the first five seeds (digits in columns) to ``docs/tiny_digits_samples.png``.

    python bench/digits_samples.py            # 100 samples, as tests/runtime/test_digits.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TILE_PX = 34  # 32 pixels and a 1-pixel border each side


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "tiny_digits_samples.png")
    parser.add_argument("--json", type=Path, default=REPO / "results" / "digits_samples.json")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.steps < 1:
        print(f"digits_samples: error: --seeds {args.seeds} and --steps {args.steps} must be "
              ">= 1", file=sys.stderr)
        return 2
    from PIL import Image

    from cocodiff.runtime.digits import DigitReader, digit_prompt
    from cocodiff.runtime.pipelines import load_pipeline
    from cocodiff.runtime.tiny import TINY_DEFAULTS

    pipe = load_pipeline("tiny-digits")
    defaults = TINY_DEFAULTS["tiny-digits"]
    digits = [d for _ in range(args.seeds) for d in range(10)]
    generators = [torch.Generator().manual_seed(s) for s in range(args.seeds) for _ in range(10)]
    with torch.no_grad():
        images = pipe(prompt=[digit_prompt(d) for d in digits], num_inference_steps=args.steps,
                      width=defaults.width, height=defaults.height, generator=generators,
                      output_type="pt", use_resolution_binning=False, clean_caption=False,
                      max_sequence_length=defaults.max_sequence_length).images
    correct = DigitReader().read(images) == torch.tensor(digits)
    per_digit = [correct[torch.tensor(digits) == d].double().mean().item() for d in range(10)]
    result = {"samples": len(digits), "steps": args.steps,
              "read_as_requested": correct.double().mean().item(), "per_digit": per_digit}
    print(json.dumps(result))
    rows = min(5, args.seeds)
    grid = Image.new("L", (10 * TILE_PX, rows * TILE_PX), 255)
    for index in range(rows * 10):
        seed, digit = divmod(index, 10)
        # (3, 32, 32) in [0, 1] -> (32, 32) grey bytes
        tile = Image.fromarray((images[index].mean(0) * 255).round().byte().numpy(), "L")
        grid.paste(tile, (digit * TILE_PX + 1, seed * TILE_PX + 1))
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    grid.resize((grid.width * 2, grid.height * 2), Image.NEAREST).save(args.plot)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
