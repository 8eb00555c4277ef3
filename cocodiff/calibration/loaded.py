"""Exchanges under load: what an exchange call costs a rank's CPU when every rank of the
host computes and exchanges at once, as a denoising step runs.

The pair sweep (:mod:`cocodiff.calibration.exchanges`) times one exchange at a time, lined
up, with the other ranks idle: right for the wire, far too cheap for the CPU. Measured on
this 2-core machine with 4 ranks under gloo (docs/changelog.md, 2026-11-23, "A cost per exchange
call"): lined up, a pair exchange costs a rank 0.2-0.3 ms of CPU; placed among the
model's real blocks as a step places it, a world all-to-all costs 0.9 ms; and TAPA's two
calls over sub-groups cost more than one world call with more messages. Much of the cost
is per *call* (the collective's set-up, handing it to the transport's threads and back,
waking a descheduled process), not per message, which is why every extra exchange the
mechanisms issue costs so much here.

So each rank runs loops of compute and exchange calls back to back, every rank at once,
for a few call shapes (the world all-to-all; disjoint pairs; TAPA's two phases when the
grid has both levels) and sizes, beside a loop of the compute alone. The compute is the
model's own forward as the runtime runs it over the stand-in transport
(:func:`model_work`), the loop's calls made at each of its exchanges, so the calls meet
the cores, the caches and the ranks' wake-ups where a step meets them (a world call of
4 ranks on 2 cores fitted 750 us of CPU among the small model's blocks, 623 us between
repeated projections: docs/changelog.md, 2026-11-25, night); without a model whose blocks
can run here, a burst of one layer's Q/K/V projection before each call
(:func:`compute_burst`). A loop's CPU less the compute's CPU is what the calls cost;
means over the loop (a step is a sum of calls, so the mean, not the median, is what it
pays), the median of several rounds (rounds interleave the loops, so a slow minute of the
machine moves every shape alike).
:func:`fit_call_cpu` fits ``calls x call_cpu_us + messages x message_cpu_us`` to them,
both at least 0, once each byte's CPU is taken out at the pair sweep's copy rate (the
loops move small messages: timing large ones across a 0.2 Gbit/s emulated link would take
minutes, and the pair sweep already prices bytes).

Under torch.distributed the world loop runs once more with the call made as diffusers'
own context parallelism makes it (:data:`DIFFUSERS_WORLD`: its ``_all_to_all_single``, a
functional collective and its wait): the ``diffusers`` baseline runs flat's plan, and its
calls cost what that loop costs beyond ours (:func:`diffusers_call_cpu_us`).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cocodiff.calibration.collect import WorldLineup, gather_floats
from cocodiff.calibration.model_shapes import LayerShapes
from cocodiff.calibration.options import ROW_BYTES, CalibrationError
from topology.spec import exchange_cpu_s

LOADED_KIB = (2, 16)
# The world loop with diffusers' exchange call in place of the transport's.
DIFFUSERS_WORLD = "world via diffusers"


@dataclass(frozen=True, slots=True)
class CallShape:
    """The exchange calls one loop iteration makes: for each call, this rank's group.

    Attributes:
        name: what the calls are (``world``, ``pairs``, ``phases``, or
            :data:`DIFFUSERS_WORLD`).
        groups: per call, the group this rank exchanges over (transport groups).
        via: who makes each call: ``transport`` (the runtime's ``all_to_all``) or
            ``diffusers`` (its Ulysses attention's exchange, torch.distributed only).
        spaced: the calls are made only at the places the step's plan computes before
            (:attr:`LoopWork.after_compute`), none straight after another.
        ahead: (spaced too) at each place but the last one more call over the first
            group is started after the shape's calls and waited for after the next
            place's, as V-First starts V's exchange, computes and makes Q's before it
            waits for V's: a call its rank is not blocked on as it completes.
    """

    name: str
    groups: tuple[Any, ...]
    via: str = "transport"
    spaced: bool = False
    ahead: bool = False

    def messages(self) -> int:
        """Messages this rank sends and receives per iteration (one per other member and
        direction of each call)."""
        return sum(2 * (group.size - 1) for group in self.groups)


@dataclass(frozen=True, slots=True)
class LoadedPoint:
    """One loop's means per iteration, the median round over ranks' means.

    Attributes:
        shape: the call shape's name.
        bytes_per_peer: bytes each call sends to every other member of its group.
        calls: exchange calls per iteration.
        messages: messages a rank sends and receives per iteration.
        bytes: bytes a rank sends and receives per iteration.
        cpu_s: process CPU per iteration beyond the compute's (mean over ranks).
        wall_s: wall time per iteration, compute included (the slowest rank).
        pieces: places per iteration where the shape's calls are made, the compute cut
            in as many pieces before them (the forward's exchanges; 1 for a burst).
        spaced: calls only at the places the step's plan computes before
            (:attr:`CallShape.spaced`; ``pieces`` counts those).
        ahead: a call started at each place but the last, waited for at the next
            (:attr:`CallShape.ahead`; ``calls`` and ``messages`` count them too).
        compute_cpu_s: process CPU per iteration outside the calls (mean over ranks): the
            compute as it runs among them; None: not timed apart.
    """

    shape: str
    bytes_per_peer: int
    calls: int
    messages: int
    bytes: int
    cpu_s: float
    wall_s: float
    pieces: int = 1
    spaced: bool = False
    ahead: bool = False
    compute_cpu_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"shape": self.shape, "bytes_per_peer": self.bytes_per_peer, "calls": self.calls,
                "messages": self.messages, "bytes": self.bytes, "cpu_s": self.cpu_s,
                "wall_s": self.wall_s, "pieces": self.pieces, "spaced": self.spaced,
                "ahead": self.ahead, "compute_cpu_s": self.compute_cpu_s}


@dataclass(frozen=True, slots=True)
class LoopWork:
    """A loop iteration's compute, which makes the loop's exchange calls at ``pieces``
    places along it.

    Attributes:
        run: runs one iteration, calling its argument at each of the places.
        pieces: how many places an iteration has.
        source: what the compute is, in words (for the calibration's record).
        piece_cpu_s: the CPU an iteration spends before each place (:func:`model_work`),
            0 at a place the step's plan reaches straight from the call before; empty:
            equal pieces.
    """

    run: Callable[[Callable[[], None]], None]
    pieces: int
    source: str
    piece_cpu_s: tuple[float, ...] = ()

    @property
    def after_compute(self) -> tuple[bool, ...]:
        """Per place, whether the plan computes before it (every place without pieces)."""
        return tuple(cpu > 0 for cpu in self.piece_cpu_s) or (True,) * self.pieces

    def spaced_run(self, calls: Callable[[], None]) -> None:
        """One iteration making ``calls`` only at the places the plan computes before."""
        flags, place = self.after_compute, [0]

        def at_place() -> None:
            if flags[place[0] % len(flags)]:
                calls()
            place[0] += 1

        self.run(at_place)


@dataclass(frozen=True, slots=True)
class CallCpuFit:
    """What an exchange costs a rank's CPU under load (``topology.HostSpec``'s terms).

    Attributes:
        call_cpu_us: CPU per exchange call, microseconds.
        message_cpu_us: CPU per message sent or received, microseconds.
        copy_gbps: GB/s one core moves (the pair sweep's, taken out before the fit); None:
            bytes cost no CPU.
        burst_cpu_s: the compute's CPU per iteration (the loops' baseline).
        burst_wall_s: the compute-only loop's wall time per iteration.
        points: the loops fitted.
        max_error: the fit's largest relative miss over the points.
        compute: what the loops computed around the calls (:attr:`LoopWork.source`).
        diffusers_call_cpu_us: CPU per exchange call made as diffusers makes it
            (:func:`diffusers_call_cpu_us`); None: not measured.
        diffusers_points: the world loops with diffusers' call (not fitted).
        piece_cpu_s: the compute's CPU before each place of the calls
            (:attr:`LoopWork.piece_cpu_s`); empty: equal pieces.
        wake_cpu_us: the part of a call's CPU a call started ahead does not spend
            (:func:`wake_cpu_from_loops`); 0: not measured.
        compute_among_calls: the compute's CPU among the calls over its CPU alone
            (:func:`compute_among_calls`), taken out of the loops before the calls are
            priced; 1: not measured.
    """

    call_cpu_us: float
    message_cpu_us: float
    copy_gbps: float | None
    burst_cpu_s: float
    burst_wall_s: float
    points: tuple[LoadedPoint, ...]
    max_error: float
    compute: str = ""
    diffusers_call_cpu_us: float | None = None
    diffusers_points: tuple[LoadedPoint, ...] = ()
    piece_cpu_s: tuple[float, ...] = ()
    wake_cpu_us: float = 0.0
    compute_among_calls: float = 1.0

    def cpu_s(self, calls: int, messages: int, num_bytes: float) -> float:
        """CPU seconds of ``calls`` calls moving ``messages`` messages of ``num_bytes``."""
        return exchange_cpu_s(calls, messages, num_bytes, call_cpu_us=self.call_cpu_us,
                              message_cpu_us=self.message_cpu_us, copy_gbps=self.copy_gbps)

    def to_json(self) -> dict[str, Any]:
        return {"call_cpu_us": self.call_cpu_us, "message_cpu_us": self.message_cpu_us,
                "copy_gbps": self.copy_gbps, "burst_cpu_s": self.burst_cpu_s,
                "burst_wall_s": self.burst_wall_s, "max_error": self.max_error,
                "compute": self.compute,
                "points": [p.to_json() for p in self.points],
                "diffusers_call_cpu_us": self.diffusers_call_cpu_us,
                "diffusers_points": [p.to_json() for p in self.diffusers_points],
                "piece_cpu_s": list(self.piece_cpu_s), "wake_cpu_us": self.wake_cpu_us,
                "compute_among_calls": self.compute_among_calls}


def shape_groups(name: str, num_nodes: int, per_node: int) -> list[list[tuple[int, ...]]]:
    """Per call of the shape ``name``, the disjoint groups that every rank's call falls in
    (node-major ranks: rank ``r`` on node ``r // per_node``)."""
    world = num_nodes * per_node
    if name == "world":
        return [[tuple(range(world))]]
    if name == "pairs":
        return [[(r, r + 1) for r in range(0, world, 2)]]
    if name == "phases":
        return [[tuple(range(n * per_node, (n + 1) * per_node)) for n in range(num_nodes)],
                [tuple(n * per_node + i for n in range(num_nodes)) for i in range(per_node)]]
    raise ValueError(f"unknown call shape {name!r}")


def shape_names(num_nodes: int, per_node: int) -> list[str]:
    """The call shapes a world of ``num_nodes x per_node`` ranks can run: the world;
    disjoint pairs (one call, fewer messages, so calls and messages can be told apart)
    when there are more than 2 ranks, evenly; TAPA's two phases (this rank's node, then the
    ranks at its place on the other nodes) when there are several nodes of several ranks."""
    world = num_nodes * per_node
    names = ["world"]
    if world % 2 == 0 and world > 2:
        names.append("pairs")
    if num_nodes > 1 and per_node > 1:
        names.append("phases")
    return names


def call_shapes(transport, node_of: Sequence[int]) -> list[CallShape]:
    """This rank's call shapes (:func:`shape_names`) over ``transport`` (collective: every
    rank makes every group, in the same order)."""
    num_nodes = max(node_of) + 1
    per_node = transport.world_size // num_nodes
    shapes = []
    for name in shape_names(num_nodes, per_node):
        if name == "world":
            shapes.append(CallShape(name, (transport.world,)))
            continue
        mine = []
        for groups in shape_groups(name, num_nodes, per_node):
            made = [transport.new_group(list(g)) for g in groups]
            mine.append(next(g for g in made if transport.rank in g.ranks))
        shapes.append(CallShape(name, tuple(mine)))
    return shapes


def predict_loop_s(topology, point: LoadedPoint, burst_cpu_s: float, num_nodes: int,
                   per_node: int, collective=None, piece_cpu_s: Sequence[float] = ()
                   ) -> float:
    """The simulator's time for one iteration of ``point``'s loop on ``topology`` (a
    calibrated one, with its ``[host]``): every rank computes the burst (its CPU seconds
    at one core) in ``point.pieces`` pieces, each followed by the shape's calls one
    after the other. The pieces are in the shares of ``piece_cpu_s`` where it has one
    per place (a place with none makes its calls straight after the place before, as a
    step's plan makes them: :func:`calls_after_compute`), else equal. What calibrate
    reports beside each loop, so a reader sees whether the host model reproduces the very
    microbenchmarks it was fitted on before trusting it on a step."""
    from cocodiff.cost import Cost, compute_seconds
    from cocodiff.plan.steps import (
        Compute,
        Exchange,
        HeadSplit,
        LayerPlan,
        Plan,
        RankProgram,
        Wait,
    )
    from cocodiff.simulator.simulate import simulate_plan

    world = num_nodes * per_node
    rows = max(1, point.bytes_per_peer // ROW_BYTES)
    # The burst's CPU seconds as FLOPs at the rate the simulator itself charges work without
    # kernels (the kernel GEMM rate where the tile has kernel rates, which calibrate writes
    # since 2026-11-27; at the tile's roofline rate there a burst was simulated 29x too
    # short and the call wait fitted to make up for it).
    seconds_per_tflop = compute_seconds(Cost(1e12, 0.0), topology.spec)
    flops = burst_cpu_s / seconds_per_tflop * 1e12
    if point.spaced:  # its calls only where compute comes before: the other pieces' CPU
        piece_cpu_s = [cpu for cpu in piece_cpu_s if cpu > 0]
    shares = ([cpu / sum(piece_cpu_s) for cpu in piece_cpu_s]
              if len(piece_cpu_s) == point.pieces and sum(piece_cpu_s) > 0
              else [1.0 / point.pieces] * point.pieces)
    tensors = ("q", "k", "v", "out")
    programs = []
    for rank in range(world):
        steps: list = []
        for call, groups in enumerate(shape_groups(point.shape, num_nodes, per_node)):
            group = next(g for g in groups if rank in g)
            splits = tuple(0 if member == rank else rows for member in group)
            tensor = tensors[call % len(tensors)]
            steps += [Exchange(tensor, group, splits, splits, ROW_BYTES, "scatter_heads"),
                      Wait(tensor)]
        layers = [list(steps) for _ in shares]
        if point.ahead:  # at each place but the last, V started after the shape's calls,
            # waited for after the next place's (loaded._AtPlace)
            group = next(g for g in shape_groups(point.shape, num_nodes, per_node)[0]
                         if rank in g)
            splits = tuple(0 if member == rank else rows for member in group)
            for place, layer_steps in enumerate(layers):
                if place > 0:
                    layer_steps.append(Wait(f"v{place - 1}"))
                if place < len(layers) - 1:
                    layer_steps.append(Exchange(f"v{place}", group, splits, splits, ROW_BYTES,
                                                "scatter_heads"))
        pieces = tuple(
            LayerPlan((Compute("mlp", Cost(flops * share, 0.0)),) if share > 0 else (),
                      tuple(layer_steps), ()) for share, layer_steps in zip(shares, layers,
                                                                           strict=True))
        programs.append(RankProgram(rank, pieces))
    plan = Plan("flat", "calibration-loop", HeadSplit(world, world, (1,) * world, 8),
                tuple(programs), shift_period=None)
    return simulate_plan(plan, topology, fold=False, collective=collective,
                         denoising_step=False).step_time_s


def compute_burst(transport, shapes: LayerShapes, dtype: str, target_s: float) -> LoopWork:
    """A step's compute between two exchanges, where the model's forward cannot run here:
    the layer's Q/K/V projection on the rank's local tokens (what precedes the first
    exchange of every layer), repeated to take about ``target_s`` of CPU, then the calls.
    Every rank repeats it the same number of times (the median of what each measured), so
    every rank brings the same work to each call."""
    import torch

    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shapes.local_tokens, shapes.hidden_size, generator=gen).to(torch_dtype)
    w = torch.randn(shapes.hidden_size, 3 * shapes.hidden_size, generator=gen).to(torch_dtype)
    x @ w  # warm-up
    cpu_s = []
    for _ in range(5):
        began = time.process_time()
        x @ w
        cpu_s.append(time.process_time() - began)
    wanted = target_s / max(statistics.median(cpu_s), 1e-7)
    repeats = max(1, round(WorldLineup(transport).agree(wanted)))

    def run(calls: Callable[[], None]) -> None:
        for _ in range(repeats):
            x @ w
        calls()

    return LoopWork(run, 1, f"{repeats} x one layer's Q/K/V projection, then the calls")


# Forwards timed for the CPU between a forward's exchanges (the median piece by piece).
PIECE_TIMINGS = 5


def model_work(forward: Callable[[], Any], standin) -> LoopWork:
    """The model's forward as the runtime runs it over ``standin`` (a
    :class:`~cocodiff.calibration.standin.StandInTransport`), the loop's calls made at
    each of its exchanges: the calls among the real blocks, as in a step. Its pieces are
    the CPU the forward spends before each exchange (what follows the last one is spent
    before the next iteration's first), where the plan the stand-in's runtime runs puts
    compute before the exchange; an exchange the plan makes straight after the one
    before (flat's K and V after Q) gets none, its bit of packing counted in the piece
    before, so that the loops are simulated with the calls a step's plan makes back to
    back (which the simulator does not make wait to be scheduled again: transports.sim)."""
    import torch

    marks: list[float] = []

    def mark() -> None:
        marks.append(time.process_time())

    def run(calls: Callable[[], None]) -> None:
        standin.on_exchange = calls
        try:
            with torch.inference_mode():
                forward()
        finally:
            standin.on_exchange = None

    run(mark)  # warm-up, counting the forward's exchanges
    places = len(marks)
    timings = []
    for _ in range(PIECE_TIMINGS):
        marks.clear()
        began = time.process_time()
        run(mark)
        ended = time.process_time()
        if len(marks) == places and places:
            bounds = [began, *marks, ended]
            cpu = [after - before for before, after in zip(bounds, bounds[1:], strict=False)]
            timings.append([cpu[0] + cpu[-1], *cpu[1:-1]])  # the tail is the next head
    pieces: tuple[float, ...] = ()
    runtime = standin.runtime
    after_compute = (calls_after_compute(runtime.plan.program(standin.rank), places)
                     if runtime is not None and runtime.plan is not None else None)
    if timings and after_compute is not None:
        medians = [statistics.median(column) for column in zip(*timings, strict=True)]
        merged: list[float] = []
        last = 0  # the place of the latest piece the plan computes
        for cpu, computed in zip(medians, after_compute, strict=True):
            if computed or not merged:
                last = len(merged)
                merged.append(cpu)
            else:
                merged[last] += cpu
                merged.append(0.0)
        pieces = tuple(merged)
    return LoopWork(run, max(1, places),
                    f"the model's forward over the stand-in transport, the calls at each "
                    f"of its {places} exchanges", pieces)


def calls_after_compute(program, places: int) -> tuple[bool, ...] | None:
    """For each of a forward's ``places`` exchange calls in order, whether ``program``
    (one rank's flat plan of a step) computes anything between the call before and this
    one; the calls past the plan's exchanges are the output's gathers, which follow the
    last layer's compute. None when the plan has more exchanges than the forward made."""
    from cocodiff.plan.steps import Compute, Exchange, Wait

    computed, flags = True, []
    for layer in program.layers:
        for step in layer.steps:
            if isinstance(step, Compute):
                computed = True
            elif isinstance(step, Exchange):
                flags.append(computed)
            elif isinstance(step, Wait):
                computed = False
    if len(flags) > places:
        return None
    return (*flags, *[True] * (places - len(flags)))


def measure_loaded(transport, shapes_of_calls: Sequence[CallShape], sizes_bytes: Sequence[int],
                   work: LoopWork, iterations: int, rounds: int
                   ) -> tuple[float, float, list[LoadedPoint]]:
    """``(compute CPU s, compute wall s, points)``: every loop on every rank at once
    (collective).

    Each round runs the compute-only loop and every (shape, size) loop once, lined up by a
    barrier; a point is the median over rounds of the ranks' mean CPU (less the
    compute-only loop's median CPU) and of the slowest rank's wall time.
    """
    import torch

    loops: list[tuple[int, CallShape | None]] = [(0, None)] + [
        (n, shape) for shape, n in itertools.product(shapes_of_calls, sizes_bytes)]
    samples: list[list[tuple[float, float]]] = [[] for _ in loops]
    for _ in range(rounds):
        round_values: list[float] = []
        for num_bytes, shape in loops:
            calls = [] if shape is None else [_call(transport, g, num_bytes, torch, shape.via)
                                              for g in shape.groups]
            make_calls = _AtPlace(calls, sum(work.after_compute),
                                  start_all_to_all(transport, shape.groups[0], num_bytes, torch)
                                  if shape is not None and shape.ahead else None)

            run = work.spaced_run if shape is not None and shape.spaced else work.run
            make_calls()  # warm-up: connections and buffers
            make_calls.settle()
            timed_calls = _CpuInCalls(make_calls)
            transport.barrier()
            cpu_began, began = time.process_time(), time.perf_counter()
            for _ in range(iterations):
                run(timed_calls)
            wall_s = time.perf_counter() - began
            cpu_s = time.process_time() - cpu_began
            round_values += [cpu_s / iterations, wall_s / iterations,
                             (cpu_s - timed_calls.cpu_s) / iterations]
        transport.barrier()
        rows = gather_floats(transport, round_values)
        for index in range(len(loops)):
            cpus = [row[3 * index] for row in rows]
            walls = [row[3 * index + 1] for row in rows]
            outside = [row[3 * index + 2] for row in rows]
            samples[index].append((statistics.mean(cpus), max(walls), statistics.mean(outside)))
    burst_cpu = statistics.median(c for c, *_ in samples[0])
    burst_wall = statistics.median(w for _, w, _ in samples[0])
    points = []
    for (num_bytes, shape), values in zip(loops[1:], samples[1:], strict=True):
        assert shape is not None
        places = sum(work.after_compute) if shape.spaced else work.pieces
        started = places - 1 if shape.ahead else 0  # the calls started ahead
        messages = places * shape.messages() + started * 2 * (shape.groups[0].size - 1)
        points.append(LoadedPoint(
            shape.name, num_bytes, places * len(shape.groups) + started, messages,
            messages * num_bytes, max(0.0, statistics.median(c for c, *_ in values) - burst_cpu),
            statistics.median(w for _, w, _ in values), places, shape.spaced, shape.ahead,
            statistics.median(o for *_, o in values)))
    return burst_cpu, burst_wall, points


class _CpuInCalls:
    """A loop's calls at a place, adding up the process CPU spent inside them (the
    rank's thread and the transport's, which do the calls' work while the rank waits)."""

    def __init__(self, calls: Callable[[], None]) -> None:
        self.calls, self.cpu_s = calls, 0.0

    def __call__(self) -> None:
        began = time.process_time()
        self.calls()
        self.cpu_s += time.process_time() - began


def compute_among_calls(points: Sequence[LoadedPoint], burst_cpu_s: float) -> float:
    """The compute's CPU among a step's calls over its CPU alone: the median over the
    loops whose calls block (a call started ahead has the transport's threads working
    during the compute) of their CPU outside the calls over the compute-only loop's. 1
    when none was timed apart. Measured on 2 x 2 ranks on 2 cores (tiny-flux, 256 px,
    2026-11-30): 1.19-1.37, the ahead loops 1.28-1.41: a rank woken from its calls finds
    its caches cold, and a flat rank's 9 calls a forward cost its blocks a quarter more
    than the same blocks timed with no calls."""
    ratios = [p.compute_cpu_s / burst_cpu_s for p in points
              if p.compute_cpu_s is not None and not p.ahead and burst_cpu_s > 0]
    return statistics.median(ratios) if ratios else 1.0


class _AtPlace:
    """What a loop does at each place of its calls: the calls, one after the other; with
    ``start_ahead``, then waits for the call it started at the place before and starts
    one more (but at the last of an iteration's ``places``), as V-First starts V's
    exchange, computes, makes Q's and waits for V's: a call its rank is not blocked on
    as it completes."""

    def __init__(self, calls: Sequence[Callable[[], None]], places: int,
                 start_ahead: Callable[[], Any] | None) -> None:
        self.calls, self.places, self.start_ahead = calls, places, start_ahead
        self.place, self.pending = 0, None

    def __call__(self) -> None:
        for call in self.calls:
            call()
        if self.start_ahead is None:
            return
        if self.pending is not None:
            self.pending.wait()
        last = self.place % self.places == self.places - 1
        self.pending = None if last else self.start_ahead()
        self.place += 1

    def settle(self) -> None:
        """Waits for a call still started ahead; the next call is an iteration's first."""
        if self.pending is not None:
            self.pending.wait()
        self.place, self.pending = 0, None


def _call(transport, group, num_bytes: int, torch, via: str = "transport"
          ) -> Callable[[], None]:
    """One all-to-all over ``group`` sending ``num_bytes`` to every other member, made by
    the transport or, ``via="diffusers"``, as diffusers' Ulysses attention makes it (even
    splits: a block to itself too, a local copy of a few KiB)."""
    rows = max(1, num_bytes // ROW_BYTES)
    if via == "diffusers":
        import torch.distributed as dist
        from diffusers.models.attention_dispatch import _all_to_all_single

        blocks = torch.empty((group.size * rows, ROW_BYTES), dtype=torch.uint8)
        process_group = group.handle if group.handle is not None else dist.group.WORLD
        return lambda: _all_to_all_single(blocks, process_group)
    start = start_all_to_all(transport, group, num_bytes, torch)
    return lambda: start().wait()


def start_all_to_all(transport, group, num_bytes: int, torch) -> Callable[[], Any]:
    """Starts one transport all-to-all over ``group`` sending ``num_bytes`` to every other
    member; returns its handle."""
    rows = max(1, num_bytes // ROW_BYTES)
    me = group.group_rank(transport.rank)
    splits = [0 if member == me else rows for member in range(group.size)]
    send = torch.empty((sum(splits), ROW_BYTES), dtype=torch.uint8)
    return lambda: transport.all_to_all(send, splits, splits, group)


BUSY_POLL_NOTE = ("CPU not priced: waits spin, the spinning is the calls' cost; the loops are "
                  "timed for the wait per call on busy cores")


def unpriced_loops(points: Sequence[LoadedPoint], burst_cpu_s: float, burst_wall_s: float,
                   compute: str, piece_cpu_s: tuple[float, ...] = (),
                   among_calls: float = 1.0) -> CallCpuFit:
    """The loops of a busy-polling transport: no CPU per call or message (its waiting
    rank spins, and the host model charges that spinning, not a price), the points kept
    so that the wait per call is fitted on them and the host model checked against them
    as for any transport (``max_error`` 0: nothing was fitted)."""
    return CallCpuFit(0.0, 0.0, None, burst_cpu_s, burst_wall_s, tuple(points), 0.0, compute,
                      piece_cpu_s=piece_cpu_s, compute_among_calls=among_calls)


def diffusers_call_cpu_us(points: Sequence[LoadedPoint], call_cpu_us: float) -> float | None:
    """CPU per exchange call made as diffusers makes it: ``call_cpu_us`` (the transport's
    call, fitted) plus what the :data:`DIFFUSERS_WORLD` loop costs per call beyond the
    ``world`` loop of the same size (the same compute, calls, messages and bytes: only
    the function making the call differs), the median over sizes, at least 0. None
    without such a pair of loops."""
    world = {p.bytes_per_peer: p for p in points if p.shape == "world"}
    extra_us = [(p.cpu_s - world[p.bytes_per_peer].cpu_s) / p.calls * 1e6 for p in points
                if p.shape == DIFFUSERS_WORLD and p.bytes_per_peer in world]
    if not extra_us:
        return None
    return max(0.0, call_cpu_us + statistics.median(extra_us))


def wake_cpu_from_loops(points: Sequence[LoadedPoint], fit: CallCpuFit) -> float:
    """The part of ``fit``'s call price (``call_cpu_us``) that a call started ahead and
    done before its rank waits for it does not spend: its price less what the ``ahead``
    loop costs beyond the spaced loop of the same size (the same compute, places and
    blocking calls, and a call started at each place but the last, waited for at the
    next), the median over sizes, between 0 and ``call_cpu_us``. A blocking call puts its
    rank to sleep and the transport's thread wakes it; a call done before its rank waits
    for it does neither (``bench/call_ahead.py`` times flat's calls and V-First's one by
    one: under gloo V started ahead costs less CPU than made after K's and does not
    wait, and the simulator, which charged both the same, predicted V-First's 5-9% gain
    over flat as a 1% loss). 0 without such a pair of loops."""
    spaced = {p.bytes_per_peer: p for p in points if p.spaced and not p.ahead
              and p.shape == "world"}
    saved_us = []
    for point in points:
        blocking = spaced.get(point.bytes_per_peer)
        started = point.calls - blocking.calls if blocking is not None else 0
        if not point.ahead or started <= 0:
            continue
        cpu_us = (point.cpu_s - blocking.cpu_s) / started * 1e6
        price_us = fit.cpu_s(1, (point.messages - blocking.messages) // started,
                             (point.bytes - blocking.bytes) / started) * 1e6
        saved_us.append(price_us - cpu_us)
    if not saved_us:
        return 0.0
    return min(fit.call_cpu_us, max(0.0, statistics.median(saved_us)))


def fit_call_cpu(points: Sequence[LoadedPoint], copy_gbps: float | None,
                 burst_cpu_s: float = 0.0, burst_wall_s: float = 0.0,
                 compute: str = "", piece_cpu_s: tuple[float, ...] = (),
                 among_calls: float = 1.0) -> CallCpuFit:
    """Fit ``cpu - bytes / copy_gbps = calls x c + messages x m`` (both >= 0) to ``points``,
    least squares on relative error (cheap and costly loops count alike), ``cpu`` being a
    loop's CPU beyond its compute's as it runs among the calls (``among_calls`` times
    ``burst_cpu_s``: :func:`compute_among_calls`), so that the simulator, charging the
    compute at that factor, charges the calls only what is theirs.

    The non-negative solution is the best of the least-squares fits over the subsets of
    the two terms whose coefficients come out >= 0 (three subsets, no solver needed). With
    one call shape only (calls and messages in a fixed ratio) the terms cannot be told
    apart, and the fit gives it all to the call.

    Raises:
        CalibrationError: fewer than two points, or none costs CPU beyond its bytes.
    """
    import numpy as np

    compute_extra_s = burst_cpu_s * (among_calls - 1.0)

    def beyond_bytes(point: LoadedPoint) -> float:
        return point.cpu_s - compute_extra_s - (
            0.0 if copy_gbps is None else point.bytes / (copy_gbps * 1e9))

    # A loop with calls started ahead spends less than their price (wake_cpu_us): not fitted.
    usable = [p for p in points if not p.ahead and beyond_bytes(p) > 0]
    if len(usable) < 2:
        raise CalibrationError(f"need at least two loaded exchange loops that cost CPU, got "
                               f"{len(usable)}")
    columns = np.array([[p.calls, p.messages] for p in usable], dtype=float)
    target = np.array([beyond_bytes(p) for p in usable])
    weights = 1.0 / target
    best: tuple[float, np.ndarray] | None = None
    separable = np.linalg.matrix_rank(columns) == 2
    for size in (2, 1) if separable else (1,):
        for subset in itertools.combinations(range(2), size) if separable else [(0,)]:
            a = columns[:, subset] * weights[:, None]
            solution, *_ = np.linalg.lstsq(a, target * weights, rcond=None)
            if (solution < 0).any():
                continue
            coefficients = np.zeros(2)
            coefficients[list(subset)] = solution
            residual = float(np.sum(((columns @ coefficients) - target) ** 2 * weights ** 2))
            if best is None or residual < best[0]:
                best = (residual, coefficients)
    assert best is not None  # one term alone with a positive target always fits >= 0
    call_s, message_s = (float(c) for c in best[1])
    fitted = columns @ best[1]
    max_error = float(np.max(np.abs(fitted / target - 1.0)))
    return CallCpuFit(call_s * 1e6, message_s * 1e6, copy_gbps, burst_cpu_s, burst_wall_s,
                      tuple(points), max_error, compute, piece_cpu_s=piece_cpu_s,
                      compute_among_calls=among_calls)
