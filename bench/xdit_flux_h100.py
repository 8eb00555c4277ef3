"""The simulator against xDiT's published FLUX.1-dev table on 4 x H100 (issue 34).

xDiT (github.com/xdit-project/xDiT, docs/performance/flux.md): FLUX.1-dev, 1024 px, 28
steps, seconds per image on 4 x H100 (NVLink), eager | torch.compile. The table is the
check only: nothing in the compute model (cocodiff.kernels, topology.DEVICES) or the
NVLink collective model is taken from it.

For each configuration and mode this simulates one denoising step with the ``dgx-h100``
preset cut to 1, 2 or 4 GPUs and no NIC (``cocodiff simulate --schedule flat``), adds the
pipeline's work outside the transformer (:func:`outside_seconds`), and prints predicted
against published seconds per image, the speedups over one GPU and their errors, and the
planner's pick (``cocodiff plan``) against the measured best. Writes JSON with --json.

    python bench/xdit_flux_h100.py --json xdit_flux_h100.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# (name, ulysses, ring): xDiT's rows; published s/image (eager, compiled).
PUBLISHED = {
    "1 GPU": ((1, 1), (6.71, 4.30)),
    "Ulysses 2": ((2, 1), (4.38, 2.68)),
    "Ring 2": ((1, 2), (5.31, 2.60)),
    "Ulysses 2 x Ring 2": ((2, 2), (5.19, 1.80)),
    "Ulysses 4": ((4, 1), (4.24, 1.63)),
    "Ring 4": ((1, 4), (5.11, 1.98)),
}
MODES = ("eager", "compiled")
STEPS = 28


def outside_seconds(mode: str) -> dict[str, float]:
    """Seconds per image of FLUX.1-dev's pipeline outside the transformer blocks on one
    H100, by the same kernel model (``h100-sxm`` rates), every rank doing all of it (xDiT
    runs the text encoders on every rank and, without its parallel VAE, the VAE decode
    on one):

    - T5-XXL encoder, 512 tokens: 24 layers of d 4096, heads 64 x 64, gated-GELU FFN of
      10240 (google/t5-v1_1-xxl config): per layer Q, K, V, O and three FFN GEMMs,
      attention over 512 tokens, ~40 elementwise passes per token (eager: RMSNorm,
      gating, residuals).
    - CLIP-L text encoder, 77 tokens: 12 layers of d 768 (negligible work; its launches).
    - VAE decoder 1024 px (latent 128 x 128 x 16): the SD/FLUX decoder's convolutions as
      implicit GEMMs (m = pixels, k = 9 x channels in, n = channels out): 4 + 7 convs at
      128 px x 512 ch, 7 at 256 px x 512, 7 at 512 px x 256 (one 512 -> 256), 7 at
      1024 px x 128 (one 256 -> 128), and GroupNorm + SiLU + residual at ~15 passes per
      ResNet block.
    - per step, outside the blocks: x_embedder, context_embedder (512 x 4096 -> 3072),
      the time/guidance/pooled embedders, norm_out, proj_out and the scheduler's step:
      a few GEMMs and ~40 small kernels.
    """
    from cocodiff import kernels as kn
    from topology import DEVICES

    rates = DEVICES["h100-sxm"]
    b = 2

    def run(kernels) -> float:
        return kn.device_seconds(tuple(kernels), rates, mode)

    t5 = []
    for _ in range(24):
        t5 += [kn.gemm(512, 4096, 4096, b, 4).times(4), kn.gemm(512, 4096, 10240, b, 2).times(2),
               kn.gemm(512, 10240, 4096, b), kn.attention(512, 512, 64, 64, b),
               kn.elementwise(512 * 4096 * b, 40, 12, 14, 4)]
    clip = [kn.elementwise(77 * 768 * b, 30, 10, 20, 5) for _ in range(12)]
    clip += [kn.gemm(77, 768, 768, b, 4).times(4), kn.gemm(77, 768, 3072, b, 2).times(2)] * 12
    vae = []
    for pixels, c_in, c_out, convs in ((128 * 128, 512, 512, 11), (256 * 256, 512, 512, 7),
                                       (512 * 512, 256, 256, 6), (512 * 512, 512, 256, 1),
                                       (1024 * 1024, 128, 128, 6), (1024 * 1024, 256, 128, 1)):
        vae.append(kn.gemm(pixels, 9 * c_in, c_out, b, convs).times(convs))
        resnets = (convs + 1) // 2
        vae.append(kn.elementwise(pixels * c_out * b, 15 * resnets, 5 * resnets,
                                  8 * resnets, 3 * resnets))
    step = [kn.gemm(4096, 64, 3072, b), kn.gemm(512, 4096, 3072, b), kn.gemm(4096, 3072, 64, b),
            kn.gemm(1, 3072, 6144, b, 6).times(6), kn.elementwise(4608 * 3072 * b, 8, 3, 40, 8)]
    return {"text_encoders_s": run(t5) + run(clip), "vae_decode_s": run(vae),
            "per_step_s": run(step)}


def _ops_per_layer(ulysses: int, ring: int) -> float | None:
    """ATen ops a FLUX.1-dev rank's layer dispatches eager in a ``ulysses x ring`` split
    (``cocodiff.kernels.DISPATCHED_OPS``, counted on the tiny twin through the runtime)."""
    from cocodiff import kernels as kn
    from cocodiff.runtime.model_names import model_spec

    return kn.dispatched_ops_per_layer(model_spec("flux1-dev"), ulysses, ring)


def _cli(args: list[str], out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "cocodiff", *args, "--json", str(out)], check=True,
                   capture_output=True, text=True)
    return json.loads(out.read_text())


def _topology(folder: Path, gpus: int) -> Path:
    path = folder / f"dgx_h100_{gpus}.toml"
    path.write_text(f'preset = "dgx-h100"\n[nodes]\ncount = 1\ngpus = {gpus}\nnics = 0\n')
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    rows: dict[str, dict] = {}
    picks: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for mode in MODES:
            outside = outside_seconds(mode)
            fixed_s = outside["text_encoders_s"] + outside["vae_decode_s"]
            for name, ((u, r), published) in PUBLISHED.items():
                gpus = u * r
                result = _cli(["simulate", "--model", "flux1-dev", "--resolution", "1024",
                               "--steps", str(STEPS), "--schedule", "flat", "--topology",
                               str(_topology(folder, gpus)), "--ulysses", str(u), "--ring",
                               str(r), "--batch", "1", "--compute-mode", mode],
                              folder / "sim.json")
                step_s = result["results"][0]["step_time_s"]
                image_s = STEPS * (step_s + outside["per_step_s"]) + fixed_s
                rows.setdefault(name, {})[mode] = {
                    "step_s": step_s, "predicted_s": image_s,
                    "published_s": published[MODES.index(mode)],
                    "error": image_s / published[MODES.index(mode)] - 1}
                if mode == "eager":
                    # what the host term charges a rank's layer in this layout
                    rows[name][mode]["dispatched_ops_per_layer"] = _ops_per_layer(u, r)
            plan = _cli(["plan", "--model", "flux1-dev", "--resolution", "1024", "--steps",
                         str(STEPS), "--schedule", "flat", "--topology",
                         str(_topology(folder, 4)), "--compute-mode", mode],
                        folder / "plan.json")
            best = min(plan["candidates"], key=lambda c: c["step_time_s"])
            measured = min((n for n in PUBLISHED if n != "1 GPU"),
                           key=lambda n: PUBLISHED[n][1][MODES.index(mode)])
            picks[mode] = {"planner": best["layout"], "measured_best": measured,
                           "outside": outside}
    for mode in MODES:
        one = rows["1 GPU"][mode]
        print(f"\n{mode}: s/image predicted | published (error); speedup over 1 GPU "
              f"predicted | published (error)")
        for name, row in rows.items():
            cell = row[mode]
            cell["speedup"] = one["predicted_s"] / cell["predicted_s"]
            cell["published_speedup"] = one["published_s"] / cell["published_s"]
            cell["speedup_error"] = cell["speedup"] / cell["published_speedup"] - 1
            print(f"  {name:20s} {cell['predicted_s']:6.2f} | {cell['published_s']:5.2f} "
                  f"({cell['error']:+6.1%});  {cell['speedup']:5.2f}x | "
                  f"{cell['published_speedup']:4.2f}x ({cell['speedup_error']:+6.1%})")
        if mode == "eager":
            print("  ATen ops a rank's layer dispatches (counted through the runtime, 9 us "
                  "each): " + ", ".join(f"{name} {row[mode]['dispatched_ops_per_layer']:.1f}"
                                        for name, row in rows.items()))
        pick = picks[mode]
        print(f"  planner's pick on 4 GPUs: {pick['planner']}; measured best: "
              f"{pick['measured_best']}; outside the transformer: "
              f"text encoders {pick['outside']['text_encoders_s']:.3f} s, VAE decode "
              f"{pick['outside']['vae_decode_s']:.3f} s, per step "
              f"{pick['outside']['per_step_s'] * 1e3:.2f} ms")
    if args.json is not None:
        args.json.write_text(json.dumps({"source": "xDiT docs/performance/flux.md",
                                         "rows": rows, "picks": picks}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
