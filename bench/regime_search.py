"""Where do TAPA, V-First and V-Major beat flat Ulysses on the emulated cluster? The
simulator answers first, from a calibration of this machine, before anything is measured.

Every configuration the emulated cluster can run is a point of a grid: the inter-node tbf
rate, the enlarged tiny-flux model's shape (heads x channels per head, layers, tokens
through the resolution), ranks per node (2 x 2 and 4 x 2) and the transport (gloo or
MPI, each with its own calibration). For each, the simulator predicts a step of `flat`,
`tapa`, `vfirst` and `cocodiff` (the plans ``cocodiff validate`` would run, built by
:func:`cocodiff.schedules.run_plan.build_run_plan`, averaged over the steps validate measures) and
the gain of each CoCoDiff schedule over flat. Every configuration is written, sorted by
its best predicted gain, as JSON that ``bench/emulated_speedup.py --configs`` runs.

    python -m bench.cluster run --nodes 2 --ranks-per-node 2 --gbit 1 -- \\
        python -m cocodiff calibrate --output cal-gloo.toml --json cal-gloo.json
    python bench/regime_search.py --calibration gloo=cal-gloo.toml --calibrated-gbit 1 \\
        --json results/regime_search.json --markdown results/regime_search.md

``--families`` asks the other question of the same grid: pipeline or sequence? For each
configuration it predicts the rows ``validate --layouts`` runs there (the four schedules
on pure Ulysses and on the Ulysses-within-node x Ring-across-nodes hybrid; PipeFusion on
2 and, where the model has 4 layers, 4 stages, M = stages, one warm-up step) and sets the
fastest sequence row against the fastest pipeline row (``bench/emulated_speedup.py``'s
``families``): where does the sequence family win by 10% or more?

How a calibration made on one cluster stands for another (assumptions, written into the
JSON):

* the inter-node link moves the same fraction of the tbf rate it moved in the
  calibration (gloo's pair exchange gets about half of it, bench/cluster/README.md), never
  more than the intra-node (loopback) link calibrated beside it;
* the ranks share the same cores: with a ``[host]`` table (calibrate writes one) the
  simulator shares them itself (every rank on the one host, as the namespaces are);
  without one, a rank's compute rate scales with calibrated ranks / ranks (4 x 2 on the
  cores a 2 x 2 calibration shared: half the rate);
* the compute rate calibrated on one model's real blocks holds for the other shapes (an
  extrapolation: small layers pay more dispatch per FLOP than large ones);
* the collective model (per-transfer set-up, per span) is the calibration's.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO))

from bench.emulated_speedup import EnlargedModel  # noqa: E402

SCHEDULES = ("flat", "tapa", "vfirst", "cocodiff")
MECHANISMS = SCHEDULES[1:]
TCP_PAYLOAD = 1448 / 1514  # what a tbf rate carries as TCP payload (bench/cluster/README.md)
GBITS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
SHAPES = ((2, 2), (4, 2))
HEAD_DIMS = (16, 32, 64)  # FLUX RoPE needs even axes: head_dim a multiple of 16 here
LAYERS = ((1, 1), (2, 4))
RESOLUTIONS = (256, 512)
HEADS = 8  # 8 ranks (4 x 2) split them evenly, as diffusers' Ulysses requires
STEPS = 6  # as bench/emulated_speedup.py runs them (the first step left out)
GAIN_TARGET = 1.10


@dataclasses.dataclass(frozen=True, slots=True)
class Calibration:
    """One transport's calibrated topology, where it was made, and its collective model."""

    transport: str
    path: Path
    spec: Any  # topology.TopologySpec
    collective: Any  # transports.sim.CollectiveModel
    gbit: float

    @property
    def num_ranks(self) -> int:
        return self.spec.num_nodes * self.spec.gpus_per_node * self.spec.tiles_per_gpu

    @property
    def link_fraction(self) -> float:
        """The calibrated inter-node rate over the tbf rate's TCP payload."""
        return self.spec.nic_link.bandwidth_gbps / (self.gbit / 8 * TCP_PAYLOAD)


def load_calibration(text: str, gbit: float) -> Calibration:
    """``TRANSPORT=PATH.toml`` (calibrate's TOML; its JSON beside it holds the collective
    model)."""
    from topology import load_topology
    from transports.sim import CollectiveModel

    transport, equals, path = text.partition("=")
    if not equals or transport not in ("gloo", "mpi") or not path.endswith(".toml"):
        raise ValueError(f"--calibration {text!r} is not gloo=PATH.toml or mpi=PATH.toml")
    spec = load_topology(path)
    beside = Path(path).with_suffix(".json")
    measured = json.loads(beside.read_text()).get("collective") if beside.is_file() else None
    if not measured:
        raise ValueError(f"{beside} holds no fitted collective model: calibrate with --json")
    return Calibration(transport, Path(path), spec,
                       CollectiveModel.from_json(measured, f"calibrated ({transport})"), gbit)


def machine(calibration: Calibration, nodes: int, ranks_per_node: int, gbit: float,
            core_scaling: bool):
    """The calibrated topology reshaped to ``nodes`` x ``ranks_per_node`` at ``gbit``."""
    from topology.spec import LinkSpec

    spec = calibration.spec
    intra = spec.gpu_link.bandwidth_gbps if spec.gpu_link is not None else float("inf")
    inter = min(calibration.link_fraction * gbit / 8 * TCP_PAYLOAD, intra)
    # A topology with a host model shares the host's cores among its ranks itself.
    scale = (calibration.num_ranks / (nodes * ranks_per_node)
             if core_scaling and spec.host is None else 1.0)
    return dataclasses.replace(
        spec, num_nodes=nodes, gpus_per_node=ranks_per_node,
        gpu_link=spec.gpu_link if ranks_per_node > 1 else None,
        nic_link=LinkSpec(bandwidth_gbps=inter, latency_us=spec.nic_link.latency_us),
        tile_tflops=spec.tile_tflops * min(1.0, scale),
        tile_memory_gbps=spec.tile_memory_gbps * min(1.0, scale),
    )


def model_spec(model: EnlargedModel):
    """The simulator's spec of an enlarged tiny-flux (no directory needed)."""
    from cocodiff.runtime.model_names import model_spec as named_spec

    base = named_spec(model.base)
    return dataclasses.replace(base, name=f"{model.base}-enlarged", num_heads=model.heads,
                               head_dim=model.head_dim,
                               num_layers=model.layers + model.single_layers)


def predict(model: EnlargedModel, described, collective) -> dict[str, float]:
    """Each schedule's predicted step on pure Ulysses (mean over the steps validate counts)."""
    steps = predict_rows(model, described, collective, [(name, "pure") for name in SCHEDULES])
    return {name: steps[f"{name}@pure"] for name in SCHEDULES}


def family_layouts(nodes: int, ranks_per_node: int, num_layers: int
                    ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(sequence rows, pipeline rows)``, each ``(schedule, layout)``: what ``validate
    --layouts`` runs on the cluster (``bench/emulated_speedup.py``'s layouts)."""
    ranks = nodes * ranks_per_node
    sequence = [(name, layout) for layout in ("pure", f"U{ranks_per_node}xR{nodes}xB1")
                for name in SCHEDULES]
    pipeline = [("pipefusion", f"P{stages}xU{ranks // stages}xM{stages}/w1")
                for stages in (2, 4) if stages <= num_layers and ranks % stages == 0]
    return sequence, pipeline


def predict_rows(model: EnlargedModel, described, collective,
                 rows: list[tuple[str, str]]) -> dict[str, float]:
    """Each ``(schedule, layout)`` row's predicted step, keyed ``schedule@layout``."""
    from cocodiff.layout import PipelineLayout
    from cocodiff.schedules import PlanOptions, RankGrid
    from cocodiff.schedules.run_plan import build_run_plan
    from cocodiff.validation import PURE, parse_layout_name, predict_step_s
    from topology import Placement, build_topology

    spec = model_spec(model)
    topology = build_topology(described)
    grid = RankGrid.from_placement(topology, Placement.node_major(topology))
    streams = (spec.image_tokens(model.resolution, model.resolution), spec.text_tokens)
    out = {}
    for name, layout_name in rows:
        layout = None if layout_name == PURE else parse_layout_name(layout_name)
        where = ({"pipeline": layout} if isinstance(layout, PipelineLayout)
                 else {"parallel": layout})
        run_plan = build_run_plan(name, spec, grid, streams, STEPS, PlanOptions(dtype="float32"),
                                  resolution=(model.resolution, model.resolution), **where)
        out[f"{name}@{layout_name}"] = predict_step_s(run_plan, topology,
                                                      collective)["predicted_step_s"]
    return out


def configurations(calibrations: list[Calibration], core_scaling: bool):
    """The grid: ``(calibration, model, described machine, the row's head)`` for each
    configuration (the head: cluster, transport, model, as every row of the JSON has)."""
    grid = itertools.product(calibrations, SHAPES, GBITS, HEAD_DIMS, LAYERS, RESOLUTIONS)
    for calibration, (nodes, per_node), gbit, head_dim, (double, single), resolution in grid:
        model = EnlargedModel(heads=HEADS, head_dim=head_dim, layers=double,
                              single_layers=single, resolution=resolution)
        described = machine(calibration, nodes, per_node, gbit, core_scaling)
        head = {"nodes": nodes, "ranks_per_node": per_node, "gbit": gbit,
                "transport": "torch" if calibration.transport == "gloo" else "mpi",
                "model": {key: value for key, value in dataclasses.asdict(model).items()
                          if key != "base"},
                "hidden_size": model.hidden_size}
        yield calibration, model, described, head


def search_families(calibrations: list[Calibration], core_scaling: bool
                    ) -> list[dict[str, Any]]:
    """Every configuration's fastest sequence row against its fastest pipeline row,
    sorted by the sequence family's predicted advantage."""
    rows = []
    for calibration, model, described, head in configurations(calibrations, core_scaling):
        sequence, pipeline = family_layouts(head["nodes"], head["ranks_per_node"],
                                            model.layers + model.single_layers)
        steps = predict_rows(model, described, calibration.collective, sequence + pipeline)
        fastest = {family: min((f"{name}@{layout}" for name, layout in members),
                               key=steps.__getitem__)
                   for family, members in (("sequence", sequence), ("pipeline", pipeline))}
        rows.append({
            **head,
            "predicted_step_s": steps,
            "fastest": fastest,
            # Above 1: the sequence family's fastest row is faster.
            "sequence_over_pipeline": (steps[fastest["pipeline"]]
                                       / steps[fastest["sequence"]]),
        })
    rows.sort(key=lambda row: -row["sequence_over_pipeline"])
    return rows


def families_markdown(rows: list[dict[str, Any]], top: int) -> str:
    lines = ["| # | cluster | transport | model (hidden, layers, px) | fastest sequence row | "
             "fastest pipeline row | sequence over pipeline |", "|---|---|---|---|---|---|---|"]
    for index, row in enumerate(rows[:top], 1):
        model, steps, fastest = row["model"], row["predicted_step_s"], row["fastest"]
        lines.append(
            f"| {index} | {row['nodes']} x {row['ranks_per_node']} @ {row['gbit']:g} Gbit/s | "
            f"{row['transport']} | {row['hidden_size']}, "
            f"{model['layers'] + model['single_layers']}, {model['resolution']} | "
            + " | ".join(f"`{fastest[family]}` {steps[fastest[family]] * 1e3:.1f} ms"
                         for family in ("sequence", "pipeline"))
            + f" | {row['sequence_over_pipeline']:.2f}x |")
    return "\n".join(lines)


def search(calibrations: list[Calibration], core_scaling: bool) -> list[dict[str, Any]]:
    rows = []
    for calibration, model, described, head in configurations(calibrations, core_scaling):
        steps = predict(model, described, calibration.collective)
        gains = {name: steps["flat"] / steps[name] for name in MECHANISMS}
        best = max(gains, key=gains.__getitem__)
        rows.append({
            **head,
            "predicted_step_s": steps,
            "predicted_gain_over_flat": gains,
            "best": best, "best_gain": gains[best],
            "inter_node_gbps": described.nic_link.bandwidth_gbps,
            "tile_tflops": described.tile_tflops,
        })
    rows.sort(key=lambda row: -row["best_gain"])
    return rows


def markdown(rows: list[dict[str, Any]], top: int) -> str:
    lines = ["| # | cluster | transport | model (hidden, layers, px) | flat (predicted) | "
             "tapa | vfirst | cocodiff | best gain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for index, row in enumerate(rows[:top], 1):
        model, gains = row["model"], row["predicted_gain_over_flat"]
        lines.append(
            f"| {index} | {row['nodes']} x {row['ranks_per_node']} @ {row['gbit']:g} Gbit/s | "
            f"{row['transport']} | {row['hidden_size']}, "
            f"{model['layers'] + model['single_layers']}, {model['resolution']} | "
            f"{row['predicted_step_s']['flat'] * 1e3:.1f} ms | "
            + " | ".join(f"{gains[name]:.2f}x" for name in MECHANISMS)
            + f" | {row['best']} {row['best_gain']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", action="append", required=True,
                        metavar="gloo=PATH.toml|mpi=PATH.toml",
                        help="a calibrated topology per transport (repeat for both)")
    parser.add_argument("--calibrated-gbit", type=float, required=True,
                        help="the inter-node tbf rate (Gbit/s) the calibrations ran at")
    parser.add_argument("--no-core-scaling", action="store_true",
                        help="without a [host] table: do not scale compute with the ranks "
                        "sharing the cores")
    parser.add_argument("--families", action="store_true",
                        help="pipeline or sequence: each configuration's fastest PipeFusion "
                        "row against its fastest sequence-family row (instead of the "
                        "mechanisms against flat)")
    parser.add_argument("--top", type=int, default=20, help="rows printed (default 20)")
    parser.add_argument("--json", type=Path, default=REPO / "results" / "regime_search.json")
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    began = time.monotonic()
    try:
        if not args.calibrated_gbit > 0:
            raise ValueError(f"--calibrated-gbit must be positive, got {args.calibrated_gbit}")
        calibrations = [load_calibration(text, args.calibrated_gbit)
                        for text in args.calibration]
        rows = (search_families if args.families else search)(calibrations,
                                                              not args.no_core_scaling)
    except (OSError, ValueError) as error:
        print(f"regime_search: error: {error}", file=sys.stderr)
        return 1
    if args.families:
        ratios = [row["sequence_over_pipeline"] for row in rows]
        ahead = {"sequence": sum(ratio >= GAIN_TARGET for ratio in ratios),
                 "pipeline": sum(1 / ratio >= GAIN_TARGET for ratio in ratios)}
        summary = (f"{len(rows)} configurations evaluated; the fastest sequence row predicted "
                   f">= {GAIN_TARGET:.2f}x over the fastest pipeline row in "
                   f"{ahead['sequence']}, the reverse in {ahead['pipeline']}; the sequence "
                   f"family's largest predicted advantage "
                   f"{rows[0]['sequence_over_pipeline']:.2f}x")
        return write_report(args, calibrations, rows, families_markdown(rows, args.top),
                            summary, {"predicted_ahead_at_target": ahead}, began)
    winners = [row for row in rows if row["best_gain"] >= GAIN_TARGET]
    median_gain = statistics.median(row["best_gain"] for row in rows)
    summary = (f"{len(rows)} configurations evaluated in {time.monotonic() - began:.0f} s; "
               f"{len(winners)} predicted with a CoCoDiff schedule >= {GAIN_TARGET:.2f}x over "
               f"flat; median best gain {median_gain:.2f}x")
    return write_report(args, calibrations, rows, markdown(rows, args.top), summary,
                        {"predicted_at_target": len(winners), "median_best_gain": median_gain},
                        began)


def write_report(args, calibrations: list[Calibration], rows: list[dict[str, Any]],
                 table: str, summary: str, counts: dict[str, Any], began: float) -> int:
    """Write the JSON (and the markdown), print the table and the summary."""
    report = {
        "calibrations": {c.transport: {"topology": str(c.path), "gbit": c.gbit,
                                       "inter_node_fraction_of_tbf": c.link_fraction,
                                       "collective": c.collective.to_json()}
                         for c in calibrations},
        "host_model": {c.transport: dataclasses.asdict(c.spec.host) if c.spec.host else None
                       for c in calibrations},
        "core_scaling": not args.no_core_scaling,
        "question": "families" if args.families else "mechanisms",
        "steps": STEPS,
        "gain_target": GAIN_TARGET,
        "evaluated": len(rows),
        **counts,
        "configs": rows,
        "wall_s": time.monotonic() - began,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(table)
    print(summary)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(f"{table}\n\n{summary}\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
