"""Plan invariants for the flat Ulysses schedule, over random shapes."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cocodiff.models import REGISTRY
from cocodiff.plan.steps import Compute, Exchange
from cocodiff.schedules import PlanOptions, RankGrid, get_schedule, plan_flat
from cocodiff.schedules.ulysses import split_heads
from cocodiff.util.errors import ScheduleError

FLUX = REGISTRY["flux1-dev"]


@given(st.integers(1, 64), st.integers(1, 128))
def test_split_heads_is_contiguous_balanced_and_complete(num_heads, num_ranks):
    heads = split_heads(num_heads, num_ranks)
    assert sum(heads) == num_heads
    assert max(heads) - min(heads) <= 1


@settings(max_examples=40, deadline=None)
@given(
    num_ranks=st.integers(1, 12),
    image_tokens=st.integers(1, 300),
    text_tokens=st.integers(0, 40),
    batch=st.integers(1, 2),
)
def test_every_exchange_is_matched_by_its_peers(num_ranks, image_tokens, text_tokens, batch):
    plan = plan_flat(FLUX, RankGrid.line(num_ranks), (image_tokens, text_tokens),
                     PlanOptions(batch=batch))
    layout = plan.head_split
    assert layout.padded_tokens % num_ranks == 0
    assert layout.padded_tokens >= image_tokens + text_tokens
    for tensor_index in range(4):
        exchanges = [plan.program(r).layers[0].exchanges[tensor_index] for r in range(num_ranks)]
        for src, exchange in enumerate(exchanges):
            assert exchange.group == tuple(range(num_ranks))
            for dst in range(num_ranks):
                # What src sends dst is what dst expects from src.
                assert exchange.send_rows[dst] == exchanges[dst].recv_rows[src]
                assert exchange.row_bytes == exchanges[dst].row_bytes


def test_flat_layer_runs_the_steps_in_ulysses_order():
    plan = plan_flat(FLUX, RankGrid.line(4), (4096, 512))
    steps = plan.program(0).layers[0].attention
    kinds = [
        step.op
        if isinstance(step, Compute)
        else f"start {step.tensor}"
        if isinstance(step, Exchange)
        else f"wait {step.tensor}"
        for step in steps
    ]
    assert kinds == [
        "proj_q",
        "proj_k",
        "proj_v",
        "qk_norm",
        "rope",
        "start q",
        "wait q",
        "start k",
        "wait k",
        "start v",
        "wait v",
        "attention",
        "start out",
        "wait out",
        "proj_out",
    ]


def test_bytes_per_layer_equal_four_activation_tensors():
    num_ranks, tokens = 8, (4096, 512)
    plan = plan_flat(FLUX, RankGrid.line(num_ranks), tokens)
    total = sum(
        ex.send_bytes for r in range(num_ranks) for ex in plan.program(r).layers[0].exchanges
    )
    assert total == 4 * sum(tokens) * FLUX.hidden_size * 2


def test_identical_ranks_share_one_layer_object_and_fold():
    plan = plan_flat(FLUX, RankGrid.line(24), (4096, 512))
    assert plan.program(0).layers[0] is plan.program(23).layers[5]
    assert plan.shift_period == 1


def test_plan_serialises_to_json():
    data = json.loads(plan_flat(FLUX, RankGrid.line(2), (64, 8)).to_json(ranks=(0,)))
    assert data["schedule"] == "flat"
    assert data["programs"][0]["layers"][0]["attention"][5]["kind"] == "exchange"


def test_unknown_schedule_lists_the_valid_ones():
    valid = "cocodiff, flat, tapa, vfirst"
    with pytest.raises(ScheduleError, match=f"unknown schedule 'nope'; valid: {valid}"):
        get_schedule("nope")
