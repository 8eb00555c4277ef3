"""Measured step times of Ulysses x Ring layouts on an emulated cluster, ranked next to the
simulator's ranking of the same layouts on the calibrated topology.

1. Enlarge tiny FLUX as ``bench/emulated_speedup.py`` does (8 heads by default) and run it
   once in one process in float32 (the reference latents).
2. For each configuration (``--configs``: nodes x ranks per node @ inter-node Gbit/s),
   build the emulated cluster and run ``cocodiff calibrate`` across it (real-block
   compute rate, fitted links, collective start-up).
3. Run every (layout, schedule) pair -- each layout as ``cocodiff run --ulysses U --ring R
   [--ring-inner] --schedule S`` runs it -- ``--repeats`` rounds, interleaved, the order
   rotated every round, in one launch (``bench/emulated_session.py``); the first step of
   each run is not counted. Round 1's final latents are checked against the reference.
4. Rank the same pairs with the planner (``cocodiff.simulator.planner.rank_layouts``) on the
   calibrated topology and collective model, and with the matrix-product compute rate
   (what calibrate wrote before it timed the real blocks), and print both rankings.

Writes JSON (default ``results/emulated_layouts.json``).

    python bench/emulated_layouts.py                                  # 4x2@1, ~6 min
    python bench/emulated_layouts.py --configs 4x2@1,2x2@1

Needs root (network namespaces, tc).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO))

from bench.cluster import ClusterSpec, EmulatedCluster  # noqa: E402
from bench.cluster.jobs import run_job  # noqa: E402
from bench.emulated_speedup import (  # noqa: E402
    EnlargedModel,
    add_model_arguments,
    calibrate_job,
    collective_model,
    export_enlarged,
    model_spec,
    parse_configs,
    read_json,
    run_reporting_failures,
    single_process_env,
)

EXACT_ATOL = 1e-5
DEFAULT_SCHEDULES = "flat,vfirst"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="4x2@1",
                        help="clusters, NODESxRANKS@GBIT comma-separated (default 4x2@1)")
    parser.add_argument("--schedules", default=DEFAULT_SCHEDULES,
                        help=f"Ulysses schedules inside each layout (default {DEFAULT_SCHEDULES})")
    parser.add_argument("--layouts", default=None,
                        help="layout names (U4xR2xB1[/ring-inner]) comma-separated (default: "
                        "every batch-1 layout the planner considers)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--steps", type=int, default=6,
                        help="denoising steps per run; the first is not counted (default 6)")
    add_model_arguments(parser)
    parser.add_argument("--timeout", type=float, default=900.0, help="per job, seconds")
    parser.add_argument("--json", type=Path, default=REPO / "results" / "emulated_layouts.json")
    return run_reporting_failures("emulated_layouts", _run, parser.parse_args(argv))


def _layouts(text: str | None, world: int, heads: int):
    from cocodiff.simulator.planner import candidate_layouts

    sys.path.insert(0, str(REPO / "bench"))
    from emulated_session import parse_layout_name

    if text is None:
        return candidate_layouts(world, heads, 1)
    return [parse_layout_name(name.strip()) for name in text.split(",") if name.strip()]


def _pairs(layouts, schedules: list[str]) -> list[tuple[str, str]]:
    """(layout name, schedule) pairs; without a Ulysses exchange every schedule makes the
    same plan, so a Ulysses-1 layout runs the first schedule only (as the planner ranks it)."""
    return [(layout.name, name) for layout in layouts
            for name in (schedules[:1] if layout.ulysses == 1 else schedules)]


def _run(args: argparse.Namespace) -> int:
    schedules = [name.strip() for name in args.schedules.split(",") if name.strip()]
    configs = parse_configs(args.configs)
    if args.steps < 2 or args.repeats < 1:
        raise ValueError("--steps must be at least 2 and --repeats at least 1")
    began = time.monotonic()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    model = EnlargedModel("tiny-flux", args.heads, args.head_dim, args.layers,
                          args.single_layers, args.resolution)
    work = Path(tempfile.mkdtemp(prefix="cocodiff-emulated-layouts-"))
    model_dir = export_enlarged(model, work / "model")
    spec = model_spec(model_dir, model)
    print(f"model: {spec.name}, {spec.sequence_tokens(args.resolution, args.resolution)} "
          f"tokens, hidden {spec.hidden_size} ({spec.num_heads} heads), {spec.num_layers} "
          "layers, float32", flush=True)
    common = ["--model", str(model_dir), "--resolution", str(args.resolution)]
    reference = work / "reference.pt"
    subprocess.run([sys.executable, "-m", "cocodiff", "run", *common, "--steps",
                    str(args.steps), "--dtype", "float32", "--quiet",
                    # the sessions save run_pipeline's latents as they are (unpacked)
                    "--latents-format", "unpacked", "--save-latents", str(reference)],
                   check=True, env=single_process_env(), cwd=REPO,
                   stdin=subprocess.DEVNULL, timeout=args.timeout)
    notes: list[str] = []
    results = [_measure(args, config, schedules, model_dir, spec, common, work, reference,
                        notes) for config in configs]
    report = {"model": {**dataclasses.asdict(model), "name": spec.name,
                        "hidden_size": spec.hidden_size, "num_heads": spec.num_heads,
                        "num_layers": spec.num_layers, "dtype": "float32"},
              "transport": "torch (gloo)", "steps": args.steps, "repeats": args.repeats,
              "schedules": schedules, "configs": results, "notes": notes,
              "wall_s": time.monotonic() - began}
    args.json.write_text(json.dumps(report, indent=2))
    for result in results:
        print(rankings_text(result))
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {args.json} in {report['wall_s']:.0f} s (work files in {work})")
    return 0


def _measure(args, config, schedules, model_dir: Path, spec, common, work: Path,
             reference: Path, notes: list[str]) -> dict[str, Any]:
    import torch

    world = config.nodes * config.ranks_per_node
    layouts = _layouts(args.layouts, world, spec.num_heads)
    pairs = _pairs(layouts, schedules)
    here = work / config.label
    here.mkdir()
    print(f"{config.label}: {len(pairs)} (layout, schedule) pairs", flush=True)
    with EmulatedCluster(ClusterSpec(config.nodes, config.ranks_per_node, config.gbit)) as cluster:
        calibration = here / "calibrated.toml"
        calibrate_job(cluster, [*common, "--dtype", "float32"], calibration, args.timeout,
                      here, notes, config.label)
        out = here / "session"
        out.mkdir()
        items = [f"{name}@{layout}" for layout, name in pairs]
        started = time.monotonic()
        result = run_job(cluster, [sys.executable, str(REPO / "bench" / "emulated_session.py"),
                                   str(model_dir), str(args.resolution), str(args.steps),
                                   config.layout, "float32", str(args.repeats),
                                   ",".join(items), str(out)],
                         "torch", timeout_s=args.timeout, log_dir=out / "logs")
        for line in result.output(0).splitlines():
            print(f"  {line}", flush=True)
        print(f"  session in {time.monotonic() - started:.0f} s", flush=True)
    session = json.loads((out / "session.json").read_text())
    expected = torch.load(reference, weights_only=True)
    measured: dict[str, dict[str, Any]] = {}
    for item in items:
        runs = [run for run in session["runs"] if run["schedule"] == item]
        if not runs:
            continue
        medians = [statistics.median(run["step_times_s"][1:]) for run in runs]
        path = out / f"latents-{item.replace('/', '_')}.pt"
        diff = (float((torch.load(path, weights_only=True) - expected).abs().max())
                if path.is_file() else None)
        measured[item] = {"measured_step_s": statistics.median(medians),
                          "min_step_s": min(medians), "max_step_s": max(medians),
                          "round_medians_s": medians, "max_abs_diff": diff}
    calibrated = read_json(calibration.with_suffix(".json")) or {}
    predicted = _predict(spec, args.resolution, calibration, layouts, schedules,
                         collective_model(calibration.with_suffix(".json")), None)
    matmul_tflops = calibrated.get("compute", {}).get("tflops")
    predicted_matmul = _predict(spec, args.resolution, calibration, layouts, schedules,
                                collective_model(calibration.with_suffix(".json")),
                                matmul_tflops)
    rows = []
    for item in items:
        schedule, _, layout = item.partition("@")
        row = {"layout": layout, "schedule": schedule, **measured.get(item, {}),
               "predicted_step_s": predicted.get(item),
               "predicted_matmul_rate_step_s": predicted_matmul.get(item)}
        if "measured_step_s" in row:
            row["error"] = row["predicted_step_s"] / row["measured_step_s"] - 1
            row["error_matmul_rate"] = (row["predicted_matmul_rate_step_s"]
                                        / row["measured_step_s"] - 1)
        rows.append(row)
    ranked = [row for row in rows if "measured_step_s" in row]
    measured_ranking = _ranking(ranked, "measured_step_s")
    return {
        "cluster": {"nodes": config.nodes, "ranks_per_node": config.ranks_per_node,
                    "inter_gbit": config.gbit, "label": config.label},
        "calibration": {"topology": calibration.read_text(), "measured": calibrated},
        "skipped": session["skipped"],
        "rows": rows,
        "measured_ranking": measured_ranking,
        "predicted_ranking": _ranking(ranked, "predicted_step_s"),
        "predicted_matmul_rate_ranking": _ranking(ranked, "predicted_matmul_rate_step_s"),
        "spearman": spearman(measured_ranking, _ranking(ranked, "predicted_step_s")),
        "spearman_matmul_rate": spearman(measured_ranking,
                                         _ranking(ranked, "predicted_matmul_rate_step_s")),
        "exact": all(row.get("max_abs_diff") is not None and row["max_abs_diff"] <= EXACT_ATOL
                     for row in ranked),
    }


def _predict(spec, resolution: int, topology_path: Path, layouts, schedules,
             collective, tile_tflops: float | None) -> dict[str, float]:
    """The planner's step time of every (layout, schedule) pair, keyed ``schedule@layout``."""
    from cocodiff.simulator.planner import rank_layouts
    from topology import build_topology, load_topology

    described = load_topology(topology_path)
    if tile_tflops is not None:
        described = dataclasses.replace(described, tile_tflops=tile_tflops)
    streams = (spec.image_tokens(resolution, resolution), spec.text_tokens)
    result = rank_layouts(spec, build_topology(described), streams, tuple(schedules),
                          collective=collective, layouts=layouts)
    return {f"{c.schedule}@{c.layout.name}": c.step_time_s for c in result.candidates}


def _ranking(rows: list[dict[str, Any]], key: str) -> list[str]:
    return [f"{row['schedule']}@{row['layout']}" for row in sorted(rows, key=lambda r: r[key])]


def spearman(first: list[str], second: list[str]) -> float:
    """Spearman's rank correlation of two orderings of the same items (no ties)."""
    n = len(first)
    if n < 2:
        return 1.0
    where = {item: index for index, item in enumerate(second)}
    d2 = sum((index - where[item]) ** 2 for index, item in enumerate(first))
    return 1 - 6 * d2 / (n * (n * n - 1))


def rankings_text(result: dict[str, Any]) -> str:
    rows = {f"{row['schedule']}@{row['layout']}": row for row in result["rows"]}
    lines = [f"{result['cluster']['label']}: measured ranking | simulator (real-block rate) | "
             "simulator (matrix-product rate)"]
    for rank, (m, p, q) in enumerate(zip(result["measured_ranking"],
                                         result["predicted_ranking"],
                                         result["predicted_matmul_rate_ranking"],
                                         strict=True), 1):
        lines.append(f"  {rank:2d}. {m:28s} {rows[m]['measured_step_s'] * 1e3:7.1f} ms | "
                     f"{p:28s} {rows[p]['predicted_step_s'] * 1e3:7.1f} ms | "
                     f"{q:28s} {rows[q]['predicted_matmul_rate_step_s'] * 1e3:7.1f} ms")
    measured = result["measured_ranking"]
    blocks = spearman(measured, result["predicted_ranking"])
    matmul = spearman(measured, result["predicted_matmul_rate_ranking"])
    lines.append(f"  Spearman (measured vs simulator): {blocks:.2f} (real-block rate), "
                 f"{matmul:.2f} (matrix-product rate); best measured {measured[0]}, "
                 f"predicted {result['predicted_ranking'][0]}; exact: {result['exact']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
