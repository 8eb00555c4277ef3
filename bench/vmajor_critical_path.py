"""V-Major in the simulator's own terms: what is on the critical path under ``vfirst``, and
what V-Major removes from it.

For one configuration on Aurora (the sweep's layout for it: pure Ulysses up to the head
count, the planner's Ulysses x Ring layout past it), simulate one ``vfirst`` step with
spans recorded and, on rank 0, split one layer's time into compute and the waits for
each exchange (a gap between compute spans is charged to the exchange that arrives at
its end). Then the same for ``cocodiff`` with every V block cached on the slow tier
(the most V-Major can remove, the last step of its linear ramp) and the 28-step mean
of both. Bytes are those of the whole step, all ranks, per tier.

    python bench/vmajor_critical_path.py --model sd35-large --resolution 2304 --nodes 4

Writes JSON (default ``results/vmajor_critical_path.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def layer_breakdown(result, num_layers: int) -> dict:
    """Rank 0's time per layer: compute, and the exposed wait charged to each exchange;
    and each exchange's time in flight."""
    spans = result.simulation.timeline.on_track("rank 0")
    compute = sorted((s for s in spans if s.category == "compute"), key=lambda s: s.start_s)
    comm = [s for s in spans if s.category == "comm"]
    exposed: dict[str, float] = defaultdict(float)
    in_flight: dict[str, float] = defaultdict(float)
    for span in comm:
        in_flight[span.name] += span.duration_s
    previous_end = 0.0
    for span in compute:
        gap = span.start_s - previous_end
        if gap > 1e-12:
            arriving = [c for c in comm if abs(c.end_s - span.start_s) < 1e-9]
            name = arriving[0].name if arriving else "other"
            exposed[name] += gap
        previous_end = max(previous_end, span.end_s)
    tail = result.step_time_s - previous_end
    if tail > 1e-12:
        arriving = [c for c in comm if abs(c.end_s - result.step_time_s) < 1e-9]
        exposed[arriving[0].name if arriving else "other"] += tail
    per_layer = {
        "compute_s": sum(s.duration_s for s in compute) / num_layers,
        "exposed_s": {k: v / num_layers for k, v in sorted(exposed.items())},
        "in_flight_s": {k: v / num_layers for k, v in sorted(in_flight.items())},
    }
    return per_layer


def main(argv: list[str] | None = None) -> int:
    from cocodiff.models import load_model_spec
    from cocodiff.schedules import VMajorOptions
    from cocodiff.schedules.options import PlanOptions
    from cocodiff.simulator.planner import best_layouts
    from cocodiff.simulator.simulate import simulate_schedule
    from topology import Placement, build_topology, get_preset

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sd35-large")
    parser.add_argument("--resolution", type=int, default=2304)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--json", type=Path, default=REPO / "results" /
                        "vmajor_critical_path.json")
    args = parser.parse_args(argv)

    model = load_model_spec(args.model)
    topology = build_topology(get_preset("aurora", args.nodes))
    placement = Placement.node_major(topology)
    streams = (model.image_tokens(args.resolution, args.resolution), model.text_tokens)
    layout = (best_layouts(model, topology, streams, ("vfirst",))["vfirst"]
              if placement.num_ranks > model.num_heads else None)
    runs = {}
    for name, options, steps in (
        ("vfirst", PlanOptions(), 1),
        ("cocodiff all cached", PlanOptions(vmajor=VMajorOptions("constant", 1.0, warmup=0)), 1),
    ):
        schedule = "vfirst" if name == "vfirst" else "cocodiff"
        result = simulate_schedule(schedule, model, topology, placement, streams, steps,
                                   options=options, record_spans=True, with_bound=False,
                                   parallel=layout)
        runs[name] = {"step_time_s": result.step_time_s,
                      "bytes_by_tier": result.bytes_by_tier,
                      "per_layer": layer_breakdown(result, model.num_layers)}
    means = {name: simulate_schedule(name, model, topology, placement, streams, args.steps,
                                     with_bound=False, parallel=layout).step_time_s
             for name in ("vfirst", "cocodiff")}
    record = {"model": model.name, "resolution": args.resolution, "nodes": args.nodes,
              "layout": None if layout is None else layout.name,
              "layers": model.num_layers, "runs": runs,
              f"mean_step_s_{args.steps}_steps": means}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=2))

    print(f"{model.name} {args.resolution}px, {args.nodes} Aurora node(s), layout "
          f"{record['layout'] or 'pure Ulysses'}; per layer on rank 0 (us):")
    names = sorted({k for run in runs.values() for k in run["per_layer"]["in_flight_s"]}
                   | {k for run in runs.values() for k in run["per_layer"]["exposed_s"]})
    print(f"| | compute | {' | '.join(f'{n} in flight / exposed' for n in names)} | step |")
    for name, run in runs.items():
        layer = run["per_layer"]
        cells = [f"{layer['in_flight_s'].get(n, 0) * 1e6:.0f} / "
                 f"{layer['exposed_s'].get(n, 0) * 1e6:.0f}" for n in names]
        print(f"| {name} | {layer['compute_s'] * 1e6:.0f} | {' | '.join(cells)} | "
              f"{run['step_time_s'] * 1e3:.2f} ms |")
    for name, run in runs.items():
        print(f"{name}: bytes per step " + ", ".join(
            f"{tier} {b / 1e9:.3f} GB" for tier, b in run["bytes_by_tier"].items()))
    print(f"{args.steps}-step mean: vfirst {means['vfirst'] * 1e3:.2f} ms, cocodiff "
          f"{means['cocodiff'] * 1e3:.2f} ms ({means['vfirst'] / means['cocodiff']:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
