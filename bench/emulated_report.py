"""Tables and the plot of ``bench/emulated_speedup.py``'s JSON report.

    python bench/emulated_report.py results/emulated_speedup.json \\
        --plot results/emulated_speedup.png

    python bench/emulated_report.py REPORT.json --compact results/measured/x.json

prints the README's Markdown table (every configuration and schedule: measured step time,
its spread over the rounds, the speedup over flat and over diffusers, the simulator's
prediction and its error; where calibrate timed the real blocks, also the prediction at
its matrix-product rate, the figure it wrote before) and draws measured against predicted
step times; ``--calibrations`` prints instead docs/validate.md's table (a row per
configuration: its rounds, what calibrate wrote to ``[host]`` and its kernel scale, each
pure-Ulysses schedule measured / predicted, the pick against the measured best);
``--compact`` keeps what the docs cite (each row's measured and predicted step, its 95%
interval and error, the pick, the families) without the calibrations and rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def config_label(config: dict[str, Any]) -> str:
    if "label" in config:  # the configuration's model and transport vary
        return config["label"]
    cluster = config["cluster"]
    return (f"{cluster['num_nodes']} x {cluster['ranks_per_node']} @ "
            f"{cluster['inter_gbit']:g} Gbit/s")


def markdown_table(report: dict[str, Any]) -> str:
    """One row per configuration and schedule."""
    both = _has_matmul(report)
    lines = [
        "| cluster | schedule | measured step (min-max) | over flat | over diffusers "
        + ("| predicted, matrix-product rate | error " if both else "")
        + "| predicted | error |",
        "|---|---|---|---|---|---|---|" + ("---|---|" if both else ""),
    ]
    for config in report["configs"]:
        label = config_label(config)
        for name, row in config["summary"].items():
            over_flat = row.get("measured_speedup_over_flat")
            over_diffusers = row.get("measured_speedup_over_diffusers")
            before = (f"{_ms(row.get('predicted_matmul_rate_step_s'))} | "
                      f"{_pct(row.get('error_matmul_rate'))} | ") if both else ""
            lines.append(
                f"| {label} | `{name}` | {row['measured_step_s'] * 1e3:.1f} ms "
                f"({row['min_step_s'] * 1e3:.1f}-{row['max_step_s'] * 1e3:.1f}) | "
                f"{_ratio(over_flat)} | {_ratio(over_diffusers)} | {before}"
                f"{_ms(row.get('predicted_step_s'))} | {_pct(row.get('error'))} |"
            )
    return "\n".join(lines)


def calibrations_table(report: dict[str, Any]) -> str:
    """docs/validate.md's table: per configuration the rounds it ran, the host figures its
    calibration wrote (waits per call, compute among the calls, late peer first, cores a
    transfer across nodes takes) and the kernel rates' scale to the blocks, then every
    pure-Ulysses schedule's measured / predicted ms (error), and the pick against the
    measured best."""
    import tomllib

    schedules = list(dict.fromkeys(name for config in report["configs"]
                                   for name in config["summary"] if "@" not in name))
    lines = ["| cluster | rounds | waits / wake-up, us | among calls | late peer first "
             "| transfer cores | kernel scale | " + " | ".join(schedules)
             + " | pick / measured best |",
             "|---|---|---|---|---|---|---|" + "---|" * len(schedules) + "---|"]
    for config in report["configs"]:
        calibration = config["calibration"]
        host = tomllib.loads(calibration["topology"]).get("host", {})
        scale = (calibration["measured"].get("kernels") or {}).get("scale")
        rounds = max(len(row["round_medians_s"]) for row in config["summary"].values())
        cells = []
        for name in schedules:
            row = config["summary"].get(name)
            cells.append("-" if row is None or row.get("predicted_step_s") is None else
                         f"{row['measured_step_s'] * 1e3:.1f} / "
                         f"{row['predicted_step_s'] * 1e3:.1f} ({row['error']:+.0%})")
        validate = config["validate"]
        lines.append(
            f"| {config_label(config)} | {rounds} | {host.get('call_wait_us', 0):.0f}, "
            f"{host.get('follow_wait_us', 0):.0f} / {host.get('wake_cpu_us', 0):.0f} | "
            f"x{host.get('compute_among_calls', 1.0):.2f} | "
            f"{'yes' if host.get('late_peer_first') else 'no'} | "
            f"{host.get('transfer_cores', 0.0):.2f} | "
            f"{'-' if scale is None else f'x{scale:.2f}'} | " + " | ".join(cells)
            + f" | {validate['planner_pick']['schedule']} / "
            f"{validate['measured_best']['schedule']} |")
    return "\n".join(lines)


def _has_matmul(report: dict[str, Any]) -> bool:
    return any("predicted_matmul_rate_step_s" in row for config in report["configs"]
               for row in config["summary"].values())


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def text_table(config: dict[str, Any]) -> str:
    """The terminal table of one configuration (the matrix-product rate's columns where
    the report has them)."""
    both = any("predicted_matmul_rate_step_s" in row for row in config["summary"].values())
    width = max(10, *map(len, config["summary"]))  # rows off pure Ulysses: schedule@layout
    lines = [f"{config_label(config)}:",
             f"{'schedule':>{width}} {'measured':>10} {'(min-max)':>17} {'/flat':>6} "
             f"{'/diffusers':>10} {'predicted':>10} {'error':>7}"
             + (f" {'matmul-rate':>11} {'error':>7}" if both else "")]
    for name, row in config["summary"].items():
        predicted = row.get("predicted_step_s")
        error = row.get("error")
        lines.append(
            f"{name:>{width}} {row['measured_step_s'] * 1e3:8.1f}ms "
            f"({row['min_step_s'] * 1e3:6.1f}-{row['max_step_s'] * 1e3:6.1f}ms) "
            f"{_ratio(row.get('measured_speedup_over_flat')):>6} "
            f"{_ratio(row.get('measured_speedup_over_diffusers')):>10} "
            f"{'-' if predicted is None else f'{predicted * 1e3:8.1f}ms':>10} "
            f"{'-' if error is None else f'{error:+7.0%}':>7}"
            + (f" {_ms(row.get('predicted_matmul_rate_step_s')):>11} "
               f"{_pct(row.get('error_matmul_rate')):>7}" if both else "")
        )
    return "\n".join(lines)


def error_bar(row: dict[str, Any]) -> tuple[float, float]:
    """(below, above) the measured step, ms: the row's 95% interval when validate gave one
    (a ratio either side), else the rounds' min-max."""
    measured = row["measured_step_s"] * 1e3
    precision = row.get("precision_95")
    if precision:
        return measured - measured / (1 + precision), measured * precision
    return measured - row["min_step_s"] * 1e3, row["max_step_s"] * 1e3 - measured


def plot(report: dict[str, Any], path: Path) -> None:
    """Measured (bars, with each row's 95% interval over its rounds, or in reports
    without one the rounds' min-max) and predicted (markers) step time of every schedule,
    one panel per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = report["configs"]
    columns = min(4, len(configs))
    rows_of_panels = -(-len(configs) // columns)
    fig, axes = plt.subplots(rows_of_panels, columns, figsize=(3.6 * columns,
                                                               3.6 * rows_of_panels),
                             squeeze=False)
    for ax in axes.flat[len(configs):]:
        ax.set_visible(False)
    for ax, config in zip(axes.flat, configs, strict=False):  # spare panels hidden
        names = list(config["summary"])
        rows = [config["summary"][name] for name in names]
        measured = [row["measured_step_s"] * 1e3 for row in rows]
        low, high = zip(*(error_bar(row) for row in rows), strict=True)
        positions = range(len(names))
        ax.bar(positions, measured, yerr=[low, high], color="#4c72b0", capsize=3,
               label="measured" + (", 95%" if rows and rows[0].get("precision_95") else
                                   ", min-max"))
        predicted = [(i, row["predicted_step_s"] * 1e3) for i, row in enumerate(rows)
                     if row.get("predicted_step_s") is not None]
        before = [(i, row["predicted_matmul_rate_step_s"] * 1e3) for i, row in enumerate(rows)
                  if row.get("predicted_matmul_rate_step_s") is not None]
        if predicted:
            ax.scatter([i for i, _ in predicted], [p for _, p in predicted], color="#dd8452",
                       marker="D", zorder=3,
                       label="simulator, real-block rate" if before else "simulator")
        if before:
            ax.scatter([i for i, _ in before], [p for _, p in before], color="#999999",
                       marker="x", zorder=3, label="simulator, matrix-product rate")
        ax.set_xticks(list(positions), names, rotation=30)
        ax.set_title(config_label(config), fontsize=9)
        ax.set_ylabel("step time (ms)")
    axes[0][0].legend(fontsize=8)
    model = report.get("model")
    if model is not None:  # one model for every configuration (earlier reports)
        fig.suptitle(f"{model['name']}: {model['tokens']} tokens, hidden "
                     f"{model['hidden_size']}, {model['num_layers']} layers, {model['dtype']} "
                     "(emulated cluster, gloo)", fontsize=10)
    else:
        fig.suptitle("measured (bars) and predicted (markers) step times on the emulated "
                     "cluster; label: nodes x ranks @ Gbit/s, transport, hidden, layers, "
                     "resolution", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compact(report: dict[str, Any]) -> dict[str, Any]:
    """The report without its calibrations and per-round records (a few kB a
    configuration): what the docs cite, small enough to keep in the repository."""
    def brief(row: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if row is None else {
            key: row.get(key) for key in ("schedule", "layout", "measured_step_s",
                                          "predicted_step_s")}

    configs = []
    for config in report["configs"]:
        validated = config["validate"]
        configs.append({
            "label": config_label(config),
            "rounds": validated.get("rounds"),
            "machine": validated.get("machine"),
            "planner_pick": brief(validated.get("planner_pick")),
            "measured_best": brief(validated.get("measured_best")),
            "pick_slower_than_best": validated.get("pick_slower_than_best"),
            "pick_within_5pct": validated.get("pick_within_5pct"),
            "families": config.get("families"),
            "rows": {name: {key: row.get(key) for key in (
                "measured_step_s", "precision_95", "predicted_step_s", "error")}
                for name, row in config["summary"].items()},
        })
    kept = ("steps", "repeats", "max_repeats", "precision", "dtype", "schedules", "layouts",
            "rows", "median_abs_error", "within_15pct", "within_20pct", "pick_within_5pct",
            "picks_missed_unresolved", "wall_s")
    return _rounded({"runs": [{key: run[key] for key in kept if key in run}
                              for run in report.get("runs", [report])], "configs": configs})


def _rounded(value: Any) -> Any:
    """Floats to 4 significant digits (the runs vary by more), recursively."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return value


def merged(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Several reports as one: their configurations together, each report's own
    settings and summary under ``runs``."""
    if len(reports) == 1:
        return reports[0]
    return {"configs": [config for report in reports for config in report["configs"]],
            "runs": reports}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, nargs="+",
                        help="the JSON bench/emulated_speedup.py wrote; several: their "
                        "configurations together")
    parser.add_argument("--plot", type=Path, default=None, help="write the plot (PNG) here")
    parser.add_argument("--calibrations", action="store_true",
                        help="print docs/validate.md's table (a row per configuration, "
                        "with what calibrate wrote) instead of the README's")
    parser.add_argument("--compact", type=Path, default=None,
                        help="write the report without calibrations and rounds here (JSON)")
    args = parser.parse_args(argv)
    try:
        report = merged([json.loads(path.read_text()) for path in args.reports])
        print(calibrations_table(report) if args.calibrations else markdown_table(report))
        if args.plot is not None:
            plot(report, args.plot)
        if args.compact is not None:
            args.compact.parent.mkdir(parents=True, exist_ok=True)
            args.compact.write_text(json.dumps(compact(report)) + "\n")
    except (OSError, ValueError, KeyError) as error:
        print(f"emulated_report: error: {' '.join(map(str, args.reports))}: {error}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
