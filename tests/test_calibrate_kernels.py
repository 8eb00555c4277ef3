"""calibrate's kernel microbenchmarks: the closed-form fits give back the rates that made
their times, a topology carries the rates (``[device]``) and the simulator prices compute
with them, and a calibration's rates are written where the simulator reads them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cocodiff import kernels
from cocodiff.calibration.kernel_bench import (
    KERNEL_SCALE_LIMIT,
    KernelCalibration,
    KernelPoints,
    block_check,
    fit_points,
    kernel_layer_seconds,
    time_kernels,
)
from cocodiff.calibration.kernel_fit import (
    AttentionPoint,
    ElementwisePoint,
    GemmPoint,
    fit_device_rates,
    fit_elementwise,
    fit_gemm,
)
from cocodiff.calibration.model_shapes import LayerShapes
from cocodiff.calibration.options import CalibrationError
from cocodiff.commands.cli import main
from topology import DeviceRates, TopologyError, dump_topology, load_topology
from topology.presets import DEVICES, PRESETS

TRUE = DeviceRates(name="synthetic", gemm_tflops=0.25, gemm_fixed_us=3.0,
                   attention_tflops=((64, 0.02), (256, 0.05), (1024, 0.08)), memory_gbps=12.0,
                   sm_count=4, launch_us=2.0, host_us=7.0, compiled_launch_us=2.0,
                   compiled_host_us=7.0,
                   attention_query_factor=((128, 1.3), (512, 1.1), (1024, 1.0)))


def _times(rates: DeviceRates) -> tuple[list, list, list]:
    """Microbenchmark times exactly as the kernel model prices each kernel plus its launch."""
    launch = rates.launch_us * 1e-6

    def seconds(kernel: kernels.Kernel) -> float:
        return kernels.kernel_seconds(kernel, rates, "eager") + launch

    elementwise = [ElementwisePoint("mul", float(n), seconds(kernels.elementwise(n, 1, 1, 1, 1)))
                   for n in (12, 4096, 16384, 65536, 262144, 1 << 20)]
    gemms = [GemmPoint(m, k, n, seconds(kernels.gemm(m, k, n, 4)))
             for m in (64, 128, 256) for k, n in ((256, 256), (256, 1024), (1024, 256))]
    attention = [AttentionPoint(s, s, 3, 64, seconds(kernels.attention(s, s, 3, 64, 4)))
                 for s in (64, 256, 1024)]
    # A patch's shape: fewer queries against the longest length's keys.
    attention += [AttentionPoint(q, 1024, 3, 64, seconds(kernels.attention(q, 1024, 3, 64, 4)))
                  for q in (128, 512)]
    return elementwise, gemms, attention


def test_the_fits_give_back_the_rates_that_made_the_times():
    elementwise, gemms, attention = _times(TRUE)
    # Compute-bound at these shapes: the fit inverts F / R + t0 + launch exactly.
    assert all(p.flops / (TRUE.gemm_tflops * 1e12) > kernels.gemm(p.m, p.k, p.n, 4).memory_bytes
               / (TRUE.memory_gbps * 1e9) for p in gemms)
    memory, launch, error = fit_elementwise(elementwise)
    assert (memory, launch, error) == pytest.approx((12.0, 2.0, 0.0), abs=1e-9)
    assert fit_gemm(gemms, launch) == pytest.approx((0.25, 3.0, 0.0), abs=1e-9)
    fit = fit_device_rates("synthetic", elementwise, gemms, attention, sm_count=4,
                           host_us=7.0, on_host=False)
    got = fit.rates
    assert got.name == "synthetic" and got.sm_count == 4 and got.host_us == 7.0
    for field in ("gemm_tflops", "gemm_fixed_us", "memory_gbps", "launch_us"):
        assert getattr(got, field) == pytest.approx(getattr(TRUE, field), rel=1e-9)
    # Attention: the table's rates at the lengths timed, the partial wave taken out
    # (3 heads x 1-8 query tiles on 4 units).
    assert [s for s, _ in got.attention_tflops] == [64, 256, 1024]
    for (_, rate), (_, true) in zip(got.attention_tflops, TRUE.attention_tflops, strict=True):
        assert rate == pytest.approx(true, rel=1e-9)
    # The query factors at the query counts timed, closed by 1 at the keys they faced.
    assert [q for q, _ in got.attention_query_factor] == [128, 512, 1024]
    assert [f for _, f in got.attention_query_factor] == pytest.approx([1.3, 1.1, 1.0],
                                                                      rel=1e-9)
    square_only = fit_device_rates("synthetic", elementwise, gemms, attention[:3], sm_count=4,
                                   host_us=7.0, on_host=False).rates
    assert square_only.attention_query_factor == ()
    # On the CPU the core that issues an op runs it: no host term, the launch is the cost.
    on_cpu = fit_device_rates("cpu", elementwise, gemms, attention, 1, host_us=7.0,
                              on_host=True).rates
    assert on_cpu.host_us == on_cpu.compiled_host_us == 0.0
    assert on_cpu.compiled_launch_us == on_cpu.launch_us == pytest.approx(2.0)


def test_a_gemm_intercept_below_a_launch_means_no_fixed_time():
    points = [GemmPoint(m, 64, 64, 2.0 * m * 64 * 64 / 1e11 + 1e-6) for m in (8, 16, 32)]
    tflops, fixed_us, _ = fit_gemm(points, launch_us=2.0)
    assert fixed_us == 0.0 and tflops > 0


def test_what_cannot_be_fitted_is_refused():
    with pytest.raises(CalibrationError, match="two sizes"):
        fit_elementwise([ElementwisePoint("mul", 8.0, 1e-6)])
    with pytest.raises(CalibrationError, match="do not grow"):
        fit_elementwise([ElementwisePoint("mul", 8.0, 2e-6), ElementwisePoint("mul", 80.0, 1e-6)])
    with pytest.raises(CalibrationError, match="no matrix product"):
        fit_gemm([], 1.0)


def test_a_topology_carries_device_rates_and_a_preset_takes_them_key_by_key(tmp_path):
    spec = dataclasses.replace(PRESETS["cluster"](), device=TRUE)
    path = tmp_path / "m.toml"
    path.write_text(dump_topology(spec))
    assert "[device]" in path.read_text() and load_topology(path) == spec
    # A preset's rates stay a name; a user's table over a preset replaces only its keys.
    h100 = PRESETS["dgx-h100"]()
    assert "[device]" not in dump_topology(h100)
    path.write_text('preset = "dgx-h100"\n[device]\ngemm_tflops = 500.0\n'
                    'attention_tflops = [[1024, 400.0]]\n')
    mine = load_topology(path).device
    assert mine == dataclasses.replace(DEVICES["h100-sxm"], gemm_tflops=500.0,
                                       attention_tflops=((1024, 400.0),))
    for text, message in (
            ('preset = "cluster"\n[device]\ngemm_tflops = 1.0\n', "missing key gemm_fixed_us"),
            ('preset = "dgx-h100"\n[device]\nattention_tflops = [[1]]\n', "attention_tflops"),
            ('preset = "dgx-h100"\n[device]\nattention_query_factor = [[128]]\n',
             r"expected \[\[query tokens, factor\], \.\.\.\] for device\.attention_query_factor"),
            ('preset = "dgx-h100"\n[device]\nattention_query_factor = [[512, 1.1], [128, 1.3]]\n',
             "ascending query tokens"),
            ('preset = "dgx-h100"\n[device]\nattention_query_factor = [[128, 0.0]]\n',
             r"zero time factor 0.0 x in attention_query_factor\[128\]"),
            ('preset = "dgx-h100"\n[device]\nspeed = 1\n', "unknown key 'speed'"),
            ('preset = "dgx-h100"\n[tile]\ndevice = "roofline"\n[device]\nsm_count = 2\n',
             "keep one")):
        path.write_text(text)
        with pytest.raises(TopologyError, match=message):
            load_topology(path)


def _simulated_step_s(topology, tmp_path, capsys) -> float:
    out = tmp_path / f"{topology.stem}.json"
    # A registry model (a tiny one would import diffusers: seconds, for the same check).
    assert main(["simulate", "--topology", str(topology), "--model", "flux1-dev",
                 "--resolution", "256", "--schedule", "flat", "--steps", "1", "--workers", "1",
                 "--json", str(out)]) == 0
    assert "compute: the synthetic kernel model, eager" in capsys.readouterr().out
    return json.loads(out.read_text())["results"][0]["step_time_s"]


def test_simulate_prices_compute_with_the_files_device_rates(tmp_path, capsys):
    from cocodiff.cost import OPS, compute_seconds, op_cost
    from cocodiff.runtime.model_names import model_spec
    from cocodiff.schedules.ulysses import head_split, layer_shape

    base = PRESETS["cluster"]()
    faster = dataclasses.replace(TRUE, gemm_tflops=2.5, memory_gbps=120.0, launch_us=0.2)
    steps = []
    for name, rates in (("slow", TRUE), ("fast", faster)):
        path = tmp_path / f"{name}.toml"
        path.write_text(dump_topology(dataclasses.replace(base, device=rates)))
        steps.append(_simulated_step_s(path, tmp_path, capsys))
    assert steps[1] < steps[0]
    # Each compute step is the kernel model's price at the file's rates, not the roofline.
    spec = model_spec("flux1-dev")
    shape = layer_shape(head_split(spec, 4, (256, 512)), 0, 2)
    tile = load_topology(tmp_path / "slow.toml")
    for op in OPS:
        cost = op_cost(spec, op, shape)
        if cost.kernels:
            assert compute_seconds(cost, tile) == kernels.device_seconds(cost.kernels, TRUE,
                                                                         "eager")


def _calibration(error: float | None, on_accelerator: bool = False) -> KernelCalibration:
    elementwise, gemms, attention = _times(TRUE)
    points = KernelPoints(tuple(elementwise), tuple(gemms), tuple(attention), 7.0)
    fit = fit_device_rates("calibrated-cpu", elementwise, gemms, attention, 1, 7.0, True)
    check = None if error is None else {"measured_layer_s": 1.0, "kernel_layer_s": 1 + error,
                                        "error": error}
    return KernelCalibration(points, fit, (), check, on_accelerator)


def test_the_rates_price_a_topology_only_where_they_predict_the_blocks(tmp_path):
    assert _calibration(-KERNEL_SCALE_LIMIT * 0.9).used
    assert not _calibration(-KERNEL_SCALE_LIMIT * 1.1).used
    assert _calibration(None, on_accelerator=True).used and not _calibration(None).used
    # Not used: the file keeps the fitted rates commented, and uncommented they load as
    # they were.
    missed = _calibration(-KERNEL_SCALE_LIMIT * 1.1)
    commented = missed.commented_table()
    assert "not used" in commented and all(
        line.startswith("#") for line in commented.strip().splitlines())
    table = "\n".join(line[2:] for line in commented.splitlines() if line.startswith("# "))
    path = tmp_path / "m.toml"
    path.write_text(dump_topology(PRESETS["cluster"]()) + table[table.index("\n[device]"):])
    assert load_topology(path).device == missed.fit.rates
    assert json.loads(json.dumps(missed.to_json()))["used"] is False


@pytest.mark.parametrize("error", [-0.32, -0.05, 0.2])
def test_used_rates_are_scaled_to_price_the_real_blocks_as_measured(error):
    """The microbenchmarks alone price the blocks ``error`` off: the topology's rates
    multiply every kernel's time by measured / predicted, so that they price the measured
    layer exactly, and keep the shape (a quarter of the tokens costs the same share of the
    layer as the fitted rates say)."""
    from cocodiff.runtime.model_names import model_spec
    from cocodiff.schedules.ulysses import head_split, layer_shape

    spec = model_spec("flux1-dev")
    shape = layer_shape(head_split(spec, 2, (64, 16)), 0, 4)
    elementwise, gemms, attention = _times(TRUE)
    fit = fit_device_rates("calibrated-cpu", elementwise, gemms, attention, 1, 7.0, True)
    fitted = fit.rates
    predicted = kernel_layer_seconds(spec, shape, fitted)
    check = block_check(spec, shape, fitted, predicted / (1 + error))
    points = KernelPoints(tuple(elementwise), tuple(gemms), tuple(attention), 7.0)
    calibration = KernelCalibration(points, fit, (), check)
    assert calibration.used and calibration.scale == pytest.approx(1 / (1 + error))
    assert kernel_layer_seconds(spec, shape, calibration.rates) == pytest.approx(
        check["measured_layer_s"], rel=1e-12)
    quarter = layer_shape(head_split(spec, 2, (16, 16)), 0, 4)
    assert (kernel_layer_seconds(spec, quarter, calibration.rates)
            / kernel_layer_seconds(spec, shape, calibration.rates)) == pytest.approx(
        kernel_layer_seconds(spec, quarter, fitted) / predicted, rel=1e-12)
    assert f"x{calibration.scale:.2f}" in calibration.verdict()


# tiny-flux's layer on one of 2 ranks (built directly: naming the tiny model imports
# diffusers, seconds of this test for nothing it checks).
TINY_ON_2 = LayerShapes(model="tiny-flux", total_tokens=80, local_tokens=40, local_heads=2,
                        head_dim=16, hidden_size=64, mlp_ratio=4.0)


def test_the_microbenchmarks_time_every_class_and_price_a_layer():
    shapes = TINY_ON_2
    points = time_kernels(shapes, "float32", "cpu", rounds=1, round_s=0.001)
    assert {p.op for p in points.elementwise} == {"mul", "layer_norm", "gelu"}
    assert {(p.k, p.n) for p in points.gemms} == {(64, 64), (64, 256), (256, 64)}
    # S = 80: as many queries as keys at S/4 .. 2S over the rank's 2 heads, then S/8 ..
    # S/2 queries against S keys over all 4 heads (a one-rank pipeline stage's patch).
    assert [(p.q_tokens, p.kv_tokens, p.heads) for p in points.attention] == [
        (20, 20, 2), (40, 40, 2), (80, 80, 2), (160, 160, 2), (10, 80, 4), (20, 80, 4),
        (40, 80, 4)]
    assert all(p.seconds > 0 for p in (*points.elementwise, *points.gemms, *points.attention))
    # The host's time per op as model code issues them: a stack of module calls, counted.
    assert points.host_op_us > 0 and points.host_stack_ops > 20
    fit = fit_points(points, "cpu")
    assert fit.rates.sm_count == 1 and fit.rates.host_us == 0.0
    assert fit.rates.launch_us == pytest.approx(points.host_op_us)  # per dispatched op
    assert [q for q, _ in fit.rates.attention_query_factor] == [10, 20, 40, 80]
    assert fit.rates.attention_query_factor[-1] == (80, 1.0)
    from cocodiff.runtime.model_names import model_spec
    from cocodiff.schedules.ulysses import head_split, layer_shape

    spec = model_spec("flux1-dev")
    shape = layer_shape(head_split(spec, 2, (64, 16)), 0, 4)
    layer_s = kernel_layer_seconds(spec, shape, fit.rates)
    check = block_check(spec, shape, fit.rates, 2 * layer_s)
    assert check["kernel_layer_s"] == layer_s and check["error"] == pytest.approx(-0.5)


def test_times_that_cannot_be_fitted_leave_the_calibration_without_them(monkeypatch, capsys):
    from types import SimpleNamespace

    from cocodiff.calibration import collect, kernel_bench
    from cocodiff.calibration.options import CalibrateOptions

    shrinking = KernelPoints((ElementwisePoint("mul", 8.0, 2e-6),
                              ElementwisePoint("mul", 80.0, 1e-6)), (), (), 0.0)
    monkeypatch.setattr(kernel_bench, "time_kernels", lambda *args, **kwargs: shrinking)
    monkeypatch.setattr(collect, "gather_floats", lambda transport, values: [list(values)])
    transport = SimpleNamespace(rank=0, world_size=1)
    assert kernel_bench.measure_kernel_rates(transport, CalibrateOptions(quick=True), TINY_ON_2,
                                             "cpu", None) is None
    assert "warning: kernel model not fitted: elementwise times do not grow" in \
        capsys.readouterr().err
