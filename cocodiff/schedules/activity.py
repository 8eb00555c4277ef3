"""V-Major activity traces: which V blocks each rank actually sent over the slow tier,
step by step and layer by layer, so that a real run's selection can be replayed in the
simulator.

The JSON format (``cocodiff-activity/1``)::

    {
      "format": "cocodiff-activity/1",
      "num_ranks": 24,            # ranks of the run
      "num_layers": 57,           # attention layers per step
      "blocks_per_rank": 96,      # V blocks one rank could send per layer on the slow tier
                                  # (or a list, one count per rank, when they differ)
      "steps": [                  # one entry per denoising step, in order
        {"step": 0,
         "sent": [[[0, 1, 5], ...],   # sent[rank][layer] = the block indices sent
                  ...]}
      ]
    }

A rank that sent every block may write ``null`` instead of the full list.
``cocodiff run --schedule cocodiff --record-activity PATH`` records one; block indices
count the rank's slow-tier messages of a layer in the order it sends them (forward
call, chunk, group member), each message's blocks in order
(:mod:`cocodiff.runtime.vmajor`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cocodiff.util.errors import ScheduleError

FORMAT = "cocodiff-activity/1"


@dataclass(frozen=True, slots=True)
class ActivityTrace:
    """Sent V blocks: ``sent[step][rank][layer]`` is a tuple of block indices, or None
    for all of them; ``blocks_per_rank`` one count for every rank, or one per rank."""

    num_ranks: int
    num_layers: int
    blocks_per_rank: int | tuple[int, ...]
    sent: tuple[tuple[tuple[tuple[int, ...] | None, ...], ...], ...]

    @property
    def num_steps(self) -> int:
        return len(self.sent)

    def blocks_of(self, rank: int) -> int:
        blocks = self.blocks_per_rank
        return blocks if isinstance(blocks, int) else blocks[rank]

    def sent_fraction(self, step: int, rank: int, layer: int) -> float:
        blocks = self.sent[step][rank][layer]
        return 1.0 if blocks is None else len(blocks) / self.blocks_of(rank)

    def check_matches(self, num_ranks: int, num_layers: int) -> None:
        """Raises ScheduleError unless the trace was recorded for this many ranks and layers."""
        if (self.num_ranks, self.num_layers) != (num_ranks, num_layers):
            raise ScheduleError(
                f"activity trace is for {self.num_ranks} ranks x {self.num_layers} layers, "
                f"the plan has {num_ranks} ranks x {num_layers} layers"
            )

    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT,
            "num_ranks": self.num_ranks,
            "num_layers": self.num_layers,
            "blocks_per_rank": (self.blocks_per_rank if isinstance(self.blocks_per_rank, int)
                                else list(self.blocks_per_rank)),
            "steps": [
                {"step": index, "sent": [[None if b is None else list(b) for b in ranks]
                                         for ranks in step]}
                for index, step in enumerate(self.sent)
            ],
        })


def load_activity(path: str | Path) -> ActivityTrace:
    """Read and validate a trace file; every problem is one ScheduleError line."""
    from cocodiff.util.jsonfile import read_json

    return parse_activity(read_json(path, "activity trace", ScheduleError), str(path))


def parse_activity(data: object, where: str = "activity trace") -> ActivityTrace:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ScheduleError(f"{where}: not a {FORMAT} trace (no matching \"format\" key)")
    sizes = []
    for key in ("num_ranks", "num_layers"):
        value = data.get(key)
        if not _positive_int(value):
            raise ScheduleError(f"{where}: {key} must be a positive integer, got {value!r}")
        sizes.append(value)
    num_ranks, num_layers = sizes
    blocks = data.get("blocks_per_rank")
    if isinstance(blocks, list) and len(blocks) == num_ranks and all(map(_positive_int, blocks)):
        blocks = tuple(blocks)
    elif not _positive_int(blocks):
        raise ScheduleError(f"{where}: blocks_per_rank must be a positive integer or a list of "
                            f"{num_ranks}, got {_short(blocks)}")
    steps = data.get("steps")
    if not isinstance(steps, list) or not steps:
        raise ScheduleError(f"{where}: \"steps\" must be a non-empty list")
    sent = []
    for index, step in enumerate(steps):
        ranks = step.get("sent") if isinstance(step, dict) else None
        if not isinstance(ranks, list) or len(ranks) != num_ranks:
            raise ScheduleError(f"{where}: step {index} must list {num_ranks} ranks")
        sent.append(tuple(
            _rank_layers(layers, num_layers, blocks if isinstance(blocks, int) else blocks[rank],
                         where, index, rank)
            for rank, layers in enumerate(ranks)))
    return ActivityTrace(num_ranks, num_layers, blocks, tuple(sent))


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _rank_layers(layers: object, num_layers: int, blocks: int, where: str, step: int,
                 rank: int) -> tuple[tuple[int, ...] | None, ...]:
    if not isinstance(layers, list) or len(layers) != num_layers:
        raise ScheduleError(f"{where}: step {step} rank {rank} must list {num_layers} layers")
    out = []
    for layer, sent in enumerate(layers):
        if sent is None:
            out.append(None)
            continue
        if not isinstance(sent, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b < blocks for b in sent
        ) or len(set(sent)) != len(sent):
            raise ScheduleError(f"{where}: step {step} rank {rank} layer {layer}: blocks must "
                                f"be distinct integers in [0, {blocks})")
        out.append(tuple(sent))
    return tuple(out)


def plan_from_activity(spec, grid, stream_tokens: Sequence[int], trace: ActivityTrace,
                       step: int, options=None):
    """The ``cocodiff`` plan of ``step`` with each rank's and layer's V-Major fraction
    taken from the trace instead of the ratio schedule (``options``: a
    :class:`~cocodiff.schedules.options.PlanOptions`; its V-Major slow levels apply)."""
    from cocodiff.plan.steps import Plan, RankProgram
    from cocodiff.schedules.flat import plan_phased
    from cocodiff.schedules.options import DEFAULT_OPTIONS
    from cocodiff.schedules.vmajor import VMajorOptions

    options = options or DEFAULT_OPTIONS
    slow_levels = (options.vmajor or VMajorOptions()).slow_levels

    trace.check_matches(grid.num_ranks, spec.num_layers)
    if not 0 <= step < trace.num_steps:
        raise ScheduleError(f"activity trace has {trace.num_steps} steps, asked for step {step}")
    cache: dict[float, object] = {}

    def plan_at(fraction: float):
        key = round(fraction, 6)
        if key not in cache:
            cache[key] = plan_phased(
                "cocodiff", spec, grid, stream_tokens, options, v_first=True,
                sent_fraction={"v": {level: fraction for level in slow_levels}},
            )
        return cache[key]

    programs = []
    for rank in range(grid.num_ranks):
        layers = tuple(
            plan_at(trace.sent_fraction(step, rank, layer)).program(rank).layers[layer]
            for layer in range(spec.num_layers)
        )
        programs.append(RankProgram(rank, layers))
    full = plan_at(1.0)
    # Ranks select different blocks: nothing repeats, so the simulator runs every rank.
    return Plan("cocodiff", spec.name, full.head_split, tuple(programs), None)
