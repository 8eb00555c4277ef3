"""The host model in closed form: ranks and their exchanges' CPU work share a host's cores
(processor sharing, each task at most one core)."""

from __future__ import annotations

import dataclasses

import pytest

from cocodiff.cost import Cost
from cocodiff.plan.steps import (
    Compute,
    Exchange,
    HeadSplit,
    LayerPlan,
    Phase,
    Plan,
    RankProgram,
    Wait,
)
from cocodiff.simulator.simulate import simulate_plan
from topology import HostSpec, build_topology
from topology.presets import cluster

TFLOPS = 1.0
COMPUTE_S = 0.010  # every compute below: 1e10 FLOPs at 1 TF/s


def machine(num_ranks: int, host: HostSpec | None):
    """One node of ``num_ranks`` ranks whose links cost nothing worth measuring (1 EB/s-ish,
    0 us): only compute and CPU work take time."""
    spec = cluster(num_nodes=1, ranks_per_node=num_ranks, intra_gbps=1e8, intra_latency_us=0.0,
                   tile_tflops=TFLOPS, tile_memory_gbps=1e8)
    # Not named "cluster": that preset's collective model adds a set-up per transfer.
    return build_topology(dataclasses.replace(spec, name="host-test", host=host))


def compute() -> Compute:
    return Compute("mlp", Cost(flops=COMPUTE_S * TFLOPS * 1e12, memory_bytes=0.0))


def exchange(num_ranks: int) -> Exchange:
    rows = (1,) * num_ranks
    return Exchange("v", tuple(range(num_ranks)), rows, rows, 8, "scatter_heads")


def plan_of(steps_by_rank: list[tuple]) -> Plan:
    num_ranks = len(steps_by_rank)
    programs = tuple(RankProgram(rank, (LayerPlan((), tuple(steps), ()),))
                     for rank, steps in enumerate(steps_by_rank))
    layout = HeadSplit(num_ranks, num_ranks, (1,) * num_ranks, 8)
    return Plan("flat", "test", layout, programs, shift_period=None)


def step_s(plan: Plan, host: HostSpec | None) -> float:
    return simulate_plan(plan, machine(plan.num_ranks, host), fold=False).step_time_s


def computing(num_ranks: int) -> Plan:
    return plan_of([(compute(),)] * num_ranks)


def test_four_ranks_on_two_cores_take_twice_as_long_as_one() -> None:
    one = step_s(computing(1), HostSpec(cores=2))
    assert one == pytest.approx(COMPUTE_S, rel=1e-9)
    assert step_s(computing(4), HostSpec(cores=2)) == pytest.approx(2 * one, rel=1e-9)
    # The time a rank computes is what its compute took, sharing included: no time is
    # passed off as exposed communication.
    result = simulate_plan(computing(4), machine(4, HostSpec(cores=2)), fold=False)
    assert result.compute_s == pytest.approx(2 * COMPUTE_S, rel=1e-9)
    assert result.comm_exposed_s == pytest.approx(0.0, abs=1e-12)


def test_two_ranks_on_two_cores_take_as_long_as_one() -> None:
    assert step_s(computing(2), HostSpec(cores=2)) == pytest.approx(COMPUTE_S, rel=1e-9)


def test_ranks_per_host_splits_the_ranks_over_hosts() -> None:
    # 4 ranks, 2 per host of 1 core: each host runs 2 computes on 1 core.
    host = HostSpec(cores=1, ranks_per_host=2)
    assert step_s(computing(4), host) == pytest.approx(2 * COMPUTE_S, rel=1e-9)


def test_accelerator_ranks_do_not_compute_on_the_host() -> None:
    host = HostSpec(cores=1, compute_core_demand=0.0)
    assert step_s(computing(4), host) == pytest.approx(COMPUTE_S, rel=1e-9)


def test_exchange_cpu_delays_a_concurrent_compute_by_the_shared_amount() -> None:
    # Two ranks on two cores each start an exchange (one message each way, 2 ms of CPU
    # to send and 2 ms to receive), compute 10 ms, then wait. The cores never idle, so
    # the step is all CPU work over the cores: (2 x 10 + 2 ranks x 2 x 2) / 2 = 14 ms,
    # where without message costs the computes run alone in 10 ms.
    message_cpu_us = 2000.0
    plan = plan_of([(exchange(2), compute(), Wait("v"))] * 2)
    free = step_s(plan, HostSpec(cores=2))
    assert free == pytest.approx(COMPUTE_S, rel=1e-6)
    charged = step_s(plan, HostSpec(cores=2, message_cpu_us=message_cpu_us))
    work_s = 2 * COMPUTE_S + 2 * 2 * message_cpu_us * 1e-6
    assert charged == pytest.approx(work_s / 2, rel=1e-6)


def test_every_exchange_call_pays_its_call_cpu_once() -> None:
    # Two ranks on one core each make one exchange call (one message each way): 3 ms per
    # call and 1 ms per message is 3 + 2 x 1 = 5 ms of CPU per rank, 10 ms on the one core.
    # Two calls (an exchange carried as two phases, say) pay the call twice: 16 ms.
    host = HostSpec(cores=1, call_cpu_us=3000.0, message_cpu_us=1000.0)
    once = plan_of([(exchange(2), Wait("v"))] * 2)
    assert step_s(once, host) == pytest.approx(2 * (3e-3 + 2e-3), rel=1e-6)
    v, k = exchange(2), dataclasses.replace(exchange(2), tensor="k")
    twice = plan_of([(v, k, Wait("v"), Wait("k"))] * 2)
    assert step_s(twice, host) == pytest.approx(2 * (2 * 3e-3 + 4e-3), rel=1e-6)
    # The call cost alone makes an exchange cost CPU (no message or byte costs needed).
    assert step_s(once, HostSpec(cores=1, call_cpu_us=3000.0)) == pytest.approx(6e-3, rel=1e-6)


def test_bytes_cost_cpu_at_the_copy_rate() -> None:
    # One rank exchanging with an idle peer: 1e6 bytes sent and received at 1 GB/s per
    # core is 2 ms of CPU per rank; with a core each, the exchange takes those 2 ms.
    rows = 1000
    big = Exchange("v", (0, 1), (0, rows), (0, rows), 1000, "scatter_heads")
    peer = Exchange("v", (0, 1), (rows, 0), (rows, 0), 1000, "scatter_heads")
    plan = plan_of([(big, Wait("v")), (peer, Wait("v"))])
    assert step_s(plan, HostSpec(cores=2, copy_gbps=1.0)) == pytest.approx(2e-3, rel=1e-6)
    # Sharing one core, the two ranks' copies take twice as long.
    assert step_s(plan, HostSpec(cores=1, copy_gbps=1.0)) == pytest.approx(4e-3, rel=1e-6)


def test_busy_poll_takes_a_core_while_sleeping_waits_do_not() -> None:
    # Rank 0 computes 10 ms, then exchanges; rank 1 posts at once and waits for it. On one
    # core, a sleeping wait leaves rank 0 the core (10 ms); a spinning one halves it (20 ms).
    plan = plan_of([(compute(), exchange(2), Wait("v")), (exchange(2), Wait("v"))])
    assert step_s(plan, HostSpec(cores=1)) == pytest.approx(COMPUTE_S, rel=1e-6)
    assert step_s(plan, HostSpec(cores=1, busy_poll=True)) == pytest.approx(2 * COMPUTE_S,
                                                                            rel=1e-6)
    # With a core to spare, the spinning rank costs the computing one nothing.
    assert step_s(plan, HostSpec(cores=2, busy_poll=True)) == pytest.approx(COMPUTE_S, rel=1e-6)


def test_a_free_host_changes_nothing() -> None:
    # A host whose ranks compute on their own devices and handle messages for free is
    # today's simulator, to the bit (every schedule, folded or not).
    from cocodiff.models import REGISTRY
    from cocodiff.simulator.simulate import simulate_schedule
    from topology import Placement

    spec = cluster(num_nodes=2, ranks_per_node=2)
    free = dataclasses.replace(spec, host=HostSpec(cores=1, ranks_per_host=2,
                                                   compute_core_demand=0.0))
    for schedule in ("flat", "tapa", "cocodiff"):
        results = []
        for machine_spec in (spec, free):
            topology = build_topology(machine_spec)
            results.append(simulate_schedule(schedule, REGISTRY["flux1-dev"], topology,
                                             Placement.node_major(topology), (256, 64), 2))
        without, with_host = results
        assert with_host.step_times_s == without.step_times_s
        assert with_host.bytes_by_tier == without.bytes_by_tier


def test_a_call_completing_on_busy_cores_waits_to_be_scheduled() -> None:
    # Rank 0 computes 10 ms; ranks 1 and 2 exchange at once (no CPU costs) and are done.
    # On 1 core the data arrives while rank 0's compute holds it: each waits 15 ms to be
    # scheduled, so the step is 15 ms. On 2 cores a core is free and nothing waits.
    host = HostSpec(cores=1, call_wait_us=15000.0)
    pair = Exchange("v", (1, 2), (0, 1), (0, 1), 8, "scatter_heads")
    peer = Exchange("v", (1, 2), (1, 0), (1, 0), 8, "scatter_heads")
    plan = plan_of([(compute(),), (pair, Wait("v")), (peer, Wait("v"))])
    assert step_s(plan, host) == pytest.approx(15e-3, rel=1e-6)
    assert step_s(plan, dataclasses.replace(host, cores=2)) == pytest.approx(COMPUTE_S, rel=1e-6)


def test_a_call_made_as_the_previous_one_finishes_does_not_wait_again() -> None:
    # Rank 0 computes 10 ms on the one core; ranks 1 and 2 make two calls, the second the
    # moment the first finishes (as TAPA's second phase follows its first). The first
    # waits 6 ms to be scheduled; the second does not (its members were just woken by the
    # first), so they are done at 6 ms and the step is rank 0's 10 ms. Were it to wait as
    # well, it would end at 12 ms: what a little compute between the two calls gives.
    host = HostSpec(cores=1, call_wait_us=6000.0)
    first = Exchange("v", (1, 2), (0, 1), (0, 1), 8, "scatter_heads")
    first_peer = Exchange("v", (1, 2), (1, 0), (1, 0), 8, "scatter_heads")
    second = Exchange("k", (1, 2), (0, 1), (0, 1), 8, "scatter_heads")
    second_peer = Exchange("k", (1, 2), (1, 0), (1, 0), 8, "scatter_heads")
    back_to_back = plan_of([(compute(),),
                            (first, Wait("v"), second, Wait("k")),
                            (first_peer, Wait("v"), second_peer, Wait("k"))])
    assert step_s(back_to_back, host) == pytest.approx(COMPUTE_S, rel=1e-6)
    tiny = Compute("mlp", Cost(flops=1e-9 * TFLOPS * 1e12, memory_bytes=0.0))
    apart = plan_of([(compute(),),
                     (first, Wait("v"), tiny, second, Wait("k")),
                     (first_peer, Wait("v"), tiny, second_peer, Wait("k"))])
    assert step_s(apart, host) == pytest.approx(12e-3, rel=1e-3)


def test_a_call_that_arrives_while_its_rank_computes_does_not_wait() -> None:
    # Ranks 1 and 2 start a call, compute 1 ms, then wait for it (as V-First starts V's
    # exchange and computes Q/K's norm and RoPE); rank 0 computes 10 ms; one core. The
    # data arrives while ranks 1 and 2 are computing, not asleep in the wait: nobody has
    # to be woken, so nothing waits 15 ms and the step is the 12 ms of CPU on the core.
    # Over a wire of 5 ms the data arrives after they have begun to wait, while rank 0
    # holds the core: then they wait to be scheduled, 5 + 15 ms.
    host = HostSpec(cores=1, call_wait_us=15000.0)
    short = Compute("mlp", Cost(flops=1e-3 * TFLOPS * 1e12, memory_bytes=0.0))
    pair = Exchange("v", (1, 2), (0, 1), (0, 1), 8, "scatter_heads")
    peer = Exchange("v", (1, 2), (1, 0), (1, 0), 8, "scatter_heads")
    plan = plan_of([(compute(),), (pair, short, Wait("v")), (peer, short, Wait("v"))])
    assert step_s(plan, host) == pytest.approx(12e-3, rel=1e-6)
    slow = cluster(num_nodes=1, ranks_per_node=3, intra_gbps=1e8, intra_latency_us=5000.0,
                   tile_tflops=TFLOPS, tile_memory_gbps=1e8)
    topology = build_topology(dataclasses.replace(slow, name="host-test", host=host))
    assert simulate_plan(plan, topology, fold=False).step_time_s == pytest.approx(
        20e-3, rel=1e-3)


def test_only_a_call_its_rank_is_blocked_on_spends_the_wake_up() -> None:
    # Two ranks, a core each, one all-to-all of 3 ms of CPU per call, 2 ms of it the
    # wake-up. Blocking: 1 ms before the (free) wire, the wake-up after it: 3 ms. Started
    # ahead of 10 ms of compute and waited for after it (V-First's V): the data arrives
    # while the rank computes, so it is never put to sleep and woken: 1 ms of the call's
    # CPU beside 10 of compute on the rank's core, 11 ms; 13 ms if it paid the wake-up too.
    host = HostSpec(cores=2, call_cpu_us=3000.0, wake_cpu_us=2000.0)
    blocking = plan_of([(exchange(2), Wait("v"))] * 2)
    assert step_s(blocking, host) == pytest.approx(3e-3, rel=1e-6)
    ahead = plan_of([(exchange(2), compute(), Wait("v"))] * 2)
    assert step_s(ahead, host) == pytest.approx(11e-3, rel=1e-6)
    no_wake = dataclasses.replace(host, wake_cpu_us=0.0)
    assert step_s(ahead, no_wake) == pytest.approx(13e-3, rel=1e-6)


def test_a_call_straight_after_another_waits_the_follow_wait_on_free_cores() -> None:
    # Two ranks, a core each, Q's exchange then K's at once, V's started ahead of them.
    # No core is busy, so Q's call does not wait; K's, made the moment Q's finished, waits
    # the follow wait all the same (its rank asleep in it, handed it back by the
    # transport's thread); V's, never waited on as it completes, waits nothing.
    host = HostSpec(cores=2, call_wait_us=15000.0, follow_wait_us=500.0)
    q, k = (dataclasses.replace(exchange(2), tensor=name) for name in ("q", "k"))
    flat = plan_of([(q, Wait("q"), k, Wait("k"))] * 2)
    assert step_s(flat, host) == pytest.approx(0.5e-3, rel=1e-3)
    first = plan_of([(exchange(2), compute(), q, Wait("q"), k, Wait("k"), Wait("v"))] * 2)
    assert step_s(first, host) == pytest.approx(COMPUTE_S + 0.5e-3, rel=1e-3)


def test_an_exchange_handles_its_messages_while_its_bytes_are_on_the_wire() -> None:
    # Four ranks, a core each, one all-to-all: three messages out and three in per rank.
    # As LogGP lays a message train out, the call and the first message sent are paid
    # before any byte leaves, the last message received after the bytes arrived, and
    # the four messages between while the wire carries the bytes: the exchange takes
    # call + m + max(wire, 4 m) + m, where serialising CPU and wire would give
    # call + 6 m + wire.
    ranks, row_bytes = 4, 250_000
    rows = (1,) * ranks
    plan = plan_of([(Exchange("v", tuple(range(ranks)), rows, rows, row_bytes,
                              "scatter_heads"), Wait("v"))] * ranks)
    spec = cluster(num_nodes=1, ranks_per_node=ranks, intra_gbps=1.0, intra_latency_us=0.0,
                   tile_tflops=TFLOPS, tile_memory_gbps=1e8)
    slow_link = build_topology(dataclasses.replace(spec, name="host-test"))
    wire_s = simulate_plan(plan, slow_link, fold=False).step_time_s
    assert wire_s == pytest.approx(0.75e-3, rel=1e-6)  # 750 kB each way at 1 GB/s

    def on_host(message_cpu_us: float) -> float:
        host = HostSpec(cores=ranks, call_cpu_us=100.0, message_cpu_us=message_cpu_us)
        topology = build_topology(dataclasses.replace(spec, name="host-test", host=host))
        return simulate_plan(plan, topology, fold=False).step_time_s

    hidden_us = wire_s * 1e6 / 8  # 4 of them fit in half the wire time
    assert on_host(hidden_us) == pytest.approx(100e-6 + wire_s + 2 * hidden_us * 1e-6, rel=1e-6)
    exposed_us = wire_s * 1e6  # 4 of them take four times the wire time
    assert on_host(exposed_us) == pytest.approx(100e-6 + 6 * exposed_us * 1e-6, rel=1e-6)


def test_a_microbenchmark_pays_no_step_overhead() -> None:
    # The step overhead is the pipeline's work outside the blocks, once per denoising
    # step: an all-to-all microbenchmark (calibrate's collective fit, `cocodiff
    # collective`) simulated on a topology that has one does not pay it.
    from cocodiff.simulator.collective import simulate_all_to_all

    spec = cluster(num_nodes=2, ranks_per_node=2)
    with_overhead = dataclasses.replace(spec, tile_step_overhead_us=5000.0)
    times = [simulate_all_to_all(build_topology(s), 1 << 20).time_s
             for s in (spec, with_overhead)]
    assert times[0] == times[1]
    plan = computing(2)
    assert simulate_plan(plan, build_topology(dataclasses.replace(
        with_overhead, name="host-test"))).step_time_s > simulate_plan(
        plan, build_topology(dataclasses.replace(spec, name="host-test"))).step_time_s


def selective_exchange(num_ranks: int, blocks_per_row: int) -> Exchange:
    """V's exchange over ``num_ranks`` ranks as one V-Major phase sending half its blocks
    (``blocks_per_row`` 0: the same phase, exact)."""
    rows = (4,) * num_ranks
    group = tuple(range(num_ranks))
    phase = Phase("node", group, rows, rows, sent_fraction=0.5, blocks_per_row=blocks_per_row)
    return Exchange("v", group, rows, rows, 64, "scatter_heads", phases=(phase,))


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_a_selective_message_costs_the_codec_at_both_ends(num_ranks: int) -> None:
    # Each rank encodes its num_ranks - 1 messages before the phase and decodes as many
    # after it; cores to spare, so nothing is shared: the step grows by 2 (n - 1) codecs.
    codec_us = 50.0
    host = HostSpec(cores=8, codec_cpu_us=codec_us)

    def step(blocks_per_row: int, codec: HostSpec) -> float:
        exchange = selective_exchange(num_ranks, blocks_per_row)
        return step_s(plan_of([(exchange, Wait("v"))] * num_ranks), codec)

    without = dataclasses.replace(host, codec_cpu_us=0.0)
    assert step(2, host) - step(2, without) == pytest.approx(
        2 * (num_ranks - 1) * codec_us * 1e-6, rel=1e-9)
    # An exact phase runs no codec.
    assert step(0, host) == pytest.approx(step(0, without), rel=1e-12)


def tapa_exchange(rank: int, ranks: tuple[int, ...], selective: bool = False) -> Exchange:
    """K's exchange among four ranks (2 x 2, ``ranks[0]`` first) as TAPA's two phases:
    over the rank's pair, then over its column; every member sends every other one row.
    ``selective``: the column's phase is V-Major's, sending half its blocks."""
    position = ranks.index(rank)
    pair = ranks[position // 2 * 2: position // 2 * 2 + 2]
    column = ranks[position % 2::2]
    two = (2, 2)
    vmajor = {"sent_fraction": 0.5, "blocks_per_row": 2} if selective else {}
    phases = (Phase("gpu", pair, two, two), Phase("node", column, two, two, **vmajor))
    ones = (1,) * len(ranks)
    return Exchange("k", ranks, ones, ones, 64, "scatter_heads", phases=phases)


def test_each_tapa_phase_costs_its_phase_cpu_with_its_call() -> None:
    # Cores to spare: nothing is shared, so the step grows by the two phases' CPU, one
    # after the other (each phase goes out once the one before landed, and a call ends
    # when both its bytes and its CPU are done).
    ranks = (0, 1, 2, 3)
    plan = plan_of([(tapa_exchange(rank, ranks), Wait("k")) for rank in ranks])
    host = HostSpec(cores=8, call_cpu_us=10.0)
    routed = dataclasses.replace(host, phase_cpu_us=70.0)
    assert step_s(plan, routed) - step_s(plan, host) == pytest.approx(140e-6, rel=1e-9)
    # A host charging nothing else still charges the routing.
    assert step_s(plan, HostSpec(cores=8, phase_cpu_us=70.0)) == pytest.approx(
        step_s(plan, None) + 140e-6, rel=1e-6)


def test_a_phases_cpu_hides_behind_its_bytes_on_the_wire() -> None:
    # TAPA's two phases over a slow link (1 GB/s), cores to spare: the phase's own CPU
    # (phase_cpu_us) is spent while its bytes travel, so 10 us per phase costs the step
    # nothing where charging it before the call would add 20 us.
    ranks = (0, 1, 2, 3)
    plan = plan_of([(dataclasses.replace(tapa_exchange(rank, ranks), row_bytes=250_000),
                     Wait("k")) for rank in ranks])
    spec = cluster(num_nodes=1, ranks_per_node=4, intra_gbps=1.0, intra_latency_us=0.0,
                   tile_tflops=TFLOPS, tile_memory_gbps=1e8)

    def on_host(phase_cpu_us: float) -> float:
        host = HostSpec(cores=8, call_cpu_us=10.0, phase_cpu_us=phase_cpu_us)
        topology = build_topology(dataclasses.replace(spec, name="host-test", host=host))
        return simulate_plan(plan, topology, fold=False).step_time_s

    bare = on_host(0.0)
    assert bare > 1e-3  # each phase's bytes take far longer than 10 us
    assert on_host(10.0) == pytest.approx(bare, rel=1e-9)


def test_routing_a_phase_does_not_part_it_from_the_phase_before() -> None:
    # Rank 0 computes 10 ms on the one core; ranks 1-4 run TAPA's two phases, each routed
    # first (1 us). The first phase waits 6 ms to be scheduled; the second follows it at
    # once, its routing part of its own call, so it does not wait again: the step is rank
    # 0's 10 ms (and the routing's few us on the shared core), not the 12 ms of two waits.
    ranks = (1, 2, 3, 4)
    host = HostSpec(cores=1, call_wait_us=6000.0, phase_cpu_us=1.0)
    plan = plan_of([(compute(),)] + [(tapa_exchange(rank, ranks), Wait("k")) for rank in ranks])
    assert step_s(plan, host) == pytest.approx(COMPUTE_S, abs=20e-6)


def test_a_later_phase_is_posted_when_the_rank_waits_as_the_runtime_posts_it() -> None:
    # The runtime's PhasedHandle posts an exchange's first phase when it starts and the
    # second at the first progress point after the first has landed. Each call costs 1 ms
    # of CPU (cores to spare, free links): with one compute of 10 ms between start and
    # wait, its progress point comes before the first call lands, so the second goes out
    # at the wait; only the first call hides behind the compute, and waiting at once
    # instead saves the compute's overlap with one call, not two.
    ranks = (0, 1, 2, 3)
    host = HostSpec(cores=8, call_cpu_us=1000.0)
    overlapped = step_s(plan_of([(tapa_exchange(r, ranks), compute(), Wait("k"))
                                 for r in ranks]), host)
    in_turn = step_s(plan_of([(tapa_exchange(r, ranks), Wait("k"), compute())
                              for r in ranks]), host)
    assert in_turn - overlapped == pytest.approx(1e-3, rel=1e-6)


def test_a_later_phase_goes_out_at_the_next_progress_point() -> None:
    # Progress points come before each compute step while an exchange is in flight: the
    # first call (1 ms of CPU) lands during the first compute, the second goes out before
    # the second compute and hides behind it too. Waiting after one compute instead
    # leaves the second call after both, 1 ms more.
    ranks = (0, 1, 2, 3)
    host = HostSpec(cores=8, call_cpu_us=1000.0)
    progressed = step_s(plan_of([(tapa_exchange(r, ranks), compute(), compute(), Wait("k"))
                                 for r in ranks]), host)
    at_wait = step_s(plan_of([(tapa_exchange(r, ranks), compute(), Wait("k"), compute())
                              for r in ranks]), host)
    assert progressed == pytest.approx(2 * COMPUTE_S, rel=1e-6)
    assert at_wait - progressed == pytest.approx(1e-3, rel=1e-6)


def test_a_later_phase_whose_group_a_later_start_opens_goes_out_at_the_wait() -> None:
    # V runs over the pair, then the column; Q, started between V's start and its wait,
    # opens with the column. A posting of V's column phase at a progress point could come
    # before Q's start on one rank and after it on another, so it waits for the wait, and
    # Q's pair phase (ready before the third compute) waits behind it, started later.
    # Both go out at the waits, after the three computes: 1 ms past them, where posting
    # them as they may would hide both.
    ranks = (0, 1, 2, 3)
    host = HostSpec(cores=8, call_cpu_us=1000.0)

    def steps(rank: int) -> tuple:
        v = dataclasses.replace(tapa_exchange(rank, ranks), tensor="v")
        q = dataclasses.replace(v, tensor="q", phases=v.phases[::-1])
        return (v, compute(), q, compute(), compute(), Wait("q"), Wait("v"))

    held = step_s(plan_of([steps(r) for r in ranks]), host)
    assert held == pytest.approx(3 * COMPUTE_S + 1e-3, rel=1e-6)


def test_encoding_a_selective_phase_does_not_part_it_from_the_phase_before() -> None:
    # As above with V-Major's second phase: its sender's encoding (1 us) is part of the
    # phase's call, as its routing is, so the phase still follows the first without a
    # second wait of 6 ms.
    ranks = (1, 2, 3, 4)
    host = HostSpec(cores=1, call_wait_us=6000.0, codec_cpu_us=1.0)
    plan = plan_of([(compute(),)] + [(tapa_exchange(rank, ranks, selective=True), Wait("k"))
                                     for rank in ranks])
    assert step_s(plan, host) == pytest.approx(COMPUTE_S, abs=20e-6)
