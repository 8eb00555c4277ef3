"""The paper's premise, measured: how similar each layer's V is between adjacent steps.

Single process. For each model, generates its samples and records the output of every
self-attention layer's V projection at every denoising step (one transformer call per
step; the pipeline's classifier-free guidance batch included), then per layer and step
``t >= 1`` the cosine similarity of V at ``t`` with V at ``t - 1`` (per sample, flattened
over tokens and channels, averaged over the samples) and the relative L1 change
``|V_t - V_(t-1)|_1 / |V_(t-1)|_1``, the quantity V-Major ranks its blocks by.

``tiny-digits`` (trained) generates each digit once (seed 0); the random-weight
``tiny-pixart`` (the same family) its default prompt for as many seeds, for contrast. With
``--tradeoff results/vmajor_tradeoff.json`` (from ``bench/vmajor_tradeoff.py``) the plot
also shows the share of V's inter-node blocks V-Major sent at each step on 2 x 2 ranks.

    python bench/v_similarity.py --tradeoff results/vmajor_tradeoff.json

Writes ``results/v_similarity.json`` and ``docs/v_similarity.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MODELS = ("tiny-digits", "tiny-pixart")
SAMPLES = 10


def v_trajectory(pipe, prompt: str, steps: int, size: tuple[int, int, int], seed: int,
                 text_tokens: int) -> torch.Tensor:
    """V of every self-attention layer at every step: ``(steps, layers, B, S, D)``."""
    from cocodiff.runtime.pipelines import run_pipeline

    layers = [block.attn1 for block in pipe.transformer.transformer_blocks]
    captured: list[list[torch.Tensor]] = [[] for _ in layers]
    handles = [layer.to_v.register_forward_hook(
        lambda _m, _in, out, i=i: captured[i].append(out.detach().double()))
        for i, layer in enumerate(layers)]
    try:
        run_pipeline(pipe, prompt, steps, *size, seed, max_sequence_length=text_tokens)
    finally:
        for handle in handles:
            handle.remove()
    # layers x steps of (B, S, D) -> (steps, layers, B, S, D)
    return torch.stack([torch.stack(per_layer) for per_layer in captured]).transpose(0, 1)


def step_similarity(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine similarity and relative L1 change of V against the previous step:
    ``(steps - 1, layers)`` each, averaged over the batch."""
    flat = v.flatten(3)  # (steps, layers, B, S*D)
    now, before = flat[1:], flat[:-1]
    cosine = torch.nn.functional.cosine_similarity(now, before, dim=-1).mean(-1)
    change = ((now - before).abs().sum(-1) / before.abs().sum(-1)).mean(-1)
    return cosine, change


def measure(model: str, steps: int) -> dict:
    from cocodiff.runtime.digits import digit_prompt
    from cocodiff.runtime.pipelines import load_pipeline
    from cocodiff.runtime.tiny import TINY_DEFAULTS

    pipe = load_pipeline(model)
    defaults = TINY_DEFAULTS[model]
    size = (defaults.width, defaults.height, defaults.frames)
    runs = ([(digit_prompt(d), 0) for d in range(SAMPLES)] if model == "tiny-digits"
            else [(defaults.prompt, seed) for seed in range(SAMPLES)])
    cosines, changes = [], []
    for prompt, seed in runs:
        cosine, change = step_similarity(v_trajectory(pipe, prompt, steps, size, seed,
                                                      defaults.max_sequence_length))
        cosines.append(cosine)
        changes.append(change)
    cosine, change = torch.stack(cosines), torch.stack(changes)  # (samples, steps-1, layers)
    return {"model": model, "steps": steps, "samples": len(runs),
            "prompts": sorted({prompt for prompt, _ in runs}),
            # [step - 1][layer]: step t against step t - 1, t = 1 .. steps - 1
            "cosine_mean": cosine.mean(0).tolist(), "cosine_min": cosine.amin(0).tolist(),
            "l1_change_mean": change.mean(0).tolist()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tradeoff", type=Path, default=None,
                        help="bench/vmajor_tradeoff.py's JSON: plot V-Major's sent share per step")
    parser.add_argument("--json", type=Path, default=REPO / "results" / "v_similarity.json")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "v_similarity.png")
    args = parser.parse_args(argv)
    if args.steps < 2:
        print(f"v_similarity: error: --steps {args.steps} < 2", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()  # the random model's prompt is truncated
    results = [measure(model, args.steps) for model in MODELS]
    sent = None
    if args.tradeoff is not None:
        runs = json.loads(args.tradeoff.read_text())["runs"]
        sent = {r["schedule"]: r["v_sent_fraction_by_step"] for r in runs
                if r["model"] == "tiny-digits"}
    for result in results:
        for step, (cosines, changes) in enumerate(zip(result["cosine_mean"],
                                                      result["l1_change_mean"], strict=True)):
            print(f"{result['model']:<12} step {step + 1:>2}: cosine "
                  + " ".join(f"{c:.4f}" for c in cosines)
                  + "  L1 change " + " ".join(f"{c:.3f}" for c in changes))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"models": results, "sent_fraction_by_step": sent},
                                    indent=2))
    _plot(results, sent, args.plot)
    print(f"wrote {args.json} and {args.plot}")
    return 0


def _plot(results: list[dict], sent: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if sent else 2, figsize=(15 if sent else 10, 4.2))
    styles = {"tiny-digits": "-", "tiny-pixart": "--"}
    for result in results:
        steps = range(1, result["steps"])
        for layer in range(len(result["cosine_mean"][0])):
            label = f"{result['model']} layer {layer}"
            axes[0].plot(steps, [row[layer] for row in result["cosine_mean"]],
                         styles[result["model"]], label=label)
            axes[1].plot(steps, [row[layer] for row in result["l1_change_mean"]],
                         styles[result["model"]], label=label)
    axes[0].set_ylabel("cosine similarity of V with the previous step")
    axes[1].set_ylabel("relative L1 change of V from the previous step")
    axes[1].set_yscale("log")
    for ax in axes[:2]:
        ax.set_xlabel("denoising step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if sent:
        for schedule, fractions in sent.items():
            axes[2].plot(range(len(fractions)), [f * 100 for f in fractions], marker=".",
                         label=schedule)
        axes[2].set_xlabel("denoising step")
        axes[2].set_ylabel("V blocks V-Major sent over the inter-node tier (%)")
        axes[2].set_title("tiny-digits, 2 x 2 ranks", fontsize=9)
        axes[2].grid(alpha=0.3)
        axes[2].legend(fontsize=7)
    fig.suptitle("V between adjacent denoising steps: trained tiny-digits (solid) against "
                 "random-weight tiny-pixart (dashed)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
