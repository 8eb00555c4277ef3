"""PipeFusion in the simulator against closed forms.

On free links (no latency, effectively infinite bandwidth) and a compute-bound device, a
layer of ``q`` tokens attending over a buffer of ``S`` tokens costs exactly
``(q (24 d^2 + 28 d) + 4 q S d) / rate`` seconds (:mod:`cocodiff.cost`: the four
projections and the MLP ``24 d^2`` FLOPs per token; norms ``2 x 7 d``, Q/K norm ``2 x 4 d``,
RoPE ``2 x 3 d``; attention ``4 q S d`` over all heads). A synchronous step runs the
stages one after another over the whole sequence (``L`` layers of ``q = S``); the
pipelined steps stream ``M`` patches through ``N`` stages, each patch-stage slot
``L/N`` layers of ``q = S/M``. With overlapping steps (xDiT's engine,
``PipelineLayout.overlap``) the pipeline is a ring across steps (stage 0 starts patch m of
the next step once the last stage has finished it), so it fills and drains once per
generation: with ``M >= N`` the ``P`` pipelined steps take ``P M + N - 1`` slots
(``M + N - 1`` for one), with ``M < N`` each step but the last waits for the ring,
``(P - 1) N + M + N - 1`` slots. Without (the default, what ``cocodiff run`` executes)
stage 0 waits for the whole step before, so every pipelined step fills and drains:
``P (M + N - 1)`` slots.
"""

from __future__ import annotations

import dataclasses

import pytest

from cocodiff.layout import LayoutError, PipelineLayout
from cocodiff.models import ModelSpec
from cocodiff.plan.steps import Exchange
from cocodiff.schedules import PlanOptions, RankGrid
from cocodiff.schedules.gather import output_gather
from cocodiff.schedules.pipefusion import pipefusion_step_plans, plan_pipefusion
from cocodiff.simulator.simulate import simulate_generation
from topology import Placement, build_topology
from topology.presets import cluster
from transports.sim import COLLECTIVE_MODELS

RATE_TFLOPS = 1.0
IDEAL = COLLECTIVE_MODELS["ideal"]


def free_machine(num_ranks: int):
    """One node whose links cost nothing worth measuring; a compute-bound device."""
    spec = cluster(num_nodes=1, ranks_per_node=num_ranks, intra_gbps=1e8, intra_latency_us=0.0,
                   tile_tflops=RATE_TFLOPS, tile_memory_gbps=1e8)
    return build_topology(dataclasses.replace(spec, name="free"))


def tiny_spec(num_layers: int) -> ModelSpec:
    # No joint text, no cross-attention: the patches are the whole sequence.
    return ModelSpec(name="tiny", family="pixart", num_layers=num_layers, num_heads=4,
                     head_dim=16, text_tokens=0, cross_attention_tokens=0, patch_size=2,
                     output_channels=8)


def layer_s(spec: ModelSpec, q: int, s: int) -> float:
    d = spec.hidden_size
    return (q * (24 * d * d + 28 * d) + 4 * q * s * d) / (RATE_TFLOPS * 1e12)


def simulate(spec, layout, num_steps, tokens, topology=None, **kwargs):
    """The generation as ``simulate_run_plan`` simulates a run's: each stage's output
    gathered every step."""
    topology = topology or free_machine(layout.num_ranks)
    placement = Placement.node_major(topology, layout.num_ranks)
    grid = RankGrid.from_placement(topology, placement)
    plans, steps = pipefusion_step_plans(spec, grid, (tokens,), layout, num_steps)
    gathers = output_gather(spec, grid, (tokens,), layout, PlanOptions())
    return (simulate_generation(plans, steps, topology, placement, IDEAL, gathers=gathers,
                                **kwargs), plans, steps)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize(("stages", "patches", "warmup", "num_steps"), [
    (4, 4, 1, 2),   # one pipelined step: M + N - 1 slots
    (4, 4, 1, 6),   # the ring keeps the pipeline full: P M + N - 1 slots
    (2, 4, 2, 5),
    (4, 2, 1, 4),   # fewer patches than stages: each step waits for the ring
    (4, 4, 0, 3),   # no warm-up
])
def test_pipeline_takes_the_closed_form_time(stages, patches, warmup, num_steps, overlap):
    spec = tiny_spec(num_layers=8)
    tokens = 64
    layout = PipelineLayout(stages, 1, patches, warmup, overlap)
    result, _, _ = simulate(spec, layout, num_steps, tokens)
    sync_s = spec.num_layers * layer_s(spec, tokens, tokens)
    slot_s = spec.num_layers // stages * layer_s(spec, tokens // patches, tokens)
    pipelined = num_steps - warmup
    if not overlap:
        slots = pipelined * (patches + stages - 1)
    elif patches >= stages:
        slots = pipelined * patches + stages - 1
    else:
        slots = (pipelined - 1) * stages + patches + stages - 1
    expected_s = (warmup * sync_s + slots * slot_s) / num_steps
    assert result.step_time_s == pytest.approx(expected_s, rel=1e-6)


def test_one_pipelined_step_is_m_plus_n_minus_1_slots():
    spec = tiny_spec(num_layers=4)
    layout = PipelineLayout(4, 1, 8, warmup=0)
    result, _, _ = simulate(spec, layout, 1, 64)
    slot_s = layer_s(spec, 8, 64)
    assert result.step_time_s == pytest.approx((8 + 4 - 1) * slot_s, rel=1e-6)


@pytest.mark.parametrize("overlap", [True, False])
def test_extrapolated_generation_equals_the_full_simulation(overlap):
    spec = tiny_spec(num_layers=6)
    topology = build_topology(cluster(num_nodes=2, ranks_per_node=2))
    layout = PipelineLayout(2, 2, 3, warmup=1, overlap=overlap)
    fast, _, _ = simulate(spec, layout, 9, 96, topology)
    full, _, _ = simulate(spec, layout, 9, 96, topology, record_spans=True)
    assert fast.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
    assert fast.compute_s == pytest.approx(full.compute_s, rel=1e-9)
    for tier, num_bytes in full.bytes_by_tier.items():
        assert fast.bytes_by_tier[tier] == pytest.approx(num_bytes, rel=1e-9)
    assert fast.exchanges_per_step == full.exchanges_per_step


def test_hybrid_with_ulysses_sends_patches_across_nodes_and_kv_inside_them():
    """2 stages x Ulysses 2 on 2 nodes of 2: the stages' transfers are the only
    inter-node bytes (each rank's share of a patch's hidden states forward, of its
    latents back); the Ulysses all-to-alls of every patch stay inside the node."""
    spec = tiny_spec(num_layers=4)
    d, dtype_bytes = spec.hidden_size, 2
    tokens, patches, num_steps = 96, 3, 4
    topology = build_topology(cluster(num_nodes=2, ranks_per_node=2))
    layout = PipelineLayout(2, 2, patches, warmup=1)
    result, plans, steps = simulate(spec, layout, num_steps, tokens, topology)
    # Forward: every step sends the whole sequence's hidden states from stage 0 to 1;
    # back: the latents of every step but the last.
    forward = num_steps * tokens * d * dtype_bytes
    back = (num_steps - 1) * tokens * spec.output_channels * dtype_bytes
    assert result.bytes_by_tier["inter-node"] == pytest.approx((forward + back) / num_steps)
    # Ulysses inside a stage: Q, K, V and the output of every layer, each rank sending
    # its other member half of its tokens' rows for the member's heads; and each step
    # the stage's output gather, each rank's half of the image to the other.
    per_layer = 4 * 2 * (tokens // 2 // 2) * d * dtype_bytes  # 4 tensors x 2 ranks
    gather = 4 * (tokens // 2) * spec.output_channels * dtype_bytes  # 4 ranks, 1 peer each
    expected_intra = spec.num_layers * per_layer + gather  # per step, any patching
    assert result.bytes_by_tier["intra-node"] == pytest.approx(expected_intra)
    # The compute alone bounds the step from below; the transfers across the slow link
    # make it longer.
    assert result.step_time_s > result.compute_s
    exchanges = [s for p in plans for prog in p.programs for layer in prog.layers
                 for s in layer.attention if isinstance(s, Exchange) and s.direction == "p2p"]
    assert all(len(e.group) == 2 for e in exchanges)


def test_each_stage_gathers_its_output_every_step_stage_0_once_the_ring_is_in():
    """The runtime gathers every stage's output in its Ulysses group after the stage's
    last block; stage 0 gathers at the output projection, after it has taken the last
    stage's output for the step (the ring), which the simulated generation follows."""
    spec = tiny_spec(num_layers=4)
    num_steps = 3
    topology = build_topology(cluster(num_nodes=2, ranks_per_node=2))
    result, _plans, _steps = simulate(spec, PipelineLayout(2, 2, 2, warmup=1), num_steps, 96,
                                      topology, record_spans=True)
    timeline = result.simulation.timeline

    def spans(rank: int, name: str):
        return [span for span in timeline.on_track(f"rank {rank}") if span.name == name]

    first, last = spans(0, "output gather"), spans(2, "output gather")
    assert len(first) == len(last) == num_steps
    # The last stage gathers once its blocks are done; stage 0 after the ring brought
    # that step's output (every step but the last, which sends nothing back).
    ends = sorted(span.end_s for span in timeline.on_track("rank 2")
                  if span.category == "compute")
    for step in range(num_steps - 1):
        assert first[step].start_s >= last[step].start_s
        assert last[step].start_s in ends


def test_stage_gathers_are_each_stages_ulysses_group_and_none_without_one():
    spec = tiny_spec(num_layers=4)
    topology = build_topology(cluster(num_nodes=2, ranks_per_node=2))
    grid = RankGrid.from_placement(topology, Placement.node_major(topology, 4))
    [stage] = output_gather(spec, grid, (96,), PipelineLayout(2, 2, 2, 1), PlanOptions())
    assert stage.groups == ((0, 1), (2, 3))
    assert stage.bytes_per_member == 48 * spec.output_channels * PlanOptions().dtype_bytes
    # One rank per stage gathers nothing; nor does xDiT's engine (overlapping steps),
    # which steps the scheduler on each patch where it is.
    assert output_gather(spec, grid, (96,), PipelineLayout(4, 1, 4, 1), PlanOptions()) == ()
    assert output_gather(spec, grid, (96,), PipelineLayout(2, 2, 2, 1, overlap=True),
                         PlanOptions()) == ()


def test_plan_layout_is_checked_in_one_line():
    spec = tiny_spec(num_layers=2)
    grid = RankGrid.line(4)
    with pytest.raises(LayoutError, match="3 pipeline stages for 2 layers"):
        plan_pipefusion(spec, RankGrid.line(3), (64,), PipelineLayout(3), PlanOptions())
    with pytest.raises(LayoutError, match="but the run has 4"):
        plan_pipefusion(spec, grid, (64,), PipelineLayout(2), PlanOptions())
    with pytest.raises(LayoutError, match="patches must be an integer >= 1"):
        PipelineLayout(2, 1, 0)


def _p2p(program) -> list[tuple[str, int, tuple[int, ...]]]:
    """A program's point-to-point transfers in order: (direction, bytes, group)."""
    return [(s.tensor, s.row_bytes, s.group) for layer in program.layers
            for s in layer.attention if isinstance(s, Exchange) and s.direction == "p2p"]


def _recvs_before_first_layer(program) -> int:
    """Receive waits stage 0 makes before its first model layer."""
    from cocodiff.plan.steps import Compute, Wait

    count = 0
    for layer in program.layers:
        if any(isinstance(s, Compute) for s in layer.steps):
            return count
        count += sum(isinstance(s, Wait) and s.tensor == "recv" for s in layer.steps)
    return count


def test_overlap_moves_stage_0s_dependencies_not_its_bytes():
    """The same generation with and without overlapping steps: every rank sends and
    receives the same transfers (bytes, peers, count); stage 0 of a pipelined step after
    a pipelined one waits for one patch before its first (overlap) or for all M (run's
    order), and the last stage sends its M patches after its last one; so the generation
    without overlap is slower."""
    spec = tiny_spec(num_layers=8)
    stages, patches, tokens, num_steps = 2, 4, 64, 5
    found = {}
    for overlap in (True, False):
        layout = PipelineLayout(stages, 1, patches, 1, overlap)
        found[overlap] = simulate(spec, layout, num_steps, tokens)
    (fast, plans_o, steps_o), (slow, plans_d, steps_d) = found[True], found[False]
    assert steps_o == steps_d
    for plan_o, plan_d in zip(plans_o, plans_d, strict=True):
        assert plan_o.pipeline.overlap and not plan_d.pipeline.overlap
        for rank in range(stages):
            assert sorted(_p2p(plan_o.program(rank))) == sorted(_p2p(plan_d.program(rank)))
    assert fast.bytes_by_tier == slow.bytes_by_tier
    assert fast.exchanges_per_step == slow.exchanges_per_step
    # The middle steps' plan: M patches in, M out.
    middle = plans_o[steps_o[2]], plans_d[steps_d[2]]
    assert [_recvs_before_first_layer(plan.program(0)) for plan in middle] == [1, patches]
    assert middle[0].program(0).layers != middle[1].program(0).layers
    # Same compute, slower: the pipeline fills and drains every step.
    assert slow.compute_s == pytest.approx(fast.compute_s, rel=1e-12)
    assert slow.step_time_s > fast.step_time_s


@pytest.mark.parametrize(("stages", "ulysses"), [(4, 1), (2, 2)])
def test_each_step_pays_its_overhead_once_on_the_critical_path(stages, ulysses):
    # The step's work outside the blocks, fixed o plus s per whole sequence on the rank
    # (a stage rank of u carries 1/u of it): stage 0 pays it once the last stage's output
    # is back, the other stages while they wait for their first patch (hidden, o + s/u
    # below a slot here), so every step takes o + s/u longer than without it.
    spec = tiny_spec(num_layers=8)
    tokens, patches, warmup, num_steps = 64, 4, 1, 5
    layout = PipelineLayout(stages, ulysses, patches, warmup)
    slot_s = spec.num_layers // stages * layer_s(spec, tokens // patches, tokens)
    fixed_s, sequence_s = slot_s / 4, slot_s / 2
    topology = free_machine(layout.num_ranks)
    charged = build_topology(dataclasses.replace(
        topology.spec, tile_step_overhead_us=fixed_s * 1e6,
        tile_step_overhead_sequence_us=sequence_s * 1e6))
    without, _, _ = simulate(spec, layout, num_steps, tokens, topology)
    with_it, _, _ = simulate(spec, layout, num_steps, tokens, charged)
    added_s = with_it.step_time_s - without.step_time_s
    assert added_s == pytest.approx(fixed_s + sequence_s / ulysses, rel=1e-6)


def test_a_stage_is_charged_the_flux_blocks_it_holds():
    # FLUX with 2 double- and 4 single-stream blocks over 4 stages (layers 0 | 1 2 | 3 |
    # 4 5): each stage's patch layers cost what its own blocks cost in the kernel model
    # (a double block more than a single one), the mean layer only where the spec does
    # not say which is which.
    from cocodiff.cost import compute_seconds
    from cocodiff.models import spec_from_config
    from cocodiff.plan.steps import Compute
    from cocodiff.schedules.pipefusion import layer_kinds
    from topology import DEVICES

    spec = spec_from_config({"_class_name": "FluxTransformer2DModel", "num_layers": 2,
                             "num_single_layers": 4, "num_attention_heads": 4,
                             "attention_head_dim": 16, "in_channels": 16})
    assert spec.double_stream_share == pytest.approx(2 / 6)
    assert [kind.double_stream_share for kind in layer_kinds(spec)] == [1, 1, 0, 0, 0, 0]
    # The kernel model prices the kinds apart (a roofline prices FLOPs and bytes alike).
    topology = build_topology(dataclasses.replace(free_machine(4).spec,
                                                  device=DEVICES["h100-sxm"]))
    grid = RankGrid.from_placement(topology, Placement.node_major(topology, 4))

    def stage_layers_s(model):
        plan = plan_pipefusion(model, grid, (64, 16), PipelineLayout(4, 1, 4, 1))
        return [[sum(compute_seconds(step.cost, topology.spec) for step in layer.steps
                     if isinstance(step, Compute))
                 for layer in plan.program(rank).layers
                 if any(isinstance(step, Compute) for step in layer.steps)][:2]
                for rank in range(4)]

    stages = stage_layers_s(spec)
    double_s, single_s = stages[0][0], stages[3][0]
    assert double_s > single_s
    # Stage 1 holds layers 1 (double) and 2 (single), stage 2 layer 3 (single).
    assert stages[1] == pytest.approx([double_s, single_s])
    assert stages[2][0] == pytest.approx(single_s)
    mean = stage_layers_s(dataclasses.replace(spec, double_stream_share=None))
    assert {round(s, 15) for layers in mean for s in layers} == {round(mean[0][0], 15)}
    assert single_s < mean[0][0] < double_s
