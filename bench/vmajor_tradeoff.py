"""V-Major's trade-off, measured: inter-node bytes saved against image quality.

For each built-in tiny model and each V-Major ratio schedule, run ``cocodiff run
--schedule cocodiff --reference`` on 4 ranks (2 nodes x 2, torchrun, gloo) and record
what the run reports: the share of V's inter-node blocks sent, the inter-node bytes of
all attention exchanges, and PSNR / SSIM of the image and the max abs error of the
latents against the exact plan (V-Major off) of the same launch. ``constant:0`` is run
too: the exact plan's inter-node bytes, against which the savings are given.

Writes JSON (default ``results/vmajor_tradeoff.json``), prints a table, and plots PSNR
against inter-node bytes (default ``docs/vmajor_tradeoff.png``).

    python bench/vmajor_tradeoff.py
    python bench/vmajor_tradeoff.py --models tiny-flux --schedules linear,constant:1 --steps 10

The tiny models have random weights: their images are not pictures, and how much V
changes between their steps need not match a trained model's. The figures show what
the machinery does and costs; a trained model's quality must be measured on it
(``cocodiff run --model DIR --schedule cocodiff --reference``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ("tiny-flux", "tiny-sd3", "tiny-qwen", "tiny-wan", "tiny-pixart")
SCHEDULES = ("constant:0", "linear:0.5", "linear:1", "constant:0.5", "constant:0.75",
             "constant:1")
DEFAULT_SCHEDULE = "linear:1"


def run_one(model: str, schedule: str, steps: int, work: Path, timeout_s: float) -> dict:
    """One launch; returns its JSON record."""
    record = work / f"{model}-{schedule.replace(':', '_')}.json"
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc-per-node", "4", "--no-python", sys.executable, "-m",
           "cocodiff", "run", "--quiet", "--model", model, "--schedule", "cocodiff",
           "--layout", "2x2x1", "--steps", str(steps), "--vmajor-ratio-schedule", schedule,
           "--reference", "--json", str(record)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COCODIFF_RENDEZVOUS_DIR": str(work)}
    job = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=timeout_s, stdin=subprocess.DEVNULL)
    if job.returncode != 0:
        last = (job.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{model} {schedule}: exit {job.returncode}: {last}")
    return json.loads(record.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help="V-Major ratio schedules (constant:0 is always added)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=600.0, help="per launch, seconds")
    parser.add_argument("--json", type=Path, default=REPO / "results" / "vmajor_tradeoff.json")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "vmajor_tradeoff.png")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    schedules = ["constant:0", *(s for s in args.schedules.split(",") if s and s != "constant:0")]
    unknown = sorted(set(models) - set(MODELS))
    if unknown or args.steps < 2:
        print(f"vmajor_tradeoff: error: unknown models {unknown} (valid: {', '.join(MODELS)}) "
              f"or --steps {args.steps} < 2", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="cocodiff-vmajor-") as work:
        for model in models:
            exact_bytes = None
            for schedule in schedules:
                try:
                    record = run_one(model, schedule, args.steps, Path(work), args.timeout)
                except (RuntimeError, subprocess.TimeoutExpired) as error:
                    print(f"vmajor_tradeoff: error: {error}", file=sys.stderr)
                    return 1
                inter = record["vmajor"]["bytes_by_tier"]["inter-node"]
                exact_bytes = inter if schedule == "constant:0" else exact_bytes
                quality = record["quality"]
                rows.append({
                    "model": model, "schedule": schedule, "steps": args.steps,
                    "v_blocks_sent": record["vmajor"]["sent_fraction"],
                    "inter_node_bytes": inter,
                    "inter_node_bytes_vs_exact": inter / exact_bytes,
                    "psnr_db": quality["psnr_db"], "ssim": quality["ssim"],
                    "latent_max_abs_error": quality["latent_max_abs_error"],
                    "v_cache_bytes": record["vmajor"]["cache_bytes"],
                    "median_step_s": sorted(record["step_times_s"])[len(record["step_times_s"])
                                                                     // 2],
                })
                _print_row(rows[-1])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"runs": rows}, indent=2))
    _plot(rows, args.plot)
    print(f"wrote {args.json} and {args.plot}")
    return 0


def _print_row(row: dict) -> None:
    psnr = "identical" if row["psnr_db"] is None else f"{row['psnr_db']:.1f} dB"
    print(f"{row['model']:<12} {row['schedule']:<13} V sent {row['v_blocks_sent']:6.1%}  "
          f"inter-node {row['inter_node_bytes_vs_exact']:6.1%} of exact  PSNR {psnr:>10}  "
          f"SSIM {row['ssim']:.4f}  max|dlatent| {row['latent_max_abs_error']:.2e}", flush=True)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    lossy = [r for r in rows if r["psnr_db"] is not None]
    for model in dict.fromkeys(r["model"] for r in lossy):
        points = sorted((r["inter_node_bytes_vs_exact"] * 100, r["psnr_db"], r["schedule"])
                        for r in lossy if r["model"] == model)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=model)
        for x, y, schedule in points:
            if model == lossy[0]["model"]:
                ax.annotate(schedule + (" (default)" if schedule == DEFAULT_SCHEDULE else ""),
                            (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(30, color="grey", linestyle="--", linewidth=1)
    ax.text(ax.get_xlim()[0], 30.5, "30 dB floor", fontsize=7, color="grey")
    ax.set_xlabel("inter-node bytes of all attention exchanges, % of the exact plan")
    ax.set_ylabel("PSNR of the image against the exact plan (dB)")
    steps = rows[0]["steps"] if rows else 0
    ax.set_title(f"V-Major on 2 nodes x 2 ranks, {steps} steps: bytes saved vs quality")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if lossy and not all(math.isfinite(r["psnr_db"]) for r in lossy):
        raise ValueError("non-finite PSNR in the results")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
