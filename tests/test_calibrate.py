"""cocodiff calibrate: the fit, the layer shapes, the compute timing, and the command end to
end on this machine (self-launched on loopback) and across an emulated cluster."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launching import job_env

from cocodiff.calibration import (
    CalibrationError,
    LinkFit,
    build_transformer,
    effective_rates,
    fit_latency_bandwidth,
    layer_roofline_seconds,
    layer_shapes,
    measure_compute,
    model_tokens,
    predict_all_to_all,
    time_blocks,
    tiny_transformer_config,
)
from cocodiff.commands.cli import main
from topology import load_topology

REPO = Path(__file__).resolve().parents[1]


def test_fit_recovers_latency_and_bandwidth():
    latency_s, bandwidth = 150e-6, 0.12e9
    points = [(n, latency_s + n / bandwidth) for n in (1024, 16384, 262144, 4 << 20, 16 << 20)]
    fit = fit_latency_bandwidth(points)
    assert fit.latency_us == pytest.approx(150.0, rel=1e-6)
    assert fit.bandwidth_gbps == pytest.approx(0.12, rel=1e-6)
    assert fit.max_rel_error < 1e-9
    assert fit.seconds(1 << 20) == pytest.approx(latency_s + (1 << 20) / bandwidth)


def test_fit_is_not_dragged_by_a_fast_middle():
    """Messages that fit a shaper's burst (or a cache) run faster than the line: the
    bandwidth still comes from the large sizes, the latency from the small ones."""
    line = [(n, 100e-6 + n / 0.1e9) for n in (1024, 4096, 4 << 20, 16 << 20)]
    burst = [(65536, 120e-6), (262144, 300e-6)]
    fit = fit_latency_bandwidth(line + burst)
    assert fit.bandwidth_gbps == pytest.approx(0.1, rel=0.02)
    assert fit.latency_us == pytest.approx(100.0, rel=0.1)
    assert fit.max_rel_error > 1.0  # reported, not hidden


def test_fit_refuses_what_cannot_be_fitted():
    with pytest.raises(CalibrationError, match="at least two message sizes"):
        fit_latency_bandwidth([(1024, 1e-4), (1024, 2e-4)])
    with pytest.raises(CalibrationError, match="do not grow with message size"):
        fit_latency_bandwidth([(1024, 3e-4), (4096, 2e-4), (16384, 1e-4)])
    with pytest.raises(CalibrationError, match="non-positive measured time"):
        fit_latency_bandwidth([(1024, 0.0), (4096, 1e-4)])


def test_all_to_all_prediction_takes_the_busiest_link():
    intra = LinkFit(10.0, 1.0)
    inter = LinkFit(50.0, 0.1)
    # 2 nodes x 2 ranks, 1 MB per peer: a rank port carries 1 MB, a NIC 2 x 2 = 4 MB.
    predicted = predict_all_to_all(10**6, 2, 2, intra, inter)
    assert predicted == pytest.approx(50e-6 + 4 * 10**6 / 0.1e9)
    assert predict_all_to_all(10**6, 1, 4, intra, inter) == pytest.approx(10e-6 + 3e-3)


def test_layer_shapes_of_a_registry_model_and_a_tiny_one():
    flux = layer_shapes("flux1-dev", None, "1024", 8)
    assert (flux.total_tokens, flux.local_tokens) == (4096 + 512, 576)
    assert (flux.local_heads, flux.head_dim, flux.hidden_size) == (3, 128, 3072)
    tiny = layer_shapes("tiny-flux", None, None, 4)
    # 128 px: 8 x 8 image tokens + the tiny pipeline's 16 text tokens (not FLUX's 512).
    assert (tiny.total_tokens, tiny.local_tokens, tiny.local_heads) == (80, 20, 1)
    assert tiny.hidden_size == 64
    assert layer_shapes("flux1-dev", 1000, None, 3).local_tokens == 334


def test_compute_rates_are_positive_and_quick():
    shapes = layer_shapes("flux1-dev", 256, None, 24)
    flops, memory, op_seconds = measure_compute(shapes, min_time_s=0.01)
    assert flops > 1e7 and memory > 1e6
    assert set(op_seconds) == {"projection", "mlp_up", "mlp_down", "attention", "norm"}


def test_real_blocks_are_timed_as_the_runtime_runs_them_and_become_an_effective_rate():
    """The model's own diffusers blocks, on one of 2 ranks' shards: every block timed,
    the runtime's own forward of one of 2 ranks (its hooks and attention processors, over a
    stand-in transport that moves nothing), and the effective rate is the one at which the
    simulator's charge for a layer (every cost-model operation at its roofline) is the
    measured layer time. No wall-clock bounds: structure and consistency only."""
    from cocodiff.schedules.ulysses import head_split, layer_shape

    world = 2
    shapes = layer_shapes("tiny-flux", None, None, world)
    spec, tokens, image = model_tokens("tiny-flux", None, None)
    assert tokens == shapes.total_tokens and 0 < image < tokens
    transformer = build_transformer(tiny_transformer_config("tiny-flux"))
    timing = time_blocks(transformer, (image, tokens - image), world, rank=1, rounds=2,
                         round_s=0.02)
    assert timing.blocks == spec.num_layers
    assert min(timing.blocks_s, timing.layer_s) > 0
    assert timing.layer_s == pytest.approx(timing.blocks_s / timing.blocks)
    # The rest of the forward and a scheduler step: what a step costs outside the blocks.
    assert min(timing.outside_blocks_s, timing.scheduler_step_s, timing.layer_wall_s) > 0
    assert timing.step_overhead_s == timing.outside_blocks_s + timing.scheduler_step_s

    shape = layer_shape(head_split(spec, world, (image, tokens - image)), 0, 4)
    memory_gbps = 10.0
    rate, memory = effective_rates(spec, shape, timing.layer_s, 1.0, memory_gbps)
    assert rate > 0 and memory == memory_gbps
    assert layer_roofline_seconds(spec, shape, rate, memory_gbps) == pytest.approx(
        timing.layer_s, rel=1e-6)
    # Slower blocks mean a lower rate.
    assert effective_rates(spec, shape, 2 * timing.layer_s, 1.0, memory_gbps)[0] < rate
    # No compute rate explains a layer faster than its memory-bound operations alone at the
    # measured memory rate (a memory microbenchmark slowed by load): both rates then scale by
    # one factor, and the fit still reproduces the blocks' time (it used to give up, and a
    # loaded machine lost the block timing).
    floor = layer_roofline_seconds(spec, shape, 1e9, memory_gbps)
    rate, memory = effective_rates(spec, shape, floor / 2, 1.0, memory_gbps)
    assert memory > memory_gbps and rate / 1.0 == pytest.approx(memory / memory_gbps)
    assert layer_roofline_seconds(spec, shape, rate, memory) == pytest.approx(floor / 2,
                                                                              rel=1e-9)
    # Only small (tiny) models are built: a registry model's weights are not.
    assert tiny_transformer_config("flux1-dev") is None


def _run_cli(args: list[str], tmp_path: Path, timeout_s: float = 180):
    return subprocess.run([sys.executable, "-m", "cocodiff", *args], cwd=REPO,
                          env=job_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


@pytest.mark.multiprocess
def test_calibrate_on_loopback_writes_a_topology_the_simulator_runs(tmp_path):
    output, record = tmp_path / "cluster.toml", tmp_path / "calibration.json"
    done = _run_cli(["calibrate", "--quick", "--nodes", "2", "--ranks-per-node", "1",
                     "--fit-patterns", "--output", str(output), "--json", str(record)],
                    tmp_path)
    assert done.returncode == 0, done.stderr
    assert "calibrated 2 node(s) x 1 ranks over torch" in done.stdout
    spec = load_topology(output)
    assert (spec.num_nodes, spec.gpus_per_node) == (2, 1)
    data = json.loads(record.read_text())
    assert data["inter"]["source"] == "measured on loopback"
    # The links are the pair fit less the CPU the host charges for each exchange. On
    # loopback that CPU may explain all of it (the kernel's copy is the process's CPU):
    # then the wire never limits. Which one happens depends on the moment's load, so
    # either is right here.
    wire = data["inter_wire"]
    assert wire["source"] in ("measured on loopback, less its CPU",
                              "measured on loopback, all of it CPU: the wire never limits")
    assert spec.nic_link.bandwidth_gbps == pytest.approx(wire["bandwidth_gbps"])
    assert spec.nic_link.latency_us * 2 == pytest.approx(wire["latency_us"])
    host = data["host"]
    assert spec.host.cores == host["cores"] and spec.host.ranks_per_host is None
    # The machine's speed at the start and the end: the same reference work's CPU time.
    assert len(data["reference_cpu_s"]) == 2 and min(data["reference_cpu_s"]) > 0
    # Exchanges under load (every rank computing and calling): 2 ranks make one shape,
    # the world, whose calls and messages cannot be told apart: the call takes it all.
    loaded = host["loaded"]
    assert {p["shape"] for p in loaded["points"]} == {"world"}
    assert spec.host.call_cpu_us == pytest.approx(loaded["call_cpu_us"])
    # The same loops with diffusers' exchange call making the calls (over torch), priced
    # apart for its baseline, never fitted with ours.
    assert {p["shape"] for p in loaded["diffusers_points"]} == {"world via diffusers"}
    assert spec.host.diffusers_call_cpu_us == pytest.approx(loaded["diffusers_call_cpu_us"])
    # Whether a late member's data goes first: the late member's own calls, a one-way
    # transfer and a pair exchange, the verdict written to [host].
    late = host["late_peer"]
    assert late["one_way_s"] > 0 and late["exchange_s"] > 0 and late["late_by_s"] >= 0.02
    assert late["exchange_over_one_way"] == pytest.approx(late["exchange_s"]
                                                          / late["one_way_s"])
    assert spec.host.late_peer_first is late["late_peer_first"]
    assert "late peer: a member calling" in done.stdout
    # The compute's CPU among the loops' calls, timed apart from the calls, over its CPU
    # alone: written to [host] and taken out of the calls' price.
    assert all(p["compute_cpu_s"] > 0 for p in loaded["points"])
    assert spec.host.compute_among_calls == pytest.approx(loaded["compute_among_calls"])
    assert 0 <= loaded["diffusers_call_cpu_us"] < 1e6
    assert loaded["call_cpu_us"] > 0
    assert spec.host.message_cpu_us == loaded["message_cpu_us"] == 0.0
    assert host["cpu"]["wait_spin"] < 0.5 and not spec.host.busy_poll  # gloo's waits sleep
    # V-Major's codec, timed on its own: a positive CPU cost per message, written as is.
    assert spec.host.codec_cpu_us == pytest.approx(host["codec_cpu_us"]) and \
        0 < host["codec_cpu_us"] < 10_000
    # TAPA's routing: 2 nodes of 1 rank make one level, so a tapa step has no phases.
    assert host["phase_cpu_us"] == spec.host.phase_cpu_us == 0.0
    # tiny-flux's real blocks were timed: their effective rate is the tile's, the
    # matrix products' rate stays in the JSON beside it.
    block = data["compute"]["block"]
    assert block["effective_tflops"] > 0 and data["compute"]["tflops"] > 0
    assert block["layer_s"] > 0 and len(block["per_rank_layer_s"]) == 2
    # Each rank's work outside its blocks, charged once per step: on its shard and with
    # the whole sequence, written as the line through both (fixed + per sequence x share).
    assert block["step_overhead_s"] > 0 and len(block["per_rank_step_overhead_s"]) == 2
    assert len(block["per_rank_whole_sequence_overhead_s"]) == 2
    assert spec.tile_step_overhead_us == pytest.approx(block["step_overhead_fixed_s"] * 1e6)
    assert spec.tile_step_overhead_sequence_us == pytest.approx(
        block["step_overhead_sequence_s"] * 1e6)
    assert spec.tile_step_overhead_us + spec.tile_step_overhead_sequence_us / 2 == \
        pytest.approx(block["step_overhead_s"] * 1e6)  # 2 ranks: half the sequence each
    assert "outside the blocks:" in done.stdout
    # The kernel model's classes, timed every rank at once, its rates fitted to them alone
    # and checked on the real blocks; written as [device] only where the check holds.
    kernels = data["kernels"]
    assert kernels["rates"]["gemm_tflops"] > 0 and kernels["rates"]["sm_count"] == 1
    assert len(kernels["per_rank_seconds"]) == 2
    check = kernels["block_check"]
    assert check["error"] == pytest.approx(check["kernel_layer_s"] / check["measured_layer_s"]
                                           - 1)
    assert check["measured_layer_s"] == pytest.approx(block["layer_s"])
    # The host term: the ATen ops the blocks dispatch, counted on the model at hand
    # (tiny-flux: 1 double + 1 single block under the runtime, cocodiff.kernels' table).
    from cocodiff.kernels import DISPATCHED_OPS

    flux = DISPATCHED_OPS["flux"]
    assert check["dispatched_ops_per_layer"] == pytest.approx(
        (flux["double"].runtime + flux["single"].runtime) / 2)
    assert "kernel model on the real blocks:" in done.stdout
    written = output.read_text()
    # The fitted rates scaled to the blocks: every kernel's time x measured / predicted.
    assert kernels["scale"] == pytest.approx(check["measured_layer_s"] / check["kernel_layer_s"])
    if kernels["used"]:
        assert spec.device.gemm_tflops == pytest.approx(kernels["rates"]["gemm_tflops"]
                                                        / kernels["scale"])
        assert spec.device.launch_us == pytest.approx(kernels["rates"]["launch_us"]
                                                      * kernels["scale"])
    else:
        assert spec.device is None and "# [device]" in written
        assert f"# gemm_tflops = {kernels['rates']['gemm_tflops']!r}" in written
    # One core's rates, as measured: the simulator shares the host's cores.
    assert spec.tile_tflops == pytest.approx(data["compute"]["tile_tflops"])
    assert data["compute"]["tile_tflops"] == pytest.approx(block["effective_tflops"])
    assert spec.tile_memory_gbps == pytest.approx(data["compute"]["tile_memory_gbps"])
    assert data["compute"]["tile_memory_gbps"] == pytest.approx(block["effective_memory_gbps"])
    # The host path is never the bottleneck, whatever the measured memory rate.
    assert spec.host_link.bandwidth_gbps >= 10 * spec.nic_link.bandwidth_gbps
    # The collective model is fitted on the exchanges measured (2 nodes x 1 rank: the
    # inter-node pair and the world all-to-all, itself a pair), each beside its fit.
    collective = data["collective"]
    assert set(collective["spans"]) == {"pair"}
    assert collective["spans"]["pair"]["startup_us"] >= 0
    # A step's exchange, timed as flat issues it, at its size and 4 times it (one rank per
    # node: TAPA has no column phase to time): a block of tiny-flux's 40 local tokens x 2
    # heads x 16 channels x 4 bytes for each of the 2 ranks, 10 KiB.
    assert [(row["pattern"], row["bytes_per_rank"]) for row in data["patterns"]] == [
        ("world", 10 << 10), ("world", 40 << 10)]
    assert all(row["measured_s"] > 0 and len(row["rounds_s"]) == 3 for row in data["patterns"])
    for row in data["patterns"]:  # each beside the simulator (the emulated test: unfitted)
        assert row["error"] == pytest.approx(row["simulated_s"] / row["measured_s"] - 1)
    # --fit-patterns: the collective is fitted on them too.
    assert {row["label"] for row in collective["fit"]} == {
        "pair inter", "all-to-all", "world as a step issues it, 10 KiB per rank",
        "world as a step issues it, 40 KiB per rank"}
    assert all(row["fitted_s"] > 0 and row["measured_s"] > 0 for row in collective["fit"])
    assert "collective model fitted on these: calibrated (pair:" in done.stdout
    assert re.search(r"world as a step issues it, 40 KiB per rank: measured [\d.]+ ms, "
                     r"simulated [\d.]+ ms", done.stdout)
    simulated = _run_cli(["simulate", "--topology", str(output), "--model", "flux1-dev",
                          "--resolution", "256", "--steps", "2"], tmp_path)
    assert simulated.returncode == 0, simulated.stderr
    assert "flat" in simulated.stdout


@pytest.mark.multiprocess
def test_calibrate_takes_the_inter_node_link_when_given(tmp_path):
    output = tmp_path / "cluster.toml"
    done = _run_cli(["calibrate", "--quick", "--nodes", "2", "--ranks-per-node", "1",
                     "--inter-gbps", "0.1196", "--inter-latency-us", "40",
                     "--output", str(output)], tmp_path)
    assert done.returncode == 0, done.stderr
    spec = load_topology(output)
    assert spec.nic_link.bandwidth_gbps == 0.1196
    assert spec.nic_link.latency_us == 20.0  # half of the route, on each NIC hop


def test_calibrate_usage_errors_are_one_line(tmp_path, capsys):
    missing = tmp_path / "no" / "cluster.toml"
    assert main(["calibrate", "--output", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"cocodiff calibrate: error: output directory {missing.parent} "
                           f"does not exist (for {missing})")
    assert main(["calibrate", "--transport", "mpi", "--output", str(tmp_path / "x.toml")]) == 2
    assert "needs its launcher" in capsys.readouterr().err
    assert main(["calibrate", "--inter-gbps", "-1", "--output", str(tmp_path / "x.toml")]) == 2
    assert "--inter-gbps must be positive" in capsys.readouterr().err


def test_calibrate_refuses_a_node_count_that_does_not_split_the_ranks(monkeypatch):
    import cocodiff.calibration.measure as module
    from cocodiff.calibration import CalibrateOptions

    class ThreeRanks:
        world_size, rank, name = 3, 0, "fake"

    monkeypatch.setattr(module, "detect_nodes", lambda transport: [0, 0, 0])
    with pytest.raises(CalibrationError, match="3 ranks do not split into 2 nodes"):
        module.calibrate(ThreeRanks(), CalibrateOptions(nodes=2))


def _cluster_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    sys.path.insert(0, str(REPO))
    from bench.cluster.netns import ClusterError, check_prerequisites

    try:
        check_prerequisites()
    except ClusterError as error:
        return str(error)
    return None


@pytest.mark.multiprocess
@pytest.mark.skipif(_cluster_reason() is not None, reason=f"emulated cluster: {_cluster_reason()}")
def test_calibrate_across_an_emulated_cluster_finds_its_nodes_and_shaped_link(tmp_path):
    from bench.cluster import ClusterSpec, EmulatedCluster
    from bench.cluster.jobs import run_job

    output, record = tmp_path / "cluster.toml", tmp_path / "calibration.json"
    spec = ClusterSpec(num_nodes=2, ranks_per_node=1, inter_gbit=0.5)
    with EmulatedCluster(spec) as cluster:
        run_job(cluster, [sys.executable, "-m", "cocodiff", "calibrate", "--quick",
                          "--output", str(output), "--json", str(record)],
                "torch", timeout_s=180, log_dir=tmp_path / "logs", cwd=REPO)
    data = json.loads(record.read_text())
    assert data["nodes_detected"] == 2 and data["inter"]["source"] == "measured"
    # One transfer gets at most the shaped rate; gloo moves a pair's two directions at
    # about half of it each (see bench/cluster/README.md), so from a third up is sane.
    measured = data["inter"]["bandwidth_gbps"]
    assert spec.inter_payload_gbps / 3 < measured < spec.inter_payload_gbps * 1.3
    assert load_topology(output).num_nodes == 2


def test_the_pair_sweep_spans_the_messages_a_step_sends():
    """The link is one line over the sizes swept: the sweep stops at 4 x the model's
    largest step message (at least 256 KiB), and at --max-kib; the larger sizes are kept
    for a link whose rate those did not show."""
    from cocodiff.calibration.measure import largest_step_message, sweep_sizes
    from cocodiff.calibration.options import CalibrateOptions

    def kib(sizes):
        return [n // 1024 for n in sizes]

    small = layer_shapes("tiny-flux", None, None, 4)
    # 20 tokens x 1 head x 16 channels x 4 bytes a block; TAPA gathers 2 blocks a peer.
    assert largest_step_message(small, 2, 2, "float32") == 2 * 20 * 1 * 16 * 4
    assert largest_step_message(small, 2, 2, "bfloat16") == 2 * 20 * 16 * 2
    sizes, larger = sweep_sizes(CalibrateOptions(), small, 2, 2)
    assert (kib(sizes), kib(larger)) == ([1, 4, 16, 64, 256], [1024, 4096])
    large = layer_shapes("flux1-dev", None, "2048", 4)
    sizes, larger = sweep_sizes(CalibrateOptions(), large, 2, 2)
    assert kib(sizes)[-1] == 4096 and larger == []
    sizes, larger = sweep_sizes(CalibrateOptions(max_kib=16), large, 2, 2)
    assert (kib(sizes), larger) == ([1, 4, 16], [])
    sizes, larger = sweep_sizes(CalibrateOptions(quick=True), small, 2, 2)
    assert (kib(sizes), kib(larger)) == ([1, 16, 256], [2048])


def test_an_accelerators_rounds_are_timed_after_its_queued_work():
    from cocodiff.calibration.compute import timed_rounds

    events: list[str] = []
    rounds = timed_rounds(lambda: events.append("call"), rounds=2, round_s=0.0,
                          sync=lambda: events.append("sync"))
    assert len(rounds) == 2
    # warm-up, the timed estimate, then each round: sync, its calls, sync
    assert events == ["call", "sync", "call", "sync", "sync", "call", "sync", "sync", "call",
                      "sync"]


def test_ranks_computing_on_accelerators_leave_the_host_cores_free():
    from cocodiff.calibration.result import HostMeasurement

    host = HostMeasurement(cores=16, ranks_per_host=None, cpu=None, compute_core_demand=0.0)
    assert host.spec().compute_core_demand == 0.0
    assert host.to_json()["compute_core_demand"] == 0.0
    assert HostMeasurement(cores=2, ranks_per_host=None, cpu=None).spec().compute_core_demand == 1
