"""The long fuzz run (outside CI): tests/commands/test_fuzz_inputs.py with more cases, new random
draws per seed, a few workers at low priority. Prints and writes (JSON) each seed's cases
per target and its failures.

    python tests/fuzz_long.py --seeds 1,2,3,4 --scale 2 --workers 2 --json results/fuzz.json

Each worker is one pytest process over the fuzz module (in-process cases, as in CI) with
``COCODIFF_FUZZ_RANDOM=1``, ``COCODIFF_FUZZ_EXAMPLES=scale`` and ``--hypothesis-seed``.
The real-process cases are fixed (not drawn), so only the first seed runs them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TALLY = re.compile(r"^fuzz: (\d+) cases tried$")
TARGET = re.compile(r"^  (.+): (\d+) \((.*)\)$")


def run_seed(seed: int, scale: float, real_processes: bool) -> dict:
    env = os.environ | {"COCODIFF_FUZZ_RANDOM": "1", "COCODIFF_FUZZ_EXAMPLES": str(scale),
                        "PYTHONPATH": str(REPO)}
    argv = ["nice", "-n", "10", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "tests/commands/test_fuzz_inputs.py", f"--hypothesis-seed={seed}"]
    if not real_processes:
        argv += ["-k", "not real_processes"]
    began = time.perf_counter()
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    cases, targets = 0, {}
    for line in result.stdout.splitlines():
        if match := TALLY.match(line):
            cases = int(match.group(1))
        elif match := TARGET.match(line):
            targets[match.group(1)] = {"cases": int(match.group(2)), "outcomes": match.group(3)}
    failed = re.findall(r"^FAILED (\S+)", result.stdout, re.MULTILINE)
    return {"seed": seed, "scale": scale, "cases": cases, "targets": targets,
            "failures": failed, "pytest_exit": result.returncode,
            "wall_s": time.perf_counter() - began,
            "tail": result.stdout[-3000:] if result.returncode else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3,4")
    parser.add_argument("--scale", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("results/fuzz_long.json"))
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    with ThreadPoolExecutor(args.workers) as pool:
        runs = list(pool.map(lambda s: run_seed(s, args.scale, s == seeds[0]), seeds))
    for run in runs:
        print(f"seed {run['seed']}: {run['cases']} cases, {len(run['failures'])} failures "
              f"({run['wall_s']:.0f} s)")
        for target, tally in sorted(run["targets"].items()):
            print(f"  {target}: {tally['cases']} ({tally['outcomes']})")
        for failure in run["failures"]:
            print(f"  FAILED {failure}")
    total = sum(run["cases"] for run in runs)
    failures = sum(len(run["failures"]) for run in runs)
    print(f"total: {total} cases over seeds {args.seeds}, {failures} failures")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"seeds": seeds, "scale": args.scale, "cases": total,
                                     "failures": failures, "runs": runs}, indent=2))
    sys.exit(1 if failures or any(run["pytest_exit"] for run in runs) else 0)


if __name__ == "__main__":
    main()
