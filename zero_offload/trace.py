"""A tiny timeline recorder: spans of compute, transfers and optimizer work, saved as a Chrome trace.

Open the saved JSON in https://ui.perfetto.dev or chrome://tracing. One process-wide recorder,
off by default, so instrumented code costs one attribute check when nobody is tracing. Spans are
recorded from any thread (appending to a list is atomic under the GIL) with the thread's id, so
the timeline shows the prefetch thread's transfers under the main thread's compute.

Categories used across the project: "compute" (model forward/backward between engine hooks),
"transfer" (tier reads/writes, host<->device copies), "comm" (all-gather, reduce-scatter),
"wait" (the main thread blocked on a transfer), "optimizer" (the step).

`hidden_fraction` is the measure behind the stage-3 claim "fetch time hidden behind compute":
the share of the transfer spans' time that lies inside the union of the compute spans.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence


@dataclass(frozen=True)
class Span:
    name: str
    cat: str
    start_ns: int
    end_ns: int
    tid: int
    args: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


class Tracer:
    """Collects spans while `enabled`; `save` writes them as Chrome-trace JSON."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.spans: list[Span] = []
        # The OS reuses a finished thread's ident: a trace thread is (ident, name), numbered here.
        self._tids: dict[tuple[int, str], int] = {}

    def add(self, name: str, cat: str, start_ns: int, end_ns: int, **args: object) -> None:
        """Record a span that already happened (times from time.perf_counter_ns)."""
        if not self.enabled:
            return
        thread = (threading.get_ident(), threading.current_thread().name)
        tid = self._tids.setdefault(thread, len(self._tids) + 1)
        self.spans.append(Span(name, cat, start_ns, end_ns, tid, dict(args)))

    @contextlib.contextmanager
    def span(self, name: str, cat: str, **args: object) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add(name, cat, start, time.perf_counter_ns(), **args)

    def clear(self) -> None:
        self.spans = []
        self._tids = {}

    def to_chrome(self) -> dict:
        """The Chrome trace-event format: complete ('X') events in microseconds, plus thread names."""
        pid = os.getpid()
        t0 = min((s.start_ns for s in self.spans), default=0)
        events: list[dict] = [{"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}
                              for (_, name), tid in self._tids.items()]
        for s in self.spans:
            events.append({"ph": "X", "pid": pid, "tid": s.tid, "name": s.name, "cat": s.cat,
                           "ts": (s.start_ns - t0) / 1e3, "dur": (s.end_ns - s.start_ns) / 1e3, "args": s.args})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_chrome(), f)


_TRACER = Tracer()


def tracer() -> Tracer:
    """The process-wide recorder every instrumented module writes to."""
    return _TRACER


def enable(on: bool = True) -> Tracer:
    _TRACER.enabled = on
    return _TRACER


def _union(intervals: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _covered(lo: int, hi: int, union: Sequence[tuple[int, int]]) -> int:
    return sum(max(0, min(hi, b) - max(lo, a)) for a, b in union)


def hidden_fraction(spans: Sequence[Span], cat: str = "transfer", behind: str = "compute",
                    name_prefix: str = "") -> tuple[float, float]:
    """(total seconds of `cat` spans, fraction of that time overlapping the union of `behind` spans)."""
    work = [s for s in spans if s.cat == cat and s.name.startswith(name_prefix)]
    union = _union([(s.start_ns, s.end_ns) for s in spans if s.cat == behind])
    total = sum(s.end_ns - s.start_ns for s in work)
    if total == 0:
        return 0.0, 0.0
    return total / 1e9, sum(_covered(s.start_ns, s.end_ns, union) for s in work) / total


def breakdown(spans: Sequence[Span]) -> dict[str, float]:
    """Seconds per category; overlapping spans of one category are counted once (their union)."""
    out: dict[str, float] = {}
    for cat in sorted({s.cat for s in spans}):
        union = _union([(s.start_ns, s.end_ns) for s in spans if s.cat == cat])
        out[cat] = sum(b - a for a, b in union) / 1e9
    return out
