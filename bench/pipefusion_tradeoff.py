"""PipeFusion's pipelined steps, measured on a trained model: quality against the exact run.

One torchrun launch of ``--stages`` ranks (gloo; one rank per stage, N patches, as
``cocodiff run --schedule pipefusion --pipefusion N --warmup W`` runs it) generates every
``tiny-digits`` sample (digits 0-9, seeds 0..``--seeds``-1) with every step synchronous
(exact: warm-up = all steps) and then with each warm-up of ``--warmups`` (the steps after
it stream the patches with stale K/V). Per warm-up: PSNR / SSIM of the image and max abs
error of the latents against the exact sample, and the classifier's reading: the share
read as requested (accuracy) and as the exact sample was read (agreement).

V-Major's trade-off on the same model (``bench/vmajor_tradeoff.py``'s JSON, if given with
``--vmajor``) is printed and plotted beside it.

Writes JSON (default ``results/pipefusion_tradeoff.json``), prints a table, and plots
PSNR and agreement per warm-up (default ``docs/pipefusion_tradeoff.png``).

    python bench/pipefusion_tradeoff.py                  # 2 stages, warm-up 1, 100 samples
    python bench/pipefusion_tradeoff.py --warmups 1,2,4 --seeds 2 \
        --vmajor results/vmajor_tradeoff.json
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # run as a script or imported

from vmajor_tradeoff import torchrun_worker  # noqa: E402  (its launcher, shared)

MODEL = "tiny-digits"


def launch(stages: int, warmups: list[int], steps: int, seeds: int, work: Path,
           timeout_s: float) -> dict:
    """One torchrun launch of the worker below; returns rank 0's record."""
    return torchrun_worker(Path(__file__), stages, [
        "--stages", str(stages), "--warmups", ",".join(map(str, warmups)),
        "--steps", str(steps), "--seeds", str(seeds)], work / "pipefusion.json", timeout_s)


def worker(stages: int, warmups: list[int], steps: int, seeds: int, out: Path) -> None:
    """One rank: every sample exactly, then with each warm-up."""
    import torch

    from cocodiff.layout import PipelineLayout
    from cocodiff.models import load_object
    from cocodiff.quality import compare
    from cocodiff.runtime.digits import digit_prompt, read_agreement
    from cocodiff.runtime.pipefusion import parallelize_pipefusion
    from cocodiff.runtime.pipelines import decode, load_pipeline, run_pipeline
    from cocodiff.runtime.tiny import TINY_DEFAULTS
    from transports.registry import create_transport

    transport = create_transport("torch", timeout_s=300.0)
    defaults = TINY_DEFAULTS[MODEL]
    reader = load_object(defaults.reader)()
    samples = [(d, seed) for seed in range(seeds) for d in range(10)]

    def generate(runtime, pipe) -> tuple[list, float]:
        latents = []
        start = time.perf_counter()
        for digit, seed in samples:
            runtime.start_generation(steps)
            with torch.no_grad():
                latents.append(run_pipeline(pipe, digit_prompt(digit), steps, defaults.width,
                                            defaults.height, defaults.frames, seed,
                                            max_sequence_length=defaults.max_sequence_length))
        return latents, time.perf_counter() - start

    rows, exact, exact_images = [], None, None
    for warmup in warmups:
        # A fresh pipeline per layout: parallelising replaces the other stages' blocks.
        pipe = load_pipeline(MODEL)
        runtime = parallelize_pipefusion(pipe, transport,
                                         PipelineLayout(stages, 1, stages, warmup))
        if exact is None:
            runtime.exact = True
            exact, exact_s = generate(runtime, pipe)
            runtime.exact = False
            exact_images = [decode(pipe, x) for x in exact]
        latents, lossy_s = generate(runtime, pipe)
        if transport.rank != 0:
            continue
        per_sample = []
        for (digit, seed), ref, ref_image, x in zip(samples, exact, exact_images, latents,
                                                   strict=True):
            image = decode(pipe, x)
            per_sample.append({"digit": digit, "seed": seed,
                               **compare(ref, x, ref_image, image).to_json(),
                               "classifier": read_agreement(reader, digit_prompt(digit),
                                                            ref_image, image).to_json()})
        rows.append(_row(stages, warmup, steps, per_sample, exact_s, lossy_s))
    if transport.rank == 0:
        out.write_text(json.dumps({"runs": rows}))
    transport.barrier()
    transport.close()


def _row(stages: int, warmup: int, steps: int, per_sample: list, exact_s: float,
         lossy_s: float) -> dict:
    lossy = [s for s in per_sample if not s["identical_image"]]
    read = [s["classifier"] for s in per_sample]
    return {
        "model": MODEL, "layout": f"P{stages}xU1xM{stages}/w{warmup}", "stages": stages,
        "patches": stages, "warmup": warmup, "steps": steps, "samples": len(per_sample),
        "identical_images": len(per_sample) - len(lossy),
        "psnr_db_mean": (sum(s["psnr_db"] for s in lossy) / len(lossy)) if lossy else None,
        "psnr_db_min": min((s["psnr_db"] for s in lossy), default=None),
        "ssim_mean": sum(s["ssim"] for s in per_sample) / len(per_sample),
        "latent_max_abs_error": max(s["latent_max_abs_error"] for s in per_sample),
        "exact_accuracy": sum(r["exact_class"] == r["requested_class"] for r in read) / len(read),
        "accuracy": sum(r["lossy_class"] == r["requested_class"] for r in read) / len(read),
        "agreement_with_exact": sum(r["agree"] for r in read) / len(read),
        # Wall time of the whole sample set on this (shared, CPU) machine: no speed claim.
        "exact_s": exact_s, "pipelined_s": lossy_s,
        "per_sample": per_sample,
    }


def _vmajor_rows(path: Path | None) -> list[dict]:
    if path is None:
        return []
    runs = json.loads(path.read_text())["runs"]
    # Its summary only: the per-sample records stay in its own JSON.
    return [{k: v for k, v in r.items() if k != "per_sample"} for r in runs
            if r["model"] == MODEL and r["schedule"] != "constant:0"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages = ranks")
    parser.add_argument("--warmups", default="1", help="synchronous warm-up steps, a list")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=10, help="samples per digit")
    parser.add_argument("--vmajor", type=Path, default=None,
                        help="bench/vmajor_tradeoff.py's JSON, to set V-Major beside")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds")
    parser.add_argument("--json", type=Path,
                        default=REPO / "results" / "pipefusion_tradeoff.json")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "pipefusion_tradeoff.png")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        warmups = [int(w) for w in args.warmups.split(",") if w]
    except ValueError:
        warmups = []
    if args.worker:
        worker(args.stages, warmups, args.steps, args.seeds, args.json)
        return 0
    if (not warmups or min(warmups) < 1 or max(warmups) >= args.steps or args.seeds < 1
            or args.stages not in (2, 4)):
        print(f"pipefusion_tradeoff: error: --warmups {args.warmups!r} must be steps in "
              f"[1, --steps {args.steps}), --seeds >= 1, --stages 2 or 4 (tiny-digits has 4 "
              f"layers and 64 image tokens)", file=sys.stderr)
        return 2
    if args.vmajor is not None and not args.vmajor.is_file():
        print(f"pipefusion_tradeoff: error: no V-Major results at {args.vmajor}",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="cocodiff-pipefusion-") as work:
        try:
            rows = launch(args.stages, warmups, args.steps, args.seeds, Path(work),
                          args.timeout)["runs"]
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            print(f"pipefusion_tradeoff: error: {error}", file=sys.stderr)
            return 1
    vmajor = _vmajor_rows(args.vmajor)
    for row in rows:
        _print_row(row["layout"], row)
    for row in vmajor:
        _print_row(f"V-Major {row['schedule']}", row)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"runs": rows, "vmajor": vmajor}, indent=2))
    _plot(rows, vmajor, args.plot)
    print(f"wrote {args.json} and {args.plot}")
    return 0


def _print_row(label: str, row: dict) -> None:
    psnr = ("identical" if row["psnr_db_mean"] is None
            else f"{row['psnr_db_mean']:.1f} dB (min {row['psnr_db_min']:.1f})")
    print(f"{label:<22} {row['samples']:>4} samples  PSNR {psnr:>22}  SSIM "
          f"{row['ssim_mean']:.4f}  digits read {row['accuracy']:6.1%} (exact "
          f"{row['exact_accuracy']:.1%}), agree with exact {row['agreement_with_exact']:6.1%}",
          flush=True)


def _plot(rows: list[dict], vmajor: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(f"PipeFusion {r['layout']}", r) for r in rows]
    points += [(f"V-Major {r['schedule']}", r) for r in vmajor]
    points = [(label, r) for label, r in points if r["psnr_db_mean"] is not None]
    if not all(math.isfinite(r["psnr_db_mean"]) for _, r in points):
        raise ValueError("non-finite PSNR in the results")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    labels = [label for label, _ in points]
    colors = ["tab:blue" if label.startswith("PipeFusion") else "tab:orange"
              for label in labels]
    ys = range(len(points))
    axes[0].barh(ys, [r["psnr_db_mean"] for _, r in points], color=colors)
    axes[0].plot([r["psnr_db_min"] for _, r in points], ys, "k|", markersize=12,
                 label="worst sample")
    axes[0].axvline(30, color="grey", linestyle="--", linewidth=1)
    axes[0].set_yticks(list(ys), labels, fontsize=7)
    axes[0].set_xlabel("PSNR against the exact run (dB): mean, | worst")
    axes[0].legend(fontsize=7)
    axes[1].barh(ys, [r["agreement_with_exact"] * 100 for _, r in points], color=colors)
    axes[1].set_yticks(list(ys), [""] * len(points))
    axes[1].set_xlim(0, 100)
    axes[1].set_xlabel("digit read as in the exact sample (%)")
    samples = rows[0]["samples"] if rows else 0
    fig.suptitle(f"tiny-digits, {rows[0]['steps'] if rows else 0} steps: PipeFusion "
                 f"({samples} samples) beside V-Major", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
