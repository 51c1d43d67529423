"""The layer order of zero_offload/, checked over its import graph.

Every module under zero_offload/ is parsed with `ast` (nothing is imported) and each of its
imports of ours is collected: absolute and relative, at module level, inside functions (late
imports) and under `if TYPE_CHECKING:`, since a late or type-only import is still a dependency
the layer order has to allow. A module may import from its own row or below, never from a higher
row, never from a sibling group of its own row (engine/buckets and engine/stage3 are two ways to
run the same engine and share only what lies below them), and no two modules may import each
other, directly or around a longer cycle.
"""
from __future__ import annotations

import ast
import fnmatch
import pathlib
from collections import defaultdict
from typing import Iterable, Iterator, Mapping

import pytest

# Bottom up. A row is a list of sibling groups; a group is a list of module patterns (fnmatch over
# the dotted name below zero_offload; "" is zero_offload/__init__.py). A package's __init__ sits in
# its own group's row ("io" with "io.*").
LAYERS: list[list[list[str]]] = [
    [["trace"]],  # the span recorder; imports nothing of ours
    [["interrupts"]],  # Ctrl-C held over a transaction; imports nothing of ours
    [["native"]],  # loading the C++ library
    [["comm"]],  # the only file that calls torch.distributed; imports nothing of ours
    [["tiers"]],  # the tier registry: pure data, asked by config and everything above
    [["optim.spec", "optim.adamw", "optim.lion", "optim.registry"]],  # optimizer specs (state parts, hyperparameters): pure data
    [["config"]],  # what the user asked for (no torch); io/swap.py defaults to its IOConfig
    [["deepspeed_compat"]],  # DeepSpeed's keys onto Config (asks comm for the world size)
    [["ledger"]],  # what the state should cost
    [["io", "io.*"]],  # async I/O backends, aligned buffers, NVMe slots and swap files
    [["partition"]],  # flat buffers and shards (aligned host buffers from io/buffers.py)
    [["store", "store.*"]],  # one store class per tier, `make_store`
    [["optim", "optim.*"]],  # stepping a shard where it lives
    [["engine.step", "engine.step.*"]],  # shards' optimizer state, the overlapped step
    [["engine.runtime", "engine.phase"]],  # seam modules the sub-packages may import
    [["engine.model", "engine.model.*"]],  # meta build, weight files, parameter bindings
    [["engine.buckets", "engine.buckets.*"], ["engine.stage3", "engine.stage3.*"]],  # siblings
    [["engine.state", "engine.state.*"]],  # checkpoints, export
    [["engine", "engine.engine", "engine.memory", "engine.preemption"]],  # the facade
    [[""]],  # zero_offload/__init__.py: initialize, Config
    [["cli", "bench", "bench.*"]],  # what users run
    [["hf", "hf.*"]],  # transformers integration
]

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "zero_offload"
ROOT = "zero_offload"

Graph = Mapping[str, Mapping[str, int]]  # importer -> {imported: line of the first such import}


def module_names(package: pathlib.Path, root: str = ROOT) -> dict[str, pathlib.Path]:
    """Every module under `package` by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = [root, *path.relative_to(package).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _owner(dotted: str, modules: Iterable[str]) -> str | None:
    """The longest module name that `dotted` is or lies inside (a name imported from it)."""
    known = set(modules)
    while dotted and dotted not in known:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _targets(node: ast.AST, name: str, is_package: bool, modules: Iterable[str]) -> Iterator[str]:
    """The modules of ours one import statement loads."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            found = _owner(alias.name, modules)
            if found:
                yield found
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:  # `from pkg import mod` loads pkg.mod; `from mod import obj`, mod
            found = _owner(f"{source}.{alias.name}", modules)
            if found:
                yield found


def import_graph(package: pathlib.Path, root: str = ROOT) -> dict[str, dict[str, int]]:
    """importer -> {imported module: first line}, over every import statement anywhere in a module."""
    modules = module_names(package, root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, name, path.name == "__init__.py", modules):
                if target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def layer_of(name: str, layers: list[list[list[str]]], root: str = ROOT) -> tuple[int, int] | None:
    """(row, group) of module `name`, or None when no pattern matches it."""
    rel = name[len(root) + 1:] if name.startswith(root + ".") else ("" if name == root else name)
    for row, groups in enumerate(layers):
        for group, patterns in enumerate(groups):
            if any(fnmatch.fnmatchcase(rel, p) for p in patterns):
                return row, group
    return None


def layer_violations(graph: Graph, layers: list[list[list[str]]], root: str = ROOT) -> list[str]:
    """One line per import from a higher row or from a sibling group of the importer's row."""
    out = []
    for importer, edges in sorted(graph.items()):
        mine = layer_of(importer, layers, root)
        for imported, line in sorted(edges.items()):
            theirs = layer_of(imported, layers, root)
            if mine is None or theirs is None:
                continue  # reported by the every-module check
            if theirs[0] > mine[0]:
                out.append(f"{importer} (row {mine[0]}) imports {imported} (row {theirs[0]}, higher) at line {line}")
            elif theirs[0] == mine[0] and theirs[1] != mine[1]:
                out.append(f"{importer} imports its sibling {imported} (row {mine[0]}) at line {line}")
    return out


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def cycle_report(graph: Graph) -> list[str]:
    """Each cycle as its modules and the imports among them (importer -> imported, line)."""
    out = []
    for component in cycles(graph):
        inside = set(component)
        edges = [f"{a} -> {b} (line {graph[a][b]})" for a in component for b in sorted(graph[a]) if b in inside]
        out.append(f"cycle among {', '.join(component)}: " + "; ".join(edges))
    return out


def unplaced(graph: Graph, layers: list[list[list[str]]], root: str = ROOT) -> list[str]:
    """Modules no row of `layers` names."""
    return sorted(m for m in graph if layer_of(m, layers, root) is None)


# -- the package --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return import_graph(PACKAGE)


def test_every_module_is_in_a_layer(graph: dict[str, dict[str, int]]) -> None:
    missing = unplaced(graph, LAYERS)
    assert not missing, "modules in no row of LAYERS (add each to its row): " + ", ".join(missing)


def test_no_import_from_a_higher_layer_or_a_sibling(graph: dict[str, dict[str, int]]) -> None:
    bad = layer_violations(graph, LAYERS)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_import_cycle(graph: dict[str, dict[str, int]]) -> None:
    bad = cycle_report(graph)
    assert not bad, "import cycles:\n" + "\n".join(bad)


# -- the checker itself -------------------------------------------------------------------------

_FAKE_LAYERS = [[["low"]], [["mid", "mid.*"]], [["a", "a.*"], ["b", "b.*"]], [["top"]]]


def _fake_package(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    pkg = tmp_path / "pkg"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


def test_collector_sees_late_type_only_and_relative_imports(tmp_path: pathlib.Path) -> None:
    pkg = _fake_package(tmp_path, {
        "__init__.py": "",
        "low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.top import T\n",
        "mid/__init__.py": "",
        "mid/x.py": "def f():\n    from .. import low\n    from ..a import y\n    import pkg.b.z\n",
        "a/__init__.py": "", "a/y.py": "from . import __name__ as n\n", "b/__init__.py": "", "b/z.py": "",
        "top.py": "import os\nfrom pkg.mid.x import f\n",
    })
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.low"] == {"pkg.top": 3}
    assert set(graph["pkg.mid.x"]) == {"pkg.low", "pkg.a.y", "pkg.b.z"}
    assert graph["pkg.a.y"] == {"pkg.a": 1}
    assert set(graph["pkg.top"]) == {"pkg.mid.x"}


def test_checker_finds_each_kind_of_violation() -> None:
    graph = {
        "pkg.low": {"pkg.mid": 3},  # upward
        "pkg.mid": {"pkg.low": 1},  # fine, but with the line above a cycle
        "pkg.a.one": {"pkg.b.two": 7, "pkg.mid": 2},  # a sibling, and a lower row (fine)
        "pkg.b.two": {},
        "pkg.top": {"pkg.a.one": 1},
        "pkg.stray": {},
    }
    assert layer_violations(graph, _FAKE_LAYERS, "pkg") == [
        "pkg.a.one imports its sibling pkg.b.two (row 2) at line 7",
        "pkg.low (row 0) imports pkg.mid (row 1, higher) at line 3",
    ]
    assert cycles(graph) == [["pkg.low", "pkg.mid"]]
    assert cycle_report(graph) == [
        "cycle among pkg.low, pkg.mid: pkg.low -> pkg.mid (line 3); pkg.mid -> pkg.low (line 1)"]
    assert unplaced(graph, _FAKE_LAYERS, "pkg") == ["pkg.stray"]


def test_checker_passes_a_graph_that_keeps_the_order() -> None:
    graph = {"pkg.low": {}, "pkg.mid": {"pkg.low": 1}, "pkg.a.one": {"pkg.mid": 1, "pkg.a": 2}, "pkg.a": {},
             "pkg.top": {"pkg.a.one": 1, "pkg.low": 1}}
    assert layer_violations(graph, _FAKE_LAYERS, "pkg") == []
    assert cycles(graph) == [] and unplaced(graph, _FAKE_LAYERS, "pkg") == []


def test_a_longer_cycle_is_one_component() -> None:
    graph: dict[str, dict[str, int]] = defaultdict(dict, {"x": {"y": 1}, "y": {"z": 1}, "z": {"x": 1}, "w": {"x": 1}})
    assert cycles(graph) == [["x", "y", "z"]]
