"""Which postings of a phased exchange go out at progress points (cocodiff.plan.phasing)."""

import pytest

from cocodiff.cost import Cost
from cocodiff.models import REGISTRY
from cocodiff.plan.phasing import early_phases
from cocodiff.plan.steps import Compute
from cocodiff.schedules import RankGrid, plan_tapa, plan_vfirst


def early_by_tensor(steps) -> dict[str, frozenset[int]]:
    return {step.tensor: early_phases(steps, index) for index, step in enumerate(steps)
            if getattr(step, "phases", ())}


def test_a_phase_whose_group_a_later_start_opens_is_held_to_the_wait():
    # 2 x 2, phases (node, gpu). V-First starts V, then Q and K before the waits: both
    # open the node group, so V's and Q's node phases are not posted at progress points;
    # K (started last) and the output (alone) may post every phase.
    grid = RankGrid((2, 2, 1), (0, 1, 2, 3))
    steps = plan_vfirst(REGISTRY["flux1-dev"], grid, (64, 16)).program(0).layers[0].attention
    assert early_by_tensor(steps) == {"v": {1}, "q": {1}, "k": {0, 1}, "out": {0, 1}}


def test_an_exchange_waited_at_once_may_post_every_phase():
    grid = RankGrid((2, 2, 2), tuple(range(8)))
    steps = plan_tapa(REGISTRY["flux1-dev"], grid, (64, 16)).program(3).layers[0].attention
    assert set(early_by_tensor(steps).values()) == {frozenset({0, 1, 2})}


def test_only_exchanges_have_phases_to_post():
    with pytest.raises(TypeError, match="not an exchange"):
        early_phases((Compute("mlp", Cost(1, 1)),), 0)
