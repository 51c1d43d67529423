"""The seam between the facade and the runtimes (engine/runtime.py), the engine's one health state (issue 23).

- Both runtimes provide every member of the `Runtime` protocol, each method with the protocol's
  parameters (names, kinds, defaults), so the facade and the state code can be typed against
  the protocol alone.
- `HealthState` transitions raise from a wrong state; nothing leaves CLOSED.
The import graph (no cycle, no upward import) is tests/test_import_contract.py's.
"""
from __future__ import annotations

import inspect
import re

import pytest
import torch

import zero_offload
from zero_offload.engine.buckets.runtime import BucketRuntime
from zero_offload.engine.engine import EngineStateError, Health, HealthState
from zero_offload.engine.runtime import Runtime
from zero_offload.engine.stage3.runtime import Stage3Runtime


def _protocol_members() -> tuple[dict[str, object], set[str]]:
    """The protocol's methods and properties (by name), and its data attributes."""
    members = {n: v for n, v in vars(Runtime).items()
               if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))}
    return members, set(Runtime.__annotations__)


def _params(fn: object) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter: what a caller's call depends on."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _assigned_in_init(cls: type) -> set[str]:
    """Attributes a class sets on self (its construction cannot run here: it builds a runtime)."""
    source = inspect.getsource(cls)
    return set(re.findall(r"self\.(\w+)(?::[^=\n]+)?\s*=[^=]", source)) | set(vars(cls))


@pytest.mark.parametrize("cls", [BucketRuntime, Stage3Runtime])
def test_each_runtime_provides_the_protocol(cls: type) -> None:
    members, attributes = _protocol_members()
    assert members and attributes  # the protocol is read, not empty
    problems = []
    for name, want in members.items():
        have = inspect.getattr_static(cls, name, None)
        if have is None:
            problems.append(f"{name}: missing")
        elif isinstance(want, property) != isinstance(have, property):
            problems.append(f"{name}: a property in one, not the other")
        elif not isinstance(want, property) and _params(have) != _params(want):
            problems.append(f"{name}: {inspect.signature(have)} != protocol's {inspect.signature(want)}")
    problems += [f"{name}: attribute never set" for name in sorted(attributes - _assigned_in_init(cls))]
    assert not problems, f"{cls.__name__} does not provide Runtime: {problems}"


def test_the_check_sees_a_missing_or_changed_method() -> None:
    """The test above can fail: a class lacking a method, or with another signature, is caught."""
    class Short(BucketRuntime):
        def step(self, now: bool) -> bool:  # type: ignore[override]
            return now

    members, _ = _protocol_members()
    assert _params(inspect.getattr_static(Short, "step")) != _params(members["step"])

    class Gone:
        replicated = False

    assert inspect.getattr_static(Gone, "standing", None) is None


def test_engine_runtime_is_typed_against_the_protocol() -> None:
    from zero_offload.engine import engine

    source = inspect.getsource(engine)
    assert "self.runtime: Runtime" in source and "runtime: Any" not in source


def test_health_transitions_raise_from_a_wrong_state() -> None:
    h = HealthState()
    with pytest.raises(EngineStateError, match="cannot finish a load"):
        h.loaded()  # no load began
    with pytest.raises(EngineStateError, match="cannot resume"):
        h.resume()  # nothing stopped
    h.stop("a step failed")
    assert (h.health, h.why(Health.STOPPED), h.why(Health.LOAD_FAILED)) == (Health.STOPPED, "a step failed", None)
    h.stop("again")  # a stop after a stop (a second Ctrl-C stops first) keeps the first reason
    assert h.why(Health.STOPPED) == "a step failed"
    h.begin_load()  # STOPPED -> LOAD_FAILED while the load writes
    h.load_failed("OSError: gone")
    assert h.why(Health.LOAD_FAILED) == "OSError: gone"
    h.begin_load()
    h.loaded()
    assert h.health is Health.OK and h.reason is None
    h.close()
    h.close()  # close() is idempotent
    for leave in (h.loaded, h.resume, h.begin_load, lambda: h.stop("x"), lambda: h.load_failed("x")):
        with pytest.raises(EngineStateError):
            leave()
    assert h.health is Health.CLOSED


def test_engine_flags_are_read_from_its_health() -> None:
    engine = zero_offload.initialize(torch.nn.Linear(4, 2), stage=1)
    assert (engine.closed, engine.stopped, engine.load_failed) == (False, None, None)
    with pytest.raises(AttributeError):
        engine.closed = True  # type: ignore[misc]
    with pytest.raises(AttributeError):
        engine.load_failed = None  # type: ignore[misc]
    with pytest.raises(EngineStateError, match="only be cleared"):
        engine.stopped = "stop"
    engine.close()
    assert engine.closed and engine.health.health is Health.CLOSED
