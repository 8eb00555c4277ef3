"""V-Major's trade-off, measured: inter-node bytes saved against image quality.

For each model, one launch of 4 ranks (2 nodes x 2, torchrun, gloo) parallelises the
pipeline under the ``cocodiff`` schedule exactly as ``cocodiff run --schedule cocodiff
--grid 2x2x1`` does, and generates every sample under the exact plan (V-Major off) and
under each V-Major ratio schedule. Per schedule it records the share of V's inter-node
blocks sent (overall and step by step), the inter-node bytes of all attention exchanges,
and per sample PSNR / SSIM of the image and the max abs error of the latents against the
exact plan's sample. ``constant:0`` is run too: the exact plan's inter-node bytes, against
which the savings are given.

``tiny-digits`` (trained, :mod:`cocodiff.runtime.digits`) generates every digit for
``--seeds`` seeds, and its classifier reads each image: the share read as the requested
digit (accuracy), and the share read as the exact plan's sample was read (agreement).
The random-weight tiny models generate their default prompt once: their images are not
pictures, and how much their V changes between steps says nothing of a trained model.

Writes JSON (default ``results/vmajor_tradeoff.json``), prints a table, and plots PSNR and
classifier accuracy against inter-node bytes (default ``docs/vmajor_tradeoff.png``).

    python bench/vmajor_tradeoff.py                       # tiny-digits, 10 seeds per digit
    python bench/vmajor_tradeoff.py --models tiny-digits,tiny-flux --seeds 2
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
MODELS = ("tiny-digits", "tiny-flux", "tiny-sd3", "tiny-qwen", "tiny-wan", "tiny-pixart")
SCHEDULES = ("constant:0", "linear:0.5", "linear:1", "constant:0.5", "constant:0.75",
             "constant:1")
DEFAULT_SCHEDULE = "linear:1"
NUM_RANKS, LAYOUT = 4, "2x2x1"


def launch(model: str, schedules: list[str], steps: int, seeds: int, work: Path,
           timeout_s: float) -> dict:
    """One torchrun launch of the worker below; returns rank 0's record."""
    try:
        return torchrun_worker(Path(__file__), NUM_RANKS, [
            "--models", model, "--schedules", ",".join(schedules), "--steps", str(steps),
            "--seeds", str(seeds)], work / f"{model}.json", timeout_s)
    except RuntimeError as error:
        raise RuntimeError(f"{model}: {error}") from None


def torchrun_worker(script: Path, ranks: int, args: list[str], record: Path,
                    timeout_s: float) -> dict:
    """``script --worker ARGS --json RECORD`` on ``ranks`` torchrun ranks (one thread
    each, rendezvous files beside ``record``); returns the record rank 0 wrote.

    Raises:
        RuntimeError: the job failed (its last error line).
    """
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc-per-node", str(ranks), "--no-python", sys.executable,
           str(script.resolve()), "--worker", *args, "--json", str(record)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COCODIFF_RENDEZVOUS_DIR": str(record.parent),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    job = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=timeout_s, stdin=subprocess.DEVNULL)
    if job.returncode != 0:
        errors = [line for line in job.stderr.splitlines() if "Error" in line]
        last = (errors or job.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"exit {job.returncode}: {last}")
    return json.loads(record.read_text())


def worker(model: str, schedules: list[str], steps: int, seeds: int, out: Path) -> None:
    """One rank: every sample under the exact plan, then under each schedule."""
    from cocodiff.commands.run import rank_grid
    from cocodiff.models import load_object
    from cocodiff.quality import compare
    from cocodiff.runtime.digits import digit_prompt, read_agreement
    from cocodiff.runtime.parallel import parallelize
    from cocodiff.runtime.pipelines import decode, load_pipeline, run_pipeline
    from cocodiff.runtime.tiny import TINY_DEFAULTS
    from cocodiff.runtime.vmajor import gather_activity
    from cocodiff.schedules.vmajor import VMajorOptions
    from transports.registry import create_transport

    transport = create_transport("torch", timeout_s=300.0)
    defaults = TINY_DEFAULTS[model]
    pipe = load_pipeline(model)
    runtime = parallelize(pipe, transport, "cocodiff", rank_grid(LAYOUT, NUM_RANKS))
    reader = load_object(defaults.reader)() if defaults.reader else None
    # (requested digit or None, prompt, seed) of every sample
    samples = ([(d, digit_prompt(d), seed) for seed in range(seeds) for d in range(10)]
               if reader else [(None, defaults.prompt, 0)])

    def generate(options: VMajorOptions | None) -> tuple[list, dict | None]:
        runtime.vmajor = options
        latents, reports = [], []
        for _, prompt, seed in samples:
            runtime.start_generation(steps)
            runtime.bytes_by_tier = dict.fromkeys(runtime.bytes_by_tier, 0)
            latents.append(run_pipeline(pipe, prompt, steps, defaults.width, defaults.height,
                                        defaults.frames, seed,
                                        max_sequence_length=defaults.max_sequence_length))
            if options is not None:  # the exact plan records no V-Major activity
                reports.append(gather_activity(runtime))
        return latents, _activity_summary(reports, steps) if reports else None

    exact, _ = generate(None)
    exact_images = [decode(pipe, x) for x in exact]
    rows = []
    for schedule in schedules:
        latents, activity = generate(VMajorOptions.parse(schedule))
        if transport.rank != 0:
            continue
        per_sample = []
        for (digit, _, seed), ref, ref_image, x in zip(samples, exact, exact_images, latents,
                                                       strict=True):
            image = decode(pipe, x)
            entry = {"digit": digit, "seed": seed,
                     **compare(ref, x, ref_image, image).to_json()}
            if reader is not None:
                entry["classifier"] = read_agreement(reader, digit_prompt(digit), ref_image,
                                                     image).to_json()
            per_sample.append(entry)
        rows.append(_row(model, schedule, steps, activity, per_sample))
    if transport.rank == 0:
        out.write_text(json.dumps({"runs": rows}))
    transport.barrier()
    transport.close()


def _activity_summary(reports: list, steps: int) -> dict:
    """Blocks and bytes over the samples, and the share of V blocks sent step by step."""
    blocks_sent = sum(report.blocks_sent for report, _ in reports)
    blocks_total = sum(report.blocks_total for report, _ in reports)
    inter = sum(report.bytes_by_tier.get("inter-node", 0) for report, _ in reports)
    per_step = [0.0] * steps
    for _, trace in reports:
        for step, members in enumerate(trace.sent):
            sent = total = 0
            for member, layers in enumerate(members):
                blocks = (trace.blocks_per_rank if isinstance(trace.blocks_per_rank, int)
                          else trace.blocks_per_rank[member])
                total += blocks * len(layers)
                sent += sum(blocks if chosen is None else len(chosen) for chosen in layers)
            per_step[step] += sent / total / len(reports)
    return {"blocks_sent": blocks_sent, "blocks_total": blocks_total,
            "inter_node_bytes": inter, "sent_fraction_by_step": per_step,
            "cache_bytes": max(report.cache_bytes for report, _ in reports)}


def _row(model: str, schedule: str, steps: int, activity: dict, per_sample: list) -> dict:
    lossy = [s for s in per_sample if not s["identical_image"]]
    row = {
        "model": model, "schedule": schedule, "steps": steps, "samples": len(per_sample),
        "v_blocks_sent": activity["blocks_sent"] / activity["blocks_total"],
        "v_sent_fraction_by_step": activity["sent_fraction_by_step"],
        "inter_node_bytes": activity["inter_node_bytes"],
        "v_cache_bytes": activity["cache_bytes"],
        # PSNR over the samples whose image differs (identical ones have no PSNR).
        "identical_images": len(per_sample) - len(lossy),
        "psnr_db_mean": (sum(s["psnr_db"] for s in lossy) / len(lossy)) if lossy else None,
        "psnr_db_min": min((s["psnr_db"] for s in lossy), default=None),
        "ssim_mean": sum(s["ssim"] for s in per_sample) / len(per_sample),
        "latent_max_abs_error": max(s["latent_max_abs_error"] for s in per_sample),
        "per_sample": per_sample,
    }
    read = [s["classifier"] for s in per_sample if "classifier" in s]
    if read:
        row["exact_accuracy"] = sum(r["exact_class"] == r["requested_class"]
                                    for r in read) / len(read)
        row["accuracy"] = sum(r["lossy_class"] == r["requested_class"] for r in read) / len(read)
        row["agreement_with_exact"] = sum(r["agree"] for r in read) / len(read)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-digits")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help="V-Major ratio schedules (constant:0 is always added)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=10,
                        help="tiny-digits: samples per digit (seeds 0..N-1)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per launch, seconds")
    parser.add_argument("--json", type=Path, default=REPO / "results" / "vmajor_tradeoff.json")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "vmajor_tradeoff.png")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    schedules = ["constant:0", *(s for s in args.schedules.split(",") if s and s != "constant:0")]
    if args.worker:
        worker(models[0], schedules, args.steps, args.seeds, args.json)
        return 0
    unknown = sorted(set(models) - set(MODELS))
    if unknown or args.steps < 2 or args.seeds < 1:
        print(f"vmajor_tradeoff: error: unknown models {unknown} (valid: {', '.join(MODELS)}), "
              f"--steps {args.steps} < 2 or --seeds {args.seeds} < 1", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="cocodiff-vmajor-") as work:
        for model in models:
            try:
                runs = launch(model, schedules, args.steps, args.seeds, Path(work),
                              args.timeout)["runs"]
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                print(f"vmajor_tradeoff: error: {error}", file=sys.stderr)
                return 1
            exact_bytes = runs[0]["inter_node_bytes"]  # constant:0 comes first
            for row in runs:
                row["inter_node_bytes_vs_exact"] = row["inter_node_bytes"] / exact_bytes
                _print_row(row)
            rows += runs
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"runs": rows}, indent=2))
    _plot(rows, args.plot)
    print(f"wrote {args.json} and {args.plot}")
    return 0


def _print_row(row: dict) -> None:
    psnr = ("identical" if row["psnr_db_mean"] is None
            else f"{row['psnr_db_mean']:.1f} dB (min {row['psnr_db_min']:.1f})")
    read = ""
    if "accuracy" in row:
        read = (f"  digits read {row['accuracy']:6.1%} (exact {row['exact_accuracy']:.1%}), "
                f"agree with exact {row['agreement_with_exact']:6.1%}")
    print(f"{row['model']:<12} {row['schedule']:<13} V sent {row['v_blocks_sent']:6.1%}  "
          f"inter-node {row['inter_node_bytes_vs_exact']:6.1%} of exact  PSNR {psnr:>22}  "
          f"SSIM {row['ssim_mean']:.4f}{read}", flush=True)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lossy = [r for r in rows if r["psnr_db_mean"] is not None]
    if not all(math.isfinite(r["psnr_db_mean"]) for r in lossy):
        raise ValueError("non-finite PSNR in the results")
    has_reader = any("accuracy" in r for r in rows)
    fig, axes = plt.subplots(1, 2 if has_reader else 1, figsize=(12 if has_reader else 7.5, 4.5),
                             squeeze=False)
    ax = axes[0][0]
    for model in dict.fromkeys(r["model"] for r in lossy):
        points = sorted((r["inter_node_bytes_vs_exact"] * 100, r["psnr_db_mean"], r["schedule"])
                        for r in lossy if r["model"] == model)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=model)
        for x, y, schedule in points:
            if model == lossy[0]["model"]:
                ax.annotate(schedule + (" (default)" if schedule == DEFAULT_SCHEDULE else ""),
                            (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(30, color="grey", linestyle="--", linewidth=1)
    ax.text(ax.get_xlim()[0], 30.5, "30 dB floor", fontsize=7, color="grey")
    ax.set_xlabel("inter-node bytes of all attention exchanges, % of the exact plan")
    ax.set_ylabel("mean PSNR of the image against the exact plan (dB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if has_reader:
        ax = axes[0][1]
        for model in dict.fromkeys(r["model"] for r in rows if "accuracy" in r):
            points = sorted((r["inter_node_bytes_vs_exact"] * 100, r["accuracy"] * 100,
                             r["agreement_with_exact"] * 100, r["schedule"])
                            for r in rows if r["model"] == model)
            xs = [p[0] for p in points]
            ax.plot(xs, [p[1] for p in points], marker="o", label=f"{model}: read as requested")
            ax.plot(xs, [p[2] for p in points], marker="s", linestyle=":",
                    label=f"{model}: read as the exact sample")
            for x, y, _, schedule in points:
                ax.annotate(schedule, (x, y), textcoords="offset points", xytext=(4, -10),
                            fontsize=7)
        ax.set_xlabel("inter-node bytes of all attention exchanges, % of the exact plan")
        ax.set_ylabel("classifier, % of samples")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    steps = rows[0]["steps"] if rows else 0
    fig.suptitle(f"V-Major on 2 nodes x 2 ranks, {steps} steps: bytes saved vs quality")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
