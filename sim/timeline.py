"""What happened when: spans on named tracks, exportable as a Chrome / Perfetto trace."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Span:
    track: str  # "rank 3", "link n0.g0->n0.g1"
    name: str  # "proj_v", "a2a q"
    category: str  # "compute" | "comm" | "link"
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(slots=True)
class Timeline:
    spans: list[Span] = field(default_factory=list)

    def add(self, track: str, name: str, category: str, start_s: float, end_s: float) -> None:
        self.spans.append(Span(track, name, category, start_s, end_s))

    def on_track(self, track: str) -> list[Span]:
        return [span for span in self.spans if span.track == track]

    def to_chrome_trace(self) -> dict:
        """The trace-event JSON that chrome://tracing and ui.perfetto.dev open.

        Ranks and links are two processes; each track is a thread of one of them.
        """
        pids = {"rank": 1, "link": 2}
        tids: dict[str, int] = {}
        events: list[dict] = [
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "ranks"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "links"}},
        ]
        for span in self.spans:
            pid = pids["link" if span.category == "link" else "rank"]
            if span.track not in tids:
                tids[span.track] = len(tids) + 1
                events.append(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": pid,
                        "tid": tids[span.track],
                        "args": {"name": span.track},
                    }
                )
            events.append(
                {
                    "ph": "X",
                    "name": span.name,
                    "cat": span.category,
                    "pid": pid,
                    "tid": tids[span.track],
                    "ts": span.start_s * 1e6,
                    "dur": span.duration_s * 1e6,
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def merged_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    spans = sorted(intervals)
    if not spans:
        return 0.0
    total = 0.0
    current_start, current_end = spans[0]
    for start, end in spans[1:]:
        if start > current_end:
            total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    return total + current_end - current_start
