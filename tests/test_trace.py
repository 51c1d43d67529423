"""The trace recorder: Chrome-trace output and the overlap arithmetic behind "fetch time hidden"."""
from __future__ import annotations

import json
import threading

from zero_offload.trace import Span, Tracer, breakdown, hidden_fraction


def span(name: str, cat: str, start_ms: int, end_ms: int, tid: int = 1) -> Span:
    return Span(name, cat, start_ms * 1_000_000, end_ms * 1_000_000, tid)


def test_hidden_fraction_counts_transfer_time_inside_the_union_of_compute() -> None:
    spans = [span("forward", "compute", 0, 10), span("forward", "compute", 8, 20), span("backward", "compute", 30, 40),
             span("fetch a", "transfer", 5, 15, 2),   # fully inside compute
             span("fetch b", "transfer", 18, 32, 2),  # 2 of 14 ms inside [0, 20], 2 inside [30, 40]
             span("write a", "transfer", 20, 30, 2)]  # not a fetch
    total, hidden = hidden_fraction(spans, "transfer", "compute", name_prefix="fetch")
    assert abs(total - 0.024) < 1e-12
    assert abs(hidden - (10 + 4) / 24) < 1e-12


def test_breakdown_counts_overlapping_spans_of_a_category_once() -> None:
    spans = [span("f", "compute", 0, 10), span("g", "compute", 5, 12), span("t", "transfer", 0, 3)]
    assert breakdown(spans) == {"compute": 0.012, "transfer": 0.003}


def test_recorder_is_off_by_default_and_writes_chrome_trace(tmp_path: object) -> None:
    t = Tracer()
    with t.span("ignored", "compute"):
        pass
    assert t.spans == []
    t.enabled = True
    with t.span("main work", "compute", unit="blocks.0"):
        pass
    worker = threading.Thread(target=lambda: t.add("fetch blocks.1", "transfer", 5, 9), name="zo-prefetch_0")
    worker.start()
    worker.join()
    path = f"{tmp_path}/out.json"
    t.save(path)
    events = json.load(open(path))["traceEvents"]
    complete = {e["name"]: e for e in events if e["ph"] == "X"}
    threads = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert set(complete) == {"main work", "fetch blocks.1"} and complete["main work"]["args"] == {"unit": "blocks.0"}
    assert complete["fetch blocks.1"]["cat"] == "transfer" and complete["fetch blocks.1"]["tid"] != complete["main work"]["tid"]
    assert "zo-prefetch_0" in threads


def test_threads_are_named_by_what_they_were_not_by_a_reused_ident() -> None:
    """The OS hands a finished thread's ident to the next one: spans of later threads were shown
    under the first one's name."""
    tracer = Tracer(enabled=True)
    for i in range(6):
        t = threading.Thread(target=lambda: tracer.add("work", "compute", 0, 1), name=f"worker-{i}")
        t.start()
        t.join()
    events = tracer.to_chrome()["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert sorted(names[e["tid"]] for e in events if e["ph"] == "X") == [f"worker-{i}" for i in range(6)]
