"""How simulation results are shown: a table, the JSON record, a per-rank Gantt plot."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from cocodiff.simulator.results import SimResult
from cocodiff.util.atomic import atomic_write
from cocodiff.util.console import plain_console
from topology import TIERS


def human_bytes(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(num_bytes) < 1000 or unit == "TB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    raise AssertionError("unreachable")


def result_table(results: Sequence[SimResult], title: str,
                 layouts: Sequence[str] | None = None) -> Table:
    """One row per result; ``layouts`` (one name per result) adds a layout column."""
    table = Table(title=title, title_justify="left")
    table.add_column("schedule")
    if layouts is not None:
        table.add_column("layout")
    table.add_column("step time", justify="right")
    table.add_column("compute", justify="right")
    table.add_column("exposed comm", justify="right")
    table.add_column("comm share", justify="right")
    for tier in TIERS:
        table.add_column(f"bytes {tier}", justify="right")
    table.add_column("busiest link (utilisation)")
    with_memory = any(result.memory is not None for result in results)
    if with_memory:
        table.add_column("memory/rank", justify="right")
    for index, result in enumerate(results):
        busiest = result.busiest_links[0] if result.busiest_links else None
        table.add_row(
            result.schedule,
            *([layouts[index]] if layouts is not None else []),
            f"{result.step_time_s * 1e3:.2f} ms",
            f"{result.compute_s * 1e3:.2f} ms",
            f"{result.comm_exposed_s * 1e3:.2f} ms",
            f"{result.comm_share:.1%}",
            *(human_bytes(result.bytes_by_tier[tier]) for tier in TIERS),
            f"{busiest.link[0]}->{busiest.link[1]} {busiest.kind} ({busiest.utilisation:.0%})"
            if busiest
            else "-",
            *([human_bytes(result.memory.total_bytes) if result.memory else "-"]
              if with_memory else []),
        )
    return table


def print_results(results: Sequence[SimResult], title: str, notes: Sequence[str],
                  layouts: Sequence[str] | None = None) -> None:
    # Wide enough for the whole table when the output is a file or a pipe.
    console = plain_console(width=None if sys.stdout.isatty() else 220)
    console.print(result_table(results, title, layouts))
    for note in notes:
        console.print(f"note: {note}")


_OP_COLOURS = {
    "norm": "#bbbbbb",
    "proj_q": "#4c72b0",
    "proj_k": "#4c72b0",
    "proj_v": "#8172b2",
    "qk_norm": "#64b5cd",
    "rope": "#64b5cd",
    "attention": "#55a868",
    "proj_out": "#4c72b0",
    "cross_attention": "#937860",
    "mlp": "#8c8c8c",
}
_COMM_COLOURS = {"a2a q": "#c44e52", "a2a k": "#dd8452", "a2a v": "#da8bc3", "a2a out": "#ccb974"}


def plot_layer_gantt(result: SimResult, path: str | Path, title: str, max_links: int = 6) -> None:
    """A per-rank Gantt of compute and communication for one layer (the second, so that
    the picture shows a layer in steady state), plus the busiest links' busy time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    simulation = result.simulation
    if simulation is None:
        raise ValueError("plotting needs a result simulated with record_spans=True")
    timeline = simulation.timeline
    starts = sorted(s.start_s for s in timeline.on_track("rank 0") if s.name == "norm")
    window = (starts[1], starts[2]) if len(starts) >= 3 else (0.0, result.step_time_s)
    if len(starts) == 2:
        window = (starts[1], result.step_time_s)
    rank_tracks = sorted(
        {s.track for s in timeline.spans if s.track.startswith("rank ")},
        key=lambda track: int(track.split()[1]),
    )[:16]
    links = [use.link for use in result.busiest_links[:max_links]]
    link_tracks = [f"link {u}->{v}" for u, v in links]
    tracks = rank_tracks + link_tracks
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(tracks) + 1.6))
    scale = 1e3  # ms
    for row, track in enumerate(tracks):
        for span in timeline.on_track(track):
            if span.end_s <= window[0] or span.start_s >= window[1]:
                continue
            start = max(span.start_s, window[0])
            end = min(span.end_s, window[1])
            if span.category == "comm":
                colour, height, offset = _COMM_COLOURS.get(span.name, "#c44e52"), 0.35, 0.0
            elif span.category == "link":
                colour, height, offset = "#444444", 0.6, 0.0
            else:
                colour, height, offset = _OP_COLOURS.get(span.name, "#999999"), 0.35, 0.4
            ax.broken_barh(
                [((start - window[0]) * scale, (end - start) * scale)],
                (row - 0.4 + offset, height),
                facecolors=colour,
            )
    ax.set_yticks(range(len(tracks)), [t.replace("link ", "") for t in tracks], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time within one layer (ms)")
    ax.set_title(title, fontsize=9)
    legend = [Patch(color=c, label=op) for op, c in _OP_COLOURS.items() if op != "proj_k"]
    legend += [Patch(color=c, label=name) for name, c in _COMM_COLOURS.items()]
    legend.append(Patch(color="#444444", label="link busy"))
    fig.legend(handles=legend, fontsize=6, ncol=8, loc="lower center")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120))
    plt.close(fig)
