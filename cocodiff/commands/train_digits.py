"""Retrain ``tiny-digits`` and write its weights (:mod:`cocodiff.runtime.digits_train`).

    pip install scikit-learn          # only this needs it
    python -m cocodiff.commands.train_digits --out w.safetensors --json train.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cocodiff.runtime.digits import WEIGHTS_PATH
from cocodiff.runtime.digits_train import Budget, train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=WEIGHTS_PATH)
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    default = Budget()
    parser.add_argument("--transformer-steps", type=int, default=default.transformer_steps)
    parser.add_argument("--vae-steps", type=int, default=default.vae_steps)
    parser.add_argument("--classifier-steps", type=int, default=default.classifier_steps)
    args = parser.parse_args(argv)
    budget = Budget(classifier_steps=args.classifier_steps, vae_steps=args.vae_steps,
                    transformer_steps=args.transformer_steps)
    report = train(budget, args.out)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
