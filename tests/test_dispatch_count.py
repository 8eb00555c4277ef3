"""The eager host term: the ATen ops a layer dispatches by layout (cocodiff.kernels.
DISPATCHED_OPS: diffusers alone, this runtime under Ulysses, Ring and both; re-counted here
on the tiny twins so the table cannot rot), what a plan charges each layout, and what the
ops cost in the kernel model's closed form."""

from __future__ import annotations

import dataclasses

import pytest

from cocodiff import kernels as kn
from cocodiff.calibration.dispatch import count_ops, host_stack, ops_per_block
from topology import DEVICES

H100 = DEVICES["h100-sxm"]


def _counts(name: str, heads_factor: int = 1, layout: tuple[int, int] = (1, 1)
            ) -> dict[str, float]:
    """Ops per block kind of tiny model ``name``, its heads multiplied by ``heads_factor``
    (the count must not depend on it): plain diffusers at ``layout`` (1, 1), else rank 0 of
    a ``(ulysses, ring)`` split run by this runtime over a stand-in transport (nothing
    moved; the exchanges are transport calls, not ATen ops, so only the runtime's own ops
    around them count)."""
    import diffusers
    import torch

    from cocodiff.calibration.model_shapes import tiny_transformer_config
    from cocodiff.calibration.standin import StandInTransport
    from cocodiff.layout import ParallelLayout
    from cocodiff.runtime.hybrid import parallelize_hybrid
    from cocodiff.runtime.parallel import parallelize

    config = dict(tiny_transformer_config(name))
    config["num_attention_heads"] *= heads_factor
    for key in ("caption_projection_dim", "ffn_dim"):  # widths that follow the heads
        if key in config:
            config[key] *= heads_factor
    transformer = getattr(diffusers, config["_class_name"]).from_config(config).eval()
    ulysses, ring = layout
    standin = StandInTransport(0, ulysses * ring)
    if ring > 1:
        parallelize_hybrid(transformer, standin, "flat", ParallelLayout(ulysses, ring))
    elif ulysses > 1:
        parallelize(transformer, standin, "flat")
    c = transformer.config
    gen = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    if name == "tiny-flux":
        from cocodiff.calibration.blocks import flux_inputs

        inputs = flux_inputs(c, 64, 16, torch.float32)
        kinds = {"double": "transformer_blocks", "single": "single_transformer_blocks"}
    elif name == "tiny-sd3":
        inputs = dict(hidden_states=r(1, 16, 16, 16), encoder_hidden_states=r(1, 8, 64),
                      pooled_projections=r(1, c.pooled_projection_dim),
                      timestep=torch.tensor([500.0]))
        kinds = {"joint": "transformer_blocks"}
    elif name == "tiny-qwen":
        inputs = dict(hidden_states=r(1, 64, c.in_channels),
                      encoder_hidden_states=r(1, 8, c.joint_attention_dim),
                      encoder_hidden_states_mask=torch.ones(1, 8),
                      timestep=torch.tensor([0.5]), img_shapes=[(1, 8, 8)])
        kinds = {"joint": "transformer_blocks"}
    else:
        inputs = dict(hidden_states=r(1, 16, 2, 8, 8), timestep=torch.tensor([500.0]),
                      encoder_hidden_states=r(1, 8, c.text_dim))
        kinds = {"cross": "blocks"}
    return ops_per_block({kind: list(getattr(transformer, attr)) for kind, attr in kinds.items()},
                         lambda: transformer(**inputs, return_dict=False))


@pytest.mark.parametrize("name,family", [("tiny-flux", "flux"), ("tiny-sd3", "sd3"),
                                         ("tiny-qwen", "qwen-image"), ("tiny-wan", "wan")])
def test_diffusers_blocks_dispatch_the_tabled_ops(name, family):
    counted = _counts(name)
    assert counted == {kind: row.diffusers for kind, row in kn.DISPATCHED_OPS[family].items()}


def test_the_count_does_not_depend_on_the_sizes():
    assert _counts("tiny-flux", 2) == _counts("tiny-flux", 1)
    assert _counts("tiny-flux", 2, (2, 2)) == _counts("tiny-flux", 1, (2, 2))


# Every split kind: Ulysses at two degrees, the Ring at three (its ops are linear in the
# degree: a fixed part and one per block), and Ulysses x Ring.
@pytest.mark.parametrize("layout", [(2, 1), (4, 1), (1, 2), (1, 3), (1, 4), (2, 2)])
def test_the_runtime_dispatches_the_tabled_ops_for_each_split(layout):
    counted = _counts("tiny-flux", 1, layout)
    assert counted == {kind: row.per_block(*layout)
                       for kind, row in kn.DISPATCHED_OPS["flux"].items()}


@pytest.mark.parametrize("name,family", [("tiny-sd3", "sd3"), ("tiny-qwen", "qwen-image"),
                                         ("tiny-wan", "wan")])
def test_the_other_families_runtime_counts_hold_at_ulysses_and_ring(name, family):
    for layout in ((2, 1), (1, 2), (1, 4)):
        assert _counts(name, 1, layout) == {
            kind: row.per_block(*layout) for kind, row in kn.DISPATCHED_OPS[family].items()}


def test_a_split_layout_counts_its_own_ops():
    row = kn.DispatchCount(diffusers=10, runtime=15, ring_first=2, ring_later=7)
    assert [row.per_block(*layout) for layout in ((1, 1), (2, 1), (8, 1), (1, 2), (1, 4), (2, 2))
            ] == [10, 15, 15, 15 + 2 + 7, 15 + 2 + 3 * 7, 15 + 2 + 7]


def test_the_runtime_under_ulysses_dispatches_the_tabled_ops():
    from cocodiff.calibration.dispatch import runtime_ops_per_block, runtime_ops_per_layer
    from cocodiff.calibration.model_shapes import tiny_transformer_config

    config = tiny_transformer_config("tiny-flux")
    per_block, sizes = runtime_ops_per_block(config, (64, 16), world=2)
    table = kn.DISPATCHED_OPS["flux"]
    assert per_block == {"transformer_blocks": table["double"].runtime,
                         "single_transformer_blocks": table["single"].runtime}
    assert sizes == {"transformer_blocks": 1, "single_transformer_blocks": 1}
    assert runtime_ops_per_layer(config, (64, 16), world=2) == pytest.approx(
        (table["double"].runtime + table["single"].runtime) / 2)


def _flux_layer(world: int):
    from cocodiff.cost import OPS, op_cost
    from cocodiff.runtime.model_names import model_spec
    from cocodiff.schedules.ulysses import head_split, layer_shape

    spec = model_spec("flux1-dev")
    shape = layer_shape(head_split(spec, world, (4096, 512)), 0, 2)
    return spec, [k for op in OPS for k in op_cost(spec, op, shape).kernels]


@pytest.mark.parametrize("world", [1, 4])
def test_a_layers_kernels_carry_the_layers_dispatched_ops(world):
    # one rank: diffusers' own blocks; a Ulysses rank: the runtime's processors
    spec, layer = _flux_layer(world)
    share = 19 / 57
    table = kn.DISPATCHED_OPS["flux"]
    expected = (share * table["double"].per_block(world)
                + (1 - share) * table["single"].per_block(world))
    assert sum(kn.host_ops(k, "eager") for k in layer) == pytest.approx(expected)
    # compiled: the fused graph's launches, as before
    assert sum(kn.host_ops(k, "compiled") for k in layer) == sum(k.fused_launches for k in layer)


@pytest.mark.parametrize("model", ["flux1-dev", "sd35-large"])
@pytest.mark.parametrize("layout", [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2)])
def test_a_plan_charges_every_layout_the_ops_its_rank_dispatches(model, layout):
    # Symmetric: every rank's layer, Ring blocks and merges included, carries the count of
    # its own split (cocodiff.cost.ring_host_ops), so no layout is cheaper for being
    # counted less.
    from cocodiff.layout import ParallelLayout
    from cocodiff.plan.steps import Compute
    from cocodiff.runtime.model_names import model_spec
    from cocodiff.schedules import RankGrid
    from cocodiff.schedules.hybrid import plan_hybrid

    spec = model_spec(model)
    ranks = layout[0] * layout[1]
    plan = plan_hybrid("flat", spec, RankGrid((1, ranks, 1), tuple(range(ranks))),
                       (4096, 512), ParallelLayout(*layout))
    for rank in range(ranks):
        layer = plan.program(rank).layers[0]
        charged = sum(kn.host_ops(k, "eager") for step in layer.steps
                      if isinstance(step, Compute) for k in step.cost.kernels)
        assert charged == pytest.approx(kn.dispatched_ops_per_layer(spec, *layout))
    assert kn.dispatched_ops_per_layer(spec, 1, 4) > kn.dispatched_ops_per_layer(spec, 4, 1)


@pytest.mark.parametrize("model", ["flux1-dev", "sd35-large"])
@pytest.mark.parametrize("stages,ulysses", [(4, 1), (2, 2)])
def test_a_pipelined_patch_layer_charges_what_a_pipeline_stage_dispatches(model, stages,
                                                                           ulysses):
    # A patch through a stage's block runs the runtime's processors and the K/V buffer's
    # work (kn.PIPELINE_DISPATCHED_OPS); the warm-up's synchronous layers keep the count
    # of the stage's Ulysses split. SD3 has no pipelined count: the Ulysses one stays.
    from cocodiff.layout import PipelineLayout
    from cocodiff.plan.steps import Compute
    from cocodiff.runtime.model_names import model_spec
    from cocodiff.schedules import RankGrid
    from cocodiff.schedules.pipefusion import layer_kinds, plan_pipefusion

    spec = model_spec(model)
    grid = RankGrid((1, stages * ulysses, 1), tuple(range(stages * ulysses)))

    def charged(patches: int) -> float:
        plan = plan_pipefusion(spec, grid, (4096, 512), PipelineLayout(stages, ulysses,
                                                                       patches, 1),
                               patches=patches, ring_from=0)
        layer = next(layer for layer in plan.program(0).layers
                     if any(isinstance(step, Compute) for step in layer.steps))
        return sum(kn.host_ops(k, "eager") for step in layer.steps
                   if isinstance(step, Compute) for k in step.cost.kernels)

    # Rank 0's first layer is the model's first block: FLUX's a double-stream one, which
    # is charged its own kind's count (layer_kinds), not the model's mean layer's.
    kind = layer_kinds(spec)[0]
    assert kind.double_stream_share == (1.0 if model == "flux1-dev" else None)
    ulysses_count = kn.dispatched_ops_per_layer(kind, ulysses)
    if model == "flux1-dev":
        assert ulysses_count == kn.DISPATCHED_OPS["flux"]["double"].per_block(ulysses)
    assert charged(1) == pytest.approx(ulysses_count)
    pipelined = kn.pipeline_dispatched_ops_per_layer(kind, ulysses)
    assert charged(stages) == pytest.approx(ulysses_count if pipelined is None else pipelined)
    assert (pipelined is None) == (model != "flux1-dev")
    if pipelined is not None:
        assert pipelined > ulysses_count  # no pipeline is cheaper for being counted less


def test_the_host_term_in_closed_form():
    g = kn.gemm(64, 64, 64, 2, launches=2).with_host_ops(3.0)  # 6 dispatched ops
    e = kn.elementwise(128.0, 4, 2, 3, 1).with_host_ops(3.0)  # 9
    work = kn.kernel_seconds(g, H100, "eager") + kn.kernel_seconds(e, H100, "eager")
    # An accelerator: max(device's work and launch gaps, host's dispatched ops).
    assert kn.device_seconds((g, e), H100, "eager") == pytest.approx(
        max(work + 5 * H100.launch_us * 1e-6, 15 * H100.host_us * 1e-6))
    assert 15 * H100.host_us * 1e-6 > work + 5 * H100.launch_us * 1e-6  # host-bound here
    # A CPU (host_us 0: the device is the host): work plus launch_us per dispatched op.
    cpu = dataclasses.replace(H100, host_us=0.0, launch_us=5.0)
    assert kn.device_seconds((g, e), cpu, "eager") == pytest.approx(work + 15 * 5e-6)
    # Without a count a kernel dispatches one op per launch (as the launch counts alone).
    plain = kn.gemm(64, 64, 64, 2, launches=2)
    assert kn.host_ops(plain, "eager") == 2.0


def test_the_host_microbenchmark_counts_what_its_stack_dispatches():
    import torch

    stack, inputs = host_stack(torch.float32, "cpu")
    with torch.inference_mode():
        ops = count_ops(lambda: stack(*inputs))
    # modules, chunk, views, transposes, SDPA: many more ATen ops than its 8 Linear calls
    assert ops > 20


def test_the_fit_charges_the_host_per_op_where_it_belongs():
    from cocodiff.calibration.kernel_fit import (
        AttentionPoint,
        ElementwisePoint,
        GemmPoint,
        fit_device_rates,
    )

    elementwise = [ElementwisePoint("mul", b, 2e-6 + b / 1e10) for b in (12.0, 1e4, 1e5)]
    gemms = [GemmPoint(m, 64, 64, 2e-6 + 2.0 * m * 64 * 64 / 1e11) for m in (64, 128)]
    attention = [AttentionPoint(64, 64, 1, 16, 1e-4)]
    cpu = fit_device_rates("cpu", elementwise, gemms, attention, 1, host_us=1.0,
                           on_host=True, host_op_us=8.0).rates
    assert (cpu.host_us, cpu.launch_us) == (0.0, 8.0)
    assert cpu.compiled_launch_us == pytest.approx(2.0)  # the bare op, per fused launch
    gpu = fit_device_rates("gpu", elementwise, gemms, attention, 4, host_us=1.0,
                           on_host=False, host_op_us=8.0).rates
    assert (gpu.host_us, gpu.compiled_host_us) == (8.0, 1.0)
    assert gpu.launch_us == pytest.approx(2.0)
