"""Where TAPA's all-to-all time goes on Aurora, cause by cause, in the simulator.

For each model, resolution and node count (on the planner's layout for TAPA: pure Ulysses
up to the head count, Ulysses x Ring past it), the all-to-all time per step (the slowest
rank's time with an exchange in flight) of TAPA at the planner's chunk count, side by
side:

* ``link``: the links' lower bound for the step's exchanges (any schedule);
* ``ideal``: TAPA simulated with links only (the ``ideal`` collective model): what the
  schedule itself loses on free links (phases one after another, forwarded bytes);
* ``no_setup``, ``no_rate``, ``no_caps``: Aurora's collective model with one of its
  prices removed (the per-transfer set-up, the per-rank rate of a multi-node collective,
  the single-transfer caps): what that price costs TAPA;
* ``aurora``: the full model; ``model``: the model's bound for TAPA's own collectives
  (``cocodiff.simulator.bounds.model_bound_s``).

Ratios are against ``link`` (efficiency = link / time). Every number is a simulation of
the same plan; nothing is fitted here.

    python bench/tapa_gap.py --json results/tapa_gap.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from cocodiff.runtime.model_names import model_spec
from cocodiff.schedules import PlanOptions
from cocodiff.simulator.planner import choose_chunks, choose_layouts
from cocodiff.simulator.simulate import simulate_schedule
from topology import Placement, build_topology, resolve_topology
from transports.sim import COLLECTIVE_MODELS, SpanCost

AURORA = COLLECTIVE_MODELS["aurora"]


def variants() -> dict:
    """The collective models compared: Aurora's, and Aurora's less one price."""
    spans = dict(AURORA.spans)
    return {
        "ideal": COLLECTIVE_MODELS["ideal"],
        "no_setup": replace(AURORA, spans=tuple(
            (span, replace(cost, startup_us=0.0)) for span, cost in spans.items())),
        "no_rate": replace(AURORA, spans=tuple(
            (span, replace(cost, rank_gbps=SpanCost().rank_gbps)) for span, cost in spans.items())),
        "no_caps": replace(AURORA, transfer_cap_gbps=()),
        "aurora": AURORA,
    }


def measure(model_name: str, resolution: int, nodes: int) -> dict:
    spec = model_spec(model_name)
    topology = build_topology(resolve_topology("aurora", nodes))
    placement = Placement.node_major(topology)
    streams = (spec.image_tokens(resolution, resolution, 1), spec.text_tokens)
    layout = choose_layouts(spec, topology, streams, ["tapa"], PlanOptions(), AURORA)["tapa"].layout
    chunks = choose_chunks("tapa", spec, topology, streams, layout, PlanOptions(), AURORA).chunks
    options = PlanOptions(chunks=chunks)
    row = {"model": model_name, "resolution": resolution, "nodes": nodes,
           "layout": layout.name, "chunks": chunks}
    for name, collective in variants().items():
        result = simulate_schedule("tapa", spec, topology, placement, streams, 1,
                                   options=options, collective=collective, parallel=layout)
        row[name] = result.exchange_s
        if name == "aurora":
            row["link"] = result.bound_s
            row["model_bound"] = result.model_bound_s
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="flux1-dev,sd35-large")
    parser.add_argument("--resolutions", default="1024,2048")
    parser.add_argument("--nodes", default="2,3,4,8")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    columns = ("ideal", "no_setup", "no_rate", "no_caps", "aurora", "model_bound")
    print(f"{'model':<11} {'px':>5} {'nodes':>5} {'layout':>10} {'chunks':>6} {'link ms':>8} "
          + " ".join(f"{c:>11}" for c in columns) + "   (link / time)")
    for model_name in args.models.split(","):
        for resolution in map(int, args.resolutions.split(",")):
            for nodes in map(int, args.nodes.split(",")):
                row = measure(model_name, resolution, nodes)
                rows.append(row)
                print(f"{model_name:<11} {resolution:>5} {nodes:>5} {row['layout']:>10} "
                      f"{row['chunks']:>6} "
                      f"{row['link'] * 1e3:>8.2f} "
                      + " ".join(f"{row['link'] / row[c]:>11.2f}" for c in columns), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
