"""The flow model against closed forms, before it is trusted on a real machine."""

import math

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.network import Network

GB = 1e9


def run_flows(capacities, flows):
    """flows: (links, bytes, latency_s, start_s, count); returns finish times."""
    env = simpy.Environment()
    network = Network(env, capacities)
    finished = {}

    def start(index, links, num_bytes, latency_s, start_s, count):
        yield env.timeout(start_s)
        yield network.transfer(links, num_bytes, latency_s, count=count, label=str(index))
        finished[index] = env.now

    for index, (links, num_bytes, latency_s, start_s, count) in enumerate(flows):
        env.process(start(index, links, num_bytes, latency_s, start_s, count))
    env.run()
    network.finish()
    return finished, network


def test_one_flow_on_one_link_takes_latency_plus_bytes_over_bandwidth():
    finished, _ = run_flows({"l": 10 * GB}, [(("l",), 1e9, 5e-6, 0.0, 1)])
    assert finished[0] == pytest.approx(5e-6 + 0.1, rel=1e-12)


@pytest.mark.parametrize("n", [2, 3, 7, 64])
def test_n_equal_flows_each_get_a_share_of_bandwidth_over_n(n):
    flows = [(("l",), 1e8, 0.0, 0.0, 1)] * n
    finished, network = run_flows({"l": 1 * GB}, flows)
    for index in range(n):
        assert finished[index] == pytest.approx(n * 0.1, rel=1e-12)
    assert network.stats["l"].bytes_carried == pytest.approx(n * 1e8, rel=1e-12)


def test_a_machine_of_many_links_shares_the_few_in_use_as_a_small_one_does():
    """Past 4,096 links the network works on the links in use only (found by marking
    them, numbered in link order): the same finish times and bytes as on those links
    alone, with flows starting and ending so the links in use change."""
    flows = [(("l9",), 1e8, 0.0, 0.0, 1), (("l9", "l4000"), 1e8, 0.0, 0.05, 2),
             (("l4000",), 5e7, 1e-6, 0.2, 1), (("l12",), 2e8, 0.0, 0.0, 3)]
    few = {"l9": GB, "l12": 2 * GB, "l4000": 0.5 * GB}
    many = {f"l{i}": 3 * GB for i in range(6000)} | few
    small, small_network = run_flows(few, flows)
    large, large_network = run_flows(many, flows)
    assert large == pytest.approx(small, rel=1e-12)
    for link in few:
        assert large_network.stats[link].bytes_carried == pytest.approx(
            small_network.stats[link].bytes_carried, rel=1e-12)


def test_a_bundle_of_count_n_equals_n_separate_flows():
    bundled, _ = run_flows({"l": GB, "m": GB}, [(("l",), 1e8, 0, 0, 5), (("l", "m"), 1e8, 0, 0, 1)])
    separate, _ = run_flows(
        {"l": GB, "m": GB}, [(("l",), 1e8, 0, 0, 1)] * 5 + [(("l", "m"), 1e8, 0, 0, 1)]
    )
    assert bundled[0] == pytest.approx(separate[0], rel=1e-12)
    assert bundled[1] == pytest.approx(separate[5], rel=1e-12)


def test_flow_through_a_bottleneck_gets_the_bottlenecks_share():
    # A crosses fast link f and slow link s; B and C also use s; D uses only f.
    # s (3 GB/s) is shared three ways -> 1 GB/s each; D takes the rest of f (9 GB/s).
    capacities = {"f": 10 * GB, "s": 3 * GB}
    flows = [
        (("f", "s"), 1e9, 0, 0, 1),
        (("s",), 1e9, 0, 0, 1),
        (("s",), 1e9, 0, 0, 1),
        (("f",), 9e9, 0, 0, 1),
    ]
    finished, _ = run_flows(capacities, flows)
    assert finished[0] == pytest.approx(1.0, rel=1e-9)
    assert finished[1] == pytest.approx(1.0, rel=1e-9)
    assert finished[3] == pytest.approx(1.0, rel=1e-9)


def test_rates_are_recomputed_when_a_flow_ends():
    # Two flows share 1 GB/s; the short one (0.5 GB) ends at t=1 s, the long one (1.5 GB)
    # then runs alone: 0.5 GB by t=1, 1 GB more at full rate -> t=2.
    finished, _ = run_flows({"l": GB}, [(("l",), 0.5e9, 0, 0, 1), (("l",), 1.5e9, 0, 0, 1)])
    assert finished[0] == pytest.approx(1.0, rel=1e-12)
    assert finished[1] == pytest.approx(2.0, rel=1e-12)


def test_rates_are_recomputed_when_a_flow_starts():
    # The first flow runs alone for 0.5 s (0.5 GB of 1 GB), then shares with a second.
    finished, _ = run_flows({"l": GB}, [(("l",), 1e9, 0, 0.0, 1), (("l",), 1e9, 0, 0.5, 1)])
    assert finished[0] == pytest.approx(1.5, rel=1e-12)
    assert finished[1] == pytest.approx(2.0, rel=1e-12)


def test_zero_byte_and_linkless_flows_cost_only_latency():
    finished, _ = run_flows({"l": GB}, [(("l",), 0, 2e-6, 0, 1), ((), 1e9, 3e-6, 0, 1)])
    assert finished[0] == pytest.approx(2e-6)
    assert finished[1] == pytest.approx(3e-6)


def test_bad_flows_are_refused():
    env = simpy.Environment()
    network = Network(env, {"l": GB})
    with pytest.raises(KeyError, match="unknown link"):
        network.transfer(("nope",), 1)
    with pytest.raises(ValueError, match="bytes -1"):
        network.transfer(("l",), -1)
    with pytest.raises(ValueError, match="positive, finite capacity"):
        Network(env, {"x": 0.0})
    with pytest.raises(ValueError, match="positive, finite capacity"):
        Network(env, {"x": float("inf")})


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sets(st.sampled_from("abcd"), min_size=1).map(tuple),
            st.floats(1e3, 1e9),
            st.floats(0, 0.5),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_max_min_allocation_respects_capacity_and_has_a_bottleneck(flows):
    capacities = {"a": GB, "b": 2 * GB, "c": 0.5 * GB, "d": 4 * GB}
    env = simpy.Environment()
    network = Network(env, capacities)
    for links, num_bytes, start_s in flows:
        env.timeout(start_s).callbacks.append(
            lambda _e, links=links, num_bytes=num_bytes: network.transfer(links, num_bytes)
        )

    def check():
        while True:
            yield env.timeout(0.01)
            active = network.allocation()
            if not active or not network.settled:
                continue
            for link, capacity in capacities.items():
                load = sum(rate * count for links, count, rate in active if link in links)
                assert load <= capacity * (1 + 1e-9)
            for links, _count, rate in active:
                # max-min: some link on the flow's path is saturated and no flow on it is faster
                assert any(
                    sum(r * c for ls, c, r in active if link in ls) >= capacities[link] * (1 - 1e-9)
                    and all(r <= rate * (1 + 1e-9) for ls, _c, r in active if link in ls)
                    for link in links
                )

    env.process(check())
    env.run(until=10.0)
    total = sum(b for _, b, _ in flows)
    carried_upper_bound = sum(b * len(links) for links, b, _ in flows)
    assert sum(s.bytes_carried for s in network.stats.values()) <= carried_upper_bound * (1 + 1e-9)
    assert math.isfinite(total)


def test_an_endless_flow_shares_until_stopped_and_then_frees_its_share():
    # A 1 B/s link: an endless flow and a 2-byte flow share it (0.5 B/s each) until the
    # endless one is stopped at t = 2, after which the other finishes its last byte alone.
    from sim.network import FlowBatch

    env = simpy.Environment()
    network = Network(env, {"l": 1.0})
    spin = network.start_endless(FlowBatch.build([([0], math.inf, 1, 0.0, (0,))], 1))
    done = network.transfer(["l"], 2.0)
    finished = []
    done.callbacks.append(lambda _e: finished.append(env.now))

    def stopper():
        yield env.timeout(2.0)
        network.stop(spin)

    env.process(stopper())
    env.run()
    assert finished == [pytest.approx(3.0)]
    # The endless flow never scheduled a completion: the run ends (stale timers of the
    # shared phase, at t = 4, are the latest events), not at t = inf.
    assert spin.triggered and env.now == pytest.approx(4.0)
