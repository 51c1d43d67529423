"""Loading a checkpoint in two passes (checkpoint.py's docstring): `prepare_load` reads and
verifies everything, every rank agreeing, before anything changes; `apply_load` writes it into the
runtime and the module, reading each shard file again. Every file is checked by files.py's one
verifier, against what the manifest recorded."""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from zero_offload import comm
from zero_offload.config import Config
from zero_offload.engine.runtime import ModelView, Runtime, TrainingState
from zero_offload.engine.state import files, manifest_checks
from zero_offload.engine.state.common import agree, attempt, non_trainable
from zero_offload.engine.state.files import CLIENT_FILE, READABLE, CheckpointError, Kind, why
from zero_offload.engine.state.plan import Copies, check_frozen_home, check_shapes, checked_non_trainable, lagging, plan
from zero_offload.engine.state.reader import Reader
from zero_offload.optim.adamw import ADAMW


@dataclass
class _Load:
    """Everything a load writes, read and checked before it writes anything."""

    root: str
    manifest: dict[str, Any]
    reader: Reader
    shards: Copies
    frozen: Copies
    non_trainable: list[tuple[torch.Tensor, torch.Tensor]]
    rng: dict[str, torch.Tensor] | None
    same_world: bool
    client_state: dict[Any, Any] | None = None
    lagging: dict[str, list[list[int]]] | None = None  # every writer's, by parameter name
    # Buffers saved in another shape, by state_dict name: (the module that registers them, their
    # name there); its own _load_from_state_dict resizes them, as module.load_state_dict would.
    resized: dict[str, tuple[torch.nn.Module, str]] = field(default_factory=dict)


def prepare_load(rt: Runtime, model: ModelView, config: Config, path: str) -> _Load:
    """Read and verify the checkpoint at `path`, which may come from another world size or tier
    config, for this engine. Every rank verifies everything before any rank changes anything, and
    the ranks agree on the outcome, so a checkpoint one rank refuses is refused by all (none is
    left waiting in a collective) and leaves every engine as it was; see the module docstring.
    Nothing is written: apply_load does that, once the facade has marked the load in progress."""
    loaded, refused = None, None
    try:
        loaded = _prepare(rt, model, config, path)
    except Exception as exc:
        refused = exc if isinstance(exc, CheckpointError) else CheckpointError(f"checkpoint {path}: {exc!r}")
    agree(refused, "refused the checkpoint")
    if loaded is None:  # agree raised for every refusal; kept for the type checker, not `assert` (python -O)
        raise CheckpointError(f"checkpoint {path}: nothing was prepared")
    _same_checkpoint(loaded.root)
    return loaded


def apply_load(rt: Runtime, model: ModelView, config: Config, loaded: _Load) -> TrainingState:
    """Write the verified checkpoint into the runtime and the module (the ranks agree on the
    outcome) and rebuild the compute copy; returns the counters the Engine takes. A failure from
    here on leaves a mixture: the facade refuses to train until a load succeeds."""
    agree(attempt(_apply, rt, model, loaded), "failed part way through loading the checkpoint")
    rt.refresh_params()
    steps = loaded.manifest["global_steps"]
    return TrainingState(global_steps=steps, micro_step=steps * config.gradient_accumulation_steps)  # a fresh cycle


def _same_checkpoint(root: str) -> None:
    """Every rank resolved `path` on its own: node-local copies that differ (another step's), or
    `path` on one rank and `path.old` on another, would load a mixture. The manifests' bytes
    must be equal on every rank (they name every file's checksum)."""
    try:
        mine: int | None = files.checksum_of(Kind.JSON, os.path.join(root, "manifest.json"))
    except OSError:  # still agreed: every rank reaches the gather
        mine = None
    seen = comm.gather_objects((mine, root))
    if any(crc != seen[0][0] for crc, _ in seen):
        where = ", ".join(f"rank {r}: {d} (manifest crc32 {c})" for r, (c, d) in enumerate(seen))
        raise CheckpointError(f"the ranks found different checkpoints ({where}): load from a path on a file "
                              "system shared by every rank, or identical copies")


# ---- the verify pass --------------------------------------------------------------------------

def _prepare(rt: Runtime, model: ModelView, config: Config, path: str) -> _Load:
    root = files.resolve(path)
    manifest = _read_manifest(root)
    check_frozen_home(rt, model.module, config.stage, root, manifest["stage"])
    check_shapes(root, "trainable parameters", rt.param_shapes(), manifest["param_shapes"])
    if "frozen_shapes" in manifest:  # older checkpoints: stage-3 frozen shards stay as initialized
        check_shapes(root, "frozen parameters", rt.frozen_shapes(), manifest["frozen_shapes"])
    _check_groups(rt, root, manifest["optimizer"])
    _check_parts(rt, root, manifest)
    reader = Reader(root, manifest)
    maps = _read_maps(root, manifest)
    same_world = manifest["world"] == comm.world_size()
    shards = plan(maps, "shard_map", rt.shard_map())
    frozen = plan(maps, "frozen_map", rt.frozen_map()) if "frozen_shapes" in manifest else {}
    read = {f for copies in (*shards.values(), *frozen.values()) for f, *_ in copies}
    _check_files(root, manifest, read)
    _verify(reader, manifest, read)
    module_held = dict(reader.get("model.pt"))
    own = f"rank{comm.rank()}.buffers.pt"
    if same_world and own in manifest["files"]:  # this rank's own buffers, as it left them
        module_held.update(_own_buffers(reader.get(own), module_held, os.path.join(root, own)))
    resized = _resized(model.module, non_trainable(rt, model.module), module_held, root)
    return _Load(root, manifest, reader, shards, frozen,
                 checked_non_trainable(rt, model.module, module_held, root, frozenset(resized)),
                 _rng(reader, manifest) if same_world else None, same_world, _read_client(root, manifest),
                 lagging(root, maps), resized)


def _read_manifest(root: str) -> dict[str, Any]:
    """manifest.json, verified against manifest.crc32 and field by field."""
    try:
        crc = manifest_checks.saved_crc(root)
    except (OSError, UnicodeDecodeError, manifest_checks.ManifestError) as exc:
        raise CheckpointError(f"checkpoint {root}: cannot read {manifest_checks.CRC_FILE}: {why(exc)}") from None
    manifest = _read_json(os.path.join(root, "manifest.json"), crc)
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE:
        raise CheckpointError(f"checkpoint {root} has format "
                              f"{manifest.get('format') if isinstance(manifest, dict) else None}, this version "
                              f"reads {' and '.join(map(str, READABLE))}: load it with the version that saved it")
    try:
        manifest_checks.check(manifest)
        manifest_checks.one_step(manifest)
    except manifest_checks.ManifestError as exc:
        raise CheckpointError(f"checkpoint {root}: manifest.json: {exc}") from None
    return manifest


def _check_groups(rt: Runtime, root: str, sd: dict[str, Any]) -> None:
    """The optimizer entry's kinds, and as many parameter groups as this engine's."""
    if not all(isinstance(sd.get(k), t) for k, t in (("steps", dict), ("param_groups", list), ("scaler", dict))):
        raise CheckpointError(f"checkpoint {root}: the manifest's optimizer entry is malformed")
    groups = len(rt.shard_optimizer.optimizer.param_groups)
    if len(sd["param_groups"]) != groups:
        raise CheckpointError(f"checkpoint {root} has {len(sd['param_groups'])} parameter group(s), this engine "
                              f"{groups}: pass initialize the param_groups of the run that saved it")


def _check_parts(rt: Runtime, root: str, manifest: dict[str, Any]) -> None:
    """The saved shards hold the state parts of the optimizer that saved them (a checkpoint
    without the field is AdamW's): another optimizer's state is refused, not half read."""
    saved = tuple(manifest.get("optimizer_parts", ADAMW.part_names))
    spec = rt.shard_optimizer.spec
    if saved != spec.part_names:
        raise CheckpointError(f"checkpoint {root} holds optimizer state {'+'.join(saved)}, this engine's optimizer "
                              f"{spec.name!r} keeps {'+'.join(spec.part_names)}: load it with the optimizer.name "
                              "that saved it")


def _read_json(path: str, crc32: int | None = None) -> Any:
    """A checkpoint's JSON file, its checksum checked when the manifest holds one."""
    raw = files.read_verified(path, Kind.JSON, value=crc32)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {why(exc)}") from None


def _read_maps(root: str, manifest: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Every writer's rank{r}.json (checksummed by the manifest since it recorded them)."""
    crcs = manifest.get("maps", {})
    return {r: _read_json(os.path.join(root, f"rank{r}.json"), crcs.get(f"rank{r}.json")) for r in manifest["writers"]}


def _verify(reader: Reader, manifest: dict[str, Any], read: set[str]) -> None:
    """The verify pass, before anything changes: every file this rank will read, and its share
    of the others (every file is verified by some rank; the ranks agree on the outcome), each
    read whole once. The apply pass reads the shard files again: a load reads them twice
    instead of staging the incoming state (memory or drive space the size of the checkpoint)."""
    rank, world = comm.rank(), comm.world_size()
    others = [n for n in sorted(manifest["files"]) if _writer(n, world) is None]
    mine = read | {n for n in manifest["files"] if _writer(n, world) == rank} | set(others[rank::world])
    for name in sorted(mine & set(manifest["files"])):
        reader.verify(name)


def _writer(name: str, world: int) -> int | None:
    """The rank that verifies a rank's own file (`rank{r}.*`, r within this world), else None."""
    head = name.split(".", 1)[0]
    r = int(head[4:]) if head.startswith("rank") and head[4:].isdigit() else None
    return r if r is not None and r < world else None


def _check_files(root: str, manifest: dict[str, Any], names: set[str]) -> None:
    """Every shard file the load will read is there, a file, and (where the manifest records
    sizes) of its saved size: named plainly before the verify pass reads any of them."""
    sizes = manifest.get("sizes", {})
    for name in sorted(names):
        full = os.path.join(root, name)
        if name not in manifest["files"]:
            raise CheckpointError(f"checkpoint file {full} is named by a shard map but not in the manifest")
        try:
            os.stat(full)
        except OSError as exc:
            raise CheckpointError(f"checkpoint file {full} cannot be read: {why(exc)}") from None
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint file {full} is not a regular file")
        files.verify(full, Kind.TENSORS, size=sizes.get(name))


def _own_buffers(saved: dict[str, torch.Tensor], model_pt: dict[str, torch.Tensor], full: str) -> dict[str, torch.Tensor]:
    """A rank's buffers file: names that model.pt holds too, each of the same shape and dtype."""
    for k, v in saved.items():
        ref = model_pt.get(k)
        if ref is None or ref.shape != v.shape or ref.dtype != v.dtype:
            raise CheckpointError(f"checkpoint file {full}: buffer {k!r} is not in model.pt as {v.dtype} {tuple(v.shape)}")
    return dict(saved)


def _resized(module: torch.nn.Module, current: dict[str, torch.Tensor], saved: dict[str, torch.Tensor],
             root: str) -> dict[str, tuple[torch.nn.Module, str]]:
    """The buffers model.pt holds in another shape than the module's now (a QAT observer's
    per-channel min/max and a FakeQuantize's scale start as one element and take the channels'
    shape in the first forward; a lazy module's buffers), each tried first on a copy of the module
    that registers it through that module's own `_load_from_state_dict`, as
    `module.load_state_dict` would load it: accepted where that resizes it to the saved shape,
    refused, in one line with torch's own message, where torch would refuse it too."""
    out: dict[str, tuple[torch.nn.Module, str]] = {}
    for key, t in current.items():
        value = saved.get(key)
        if value is None or value.shape == t.shape:
            continue  # a missing name is checked_non_trainable's to refuse
        path, _, local = key.rpartition(".")
        owner = module.get_submodule(path)
        if local not in owner._buffers:
            continue  # a frozen parameter: checked_non_trainable refuses another shape
        trial = copy.copy(owner)  # its own buffers cloned, no parameters, no children: the real one is untouched
        trial.__dict__.update(_buffers={k: None if b is None else b.clone() for k, b in owner._buffers.items()},
                              _parameters={}, _modules={})
        errors = _load_own(trial, local, value)
        if errors or trial._buffers[local].shape != value.shape:
            why_not = errors[0].splitlines()[0] if errors else f"its loader keeps shape {tuple(t.shape)}"
            raise CheckpointError(f"checkpoint {root}: model.pt's {key!r} is {tuple(value.shape)}, the model's is "
                                  f"{tuple(t.shape)}, and {type(owner).__name__}'s load_state_dict refuses it: {why_not}")
        out[key] = (owner, local)
    return out


def _load_own(owner: torch.nn.Module, local: str, value: torch.Tensor) -> list[str]:
    """One buffer through `owner`'s own `_load_from_state_dict` (not its children's), with the
    metadata version its class records in a state_dict now; returns torch's error messages."""
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []
    with torch.no_grad():
        owner._load_from_state_dict({local: value}, "", {"version": type(owner)._version}, False,
                                    missing, unexpected, errors)
    return errors


def _rng(reader: Reader, manifest: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """This rank's RNG states, checked against the manifest; from a checkpoint written before the
    manifest listed them, the file as it is (None if absent)."""
    name = f"rank{comm.rank()}.rng.pt"
    if name in manifest["files"]:
        return reader.get(name)
    full = os.path.join(reader.root, name)
    if not os.path.exists(full):
        return None
    return files.load_tensors(full)


def _read_client(root: str, manifest: dict[str, Any]) -> dict[Any, Any] | None:
    """The saved client_state, checked against the manifest's size and CRC32; None if none was saved."""
    entry = manifest.get("client_state")
    if entry is None:
        return None
    full = os.path.join(root, CLIENT_FILE)
    data = files.read_verified(full, Kind.CLIENT, entry["size"], entry["crc32"])
    return files.load_tensors(full, data)


# ---- the apply pass ---------------------------------------------------------------------------

def _apply(rt: Runtime, model: ModelView, loaded: _Load) -> None:
    """Write the checked checkpoint into the engine (no collective: the ranks agree afterwards)."""
    opt, manifest = rt.shard_optimizer, loaded.manifest
    for key, pieces in loaded.shards.items():
        parts = {part: torch.zeros(opt.numel[key], dtype=torch.float32) for part in opt.spec.part_names}
        _fill(parts, pieces, loaded.reader)
        opt.write_state(key, parts)
    for key, pieces in loaded.frozen.items():
        out = rt.read_frozen(key).clone()  # the shard's size, dtype and padding; every piece is overwritten
        _fill({"value": out}, pieces, loaded.reader)
        rt.write_frozen(key, out)
    resized = {id(owner._buffers[local]): (owner, local) for owner, local in loaded.resized.values()}
    with torch.no_grad():
        for t, saved in loaded.non_trainable:
            if id(t) in resized:
                _load_own(*resized[id(t)], saved)  # errors: none, as prepare found on a copy
            else:
                t.copy_(saved)
    # fp16's loss scaler state means nothing to another precision, nor to a static scale
    opt.load_scalars(manifest["optimizer"], same_layout=loaded.same_world,
                     scaler=manifest["precision"] == "fp16" and opt.scaler.dynamic,
                     lagging=loaded.lagging, pieces=rt.shard_map())
    rt.accumulator.reset()  # saved at a boundary: this engine's partial sums are not the checkpoint's
    if loaded.rng is not None:
        torch.set_rng_state(loaded.rng["cpu"])
        if "cuda" in loaded.rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(loaded.rng["cuda"], model.device)


def _fill(outs: dict[str, torch.Tensor], copies: list[tuple[str, int, int, int]], reader: Reader) -> None:
    """Every part of one shard from its copies, each saved file read once per run of copies."""
    for fname, src_off, dst_off, n in copies:
        data = reader.get(fname)
        for part, out in outs.items():
            src = data[part]
            if src_off + n > src.numel():
                raise CheckpointError(f"checkpoint file {os.path.join(reader.root, fname)}: tensor {part!r} holds "
                                      f"{src.numel()} elements, the shard map reads up to {src_off + n}")
            out[dst_off:dst_off + n].copy_(src[src_off:src_off + n])
