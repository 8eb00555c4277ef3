"""The simulated transport: a real backend (protocol, lifecycle) and exact against
closed forms; node folding gives the same answer as simulating every rank."""

import dataclasses

import pytest

from cocodiff.models import REGISTRY
from cocodiff.schedules import RankGrid, plan_flat
from cocodiff.simulator.simulate import simulate_plan
from sim import Simulation
from topology import HostSpec, Placement, build_topology, get_preset
from topology.presets import cluster
from transports.base import Transport, TransportError, VirtualBuffer
from transports.sim import SimWorld, _Interner


def make_world(spec, fold=False):
    topology = build_topology(spec)
    simulation = Simulation(topology)
    placement = Placement.node_major(topology)
    return (
        SimWorld(simulation, placement, fold_nodes=1 if fold else None),
        simulation,
        topology,
        placement,
    )


def all_to_all_times(world, simulation, num_bytes, group=None):
    finish = {}

    def rank_process(rank):
        transport = world.transport(rank)
        members = group or transport.world
        if rank not in members.ranks:
            return
        size = members.size
        handle = transport.all_to_all(
            VirtualBuffer(size, num_bytes), [1] * size, [1] * size, members
        )
        yield handle.event
        handle.wait()
        finish[rank] = simulation.now

    for rank in world.simulated_ranks:
        simulation.env.process(rank_process(rank))
    simulation.run()
    return finish


def test_sim_transport_implements_the_protocol():
    world, *_ = make_world(cluster(num_nodes=1, ranks_per_node=2))
    assert isinstance(world.transport(0), Transport)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_flat_all_to_all_on_one_switch_matches_alpha_beta(ranks):
    spec = cluster(num_nodes=1, ranks_per_node=ranks, intra_gbps=10.0)
    world, simulation, topology, placement = make_world(spec)
    num_bytes = 4_000_000
    finish = all_to_all_times(world, simulation, num_bytes)
    route = topology.route(placement.tile_of(0), placement.tile_of(1))
    alpha = topology.route_latency_us(route) * 1e-6
    # Every rank's link into the switch carries its P-1 outgoing messages (and the
    # switch's link to it the P-1 incoming ones), each at B / (P-1).
    expected = alpha + (ranks - 1) * num_bytes / (spec.gpu_link.bandwidth_gbps * 1e9)
    assert set(finish) == set(range(ranks))
    for time_s in finish.values():
        assert time_s == pytest.approx(expected, rel=1e-9)


def test_sub_group_collectives_run_concurrently_and_independently():
    spec = cluster(num_nodes=1, ranks_per_node=4, intra_gbps=10.0)
    world, simulation, topology, placement = make_world(spec)
    finish = {}

    def rank_process(rank):
        transport = world.transport(rank)
        group = transport.new_group([0, 1] if rank < 2 else [2, 3])
        handle = transport.all_to_all(VirtualBuffer(2, 10**6), [1, 1], [1, 1], group)
        yield handle.event
        finish[rank] = simulation.now

    for rank in range(4):
        simulation.env.process(rank_process(rank))
    simulation.run()
    route = topology.route(placement.tile_of(0), placement.tile_of(1))
    expected = topology.route_latency_us(route) * 1e-6 + 10**6 / 10e9
    assert all(t == pytest.approx(expected, rel=1e-9) for t in finish.values())


def test_handle_lifecycle_raises_on_misuse():
    world, simulation, *_ = make_world(cluster(num_nodes=1, ranks_per_node=2))
    transport = world.transport(0)
    handle = transport.all_to_all(VirtualBuffer(2, 8), [1, 1], [1, 1])
    with pytest.raises(TransportError, match="before its event fired"):
        handle.wait()
    world.transport(1).all_to_all(VirtualBuffer(2, 8), [1, 1], [1, 1])
    simulation.run()
    assert handle.wait() == VirtualBuffer(2, 8)
    with pytest.raises(TransportError, match="twice"):
        handle.wait()
    with pytest.raises(TransportError, match="splits"):
        transport.all_to_all(VirtualBuffer(3, 8), [1, 1], [1, 1])


@pytest.mark.parametrize(
    ("spec", "model_name"),
    [
        (get_preset("aurora", 2), "flux1-dev"),
        (cluster(num_nodes=3, ranks_per_node=2), "flux1-dev"),
        (cluster(num_nodes=4, ranks_per_node=2), "wan21-14b"),
    ],
)
def test_folding_by_node_equals_simulating_every_rank(spec, model_name):
    topology = build_topology(spec)
    model = REGISTRY[model_name]
    streams = (model.image_tokens(512, 512), model.text_tokens)
    plan = plan_flat(model, RankGrid.line(len(topology.tiles)), streams)
    full = simulate_plan(plan, topology, fold=False)
    folded = simulate_plan(plan, topology, fold=True)
    assert folded.simulated_ranks == spec.gpus_per_node * spec.tiles_per_gpu
    assert full.simulated_ranks == len(topology.tiles)
    assert folded.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
    assert folded.compute_s == pytest.approx(full.compute_s, rel=1e-12)
    for tier, num_bytes in full.bytes_by_tier.items():
        assert folded.bytes_by_tier[tier] == pytest.approx(num_bytes, rel=1e-12)
    assert folded.busiest_links[0].utilisation == pytest.approx(
        full.busiest_links[0].utilisation, rel=1e-9
    )


def test_folding_is_refused_for_plans_that_are_not_node_symmetric():
    topology = build_topology(cluster(num_nodes=2, ranks_per_node=2))
    # 7 heads over 4 ranks (1, 2, 2, 2 with the spread split) repeat only every 4 ranks.
    model = dataclasses.replace(REGISTRY["sd35-large"], num_heads=7)
    plan = plan_flat(model, RankGrid.line(4), (model.image_tokens(256, 256), model.text_tokens))
    assert plan.shift_period == 4
    with pytest.raises(ValueError, match="not node-symmetric"):
        simulate_plan(plan, topology, fold=True)
    assert simulate_plan(plan, topology).folded is False


def test_interned_keys_are_equal_for_equal_tuples_and_kept_per_object() -> None:
    # Matching across ranks needs equal groups to share a key, whichever object holds them.
    key = _Interner()
    ring = tuple(range(2048))
    copy = tuple(list(ring))
    assert copy is not ring
    assert key(ring) == key(copy) == key(ring)
    assert key((0, 1)) != key(ring)


def late_pair_times(late_peer_first: bool, late_by_s: float, num_bytes: int,
                    ranks_per_node: int = 1) -> tuple[dict[int, float], float, float]:
    """Finish time of every rank of a world-wide exchange over two nodes whose second
    node's ranks post ``late_by_s`` after the first's; with the NIC's latency and rate."""
    spec = dataclasses.replace(cluster(num_nodes=2, ranks_per_node=ranks_per_node),
                               host=HostSpec(cores=8.0, late_peer_first=late_peer_first))
    world, simulation, topology, placement = make_world(spec)
    finish = {}

    def rank_process(rank):
        transport = world.transport(rank)
        if rank >= ranks_per_node:
            yield simulation.env.timeout(late_by_s)
        size = transport.world.size
        handle = transport.all_to_all(VirtualBuffer(size, num_bytes), [1] * size,
                                      [1] * size)
        yield handle.event
        finish[rank] = simulation.now

    for rank in world.simulated_ranks:
        simulation.env.process(rank_process(rank))
    simulation.run()
    route = topology.route(placement.tile_of(0), placement.tile_of(ranks_per_node))
    return (finish, topology.route_latency_us(route) * 1e-6,
            spec.nic_link.bandwidth_gbps * 1e9)


def test_a_late_peer_sends_first_and_the_early_peer_after_it() -> None:
    # gloo's rendezvous: the early rank's data waits for the late rank's "ready", which
    # travels behind the late rank's own data. Early: done once the late data is in;
    # late: once the early data, started then, is in too.
    num_bytes, late_by = 2_000_000, 0.05
    finish, latency, rate = late_pair_times(True, late_by, num_bytes)
    one_way = latency + num_bytes / rate
    assert finish[0] == pytest.approx(late_by + one_way, rel=1e-9)
    assert finish[1] == pytest.approx(late_by + 2 * one_way, rel=1e-9)
    both_ways, *_ = late_pair_times(False, late_by, num_bytes)
    assert both_ways == pytest.approx({0: late_by + one_way, 1: late_by + one_way}, rel=1e-9)


def test_peers_in_step_exchange_both_ways_at_once() -> None:
    # Within the route's latency the late rank had not yet seen the early one's "ready".
    for late_by in (0.0, 5e-5):  # the NIC route's latency is 100 us
        finish, latency, rate = late_pair_times(True, late_by, 2_000_000)
        assert finish == pytest.approx({0: late_by + latency + 2_000_000 / rate,
                                        1: late_by + latency + 2_000_000 / rate}, rel=1e-9)


def test_late_node_of_an_all_to_all_goes_first_where_gloo_sends_before_it_receives():
    # Members 0, 1 on node 0; 2, 3 on node 1, late. gloo's all-to-all posts, at turn i,
    # the send to (me + i) % 4 and then the receive from (me - i) % 4: member 2 sends to
    # 0 at turn 2 before receiving from 0 at turn 2 (its "ready" follows its data: late
    # first), but receives from 1 at turn 1 before sending to 1 at turn 3 (both ways at
    # once); member 3 sends to 0 and 1 first (turns 1, 2 against 3, 2). So node 1 -> 0
    # carries 2->0, 3->0, 3->1 and 2->1 at once, node 0 -> 1 only 1->2; then 0->2, 0->3
    # and 1->3 follow, three flows on the NIC.
    num_bytes, late_by = 1_000_000, 0.05
    finish, latency, rate = late_pair_times(True, late_by, num_bytes, ranks_per_node=2)
    first = late_by + latency + 4 * num_bytes / rate
    assert finish[0] == finish[1] == pytest.approx(first, rel=1e-6)
    assert finish[2] == finish[3] == pytest.approx(first + latency + 3 * num_bytes / rate,
                                                   rel=1e-6)


def computes_beside_a_transfer(transfer_cores: float, work_s: float, num_bytes: int,
                               computing: tuple[int, ...]) -> tuple[dict[int, float], float]:
    """When each of ``computing`` (of 4 ranks, 2 nodes of 2, one host of 2 cores) ends
    ``work_s`` of compute started at 0, while rank 0 sends rank 2 ``num_bytes`` one way;
    and the transfer's time."""
    spec = dataclasses.replace(cluster(num_nodes=2, ranks_per_node=2),
                               host=HostSpec(cores=2.0, transfer_cores=transfer_cores))
    world, simulation, topology, placement = make_world(spec)
    finish: dict[int, float] = {}

    def transfer(rank, send, receive):
        pair = world.transport(rank).new_group((0, 2))
        handle = world.transport(rank).all_to_all(VirtualBuffer(sum(send), num_bytes), send,
                                                  receive, pair)
        yield handle.event

    def compute(rank):
        yield simulation.cpu_task(rank, work_s)
        finish[rank] = simulation.now

    simulation.env.process(transfer(0, [0, 1], [0, 0]))
    simulation.env.process(transfer(2, [0, 0], [1, 0]))
    for rank in computing:
        simulation.env.process(compute(rank))
    simulation.run()
    route = topology.route(placement.tile_of(0), placement.tile_of(2))
    return finish, (topology.route_latency_us(route) * 1e-6
                    + num_bytes / (spec.nic_link.bandwidth_gbps * 1e9))


@pytest.mark.parametrize("computing", [(0, 1), (1, 3), (0, 1, 2, 3)])
def test_a_transfer_across_nodes_takes_the_hosts_transfer_cores_from_every_rank(computing):
    # While the transfer runs the host keeps 2 - 1 = 1 core: two ranks on it each run at
    # half speed, four at a quarter (half, quiet); a rank computing stretches by the
    # transfer's time x what it lost, whether it is an end of the transfer or not.
    work_s, num_bytes = 0.5, 1_000_000
    quiet, _ = computes_beside_a_transfer(0.0, work_s, num_bytes, computing)
    loaded, transfer_s = computes_beside_a_transfer(1.0, work_s, num_bytes, computing)
    speed = min(len(computing), 2.0) / len(computing)  # each rank's share, quiet
    assert quiet == pytest.approx(dict.fromkeys(computing, work_s / speed), rel=1e-9)
    assert loaded == pytest.approx(dict.fromkeys(computing, work_s / speed + transfer_s / 2),
                                   rel=1e-9)


def test_without_transfer_cores_a_transfer_leaves_compute_alone():
    work_s = 0.5
    quiet, _ = computes_beside_a_transfer(0.0, work_s, 1_000_000, (0, 1))
    assert quiet == {0: work_s, 1: work_s}
