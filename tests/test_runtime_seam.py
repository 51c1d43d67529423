"""The seam between the facade and the runtimes (engine/runtime.py), the engine's one health state,
and the import graph without cycles (issue 23).

- Both runtimes provide every member of the `Runtime` protocol, each method with the protocol's
  parameters (names, kinds, defaults), so the facade and the state code can be typed against
  the protocol alone.
- `HealthState` transitions raise from a wrong state; nothing leaves CLOSED.
- No module of the package imports, even lazily or under TYPE_CHECKING, a module that imports it
  back (the cycles were config <-> deepspeed_compat and engine <-> checkpoint, memory, export,
  the runtimes, gathered).
"""
from __future__ import annotations

import ast
import inspect
import os
import re

import pytest
import torch

import zero_offload
from zero_offload.engine.buckets.runtime import BucketRuntime
from zero_offload.engine.engine import EngineStateError, Health, HealthState
from zero_offload.engine.runtime import Runtime
from zero_offload.engine.stage3.runtime import Stage3Runtime

PACKAGE = os.path.dirname(zero_offload.__file__)


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
    with pytest.raises(EngineStateError, match="cannot stop"):
        h.stop("again")
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


def _imports() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports, anywhere in its body."""
    mods = {}
    for d, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = os.path.join(d, f)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        names = [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                 and n.level == 0 for a in n.names]
        names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        graph[mod] = {t for t in map(resolve, (n for n in names if n.startswith("zero_offload"))) if t} - {mod}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of imports, if any (depth first, with the path kept)."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt, path + [node])
            if found:
                return found
        done.add(node)
        return None

    return next((c for c in (visit(m, []) for m in sorted(graph)) if c), None)


def test_no_import_cycles() -> None:
    graph = _imports()
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]  # the search finds one where there is one
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_runtimes_and_the_state_code_stand_below_the_facade() -> None:
    graph = _imports()
    facade = {"zero_offload.engine.engine", "zero_offload.engine.memory", "zero_offload.engine.preemption"}
    below = ["zero_offload.engine.buckets.runtime", "zero_offload.engine.stage3.runtime",
             "zero_offload.engine.stage3.gathered", "zero_offload.engine.state.checkpoint",
             "zero_offload.engine.state.export", "zero_offload.engine.runtime"]
    wrong = {m: sorted(graph.get(m, set()) & facade) for m in below if graph.get(m, set()) & facade}
    assert not wrong, wrong
    assert "zero_offload.engine.stage3.runtime" not in graph["zero_offload.engine.stage3.gathered"]
    assert "zero_offload.deepspeed_compat" not in graph["zero_offload.config"]
