"""The docs name what the code has: every Config field (with its type and default) in
docs/config.md, every DeepSpeed key the reader knows in docs/deepspeed.md with its treatment, and
every known limit the README lists as a link to a heading of docs/limits.md. A field, key or limit
added to one side only fails here, so the docs cannot drift silently. Pure text checks: fast."""
from __future__ import annotations

import ast
import dataclasses
import os
import re
import typing
from typing import Any

import pytest

from zero_offload import deepspeed_compat as ds
from zero_offload.config import Config, ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREATMENTS = ("mapped", "accepted without effect", "accepted with one value", "refused")
MAX_README_LIMITS = 15


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _table_rows(text: str) -> dict[str, list[str]]:
    """The rows of the doc's tables whose first cell is one `code` name: name -> the other cells."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} has two rows"
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def _config_fields(cls: type = Config, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every leaf field of the Config tree by its dotted path (sections are dataclasses)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_config_fields(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = f
    return out


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _doc_value(cell: str) -> Any:
    """The first `code` value of a default cell, read as a Python literal (JSON's true/false too)."""
    m = re.match(r"`([^`]+)`", cell)
    assert m, f"default cell {cell!r} has no `value`"
    return ast.literal_eval({"true": "True", "false": "False"}.get(m.group(1), m.group(1)))


def test_every_config_field_is_in_config_md_with_its_type_and_default() -> None:
    fields = _config_fields()
    rows = _table_rows(_read("docs/config.md"))
    missing = sorted(set(fields) - set(rows))
    assert not missing, f"Config fields missing from docs/config.md: {missing}"
    unknown = sorted(set(rows) - set(fields))
    assert not unknown, f"docs/config.md rows for fields Config does not have: {unknown}"
    for path, f in fields.items():
        kind, default, meaning = rows[path]
        assert kind == f.type, f"{path}: type {kind!r} in docs/config.md, {f.type!r} in config.py"
        assert _doc_value(default) == _default(f), f"{path}: default {default!r} in docs/config.md"
        assert meaning, f"{path}: no meaning in docs/config.md"


def _known_deepspeed_keys() -> dict[str, str]:
    """Every DeepSpeed key deepspeed_compat's tables know, by dotted path, with its treatment."""
    out: dict[str, str] = {}
    for path, keys in ds._ALLOWED.items():
        for key in keys:
            out[".".join((*path, key))] = "mapped"
    out.update({".".join(k): "accepted without effect" for k in ds._INERT_KEYS})
    out.update({".".join(k): "accepted with one value" for k in ds._CHECKED_KEYS})
    out.update({k: "refused" for k in ds._REFUSED_TOP})
    return out


def _config_with(dotted: str) -> dict[str, Any]:
    """A DeepSpeed config holding `dotted` (value 1) and nothing else of note."""
    *sections, leaf = dotted.split(".")
    data: dict[str, Any] = {}
    node = data
    for name in sections:
        node = node.setdefault(name, {"stage": 3} if name == "zero_optimization" else {})
    node[leaf] = 1
    return data


def test_every_deepspeed_key_is_in_deepspeed_md_with_its_treatment() -> None:
    known = _known_deepspeed_keys()
    rows = _table_rows(_read("docs/deepspeed.md"))
    missing = sorted(k for k in known if k not in rows)
    assert not missing, f"DeepSpeed keys missing from docs/deepspeed.md: {missing}"
    for key, cells in rows.items():
        assert cells[0] in TREATMENTS, f"{key}: treatment {cells[0]!r} is none of {TREATMENTS}"
        if key in known:
            assert cells[0] == known[key], f"{key}: docs/deepspeed.md says {cells[0]!r}, the code {known[key]!r}"
        else:
            assert cells[0] == "refused", f"{key}: docs/deepspeed.md says {cells[0]!r}, the code does not know it"


def test_every_key_deepspeed_md_calls_refused_is_refused_by_name() -> None:
    rows = _table_rows(_read("docs/deepspeed.md"))
    refused = [k for k, cells in rows.items() if cells[0] == "refused"]
    assert refused
    for key in refused:
        with pytest.raises(ConfigError) as err:
            Config.from_dict(_config_with(key))
        assert key in str(err.value), f"{key}: refused, but not by name: {err.value}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    out: set[str] = set()
    in_code = False
    for line in text.splitlines():
        in_code ^= line.startswith("```")
        m = None if in_code else re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            slug, n = _slug(m.group(1)), 1
            while slug in out:  # GitHub numbers repeated headings
                slug, n = f"{_slug(m.group(1))}-{n}", n + 1
            out.add(slug)
    return out


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def test_readme_known_limits_are_one_line_links_to_headings_of_limits_md() -> None:
    lines = [ln for ln in _section(_read("README.md"), "Known limits").splitlines()[2:] if ln.strip()]
    items = [ln for ln in lines if ln.startswith("- ")]
    spans = [ln for ln in lines if ln[0].isspace()]
    assert not spans, f"a README limit spans lines (one line each, the rest in docs/limits.md): {spans[0]}"
    assert 0 < len(items) <= MAX_README_LIMITS, f"{len(items)} known limits in the README"
    anchors = _anchors(_read("docs/limits.md"))
    linked = set()
    for item in items:
        m = re.search(r"\]\(docs/limits\.md#([^)]+)\)", item)
        assert m, f"README limit without a link to docs/limits.md#...: {item}"
        assert m.group(1) in anchors, f"README links docs/limits.md#{m.group(1)}, no such heading"
        linked.add(m.group(1))
    body = {a for a in anchors if a != _slug("Known limits")}
    assert body <= linked, f"docs/limits.md headings the README does not list: {sorted(body - linked)}"


@pytest.mark.parametrize("doc", ["README.md", "docs/config.md", "docs/deepspeed.md", "docs/limits.md",
                                 "docs/usage.md", "docs/perf_adam.md", "docs/perf_io.md",
                                 "docs/perf_stage3.md", "docs/perf_step.md"])
def test_relative_links_resolve(doc: str) -> None:
    """Each [text](path#anchor) to a file of this repository names a file that exists and, with an
    anchor into a Markdown file, one of its headings."""
    here = os.path.dirname(doc)
    for target in re.findall(r"\]\(([^)\s]+)\)", _read(doc)):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        rel = os.path.normpath(os.path.join(here, path)) if path else doc
        assert os.path.exists(os.path.join(ROOT, rel)), f"{doc} links {target}: no file {rel}"
        if anchor and rel.endswith(".md"):
            assert anchor in _anchors(_read(rel)), f"{doc} links {target}: no such heading in {rel}"


def test_readme_has_the_two_commands_ci_runs() -> None:
    """.ci/run runs the README's test command; both commands stay in the README's bash block."""
    readme = _read("README.md")
    block = re.search(r"## Two commands\n.*?```bash\n(.*?)```", readme, re.S)
    assert block, "README has no bash block under '## Two commands'"
    commands = [ln.split("#")[0].strip() for ln in block.group(1).splitlines()]
    assert "make demo" in commands and "make test" in commands
    ci = [ln.strip() for ln in _read(".ci/run").splitlines() if ln.strip() and not ln.startswith("#")]
    assert ci[-1] == "make test", f".ci/run ends with {ci[-1]!r}, not the README's test command"


_PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|cpp|h|md|json|txt|toml))`")
# Where a path the docs name may be written from: the repository root, the package, its engine.
_BASES = ("", "zero_offload", os.path.join("zero_offload", "engine"))
# Their files, not ours, and the workspace beside the repository (../shared/, which a clone lacks).
_OTHER_PROJECTS = ("deepspeed/", "torch/", "transformers/", "accelerate/", "peft/", "../")


@pytest.mark.parametrize("doc", sorted(["README.md", *(os.path.join("docs", f) for f in os.listdir(
    os.path.join(ROOT, "docs")) if f.endswith(".md"))]))
def test_every_path_a_doc_names_exists(doc: str) -> None:
    """A file path in backquotes (`engine/stage3/prefetch.py`, `tests/test_zoo.py`) names a file
    of this repository, written from its root, the package or the engine: docs that name moved
    or renamed files were found stale in review."""
    missing = sorted({p for p in _PATH.findall(_read(doc))
                      if not p.startswith(_OTHER_PROJECTS)
                      and not any(os.path.exists(os.path.join(ROOT, base, p)) for base in _BASES)})
    assert not missing, f"{doc} names files that do not exist: {missing}"
