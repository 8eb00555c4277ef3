"""Chunks always split (cocodiff.plan.chunking): every chunk of a phased exchange carries a
share of every message it has bytes for, and the chunks add up to the message."""

from dataclasses import replace

import pytest

from cocodiff.models import REGISTRY
from cocodiff.plan.chunking import chunk_tokens, cuts_tokens
from cocodiff.plan.phasing import chunk_member_bytes
from cocodiff.schedules import PlanOptions, RankGrid, plan_tapa


@pytest.mark.parametrize(("shape", "num_heads"), [((2, 2, 1), 4), ((2, 2, 1), 8),
                                                  ((2, 2, 2), 11), ((3, 2, 1), 7)])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_every_chunk_carries_a_share_of_every_message(shape, num_heads, chunks):
    num_ranks = shape[0] * shape[1] * shape[2]
    spec = replace(REGISTRY["flux1-dev"], num_heads=num_heads)
    grid = RankGrid(shape, tuple(range(num_ranks)))
    plan = plan_tapa(spec, grid, (40, 24), PlanOptions(dtype="float32", chunks=chunks))
    heads = plan.head_split.heads
    for rank in range(num_ranks):
        for step in plan.program(rank).layers[0].exchanges:
            assert bool(step.chunk_tokens) == cuts_tokens(heads, chunks)
            for phase in step.phases:
                whole = [rows * step.row_bytes for rows in phase.send_rows]
                parts = [chunk_member_bytes(step, phase, c)[0] for c in range(chunks)]
                assert [sum(p[j] for p in parts) for j in range(len(whole))] == whole
                for j, total in enumerate(whole):
                    # no chunk empty where the message is not, none above its fair share
                    # by more than one row (rows cut) or one token of each row
                    assert all(p[j] > 0 for p in parts) == (total > 0)
                    slack = (step.row_bytes // plan.head_split.local_tokens
                             * phase.send_rows[j] if step.chunk_tokens else step.row_bytes)
                    assert all(p[j] <= -(-total // chunks) + slack for p in parts)


def test_token_chunks_are_as_even_as_possible():
    assert chunk_tokens(7, 3) == (3, 2, 2)
    assert cuts_tokens((1, 1, 1, 1), 2) and not cuts_tokens((2, 2), 2)
    assert not cuts_tokens((1, 1), 1) and cuts_tokens((3, 3, 2, 0), 3)


def test_a_plan_file_keeps_token_chunks_and_an_older_file_cuts_rows():
    import json

    from cocodiff.schedules.run_plan import RunPlan, build_run_plan

    spec = replace(REGISTRY["flux1-dev"], num_heads=8)
    grid = RankGrid((2, 2, 2), tuple(range(8)))
    run_plan = build_run_plan("vfirst", spec, grid, (1024, 512), 2, PlanOptions(chunks=3))
    exchange = run_plan.plans[0].program(0).layers[0].exchanges[0]
    assert exchange.chunk_tokens == (64, 64, 64)  # one head per rank: tokens cut
    again = RunPlan.from_json(run_plan.to_json())
    assert again.plans == run_plan.plans and again.to_json() == run_plan.to_json()
    # A file written before chunks could cut tokens has no chunk_tokens: its chunks cut rows.
    rows_cut = build_run_plan("tapa", REGISTRY["flux1-dev"], grid, (1024, 512), 2,
                              PlanOptions(chunks=3))
    data = json.loads(rows_cut.to_json())
    for layer in data["layers"]:
        for step in layer["attention"]:
            step.pop("chunk_tokens", None)
    assert RunPlan.from_json(json.dumps(data)).plans == rows_cut.plans
