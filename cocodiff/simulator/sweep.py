"""``cocodiff simulate --sweep``: the paper's grid of models x resolutions x Aurora nodes.

With ``pipefusion`` among the schedules, each row also ranks PipeFusion's layouts (stages x
Ulysses inside each; :func:`cocodiff.simulator.ranking.rank_with_floors`, the best one
simulated over the whole generation, the others pruned by their floors) and sets the best
beside the sequence family's, with the device memory each rank needs: pipeline or
sequence parallelism, per model, resolution and node count. Pipelines are simulated rank
by rank (no node symmetry folds them), so these rows cost minutes, not seconds.

Every configuration is an independent, deterministic simulation, so they run side by
side: on the local cores (:func:`cocodiff.simulator.fanout.map_local`), and under ``mpiexec``
split across the ranks (:func:`cocodiff.simulator.fanout.map_mpi`, each rank fanning its share out
over its own cores), so a larger sweep scales out on a cluster. Where a configuration
runs changes nothing in its numbers: rows are gathered back in grid order and match a
serial run (``--workers 1``) exactly (``tests/simulator/test_sweep.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cocodiff.schedules import BASELINE, PlanOptions
from cocodiff.simulator.fanout import local_cores, map_local, map_mpi
from cocodiff.util.errors import CocodiffError
from transports.sim import CollectiveModel

# The paper's grid (arXiv 2604.14561): models x resolutions x Aurora nodes.
SWEEP = {
    "models": ("flux1-dev", "qwen-image", "sd35-large", "flux2-dev"),
    "resolutions": (768, 1536, 2304),
    "nodes": (1, 2, 4, 8),
}


@dataclass(frozen=True, slots=True)
class SweepOptions:
    """What every configuration of one sweep shares."""

    schedules: tuple[str, ...]  # the baseline (flat) first: the speedups are over it
    steps: int
    options: PlanOptions
    collective: CollectiveModel | None
    # The planner chooses each phased schedule's chunk count per row (`--chunks auto`);
    # else every row runs at options.chunks.
    auto_chunks: bool = False
    # Rank PipeFusion's layouts too; `overlap`: consecutive steps overlapped as xDiT's
    # engine runs them (default: as `cocodiff run` does, the pipeline drained every step).
    pipefusion: bool = False
    overlap: bool = False


def run_sweep(models: list[str], resolutions: list[int], nodes_list: list[int],
              names: list[str], steps: int, options: PlanOptions,
              collective: CollectiveModel | None, workers: int | None,
              auto_chunks: bool = False, pipefusion: bool = False, overlap: bool = False
              ) -> tuple[SweepOptions, list[dict] | None]:
    """Check the grid (resolutions, resources), then run it: every row in grid order on
    rank 0 (None on the other MPI ranks: rank 0 reports), with what the rows share.
    ``pipefusion``: each row also ranks PipeFusion's layouts (``overlap``: as xDiT's
    engine runs them)."""
    from cocodiff.models import load_model_spec

    specs = {name: load_model_spec(name) for name in models}
    for spec in specs.values():  # every resolution checked before anything runs
        for resolution in resolutions:
            spec.check_resolution(resolution, resolution)
    schedules = tuple(dict.fromkeys([BASELINE, *names]))
    _check_resources(steps, schedules, options, specs, resolutions, nodes_list, pipefusion,
                     overlap)
    shared = SweepOptions(schedules, steps, options, collective, auto_chunks, pipefusion,
                          overlap)
    grid = [(m, r, n) for m in models for r in resolutions for n in nodes_list]
    return shared, _run_grid(shared, grid, _mpi_world(), workers)


def _check_resources(steps, names, options, specs, resolutions, nodes_list,
                     pipefusion=False, overlap=False) -> None:
    """The resource guard (:mod:`cocodiff.simulator.budget`) over the whole grid, before anything
    runs: every row's simulations, the planner's ranking where a row has more ranks
    than heads, and with ``pipefusion`` every pipeline layout (every candidate counted:
    an upper bound, the planner prunes)."""
    from cocodiff.simulator import budget
    from cocodiff.simulator.pipelines import pipeline_layouts
    from topology import get_preset

    plans = {name: budget.distinct_plans(name, steps, options, None) for name in names}
    ranked = budget.ranked_schedules(names)
    estimates = []
    for model in specs.values():
        for nodes in nodes_list:
            machine = get_preset("aurora", nodes)
            row = [budget.estimate_simulation(machine, model.num_layers, model.num_heads,
                                              plans, options.chunks)]
            if machine.num_tiles > model.num_heads:
                row.append(budget.estimate_planner(machine, model.num_layers, model.num_heads,
                                                   ranked, 1, options.chunks))
            if pipefusion:
                row.append(budget.estimate_pipelines(
                    machine, model.num_layers,
                    pipeline_layouts(machine.num_tiles, model, overlap=overlap), steps))
            estimates += row * len(resolutions)
    budget.check_estimate(budget.combine(estimates),
                          f"the sweep ({len(specs)} model(s) x {len(resolutions)} "
                          f"resolution(s) x nodes {','.join(map(str, nodes_list))})")


def run_configuration(options: SweepOptions, config: tuple[str, int, int]) -> dict:
    """One row of the grid: every schedule on one model, resolution and node count."""
    from cocodiff.models import load_model_spec
    from cocodiff.simulator.planner import choose_layouts
    from cocodiff.simulator.simulate import simulate_schedule
    from topology import Placement, build_topology, get_preset

    model_name, resolution, nodes = config
    model = load_model_spec(model_name)
    streams = (model.image_tokens(resolution, resolution), model.text_tokens)
    topology = build_topology(get_preset("aurora", nodes))
    placement = Placement.node_major(topology)
    names = options.schedules
    # Past the head count pure Ulysses leaves ranks idle: every schedule then runs on the
    # planner's best layout for it (flat included: USP's baseline).
    choices = (choose_layouts(model, topology, streams, names, options.options,
                              options.collective)
               if placement.num_ranks > model.num_heads else {})
    layouts = {name: choices[name].layout if choices else None for name in names}
    # The planner's own simulation of a winner is that schedule's step (same options).
    known = {name: c.result for name, c in choices.items()}
    chunks = _chunks(options, model, topology, streams, layouts, known)
    results = {name: simulate_schedule(name, model, topology, placement, streams,
                                       options.steps,
                                       options=replace(options.options, chunks=chunks[name]),
                                       collective=options.collective,
                                       parallel=layouts[name], known=known.get(name))
               for name in names}
    flat = results[BASELINE].step_time_s
    row = {
        "model": model_name, "resolution": resolution, "nodes": nodes,
        "num_ranks": placement.num_ranks,
        "tile_memory_gb": topology.spec.tile_memory_gb,
        "layouts": {name: layout.name if layout else "pure" for name, layout in layouts.items()},
        "results": [r.to_json() for r in results.values()],
        "speedup": {name: flat / r.step_time_s for name, r in results.items()},
        "memory_gb": {name: r.memory.total_bytes / 1e9 for name, r in results.items()
                      if r.memory is not None},
        "chunks": chunks,
    }
    if options.pipefusion:
        row["pipefusion"] = _best_pipeline(options, model, topology, streams, flat)
    return row


def _best_pipeline(options: SweepOptions, model, topology, streams, flat_s: float) -> dict:
    """The fastest PipeFusion layout of one row that fits the device (the ranking's best,
    the others pruned by their floors), its speedup over flat and its memory per rank;
    ``layout`` None and the first refusal's line where none fits."""
    from cocodiff.simulator.pipelines import pipeline_layouts
    from cocodiff.simulator.ranking import rank_with_floors

    layouts = pipeline_layouts(len(topology.tiles), model, overlap=options.overlap)
    ranking = rank_with_floors(model, topology, streams, [], [], layouts, options.steps,
                               options.options, options.collective, top=1)
    if not ranking.candidates:
        why = ranking.refused[0] if ranking.refused else "no pipeline layout of these ranks"
        return {"layout": None, "why": why}
    best = ranking.best
    return {"layout": best.layout.name, "step_time_s": best.step_time_s,
            "compute_s": best.compute_s, "speedup": flat_s / best.step_time_s,
            "memory_gb": best.memory.total_bytes / 1e9 if best.memory else None,
            "simulated": len(ranking.candidates), "pruned": len(ranking.pruned),
            "refused": len(ranking.refused)}


def _chunks(options: SweepOptions, model, topology, streams, layouts, known) -> dict[str, int]:
    """Each schedule's chunk count in one row: under ``auto_chunks`` the planner's fastest
    for a phased schedule on its layout (``known`` then holds that count's step)."""
    from cocodiff.schedules import get_schedule
    from cocodiff.simulator.planner import choose_chunks

    chunks = dict.fromkeys(options.schedules, options.options.chunks)
    if not options.auto_chunks:
        return chunks
    by_ranked: dict = {}  # (ranked schedule, layout) -> choice: cocodiff chooses as vfirst
    for name in options.schedules:
        entry = get_schedule(name)
        if not entry.phased:
            continue
        key = (entry.ranked_as, layouts[name])
        if key not in by_ranked:
            by_ranked[key] = choose_chunks(key[0], model, topology, streams, layouts[name],
                                           options.options, options.collective)
        choice = by_ranked[key]
        chunks[name] = choice.chunks
        if choice.result is not None and key[0] == name:
            known[name] = choice.result
        elif choice.chunks != options.options.chunks:
            known.pop(name, None)  # the planner's step of the layout was at one chunk
    return chunks


def _run_grid(options: SweepOptions, grid: list, comm, workers: int | None) -> list | None:
    """Every row, in grid order, with a progress bar (on rank 0 under MPI: its share)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    show = comm is None or comm.Get_rank() == 0
    if comm is not None and workers is None:
        # The ranks on one host share its cores.
        host = comm.Split_type(_shared_type())
        workers = max(1, local_cores() // host.Get_size())
        host.Free()
    share = len(range(0, len(grid), comm.Get_size())) if comm is not None else len(grid)
    label = ("configurations" if comm is None
             else f"configurations (rank 0's {share} of {len(grid)})")
    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), disable=not show,
                  transient=False) as progress:
        task = progress.add_task(label, total=share)

        def advance(_index: int) -> None:
            progress.advance(task)

        if comm is None:
            return map_local(run_configuration, options, grid, workers, advance)
        return map_mpi(comm, run_configuration, options, grid, workers, advance)


def _mpi_world():
    """COMM_WORLD when this process is one of several MPI ranks, else None."""
    from transports.launch import MPIEXEC, detect_launch, mpi4py_available

    launch = detect_launch()
    if launch.launcher != MPIEXEC or not launch.is_distributed:
        return None
    if not mpi4py_available():
        raise CocodiffError(f"--sweep under mpiexec ({launch.world_size} ranks) needs mpi4py: "
                            "pip install 'cocodiff[mpi]'")
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _shared_type() -> int:
    from mpi4py import MPI

    return MPI.COMM_TYPE_SHARED


def plot_sweep(rows, names, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(row["model"] for row in rows))
    resolutions = sorted({row["resolution"] for row in rows})
    # One colour per resolution, one line style per schedule (PipeFusion dotted, squares).
    colours = dict(zip(resolutions, plt.get_cmap("tab10").colors, strict=False))
    styles = dict(zip(names[1:], ("--", "-.", "-"), strict=False))
    fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for resolution in resolutions:
            chosen = [row for row in rows if row["model"] == model
                      and row["resolution"] == resolution]
            for name, style in styles.items():
                ax.plot([row["nodes"] for row in chosen],
                        [row["speedup"][name] for row in chosen], style, marker="o",
                        color=colours[resolution], label=f"{name} {resolution}px")
            pipelines = [row for row in chosen if row.get("pipefusion", {}).get("layout")]
            if pipelines:  # the best PipeFusion layout of each row
                ax.plot([row["nodes"] for row in pipelines],
                        [row["pipefusion"]["speedup"] for row in pipelines], ":", marker="s",
                        color=colours[resolution], label=f"pipefusion {resolution}px")
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("Aurora nodes")
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="grey", linewidth=0.8)
    axes[0][0].set_ylabel("speedup over flat Ulysses")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


__all__ = ["SWEEP", "SweepOptions", "plot_sweep", "run_configuration", "run_sweep"]
