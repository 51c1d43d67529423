"""The checkpoint manifest's own integrity: its checksum and the kind of every field a load uses.

The manifest holds the checksums of every other file, so a flipped digit in it (a step count,
global_steps) would otherwise load silently and make the resumed run differ; and a field of the
wrong kind would fail only once the load has begun writing, leaving the engine stopped. Both are
found here, before anything changes. The checksum lives beside the manifest (`manifest.crc32`,
written after it into the save's temporary directory); a checkpoint without one (saved before it
existed) is checked field by field only. Format 2 manifests also hold every tensor file's
whole-file checksum ("checksums": the algorithm, io/checksum.py's file_algorithm, and a value per
file), and a manifest whose shards record different step counts is refused (`one_step`).
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable

from zero_offload.config import PRECISIONS
from zero_offload.engine.state import files

CRC_FILE = "manifest.crc32"


class ManifestError(ValueError):
    """One field of the manifest is missing or of the wrong kind (the message names it)."""


def write_crc(root: str, raw: bytes) -> None:
    """manifest.crc32 for the manifest's bytes `raw`, written durably (files.py's one writer)."""
    with files.durable(os.path.join(root, CRC_FILE), "w") as f:
        f.write(str(files.checksum_of(files.Kind.JSON, data=raw)))


def saved_crc(root: str) -> int | None:
    """The manifest's recorded checksum, or None for a checkpoint saved without one."""
    path = os.path.join(root, CRC_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ManifestError(f"{CRC_FILE} holds {text[:20]!r}, not a checksum")
    return int(text)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _counts(v: Any) -> bool:
    return isinstance(v, dict) and all(_count(x) for x in v.values())


def lagging_table(v: Any) -> bool:
    """A shard map's per-parameter step counts: name -> [[offset, numel, count], ...] (counts)."""
    return isinstance(v, dict) and all(
        isinstance(name, str) and isinstance(runs, list)
        and all(isinstance(r, list) and len(r) == 3 and all(_count(x) for x in r) for r in runs)
        for name, runs in v.items())


def _group(g: Any) -> bool:
    betas = g.get("betas") if isinstance(g, dict) else None
    return (isinstance(g, dict) and all(_number(g.get(k)) and g[k] >= 0 for k in ("lr", "eps", "weight_decay"))
            and isinstance(betas, list) and len(betas) == 2 and all(_number(b) for b in betas))


def _scaler(s: Any) -> bool:
    return (isinstance(s, dict) and _number(s.get("scale")) and s["scale"] > 0
            and _count(s.get("good_steps")) and isinstance(s.get("hysteresis_left"), int))


_TOP: dict[str, tuple[Callable[[Any], bool], str]] = {
    "world": (lambda v: _count(v) and v >= 1, "a positive integer"),
    "stage": (lambda v: v in (0, 1, 2, 3) and not isinstance(v, bool), "0, 1, 2 or 3"),
    "precision": (lambda v: v in PRECISIONS, f"one of {list(PRECISIONS)}"),
    "writers": (lambda v: isinstance(v, list) and bool(v) and all(_count(r) for r in v), "a list of ranks"),
    "micro_step": (_count, "a count"),
    "global_steps": (_count, "a count"),
    "param_shapes": (lambda v: isinstance(v, dict) and all(isinstance(s, list) and all(_count(d) for d in s)
                                                          for s in v.values()), "parameter shapes"),
    "files": (lambda v: isinstance(v, dict) and all(isinstance(d, dict) for d in v.values()), "file descriptions"),
    "optimizer": (lambda v: isinstance(v, dict), "the optimizer's scalars"),
}
_OPTIMIZER: dict[str, tuple[Callable[[Any], bool], str]] = {
    "steps": (_counts, "step counts per shard"),
    "param_groups": (lambda v: isinstance(v, list) and bool(v) and all(_group(g) for g in v),
                     "parameter groups with lr, betas, eps and weight_decay"),
    "scaler": (_scaler, "the loss scaler's scale, good_steps and hysteresis_left"),
}
_OPTIONAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "sub_steps": (_counts, "step counts per sub-shard"),
    "skipped_steps": (_count, "a count"),
}


def check(manifest: Any) -> None:
    """Raise ManifestError naming the first field a load would misread."""
    if not isinstance(manifest, dict):
        raise ManifestError("the manifest is not a JSON object")
    _fields(manifest, _TOP, "", required=True)
    _fields(manifest["optimizer"], _OPTIMIZER, "optimizer.", required=True)
    _fields(manifest["optimizer"], _OPTIONAL, "optimizer.", required=False)
    for r in manifest["writers"]:
        if r >= manifest["world"]:
            raise ManifestError(f"writers names rank {r} of a world of {manifest['world']}")
    parts = manifest.get("optimizer_parts", ["master"])
    if not (isinstance(parts, list) and parts and all(isinstance(p, str) for p in parts)):
        raise ManifestError(f"optimizer_parts is {str(parts)[:40]!r}, expected the names of the optimizer's "
                            "state parts")
    for key in ("sizes", "maps", "client_state"):
        if key in manifest and not _counts(manifest[key]):
            raise ManifestError(f"{key} is not a table of non-negative integers")
    if "client_state" in manifest and set(manifest["client_state"]) != {"size", "crc32"}:
        raise ManifestError("client_state is not a size and a crc32")
    if manifest.get("format", 1) >= 2 or "checksums" in manifest:  # format 2 records whole-file checksums
        sums = manifest.get("checksums")
        if not (isinstance(sums, dict) and isinstance(sums.get("algorithm"), str) and _counts(sums.get("files"))):
            raise ManifestError(f"checksums is {str(sums)[:40]!r}, expected an algorithm and a checksum per file")


def one_step(manifest: dict[str, Any]) -> None:
    """Every shard (bucket or unit) at the same step count: the optimizer state of one step of
    the engine. Parameters that missed a gradient keep their own, lower counts in the shard maps'
    "lagging", and the sub-shards of a shard theirs ("sub_steps"), neither checked here. Shards
    saved at different steps would resume a mixture."""
    counts = manifest["optimizer"]["steps"]
    if len(set(counts.values())) > 1:
        lo, hi = min(counts, key=counts.__getitem__), max(counts, key=counts.__getitem__)
        raise ManifestError(f"its shards are at different steps ({lo} at step {counts[lo]}, {hi} at step "
                            f"{counts[hi]}): not the state of one step; load another checkpoint")


def _fields(obj: dict, spec: dict[str, tuple[Callable[[Any], bool], str]], prefix: str, *, required: bool) -> None:
    for key, (ok, what) in spec.items():
        if key not in obj:
            if required:
                raise ManifestError(f"{prefix}{key} is missing")
            continue
        if not ok(obj[key]):
            raise ManifestError(f"{prefix}{key} is {str(obj[key])[:40]!r}, expected {what}")
