"""Exchanges under load: the per-call and per-message CPU fit, the wait-spin verdict, and
what they put in the calibrated topology's [host]."""

from __future__ import annotations

import dataclasses

import pytest

from cocodiff.calibration import Calibration, ComputeRates, CpuFit, HostMeasurement, LinkFit
from cocodiff.calibration.loaded import (
    DIFFUSERS_WORLD,
    LoadedPoint,
    compute_among_calls,
    diffusers_call_cpu_us,
    fit_call_cpu,
)
from cocodiff.calibration.model_shapes import LayerShapes
from cocodiff.calibration.options import CalibrationError

CALL_S, MESSAGE_S, COPY_GBPS = 500e-6, 60e-6, 4.0


def point(shape: str, calls: int, messages: int, bytes_per_peer: int,
          noise: float = 0.0) -> LoadedPoint:
    num_bytes = messages * bytes_per_peer
    cpu = (calls * CALL_S + messages * MESSAGE_S + num_bytes / (COPY_GBPS * 1e9)) * (1 + noise)
    return LoadedPoint(shape, bytes_per_peer, calls, messages, num_bytes, cpu, 2 * cpu)


def loops(noise: tuple[float, ...] = (0.0,) * 6) -> list[LoadedPoint]:
    # 4 ranks on a 2 x 2 grid: the world (1 call, 6 messages), pairs (1 call, 2
    # messages), TAPA's phases (2 calls, 4 messages), each at 2 and 16 KiB per peer.
    shapes = [("world", 1, 6), ("pairs", 1, 2), ("phases", 2, 4)]
    sizes = (2048, 16384)
    return [point(name, calls, messages, size, noise[i * 2 + j])
            for i, (name, calls, messages) in enumerate(shapes) for j, size in enumerate(sizes)]


def test_fit_recovers_call_and_message_costs() -> None:
    fit = fit_call_cpu(loops(), COPY_GBPS, burst_cpu_s=1e-3, burst_wall_s=2e-3)
    assert fit.call_cpu_us == pytest.approx(CALL_S * 1e6, rel=1e-6)
    assert fit.message_cpu_us == pytest.approx(MESSAGE_S * 1e6, rel=1e-6)
    assert fit.copy_gbps == COPY_GBPS and fit.max_error == pytest.approx(0.0, abs=1e-9)
    assert fit.cpu_s(2, 4, 0) == pytest.approx(2 * CALL_S + 4 * MESSAGE_S)
    assert fit.to_json()["points"][0]["shape"] == "world"


def test_the_computes_slowdown_among_the_calls_is_not_priced_as_the_calls() -> None:
    # Each loop's CPU beyond the compute alone holds the calls' price and the compute
    # run 1.25x dearer among them; timed apart (CPU outside the calls), the factor is
    # taken out and the calls priced on what is theirs.
    burst, factor = 4e-3, 1.25
    measured = [dataclasses.replace(p, cpu_s=p.cpu_s + burst * (factor - 1),
                                    compute_cpu_s=burst * factor * (1 + 0.01 * (i - 2)))
                for i, p in enumerate(loops())]
    ahead = dataclasses.replace(measured[0], ahead=True, compute_cpu_s=burst * 3)
    assert compute_among_calls([*measured, ahead], burst) == pytest.approx(factor, rel=0.02)
    fit = fit_call_cpu(measured, COPY_GBPS, burst, 2 * burst, among_calls=factor)
    assert fit.call_cpu_us == pytest.approx(CALL_S * 1e6, rel=1e-6)
    assert fit.message_cpu_us == pytest.approx(MESSAGE_S * 1e6, rel=1e-6)
    assert fit.compute_among_calls == factor
    assert fit.to_json()["compute_among_calls"] == factor
    # Priced as before (the factor at 1), the calls take the compute's slowdown.
    assert fit_call_cpu(measured, COPY_GBPS, burst).call_cpu_us > CALL_S * 1e6 * 1.5
    assert compute_among_calls(loops(), burst) == 1.0  # not timed apart
    cpu = CpuFit(message_cpu_us=90.0, copy_gbps=COPY_GBPS, busy_fraction=0.8, wait_spin=0.02)
    spec = _calibration(HostMeasurement(2.0, None, cpu, fit)).topology()
    assert spec.host.compute_among_calls == factor


def test_fit_stays_close_on_noisy_loops() -> None:
    fit = fit_call_cpu(loops((0.08, -0.05, 0.03, -0.1, 0.06, 0.0)), COPY_GBPS)
    assert fit.call_cpu_us == pytest.approx(CALL_S * 1e6, rel=0.25)
    assert fit.message_cpu_us == pytest.approx(MESSAGE_S * 1e6, rel=0.5)
    assert fit.max_error < 0.15


def test_fit_never_gives_a_negative_cost() -> None:
    # Calls that cost more when they carry fewer messages would fit a negative message
    # cost: the best fit with every coefficient >= 0 puts it all on the call instead, at
    # the relative least-squares value between 400 and 600 us.
    odd = [LoadedPoint("world", 2048, 1, 6, 6 * 2048, 400e-6, 1e-3),
           LoadedPoint("pairs", 2048, 1, 2, 2 * 2048, 600e-6, 1e-3)]
    fit = fit_call_cpu(odd, None)
    best = (1 / 400 + 1 / 600) / (1 / 400**2 + 1 / 600**2)
    assert fit.message_cpu_us == 0.0 and fit.call_cpu_us == pytest.approx(best, rel=1e-6)


def test_one_call_shape_gives_everything_to_the_call() -> None:
    # The world alone: calls and messages in a fixed ratio cannot be told apart.
    world = [p for p in loops() if p.shape == "world"]
    fit = fit_call_cpu(world, COPY_GBPS)
    assert fit.message_cpu_us == 0.0
    assert fit.call_cpu_us == pytest.approx((CALL_S + 6 * MESSAGE_S) * 1e6, rel=1e-6)


def test_diffusers_call_costs_ours_plus_its_loops_extra_per_call() -> None:
    # The world loops again with diffusers' call: 150 us more per call at 2 KiB, 250 us
    # at 16 KiB (the median of the two: 200 us), the calls made at 4 places per iteration.
    world = [dataclasses.replace(p, calls=4) for p in loops() if p.shape == "world"]
    theirs = [dataclasses.replace(p, shape=DIFFUSERS_WORLD, cpu_s=p.cpu_s + 4 * extra)
              for p, extra in zip(world, (150e-6, 250e-6), strict=True)]
    assert diffusers_call_cpu_us([*world, *theirs], 500.0) == pytest.approx(700.0)
    # A cheaper call than ours is priced so; never below zero; none without its loops.
    cheaper = [dataclasses.replace(p, cpu_s=p.cpu_s - 4 * 100e-6) for p in world]
    assert diffusers_call_cpu_us(
        [*world, *(dataclasses.replace(p, shape=DIFFUSERS_WORLD) for p in cheaper)],
        500.0) == pytest.approx(400.0)
    assert diffusers_call_cpu_us(
        [*world, *(dataclasses.replace(p, shape=DIFFUSERS_WORLD) for p in cheaper)], 50.0) == 0
    assert diffusers_call_cpu_us(world, 500.0) is None


def test_fit_refuses_loops_that_cost_nothing() -> None:
    free = [dataclasses.replace(p, cpu_s=0.0) for p in loops()]
    with pytest.raises(CalibrationError, match="at least two loaded exchange loops"):
        fit_call_cpu(free, COPY_GBPS)


def test_wait_spin_decides_busy_poll_over_the_exchange_cpu_fraction() -> None:
    # gloo's exchanges burn ~80% of their wall time in CPU (the transfer's own work): on the
    # old threshold that flipped the verdict. A late peer's wait tells them apart.
    sleeping = CpuFit(100.0, 3.0, busy_fraction=0.83, wait_spin=0.03)
    spinning = CpuFit(100.0, 3.0, busy_fraction=0.5, wait_spin=0.98)
    assert not sleeping.busy_poll and spinning.busy_poll
    assert CpuFit(100.0, 3.0, busy_fraction=0.83).busy_poll  # not measured: the old rule


def _calibration(host: HostMeasurement) -> Calibration:
    shapes = LayerShapes("tiny-flux", 1024, 256, 1, 16, 64, 4.0)
    compute = ComputeRates(0.01, 5.0, (0.01,) * 4, (5.0,) * 4)
    link = LinkFit(100.0, 1.0, ((1024, 1e-4), (2048, 2e-4)))
    return Calibration(2, 2, 1, "gloo", "float32", shapes, compute, link, link, [],
                       host=host, intra_wire=link, inter_wire=link)


def test_loaded_fit_prices_the_hosts_calls_and_messages() -> None:
    cpu = CpuFit(message_cpu_us=90.0, copy_gbps=3.0, busy_fraction=0.8, wait_spin=0.02)
    loaded = fit_call_cpu(loops(), 3.0)
    spec = _calibration(HostMeasurement(2.0, None, cpu, loaded)).topology()
    assert spec.host.call_cpu_us == pytest.approx(loaded.call_cpu_us)
    assert spec.host.message_cpu_us == pytest.approx(loaded.message_cpu_us)
    assert spec.host.copy_gbps == 3.0 and not spec.host.busy_poll
    assert spec.host.diffusers_call_cpu_us is None  # no loops with diffusers' call
    priced = dataclasses.replace(loaded, diffusers_call_cpu_us=640.0)
    spec = _calibration(HostMeasurement(2.0, None, cpu, priced)).topology()
    assert spec.host.diffusers_call_cpu_us == 640.0
    assert HostMeasurement(2.0, None, cpu, priced).to_json()["loaded"][
        "diffusers_call_cpu_us"] == 640.0
    # Without the loops, the pair exchange's costs as before, and the note says why.
    host = HostMeasurement(2.0, None, cpu, None, "not fitted: need at least two")
    spec = _calibration(host).topology()
    assert (spec.host.call_cpu_us, spec.host.message_cpu_us) == (0.0, 90.0)
    assert host.to_json()["loaded"] == {"note": "not fitted: need at least two"}


class _Ranks:
    """The part of a transport call_shapes uses: one rank's view of a world."""

    def __init__(self, rank: int, world_size: int) -> None:
        from transports import Group

        self.rank, self.world_size = rank, world_size
        self.world = Group(tuple(range(world_size)))
        self.made: list[tuple[int, ...]] = []

    def new_group(self, ranks):
        from transports import Group

        self.made.append(tuple(ranks))
        return Group(tuple(ranks))


def test_call_shapes_of_a_two_by_two_grid() -> None:
    from cocodiff.calibration.loaded import call_shapes

    views = [_Ranks(rank, 4) for rank in range(4)]
    shapes = [call_shapes(view, [0, 0, 1, 1]) for view in views]
    # Every rank makes every group in the same order (group creation is collective).
    assert all(view.made == views[0].made for view in views)
    world, pairs, phases = shapes[3]
    assert (world.name, world.messages()) == ("world", 6)
    assert (pairs.name, pairs.groups[0].ranks, pairs.messages()) == ("pairs", (2, 3), 2)
    assert phases.name == "phases" and [g.ranks for g in phases.groups] == [(2, 3), (1, 3)]
    assert phases.messages() == 4
    # One node, or one rank per node: no TAPA phases; two ranks: the world only.
    assert [s.name for s in call_shapes(_Ranks(0, 4), [0, 0, 0, 0])] == ["world", "pairs"]
    assert [s.name for s in call_shapes(_Ranks(0, 2), [0, 1])] == ["world"]


def free_wires_on_two_cores():
    """2 x 2 ranks on one host of 2 cores, calls at 500 us + 50 us per message, wires
    that cost nothing: only the ranks' CPU takes time."""
    from topology import HostSpec, build_topology
    from topology.presets import cluster

    host = HostSpec(cores=2, call_cpu_us=500.0, message_cpu_us=50.0)
    spec = cluster(num_nodes=2, ranks_per_node=2, intra_gbps=1e8, intra_latency_us=0.0,
                   inter_gbps=1e8, inter_latency_us=0.0, tile_tflops=1.0,
                   tile_memory_gbps=1e8)
    return build_topology(dataclasses.replace(spec, name="loop-test", host=host))


def test_simulated_loop_is_the_burst_and_the_calls_cpu_over_the_cores() -> None:
    # 4 ranks on 2 cores, wires that cost nothing: a loop iteration is every rank's burst
    # and calls' CPU shared over the cores, the simulator's reading of one loop.
    from cocodiff.calibration.loaded import predict_loop_s

    topology = free_wires_on_two_cores()
    for shape, calls, messages in (("world", 1, 6), ("phases", 2, 4)):
        loop = LoadedPoint(shape, 2048, calls, messages, messages * 2048, 0.0, 0.0)
        cpu_s = 1e-3 + (calls * 500 + messages * 50) * 1e-6  # burst + calls, one rank
        assert predict_loop_s(topology, loop, 1e-3, 2, 2) == pytest.approx(4 * cpu_s / 2,
                                                                           rel=1e-3)


def test_a_loop_on_kernel_rates_charges_the_burst_it_measured() -> None:
    # Calibrate writes the tile's kernel rates ([device]) since 2026-11-27, and the
    # simulator prices kernel-less work at their GEMM rate, not the tile's roofline rate:
    # the burst must still take its measured CPU (it was simulated 29x short there).
    from cocodiff.calibration.loaded import predict_loop_s
    from topology import DeviceRates, build_topology

    plain = free_wires_on_two_cores()
    rates = DeviceRates("calibrated-cpu", gemm_tflops=30.0, gemm_fixed_us=1.0,
                        attention_tflops=((128, 1.0),), memory_gbps=1e8, sm_count=1,
                        launch_us=5.0, host_us=0.0, compiled_launch_us=1.0,
                        compiled_host_us=0.0)
    with_rates = build_topology(dataclasses.replace(plain.spec, device=rates))
    loop = LoadedPoint("world", 2048, 1, 6, 6 * 2048, 0.0, 0.0)
    assert predict_loop_s(with_rates, loop, 1e-3, 2, 2) == pytest.approx(
        predict_loop_s(plain, loop, 1e-3, 2, 2), rel=1e-9)


def test_a_loop_in_pieces_charges_the_same_cpu_with_the_calls_between_them() -> None:
    # The model's forward as a loop's compute: its CPU in 9 pieces, the shape's calls
    # after each. On wires that cost nothing the iteration is still all ranks' CPU over
    # the cores: the burst once, the calls 9 times.
    from cocodiff.calibration.loaded import predict_loop_s

    topology = free_wires_on_two_cores()
    loop = LoadedPoint("world", 2048, 9, 9 * 6, 9 * 6 * 2048, 0.0, 0.0, pieces=9)
    cpu_s = 4e-3 + 9 * (500 + 6 * 50) * 1e-6
    assert predict_loop_s(topology, loop, 4e-3, 2, 2) == pytest.approx(4 * cpu_s / 2, rel=1e-3)
    assert loop.to_json()["pieces"] == 9


@pytest.mark.parametrize("follow_wait_us", [0.0, 400.0])
def test_a_place_the_plan_reaches_from_the_call_before_waits_the_follow_wait(
        follow_wait_us: float) -> None:
    # 4 ranks spinning on 2 cores, calls that wait 1 ms on busy cores, free wires: 4 ms of
    # CPU a rank is 8 ms over the cores; in equal pieces every one of the 4 places waits,
    # in the forward's pieces a place with no compute before it (flat's K and V after Q)
    # makes its calls straight after the place before and waits the follow wait instead.
    from cocodiff.calibration.loaded import predict_loop_s
    from topology import HostSpec, build_topology
    from topology.presets import cluster

    spec = cluster(num_nodes=1, ranks_per_node=4, intra_gbps=1e8, intra_latency_us=0.0,
                   inter_gbps=1e8, inter_latency_us=0.0, tile_tflops=1.0,
                   tile_memory_gbps=1e8)
    topology = build_topology(dataclasses.replace(
        spec, name="pieces", host=HostSpec(cores=2, busy_poll=True, call_wait_us=1000.0,
                                           follow_wait_us=follow_wait_us)))
    loop = LoadedPoint("world", 2048, 4, 24, 24 * 2048, 0.0, 0.0, pieces=4)
    for pieces, waits in (((), 4), ((1.0, 1.0, 1.0, 1.0), 4), ((3.0, 0.0, 0.0, 1.0), 2),
                          ((4.0, 0.0, 0.0, 0.0), 1)):
        assert predict_loop_s(topology, loop, 4e-3, 1, 4, None, pieces) == pytest.approx(
            8e-3 + waits * 1e-3 + (4 - waits) * follow_wait_us * 1e-6, rel=1e-6)
    # Spaced: the calls only at the places with compute before them, none following.
    spaced = dataclasses.replace(loop, calls=2, pieces=2, spaced=True)
    assert predict_loop_s(topology, spaced, 4e-3, 1, 4, None, (3.0, 0.0, 0.0, 1.0)) == (
        pytest.approx(8e-3 + 2e-3, rel=1e-6))


def test_the_two_waits_are_fitted_apart_on_spaced_and_full_loops() -> None:
    # Loops "measured" on a host whose calls wait 700 us after compute and 300 us straight
    # after another call: the spaced loops (calls only after compute) give the first, the
    # others (flat's K and V following Q) the second.
    from cocodiff.calibration.loaded import predict_loop_s
    from cocodiff.calibration.result import Loops
    from topology import HostSpec, build_topology
    from topology.presets import cluster

    spec = cluster(num_nodes=1, ranks_per_node=4, intra_gbps=1e8, intra_latency_us=0.0,
                   inter_gbps=1e8, inter_latency_us=0.0, tile_tflops=1.0,
                   tile_memory_gbps=1e8)
    host = HostSpec(cores=2, busy_poll=True, call_wait_us=700.0, follow_wait_us=300.0)
    pieces = (3e-3, 0.0, 0.0, 1e-3)
    truth = build_topology(dataclasses.replace(spec, name="waits", host=host))
    points = tuple(dataclasses.replace(p, wall_s=predict_loop_s(truth, p, 4e-3, 1, 4, None,
                                                                pieces))
                   for p in (LoadedPoint("world", size, 4, 24, 0, 0.0, 0.0, 4)
                             for size in (2048, 16384)))
    points += tuple(dataclasses.replace(p, calls=2, pieces=2, spaced=True, wall_s=0.0)
                    for p in points)
    points = points[:2] + tuple(
        dataclasses.replace(p, wall_s=predict_loop_s(truth, p, 4e-3, 1, 4, None, pieces))
        for p in points[2:])
    unfitted = dataclasses.replace(spec, name="fresh", host=HostSpec(cores=2, busy_poll=True))
    loops = Loops(unfitted, points, 4e-3, 1, 4, None, pieces)
    call_wait, follow_wait = loops.fitted_waits_us()
    assert call_wait == pytest.approx(700.0, abs=2.0)
    assert follow_wait == pytest.approx(300.0, abs=2.0)


def test_a_loop_with_calls_started_ahead_spends_no_wake_up_on_them() -> None:
    # 4 ranks on 4 cores, free wires, 1 ms of CPU per call; 4 ms of compute in the
    # forward's pieces (3 ms before the first place, 1 ms before the second). The ahead
    # loop makes its call at each place and starts V at the first, waited for at the
    # second: 3 ms, the call's 1 ms, then V's 1 ms beside the 1 ms of compute on the
    # rank's core (2 ms), the call's 1 ms: 7 ms. With the whole call price a wake-up, V
    # (its data in while its rank computes) costs nothing: 6 ms, as the spaced loop.
    from cocodiff.calibration.loaded import predict_loop_s
    from topology import HostSpec, build_topology
    from topology.presets import cluster

    spec = cluster(num_nodes=1, ranks_per_node=4, intra_gbps=1e8, intra_latency_us=0.0,
                   inter_gbps=1e8, inter_latency_us=0.0, tile_tflops=1.0,
                   tile_memory_gbps=1e8)
    pieces = (3e-3, 0.0, 0.0, 1e-3)
    spaced = LoadedPoint("world", 2048, 2, 12, 12 * 2048, 0.0, 0.0, 2, spaced=True)
    ahead = dataclasses.replace(spaced, calls=3, messages=18, bytes=18 * 2048, ahead=True)

    def loop_s(point: LoadedPoint, wake_cpu_us: float) -> float:
        host = HostSpec(cores=4, call_cpu_us=1000.0, wake_cpu_us=wake_cpu_us)
        topology = build_topology(dataclasses.replace(spec, name="ahead", host=host))
        return predict_loop_s(topology, point, 4e-3, 1, 4, None, pieces)

    assert loop_s(spaced, 0.0) == pytest.approx(6e-3, rel=1e-6)
    assert loop_s(ahead, 0.0) == pytest.approx(7e-3, rel=1e-6)
    assert loop_s(ahead, 1000.0) == pytest.approx(6e-3, rel=1e-6)


def test_the_wake_up_is_what_a_call_started_ahead_saves_of_its_price() -> None:
    # A world call of 4 ranks (6 messages) priced 500 + 6 x 50 us. The ahead loop makes
    # the spaced loop's 5 calls and starts 4 more; what those 4 cost below their price is
    # the wake-up, at most the call's own 500 us, at least 0.
    from cocodiff.calibration.loaded import CallCpuFit, wake_cpu_from_loops

    fit = CallCpuFit(500.0, 50.0, None, 0.0, 0.0, (), 0.0)
    price_s = 800e-6
    spaced = LoadedPoint("world", 2048, 5, 30, 30 * 2048, 5 * price_s, 0.0, 5, spaced=True)

    def ahead(started_cpu_s: float) -> LoadedPoint:
        return dataclasses.replace(spaced, calls=9, messages=54, bytes=54 * 2048,
                                   cpu_s=spaced.cpu_s + 4 * started_cpu_s, ahead=True)

    assert wake_cpu_from_loops([spaced, ahead(price_s - 200e-6)], fit) == pytest.approx(200.0)
    assert wake_cpu_from_loops([spaced, ahead(0.0)], fit) == 500.0
    assert wake_cpu_from_loops([spaced, ahead(price_s + 100e-6)], fit) == 0.0
    assert wake_cpu_from_loops([spaced], fit) == 0.0


def test_model_work_makes_the_calls_at_each_of_the_forwards_exchanges() -> None:
    # A tiny FLUX over the stand-in: the work counts the forward's exchanges (4 per layer
    # and the output's gather) and makes the loop's calls exactly there.
    import torch

    from cocodiff.calibration.blocks import build_transformer, standin_forward
    from cocodiff.calibration.loaded import model_work
    from cocodiff.calibration.model_shapes import model_tokens, tiny_transformer_config

    _spec, tokens, image = model_tokens("tiny-flux", None, None)
    forward, standin = standin_forward(build_transformer(tiny_transformer_config("tiny-flux")),
                                       (image, tokens - image), world=4, rank=1)
    counted = []
    standin.on_exchange = lambda: counted.append(1)
    with torch.inference_mode():
        forward()
    standin.on_exchange = None
    work = model_work(forward, standin)
    assert work.pieces == len(counted) > 1 and "exchanges" in work.source
    calls = []
    work.run(lambda: calls.append(1))
    assert len(calls) == work.pieces and standin.on_exchange is None
    # Its pieces: the CPU before each exchange, none before K and V (flat's plan makes
    # them straight after Q), some before Q, the attention's output and the gather.
    assert len(work.piece_cpu_s) == work.pieces
    empty = [place for place, cpu in enumerate(work.piece_cpu_s) if cpu == 0]
    assert empty == [1, 2, 5, 6] and min(work.piece_cpu_s[place] for place in (0, 3, 4, 7, 8)) > 0


def test_calls_after_compute_follows_the_plan() -> None:
    # Flat's layer computes, then Q, K, V back to back, attention, out: compute before Q
    # and out only; the places past the plan's exchanges are the output's gathers.
    from cocodiff.calibration.loaded import calls_after_compute
    from cocodiff.cost import Cost
    from cocodiff.plan.steps import Compute, Exchange, LayerPlan, RankProgram, Wait

    def exchange(name):
        return (Exchange(name, (0, 1), (1, 1), (1, 1), 4, "scatter_heads"), Wait(name))

    layer = LayerPlan((Compute("norm", Cost(1.0, 0.0)),),
                      (*exchange("q"), *exchange("k"), *exchange("v"),
                       Compute("attention", Cost(1.0, 0.0)), *exchange("out")),
                      (Compute("mlp", Cost(1.0, 0.0)),))
    program = RankProgram(0, (layer, layer))
    assert calls_after_compute(program, 9) == (True, False, False, True) * 2 + (True,)
    assert calls_after_compute(program, 7) is None


def test_call_wait_is_what_the_loops_leave_once_the_cpu_is_charged() -> None:
    # Loops "measured" on a host whose calls wait 700 us on busy cores: the fit, starting
    # from no wait, finds 700 us again; loops the simulator already matches give 0.
    from cocodiff.calibration.loaded import predict_loop_s
    from cocodiff.calibration.result import Loops
    from topology import build_topology

    cpu = CpuFit(message_cpu_us=90.0, copy_gbps=3.0, busy_fraction=0.8, wait_spin=0.02)
    fit = fit_call_cpu(loops(), 3.0, burst_cpu_s=1e-3, burst_wall_s=2e-3)
    waited = _calibration(HostMeasurement(2.0, None, cpu, fit, call_wait_us=700.0))
    topology = build_topology(waited.topology())
    measured = [dataclasses.replace(p, wall_s=predict_loop_s(topology, p, 1e-3, 2, 2))
                for p in fit.points]
    loaded = dataclasses.replace(fit, points=tuple(measured))
    fresh = _calibration(HostMeasurement(2.0, None, cpu, loaded))
    assert Loops.of(fresh).fitted_waits_us() == (pytest.approx(700.0, abs=2.0), 0.0)
    assert waited.topology().host.call_wait_us == 700.0
    unwaited = [dataclasses.replace(p, wall_s=p.wall_s / 2) for p in measured]
    fast = _calibration(HostMeasurement(2.0, None, cpu, dataclasses.replace(
        fit, points=tuple(unwaited))))
    assert Loops.of(fast).fitted_waits_us() == (0.0, 0.0)
    # As many cores as ranks: no call of the loops completes on busy cores, so no wait
    # moves them; loops slower than simulated then measure something else, not a wait
    # (the fit used to return its 20 ms cap, charged to every step's call that did).
    roomy = _calibration(HostMeasurement(4.0, None, cpu, dataclasses.replace(
        fit, points=tuple(dataclasses.replace(p, wall_s=2 * p.wall_s) for p in measured))))
    assert Loops.of(roomy).simulated_s(0.0) == Loops.of(roomy).simulated_s(20_000.0)
    assert Loops.of(roomy).fitted_waits_us() == (0.0, 0.0)


def test_simulate_and_plan_say_what_a_call_costs_on_the_host() -> None:
    from cocodiff.commands.plan import host_call_note
    from topology import HostSpec
    from topology.presets import get_preset

    aurora = get_preset("aurora")
    assert host_call_note(aurora) is None  # accelerators: calls cost the host nothing
    spec = dataclasses.replace(aurora, host=HostSpec(cores=2, call_cpu_us=408.0,
                                                     message_cpu_us=58.0, call_wait_us=652.0))
    note = host_call_note(spec)
    assert note is not None and "408 us of CPU + 58 us per message" in note
    assert "652 us of waiting" in note and "each TAPA phase and chunk is a call" in note
    assert "straight after another 0 us" in note and "less for a call done" not in note
    waking = dataclasses.replace(spec, host=dataclasses.replace(
        spec.host, follow_wait_us=120.0, wake_cpu_us=300.0))
    note = host_call_note(waking)
    assert note is not None and "408 us of CPU (300 us less for a call done before" in note
    assert "straight after another 120 us" in note


def test_calibrate_warns_when_the_machines_speed_moved_during_it() -> None:
    from pathlib import Path

    from cocodiff.calibration.result import speed_drift, summary

    cpu = CpuFit(message_cpu_us=90.0, copy_gbps=3.0, busy_fraction=0.8, wait_spin=0.02)
    steady = _calibration(HostMeasurement(2.0, None, cpu))
    steady.reference_cpu_s = (0.030, 0.031)
    assert speed_drift(steady) == pytest.approx(1 / 30)
    assert "speed moved" not in summary(steady, Path("t.toml"))
    slowed = _calibration(HostMeasurement(2.0, None, cpu))
    slowed.reference_cpu_s = (0.030, 0.045)
    assert speed_drift(slowed) == pytest.approx(0.5)
    assert "took +50% CPU time at the end than at the start" in summary(slowed, Path("t.toml"))
    assert speed_drift(_calibration(HostMeasurement(2.0, None, cpu))) is None  # not timed


def test_every_rank_runs_the_loops_the_same_number_of_times() -> None:
    # The loops' calls are collective: the count comes from what the ranks agree on, not
    # from this rank's own forward (ranks at 7.6 and 7.8 ms per forward wanted 13 and 12
    # loops, and gloo aborted on the mismatched calls).
    from cocodiff.calibration.measure import model_loop_iterations

    class Median:
        def __init__(self, agreed: float) -> None:
            self.agreed, self.asked = agreed, []

        def agree(self, value: float) -> float:
            self.asked.append(value)
            return self.agreed

    for forward_s in (0.0076, 0.0078):
        lineup = Median(12.6)
        assert model_loop_iterations(lineup, forward_s, 20) == 13
        assert lineup.asked == [pytest.approx(0.1 / forward_s)]
    assert model_loop_iterations(Median(40.0), 0.002, 20) == 20  # at most `most`
    assert model_loop_iterations(Median(1.4), 0.07, 20) == 3  # at least 3 forwards
