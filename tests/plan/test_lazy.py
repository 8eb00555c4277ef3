"""Lazy rank programs (cocodiff.plan.lazy): a hybrid plan builds a rank's program when
first asked for, and gives the programs the eager construction gave (every rank relabelled
and Ring-spliced up front), in any order of asking, through a pickle, and cut to fewer
layers."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from cocodiff.cost import ring_host_ops
from cocodiff.layout import ParallelLayout
from cocodiff.models import REGISTRY
from cocodiff.plan.lazy import LazyPrograms, exemplar_programs, with_layers
from cocodiff.plan.steps import LayerPlan, RankProgram
from cocodiff.schedules import DEFAULT_OPTIONS, RankGrid, get_schedule
from cocodiff.schedules.hybrid import (
    plan_hybrid,
    relabel_layer,
    ring_pass,
    splice_ring,
    ulysses_grids,
)
from topology import Placement, build_topology, get_preset

FLUX = replace(REGISTRY["flux1-dev"], num_layers=3)
STREAMS = (1024, 512)
LAYOUTS = [ParallelLayout(12, 2), ParallelLayout(8, 3, 1, ("batch", "ulysses", "ring")),
           ParallelLayout(6, 2, 2), ParallelLayout(1, 24), ParallelLayout(24, 1)]


def _grid(nodes: int = 2) -> RankGrid:
    topology = build_topology(get_preset("aurora", nodes))
    return RankGrid.from_placement(topology, Placement.node_major(topology))


def _eager(name: str, grid: RankGrid, layout: ParallelLayout, options=DEFAULT_OPTIONS):
    """Every rank's program as plan_hybrid built them before they were lazy."""
    ulysses, ring = layout.ulysses, layout.ring
    group_streams = tuple(-(-t // layout.sequence_ranks) * ulysses for t in STREAMS)
    groups = ulysses_grids(grid, layout)
    local = RankGrid(groups[0].shape, tuple(range(ulysses)))
    sub = get_schedule(name).plan(FLUX, local, group_streams,
                                  replace(options, batch=options.batch // layout.batch), 0.0)
    split = sub.head_split
    host = ring_host_ops(FLUX, ulysses)
    programs: list = [None] * grid.num_ranks
    for leader, members in groups.items():
        relabelled: dict[int, LayerPlan] = {}
        for u, position in enumerate(layout.ulysses_group(leader)):
            rank = grid.ranks[position]
            ring_ranks = tuple(grid.ranks[p] for p in layout.ring_group(position))
            row_bytes = (2 * split.batch * split.padded_tokens * split.heads[u]
                         * split.head_dim * options.dtype_bytes)
            kv_pass = ring_pass(ring_ranks, layout.coords(position)[1], row_bytes)
            done: dict[int, LayerPlan] = {}
            layers = []
            for layer in sub.program(u).layers:
                if id(layer) not in done:
                    local_layer = relabelled.setdefault(id(layer),
                                                        relabel_layer(layer, members.ranks))
                    done[id(layer)] = (splice_ring(local_layer, kv_pass, ring,
                                                   options.dtype_bytes, host)
                                       if ring > 1 else local_layer)
                layers.append(done[id(layer)])
            programs[rank] = RankProgram(rank, tuple(layers))
    return tuple(programs)


def _same_sharing(programs) -> list[list[int]]:
    """Which of a rank's layers are one object (by first index)."""
    return [[next(i for i, other in enumerate(p.layers) if other is layer)
             for layer in p.layers] for p in programs]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("name", ["flat", "tapa", "vfirst"])
def test_lazy_programs_are_the_eager_ones_in_any_order(name, layout):
    grid = _grid()
    options = replace(DEFAULT_OPTIONS, batch=layout.batch)
    eager = _eager(name, grid, layout, options)
    plan = plan_hybrid(name, FLUX, grid, STREAMS, layout, options)
    if layout.is_pure_ulysses:  # the Ulysses schedule's own plan: nothing to build
        assert plan.programs == eager
        return
    assert isinstance(plan.programs, LazyPrograms)
    # Asked from the last rank down, then in order: the same programs either way.
    backwards = [plan.program(rank) for rank in reversed(range(grid.num_ranks))][::-1]
    assert tuple(backwards) == eager
    assert tuple(plan.programs) == eager and plan.programs == eager
    assert _same_sharing(plan.programs) == _same_sharing(eager)
    assert plan.programs[-1] == eager[-1] and plan.programs[1:3] == eager[1:3]
    with pytest.raises(IndexError):
        plan.programs[grid.num_ranks]


@pytest.mark.parametrize("layout", LAYOUTS[:4], ids=lambda layout: layout.name)
def test_cut_layers_exemplars_and_pickle(layout):
    grid = _grid()
    options = replace(DEFAULT_OPTIONS, batch=layout.batch)
    plan = plan_hybrid("tapa", FLUX, grid, STREAMS, layout, options)
    eager = _eager("tapa", grid, layout, options)
    cut = with_layers(plan.programs, 2)
    assert isinstance(cut, LazyPrograms)
    assert tuple(cut) == with_layers(eager, 2)
    assert all(len(p.layers) == 2 for p in cut)
    # The exemplars (one Ulysses group) show every layer up to relabelling.
    exemplars = exemplar_programs(plan.programs)
    assert [p.rank for p in exemplars] == sorted(p.rank for p in exemplars)
    assert len(exemplars) == layout.ulysses
    assert {len(p.layers[0].attention) for p in exemplars} == {
        len(p.layers[0].attention) for p in eager}
    # Fresh (nothing built) and part-built plans pickle to the same programs.
    assert tuple(pickle.loads(pickle.dumps(plan_hybrid(
        "tapa", FLUX, grid, STREAMS, layout, options))).programs) == eager
    plan.program(5)
    assert tuple(pickle.loads(pickle.dumps(plan)).programs) == eager


def test_a_plan_file_of_a_lazy_plan_is_the_eager_plans():
    from cocodiff.plan.steps import Plan

    grid = _grid()
    layout = ParallelLayout(12, 2)
    plan = plan_hybrid("vfirst", FLUX, grid, STREAMS, layout)
    eager = replace(plan, programs=_eager("vfirst", grid, layout))
    assert isinstance(plan, Plan) and plan == eager and hash(plan) == hash(eager)
    assert plan.to_json() == eager.to_json()
