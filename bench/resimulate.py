"""Re-simulate a ``bench/emulated_speedup.py`` report with ``[host]`` keys of every
configuration's calibrated topology replaced: how much of the predictions rests on one
calibrated term (nothing is measured).

    python bench/resimulate.py results/measured/validate/run33.json --set call_wait_us=0 \\
        --json results/run33_no_call_wait.json

Per configuration, the report's models are exported again from their shapes and every
schedule is simulated twice with ``cocodiff simulate``: on the topology as calibrated (it
must give the report's predictions again: the check that this re-simulation is the
validate one) and with the keys replaced. Prints each row's error both ways, the planner's
pick both ways, and the overall figures. Both simulations use the collective model the
report's calibration fitted (its JSON, written beside each topology file, where
``cocodiff simulate`` finds it as validate did).

``--refit-call-wait`` fits ``call_wait_us`` again as calibrate would now, on the loops the
report's calibrations measured (microbenchmarks, never a step), and prints how the
simulator meets those loops before and after: a change to the simulator judged on a
report's measurements without running the cluster again.

    python bench/resimulate.py results/measured/validate/run33.json --refit-call-wait \\
        --equal-pieces

(``--equal-pieces``: the wait fitted as before 2026-11-29, every loop call after compute.)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO))

from bench.emulated_speedup import EnlargedModel, export_enlarged  # noqa: E402
from cocodiff.validation import pick_against_best  # noqa: E402

SCHEDULES = ("flat", "tapa", "vfirst", "cocodiff")


def replaced_topology(calibrated: Path, changes: dict[str, float], path: Path) -> Path:
    """The topology file ``calibrated`` with ``changes`` made to its ``[host]`` table,
    written to ``path``."""
    import dataclasses

    from topology.toml_format import dump_topology, load_topology

    spec = load_topology(calibrated)
    if spec.host is None:
        raise SystemExit(f"{calibrated}: the calibrated topology has no [host] table")
    path.write_text(dump_topology(dataclasses.replace(
        spec, host=dataclasses.replace(spec.host, **changes))))
    return path


def forward_pieces(model_dir: Path, resolution: int, world: int) -> tuple[float, ...]:
    """The CPU before each exchange of the forward of ``model_dir`` as rank 1 of ``world``
    runs it here (:func:`cocodiff.calibration.loaded.model_work`): the loops' pieces, for
    a report whose calibration did not record them (before 2026-11-29). Only their shares
    are used, and those hold across machines far better than the milliseconds do."""
    from cocodiff.calibration.blocks import build_transformer, standin_forward
    from cocodiff.calibration.loaded import model_work
    from cocodiff.calibration.model_shapes import model_tokens, tiny_transformer_config

    _spec, tokens, image = model_tokens(str(model_dir), None, str(resolution))
    forward, standin = standin_forward(build_transformer(tiny_transformer_config(
        str(model_dir))), (image, tokens - image), world, min(1, world - 1))
    return model_work(forward, standin).piece_cpu_s


def refit_call_wait(config: dict[str, Any], calibrated: Path,
                    pieces: Callable[[], tuple[float, ...]] | None = tuple
                    ) -> tuple[dict[str, float], list[float]] | None:
    """The waits calibrate fits now on ``config``'s measured loops (``call_wait_us`` and
    ``follow_wait_us``, 0 for a report without spaced loops), and each loop's simulated
    error with them; None when its calibration ran no loops (a busy-polling
    transport's loops record only why they were not fitted). The loops' pieces are the
    calibration's, else ``pieces()`` (:func:`forward_pieces`); ``pieces`` None: equal
    pieces, every call after compute (the fit before 2026-11-29)."""
    from cocodiff.calibration.loaded import LoadedPoint
    from cocodiff.calibration.result import Loops
    from topology.toml_format import load_topology
    from transports.sim import CollectiveModel

    measured = config["calibration"]["measured"]
    loaded = (measured.get("host") or {}).get("loaded")
    if not loaded or "points" not in loaded:
        return None
    collective = measured.get("collective")
    loops = Loops(load_topology(calibrated),
                  tuple(LoadedPoint(**point) for point in loaded["points"]),
                  loaded["burst_cpu_s"], measured["num_nodes"], measured["ranks_per_node"],
                  CollectiveModel.from_json(collective) if collective else None,
                  () if pieces is None else tuple(loaded.get("piece_cpu_s") or pieces()))
    call_wait, follow_wait = loops.fitted_waits_us()
    return ({"call_wait_us": call_wait, "follow_wait_us": follow_wait},
            [simulated / point.wall_s - 1 for point, simulated in
             zip(loops.points, loops.simulated_s(call_wait, follow_wait), strict=True)])


def simulate(topology: Path, model_dir: Path, resolution: int, steps: int,
             schedules: tuple[str, ...] = SCHEDULES) -> dict[str, float]:
    """Step seconds per schedule, ``cocodiff simulate`` on ``topology``: the mean over the
    steps but the first, which validate leaves out as it leaves out the measured one.
    TAPA's phases unchunked, as validate's runs send them (``simulate`` would choose its
    best chunk count: 60-70% shorter steps for tapa and vfirst on the enlarged model)."""
    out = topology.with_name(f"{topology.stem}-simulated.json")  # not the calibration beside it
    subprocess.run([sys.executable, "-m", "cocodiff", "simulate", "--topology", str(topology),
                    "--model", str(model_dir), "--resolution", str(resolution), "--dtype",
                    "float32", "--steps", str(steps), "--schedule", ",".join(schedules),
                    "--chunks", "1", "--json", str(out)], check=True, capture_output=True,
                   cwd=REPO)
    times = {}
    for row in json.loads(out.read_text())["results"]:
        per_step = row["step_times_s"]
        times[row["schedule"]] = statistics.fmean(per_step[1:] if len(per_step) > 1
                                                  else per_step)
    return times


def with_diffusers(times: dict[str, float], topology: Path, model_dir: Path, resolution: int,
                   steps: int) -> dict[str, float]:
    """``times`` and the ``diffusers`` baseline's step: flat's plan on the machine validate
    predicts it on (:func:`cocodiff.validation.topology_of`: its calls at the ``[host]``'s
    ``diffusers_call_cpu_us`` where the topology has one), else flat's step."""
    from cocodiff.validation import topology_of
    from topology import build_topology
    from topology.toml_format import dump_topology, load_topology

    calibrated = build_topology(load_topology(topology))
    machine = topology_of("diffusers", calibrated)
    if machine is calibrated:
        return {**times, "diffusers": times["flat"]}
    priced = topology.with_name(f"{topology.stem}-diffusers.toml")
    priced.write_text(dump_topology(machine.spec))
    priced.with_suffix(".json").write_text(topology.with_suffix(".json").read_text())
    flat = simulate(priced, model_dir, resolution, steps, ("flat",))["flat"]
    return {**times, "diffusers": flat}


def summary(errors: list[float], picked: list[bool]) -> str:
    magnitudes = [abs(e) for e in errors]
    return (f"median |error| {statistics.median(magnitudes):.1%}, "
            f"{sum(m <= 0.15 for m in magnitudes)} within 15%, "
            f"{sum(m <= 0.20 for m in magnitudes)} within 20% of {len(magnitudes)}; "
            f"pick within 5% of the measured best in {sum(picked)} of {len(picked)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="a bench/emulated_speedup.py JSON report")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a [host] key and its new value (repeatable), e.g. call_wait_us=0")
    parser.add_argument("--refit-call-wait", action="store_true",
                        help="fit call_wait_us again on each calibration's loops, as "
                        "calibrate would now")
    parser.add_argument("--equal-pieces", action="store_true",
                        help="with --refit-call-wait: fit as before 2026-11-29, the loops' "
                        "compute in equal pieces with every call after compute")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    try:
        changes = {key: float(value) for key, value in (s.split("=", 1) for s in args.set)}
    except ValueError:
        parser.error("--set takes KEY=VALUE with a number, e.g. call_wait_us=0")
    report = json.loads(args.report.read_text())
    # The topologies and models written here are rebuilt from the report on every run.
    with tempfile.TemporaryDirectory(prefix="cocodiff-resimulate-") as work:
        return _resimulate(args, report, changes, Path(work))


def _resimulate(args: argparse.Namespace, report: dict[str, Any], changes: dict[str, float],
                work: Path) -> int:
    models: dict[str, Path] = {}
    configs: list[dict[str, Any]] = []
    errors: dict[str, list[float]] = {"calibrated": [], "replaced": []}
    picked: dict[str, list[bool]] = {"calibrated": [], "replaced": []}
    print("| cluster | schedule | measured ms | error: report / calibrated / replaced |")
    print("|---|---|---|---|")
    for index, config in enumerate(report["configs"]):
        shape = config["config"]["model"]
        key = json.dumps(shape, sort_keys=True)
        if key not in models:
            models[key] = export_enlarged(EnlargedModel(**shape), work / f"model-{len(models)}")
        calibrated = work / f"calibrated-{index}.toml"
        calibrated.write_text(config["calibration"]["topology"])
        config_changes = dict(changes)
        loops = None
        world = config["config"]["nodes"] * config["config"]["ranks_per_node"]
        pieces = None if args.equal_pieces else functools.partial(
            forward_pieces, models[key], shape["resolution"], world)
        refit = (refit_call_wait(config, calibrated, pieces) if args.refit_call_wait
                 else None)
        if refit is not None:
            waits, errors_now = refit
            config_changes.update(waits)
            before = [row["error"] for row in config["calibration"]["measured"]["loops_check"]]
            loops = {**waits, "loops_error_report": before, "loops_error_now": errors_now}
            print(f"| {config['label']} | loops | | call wait "
                  f"{config['calibration']['measured']['host']['call_wait_us']:.0f} -> "
                  f"{waits['call_wait_us']:.0f} us, after a call "
                  f"{waits['follow_wait_us']:.0f} us; loops "
                  f"{' '.join(f'{e:+.0%}' for e in before)} -> "
                  f"{' '.join(f'{e:+.0%}' for e in errors_now)} |")
        elif args.refit_call_wait:
            print(f"| {config['label']} | loops | | none measured: call wait as calibrated |")
        replaced = replaced_topology(calibrated, config_changes, work / f"replaced-{index}.toml")
        for topology in (calibrated, replaced):  # its fitted collective, as validate used it
            topology.with_suffix(".json").write_text(json.dumps(config["calibration"]["measured"]))
        steps = config["validate"]["steps"]
        times = {name: with_diffusers(simulate(path, models[key], shape["resolution"], steps),
                                      path, models[key], shape["resolution"], steps)
                 for name, path in (("calibrated", calibrated), ("replaced", replaced))}
        rows = []
        for schedule, row in config["summary"].items():
            if schedule not in times["calibrated"]:
                continue
            measured = row["measured_step_s"]
            error = {name: times[name][schedule] / measured - 1 for name in times}
            for name in times:
                errors[name].append(error[name])
            rows.append({"schedule": schedule, "measured_step_s": measured,
                         "report_error": row.get("error"),
                         **{f"{name}_step_s": times[name][schedule] for name in times},
                         **{f"{name}_error": error[name] for name in times}})
            print(f"| {config['label']} | {schedule} | {measured * 1e3:.1f} | "
                  f"{row.get('error', float('nan')):+.0%} / {error['calibrated']:+.0%} / "
                  f"{error['replaced']:+.0%} |")
        # validate's own rule: the least predicted plan schedule against the least measured
        judged = {name: pick_against_best([
            {**row, "predicted_step_s": times[name].get(row["schedule"])
             if row["layout"] == "pure" else None} for row in config["summary"].values()])
            for name in times}
        picks = {name: verdict["planner_pick"]["schedule"] for name, verdict in judged.items()}
        slower = {name: verdict["pick_slower_than_best"] for name, verdict in judged.items()}
        for name in times:
            picked[name].append(judged[name]["pick_within_5pct"])
        print(f"| {config['label']} | pick | | {picks['calibrated']} / {picks['replaced']} "
              f"(measured {slower['calibrated']:+.0%} / {slower['replaced']:+.0%} over the "
              f"best, {judged['calibrated']['measured_best']['schedule']}) |")
        configs.append({"label": config["label"], "picks": picks, "rows": rows,
                        **({"loops": loops} if loops else {})})
    print(f"calibrated: {summary(errors['calibrated'], picked['calibrated'])}")
    what = ", ".join([*args.set, *(["call_wait_us refitted"] if args.refit_call_wait else [])])
    print(f"with {what or 'nothing'} replaced: {summary(errors['replaced'], picked['replaced'])}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"report": str(args.report), "set": changes,
                                         "refit_call_wait": args.refit_call_wait,
                                         "configs": configs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
