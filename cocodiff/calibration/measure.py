"""The whole calibration on every rank of a transport's world (collective): compute,
real blocks, link tiers and each exchange's CPU, the host, world all-to-alls."""

from __future__ import annotations

import dataclasses
import itertools
import os
import socket
import statistics
import time
import zlib

from cocodiff.calibration import neighbours
from cocodiff.calibration.blocks import measure_blocks, model_standin
from cocodiff.calibration.codec import measure_codec_cpu_s
from cocodiff.calibration.collect import WorldLineup, gather_floats, share_fit
from cocodiff.calibration.compute import ComputeRates, measure_compute
from cocodiff.calibration.exchanges import (
    measure_exchanges,
    measure_exchanges_cpu,
    measure_wait_spin,
    predict_all_to_all,
)
from cocodiff.calibration.fits import CpuFit, LinkFit, fit_exchange_cpu, wire_points
from cocodiff.calibration.inflight import measure_transfer_load, transfer_bytes
from cocodiff.calibration.kernel_bench import measure_kernel_rates
from cocodiff.calibration.lateness import late_peer_sizes, measure_late_peer
from cocodiff.calibration.loaded import (
    BUSY_POLL_NOTE,
    DIFFUSERS_WORLD,
    LOADED_KIB,
    CallCpuFit,
    CallShape,
    call_shapes,
    compute_among_calls,
    compute_burst,
    diffusers_call_cpu_us,
    fit_call_cpu,
    measure_loaded,
    model_work,
    unpriced_loops,
    wake_cpu_from_loops,
)
from cocodiff.calibration.model_shapes import LayerShapes, layer_shapes
from cocodiff.calibration.options import (
    ALL_TO_ALL_KIB,
    DEFAULT_SIZES_KIB,
    QUICK_ALL_TO_ALL_KIB,
    QUICK_SIZES_KIB,
    CalibrateOptions,
    CalibrationError,
)
from cocodiff.calibration.patterns import measure_patterns, pattern_sizes
from cocodiff.calibration.result import UNCONSTRAINED_FACTOR, Calibration, HostMeasurement
from cocodiff.calibration.routing import measure_phase_cpu_s
from cocodiff.runtime.nodes import detect_nodes, node_major_shape
from cocodiff.schedules import DTYPE_BYTES
from topology.presets import machine_cores


def calibrate(transport, options: CalibrateOptions) -> Calibration:
    """Run every measurement on every rank of ``transport``'s world (collective)."""
    began = time.perf_counter()
    load_began = _load_average()
    cpu_began = neighbours.snapshot()  # what other processes do with the cores meanwhile
    world = transport.world_size
    rank = transport.rank
    node_of = detect_nodes(transport)
    detected = max(node_of) + 1
    if detected > 1:
        num_nodes, ranks_per_node = node_major_shape(node_of)
        if options.nodes is not None and options.nodes != num_nodes:
            raise CalibrationError(
                f"--nodes {options.nodes} but the ranks sit on {num_nodes} nodes"
            )
    else:
        num_nodes = options.nodes or 1
        if world % num_nodes:
            raise CalibrationError(f"{world} ranks do not split into {num_nodes} nodes")
        ranks_per_node = world // num_nodes
        node_of = [r // ranks_per_node for r in range(world)]
    if ranks_per_node < 2 and num_nodes < 2:
        raise CalibrationError("calibration needs at least 2 ranks")

    shapes = layer_shapes(options.model, options.tokens, options.resolution, world)
    speed_began = _reference_cpu_s(transport)
    # Compute is timed where a run computes (the rank's accelerator, else the CPU).
    from transports.launch import detect_launch
    from transports.torch_dist import rank_device

    device = rank_device(transport, detect_launch().local_rank)
    flops, memory, op_seconds = measure_compute(shapes, options.dtype,
                                                0.02 if options.quick else 0.05,
                                                WorldLineup(transport), 3 if options.quick else 5,
                                                device)
    rates = gather_floats(transport, [flops / 1e12, memory / 1e9])
    compute = ComputeRates(
        tflops=statistics.median(r[0] for r in rates),
        memory_gbps=statistics.median(r[1] for r in rates),
        per_rank_tflops=tuple(r[0] for r in rates),
        per_rank_memory_gbps=tuple(r[1] for r in rates),
        op_seconds=op_seconds if rank == 0 else {},
    )
    compute = dataclasses.replace(compute, block=measure_blocks(transport, options, compute,
                                                                 world, device))
    # The kernel model's classes on the same device, its rates from them alone.
    kernels = measure_kernel_rates(transport, options, shapes, device, compute.block)

    sizes, larger = sweep_sizes(options, shapes, num_nodes, ranks_per_node)
    # Medians over this many: two calibrations one after the other must agree (5 let one
    # burst of a neighbour's work move a size's median).
    repeats = 5 if options.quick else 9
    # Every group is made by every rank, in the same order (group creation is collective).
    intra_pair = (0, 1) if ranks_per_node > 1 else None
    inter_pair = (0, ranks_per_node) if num_nodes > 1 else None
    pairs = {name: transport.new_group(list(p))
             for name, p in (("intra", intra_pair), ("inter", inter_pair)) if p is not None}
    fits: dict[str, LinkFit] = {}
    wires: dict[str, LinkFit] = {}
    cpu: CpuFit | None = None
    for name, group in pairs.items():
        if name == "inter" and options.inter_gbps is not None:
            continue
        transport.barrier()
        points, swept = _sweep(transport, group, sizes, larger, repeats)
        transport.barrier()
        source = "measured" if detected > 1 or name == "intra" else "measured on loopback"
        walls = [(n, wall_s) for n, wall_s, _ in points]
        fits[name] = share_fit(transport, group.ranks[0], walls, source)
        # Both members' CPU per size, averaged: each sends and receives one message.
        cpu_by_rank = gather_floats(transport, [c for _, _, c in points] if points
                                    else [0.0] * swept)
        pair_cpu = fit_exchange_cpu([
            (2, 2 * n, statistics.mean(cpu_by_rank[r][i] for r in group.ranks), wall_s)
            for i, (n, wall_s) in enumerate(fits[name].points)])
        if cpu is None:  # the first tier measured (intra when there is one) prices the CPU
            spin = measure_wait_spin(transport, group) if rank in group.ranks else 0.0
            shared_spin = gather_floats(transport, [spin])[group.ranks[0]][0]
            cpu = dataclasses.replace(pair_cpu, wait_spin=shared_spin)
        # What is left for the links once the CPU is charged on the host (nothing is left
        # to take when waits spin: the spinning is the CPU cost, charged as a busy-poll).
        wires[name] = fits[name] if cpu.busy_poll else _wire_fit(
            transport, group.ranks[0], fits[name], wire_points(walls, cpu, 2) if walls else [],
            source)
    if options.inter_gbps is not None:
        fits["inter"] = LinkFit(options.inter_latency_us, options.inter_gbps, source="given")
        wires["inter"] = fits["inter"]
    for table in (fits, wires):
        if "intra" not in table:  # one rank per node: nothing shares a node, the tier is unused
            table["intra"] = dataclasses.replace(table["inter"], source="unused (1 rank per node)")
        if "inter" not in table:  # one node: the tier is unused
            table["inter"] = dataclasses.replace(table["intra"], source="unused (1 node)")

    # Whether a late member's data goes first (gloo's rendezvous), on the slowest pair.
    slowest = "inter" if "inter" in pairs else "intra"
    late_peer = measure_late_peer(transport, pairs[slowest],
                                  *late_peer_sizes(fits[slowest], options.max_kib),
                                  3 if options.quick else 7)
    loaded, loaded_note = _loaded_cpu(transport, options, shapes, node_of, cpu, compute)
    codec_cpu_s = measure_codec_cpu_s(transport, shapes, options.dtype)
    host = _host_of_ranks(transport, cpu, loaded, loaded_note)
    # How many of the host's cores a transfer across nodes takes from the ranks' compute
    # (CPU ranks, two nodes at least: the slowest pair is then across them).
    transfer_load = measure_transfer_load(
        transport, pairs[slowest], shapes,
        transfer_bytes(fits[slowest].bandwidth_gbps, options.max_kib), host.cores,
        host.ranks_per_host or transport.world_size, 5 if options.quick else 9,
    ) if slowest == "inter" and device.type == "cpu" else None
    phase_cpu_s = measure_phase_cpu_s(transport, options.model, options.tokens,
                                      options.resolution, options.dtype, num_nodes,
                                      ranks_per_node, host.spec())

    all_to_all = []
    a2a_sizes = QUICK_ALL_TO_ALL_KIB if options.quick else ALL_TO_ALL_KIB
    for kib in a2a_sizes:
        if kib > options.max_kib:
            continue
        ((num_bytes, seconds),) = measure_exchanges(transport, transport.world, [kib * 1024],
                                                    repeats)
        slowest = max(r[0] for r in gather_floats(transport, [seconds]))
        predicted = predict_all_to_all(num_bytes, num_nodes, ranks_per_node,
                                       fits["intra"], fits["inter"])
        all_to_all.append({"bytes_per_peer": num_bytes, "measured_s": slowest,
                           "link_model_s": predicted,
                           "error": (predicted - slowest) / slowest})
    # A step's exchanges as the schedules issue them, over the link measured (a given link
    # is not the one these would cross).
    patterns = [] if options.inter_gbps is not None else measure_patterns(
        transport, num_nodes, ranks_per_node,
        pattern_sizes(step_exchange_bytes(shapes, world, options.dtype), world,
                      options.max_kib),
        rounds=3 if options.quick else 5, repeats=2 if options.quick else 3)
    return Calibration(num_nodes, ranks_per_node, detected, transport.name, options.dtype, shapes,
                       compute, fits["intra"], fits["inter"], all_to_all,
                       time.perf_counter() - began,
                       host=dataclasses.replace(
                           host,
                           codec_cpu_us=codec_cpu_s * 1e6, phase_cpu_us=phase_cpu_s * 1e6,
                           late_peer=late_peer, transfer_load=transfer_load,
                           compute_core_demand=1.0 if device.type == "cpu" else 0.0),
                       intra_wire=wires["intra"], inter_wire=wires["inter"],
                       load_average=(load_began, _load_average()),
                       foreign_share=neighbours.foreign_share(transport, cpu_began),
                       reference_cpu_s=(speed_began, _reference_cpu_s(transport)),
                       patterns=patterns, kernels=kernels)


# A flat layer makes this many exchange calls (Q, K, V in, the attention's output back).
EXCHANGES_PER_LAYER = 4


def _compute_per_exchange_s(compute: ComputeRates) -> float:
    """The CPU a rank computes between two exchanges of a step, roughly: one layer's
    seconds (the real blocks' when timed, else the matrix products') over the exchanges a
    flat layer makes. The loaded loops put that much compute before each call, so their
    calls meet the cores as busy as a step's do."""
    block = compute.block or {}
    layer_s = block.get("layer_s") or block.get("matmul_rate_layer_s") or sum(
        compute.op_seconds.values())
    return layer_s / EXCHANGES_PER_LAYER


# The CPU a rank computes in one loaded loop, when the compute is the model's forward.
LOOP_CPU_S = 0.1


def model_loop_iterations(lineup: WorldLineup, forward_s: float, most: int) -> int:
    """Forwards per loaded loop: about LOOP_CPU_S of compute per rank (an enlarged model's
    forward takes tens of ms), at least 3, at most ``most``. Every rank must loop as many
    times, the calls being collective (a rank whose own forward was a little faster made
    more calls, and gloo aborted on the mismatch): the ranks' median of what each wants."""
    wanted = lineup.agree(LOOP_CPU_S / max(forward_s, 1e-6))
    return max(3, min(most, round(wanted)))


def _loaded_cpu(transport, options: CalibrateOptions, shapes, node_of: list[int],
                cpu: CpuFit | None, compute: ComputeRates) -> tuple[CallCpuFit | None, str]:
    """What exchange calls cost a rank's CPU with every rank computing and exchanging
    (:mod:`cocodiff.calibration.loaded`), and a note of why not when it is not measured:
    without a pair sweep there is no copy rate to take out. A spinning transport's loops
    are timed but not priced (:func:`~cocodiff.calibration.loaded.unpriced_loops`): its
    cost is its spinning (the host model's busy-poll)."""
    if cpu is None:
        return None, "not measured: no pair exchange was timed"
    sizes = [kib * 1024 for kib in LOADED_KIB if kib <= options.max_kib]
    iterations = 10 if options.quick else 20
    standin = (model_standin(options, transport.world_size, transport.rank)
               if compute.block else None)
    if standin is not None:
        work = model_work(*standin)
        forward_s = compute.block["rank0"]["blocks_s"] + compute.block["rank0"][
            "outside_blocks_s"]
        iterations = model_loop_iterations(WorldLineup(transport), forward_s, iterations)
    else:
        work = compute_burst(transport, shapes, options.dtype, _compute_per_exchange_s(compute))
    shapes_of_calls = call_shapes(transport, node_of)
    if not all(work.after_compute):
        # The world's calls only where the step's plan computes first: the wait of a call
        # made after compute apart from that of one made straight after another
        # (result.Loops.fitted_waits_us).
        shapes_of_calls.append(CallShape("world", (transport.world,), spaced=True))
        # And with one more call started at each place, waited for at the next, as
        # V-First makes V's: what a call its rank is not blocked on saves of its CPU
        # (loaded.wake_cpu_from_loops).
        shapes_of_calls.append(CallShape("world", (transport.world,), spaced=True,
                                         ahead=True))
    if transport.name == "torch":  # the diffusers baseline runs over torch.distributed only
        shapes_of_calls.append(CallShape(DIFFUSERS_WORLD, (transport.world,), via="diffusers"))
    burst_cpu, burst_wall, points = measure_loaded(
        transport, shapes_of_calls, sizes, work, iterations, rounds=3)
    ours = [p for p in points if p.shape != DIFFUSERS_WORLD]
    among_calls = compute_among_calls(ours, burst_cpu)
    if cpu.busy_poll:
        # Waits spin: the spinning is the calls' CPU (the host model's busy_poll), so no
        # CPU price is fitted; the loops still give the wait per call on busy cores
        # (`call_wait_us`, fitted on them by write_outputs) and check the host model on
        # a step-like load. Without them, 4 MPICH ranks on 2 cores were simulated 27-38%
        # short on these very loops, as short as on tiny-flux's steps (issue 38).
        return (unpriced_loops(ours, burst_cpu, burst_wall, work.source, work.piece_cpu_s,
                               among_calls), BUSY_POLL_NOTE)
    try:
        fit = fit_call_cpu(ours, cpu.copy_gbps, burst_cpu, burst_wall, work.source,
                           work.piece_cpu_s, among_calls)
    except CalibrationError as exc:
        return None, f"not fitted: {exc}"
    return dataclasses.replace(
        fit, diffusers_call_cpu_us=diffusers_call_cpu_us(points, fit.call_cpu_us),
        diffusers_points=tuple(p for p in points if p.shape == DIFFUSERS_WORLD),
        wake_cpu_us=wake_cpu_from_loops(ours, fit)), ""


# The reference work: this many products of two 128 x 128 float32 matrices (a few ms).
REFERENCE_PRODUCTS = 200


# The pair sweep spans the messages a step of the model sends, this many times over, and at
# least SWEEP_FLOOR_KIB; past that, it goes on while the largest message takes less than
# RATE_SHOWS x the smallest's time (the link's rate hidden under its start-up).
SWEEP_MARGIN = 4
SWEEP_FLOOR_KIB = 256
RATE_SHOWS = 8.0
# A pair exchange's wall time, for its link: the fastest quarter of the repeats, not the
# median. A lone pair under gloo runs some exchanges one direction after the other (twice
# the time) at every size from 64 KiB up, a varying share of them: at 0.2 Gbit/s the
# median of 9 fitted 0.16-0.18 Gbit/s in one run of the benchmark and 0.10 in the next,
# on the same configurations. The fast exchanges are the link (a raw TCP connection
# carries both directions at 98% of its rate: `python -m bench.cluster selftest`); a
# world all-to-all keeps it busy with other pairs' flows.
LINK_QUANTILE = 0.25


def largest_step_message(shapes: LayerShapes, num_nodes: int, ranks_per_node: int,
                         dtype: str) -> int:
    """Bytes of the largest message a step of the model sends one peer: a flat exchange's
    block (a rank's tokens x a peer's heads), as many blocks as a TAPA phase gathers for
    one peer (the larger level's ranks)."""
    block = shapes.local_tokens * shapes.local_heads * shapes.head_dim * DTYPE_BYTES[dtype]
    return block * max(num_nodes, ranks_per_node)


def step_exchange_bytes(shapes: LayerShapes, world: int, dtype: str) -> int:
    """Bytes a rank holds in one of a step's flat exchanges (a block for every rank,
    itself included)."""
    return shapes.local_tokens * shapes.local_heads * shapes.head_dim * DTYPE_BYTES[
        dtype] * world


def sweep_sizes(options: CalibrateOptions, shapes: LayerShapes, num_nodes: int,
                ranks_per_node: int) -> tuple[list[int], list[int]]:
    """``(sizes, larger)``: the pair sweep's message sizes, the standard ones up to
    ``--max-kib`` and up to :data:`SWEEP_MARGIN` x the model's largest step message (at
    least :data:`SWEEP_FLOOR_KIB`); and the larger standard ones (up to ``--max-kib``),
    swept one by one only until the link's rate shows (:func:`_sweep`).

    Why a cap from the model: the link is fitted as start-up + bytes / rate, one line over
    the sizes swept, and a line holds over a range. Under gloo, a pair's exchange of
    1-4 MiB each way runs at times one direction after the other (0.2 Gbit/s link, 1 MiB:
    44 or 86 ms, alternating run to run; 4 MiB: 181 or 350 ms), which pulled the fitted
    rate to 0.108-0.14 Gbit/s where the 16-256 KiB messages of the models measured moved at
    0.19 (docs/changelog.md, 2026-11-25). Why go on past it: on a fast link, messages of
    256 KiB are mostly start-up (0.5 ms against 0.3 at 5 Gbit/s), and a line through them
    gave rates of 10-140 Gbit/s for a 5 Gbit/s link."""
    cap_kib = max(SWEEP_FLOOR_KIB, SWEEP_MARGIN * largest_step_message(
        shapes, num_nodes, ranks_per_node, options.dtype) / 1024)
    standard = [kib for kib in (QUICK_SIZES_KIB if options.quick else DEFAULT_SIZES_KIB)
                if kib <= options.max_kib]
    return ([kib * 1024 for kib in standard if kib <= cap_kib],
            [kib * 1024 for kib in standard if kib > cap_kib])


def _sweep(transport, group, sizes: list[int], larger: list[int], repeats: int
           ) -> tuple[list[tuple[int, float, float]], int]:
    """The pair exchanges of ``group`` at ``sizes``, then at each of ``larger`` in turn
    until the largest message takes :data:`RATE_SHOWS` x the smallest's time (collective:
    the group's first member's times decide for every rank): ``(points, sizes swept)``,
    the points on members ([] on the others), the count on every rank."""
    member = transport.rank in group.ranks
    points = (measure_exchanges_cpu(transport, group, sizes, repeats, LINK_QUANTILE)
              if member else [])
    swept = len(sizes)
    for num_bytes in larger:
        first_last = [points[0][1], points[-1][1]] if member else [0.0, 0.0]
        smallest, largest = gather_floats(transport, first_last)[group.ranks[0]]
        if largest >= RATE_SHOWS * smallest:
            break
        if member:
            points += measure_exchanges_cpu(transport, group, [num_bytes], repeats,
                                            LINK_QUANTILE)
        swept += 1
    return points, swept


def _reference_cpu_s(transport) -> float:
    """CPU seconds of a fixed piece of work, every rank at once, the median over ranks
    (collective). Timed at a calibration's start and end: on a machine whose speed drifts
    (a virtual machine measured here ran the same step 1.6x slower within an hour, with
    nothing else running and no steal time shown), the two disagree, and every rate the
    calibration measured in between is that moment's."""
    import torch

    a = torch.ones(128, 128)
    for _ in range(REFERENCE_PRODUCTS // 10):  # warm-up: the first products set up kernels
        a @ a
    lineup = WorldLineup(transport)
    lineup.barrier()
    began = time.process_time()
    for _ in range(REFERENCE_PRODUCTS):
        a @ a
    return lineup.agree(time.process_time() - began)


def _load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def _host_of_ranks(transport, cpu: CpuFit | None, loaded: CallCpuFit | None = None,
                   loaded_note: str = "") -> HostMeasurement:
    """Which ranks share a host (by host name: an emulated cluster's namespaces share this
    machine's cores) and how many cores it has (the fewest any rank may run on)."""
    name = socket.gethostname().encode()
    rows = gather_floats(transport, [float(zlib.crc32(name)), float(machine_cores())])
    hosts = [row[0] for row in rows]
    sizes = [len(list(run)) for _, run in itertools.groupby(hosts)]
    if len(set(hosts)) == 1:
        ranks_per_host = None  # every rank on this one machine
    elif len(set(sizes)) == 1 and len(sizes) == len(set(hosts)):
        ranks_per_host = sizes[0]
    else:
        raise CalibrationError(
            f"ranks sit on hosts of {sizes} consecutive ranks: the host model needs the same "
            "number of consecutive ranks on every host")
    return HostMeasurement(min(row[1] for row in rows), ranks_per_host, cpu, loaded, loaded_note)


def _wire_fit(transport, owner: int, wall: LinkFit, points: list[tuple[int, float]],
              source: str) -> LinkFit:
    """What a tier's link keeps once the host pays each exchange's CPU. When the CPU
    explains the wall time at every size (what is left does not grow with the size), the
    wire never limits the exchange: it gets :data:`UNCONSTRAINED_FACTOR` x the wall-clock
    rate and no start-up, rather than a failed calibration. Every rank fits the same
    shared points, so every rank takes the same branch."""
    try:
        return share_fit(transport, owner, points, source + ", less its CPU")
    except CalibrationError:
        return LinkFit(0.0, UNCONSTRAINED_FACTOR * wall.bandwidth_gbps, wall.points,
                       source=source + ", all of it CPU: the wire never limits")
