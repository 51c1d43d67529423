"""Checkpoints: atomic, every tier's state, resharded on load, never unpickling objects.

Layout of a checkpoint directory:
  manifest.json          world size, stage, precision, step counters, hyperparameters, loss
                         scaler, parameter shapes, and for every tensor file its shape, dtype and
                         CRC32 (checked on load)
  rank{r}.json           rank r's shard map: for each shard key, which element ranges of which
                         parameters it holds (this is what lets a different D or bucketing load it)
  rank{r}.{key}.pt       master, m, v of one shard (one file per shard, so saving an NVMe-tier
                         state needs one shard in RAM at a time; read through the store); for a
                         frozen group inside a stage-3 unit, its compute-copy shard ("value"),
                         listed in rank{r}.json's frozen_map and resharded the same way
  rank{r}.rng.pt         that rank's RNG states (restored only when the world size is unchanged)
  model.pt               buffers and frozen parameters that live in the module itself
All .pt files hold plain tensors only and are read with torch.load(weights_only=True).

Atomicity: everything is written into `<path>.tmp`, each file fsynced; rank 0 then moves an old
`<path>` aside to `<path>.old`, renames the new one into place, fsyncs the parent and deletes the
old one. A crash at any point leaves either `<path>` or `<path>.old` complete, and load() takes
`<path>.old` when `<path>` is missing. Multi-node saving needs `path` on a shared file system.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from typing import TYPE_CHECKING, Any

import torch

from zero_offload import comm
from zero_offload.engine.step import PARTS

if TYPE_CHECKING:
    from zero_offload.engine.engine import Engine

FORMAT = 1
PAUSE_ENV = "ZERO_OFFLOAD_TEST_SAVE_PAUSE"  # tests: seconds to sleep after the first shard file


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy().tobytes())


def _describe(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "crc32": _crc(t)}


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_tensors(tensors: dict[str, torch.Tensor], path: str) -> dict[str, dict[str, Any]]:
    torch.save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, path)
    _fsync_file(path)
    return {k: _describe(v) for k, v in tensors.items()}


def _write_json(obj: Any, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _non_trainable(engine: "Engine") -> dict[str, torch.Tensor]:
    """Buffers and frozen parameters that live in the module itself.

    At stage 3 frozen parameters inside units are sharded and released between uses (their tensor
    is empty here); they are saved shard by shard instead (the runtime's frozen_map).
    """
    trainable = {id(p) for p in engine.module.parameters() if p.requires_grad}
    in_units = set()
    if engine.config.stage == 3:
        in_units = {id(p) for u in engine.runtime.units for g in u.groups for p in g.params}
    return {k: v for k, v in engine.module.state_dict(keep_vars=True).items()
            if id(v) not in trainable and id(v) not in in_units}


def save(engine: "Engine", path: str) -> None:
    """Write `engine`'s whole training state to `path` atomically (a collective)."""
    rt, opt = engine.runtime, engine.runtime.shard_optimizer
    path = os.path.abspath(path)
    tmp, rank = path + ".tmp", comm.rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    comm.barrier()
    files: dict[str, dict[str, Any]] = {}
    if rank == 0 or not rt.replicated:
        shard_map = rt.shard_map()
        for i, key in enumerate(shard_map):
            name = f"rank{rank}.{key}.pt"
            files[name] = _save_tensors(opt.read_state(key), os.path.join(tmp, name))
            if i == 0 and os.environ.get(PAUSE_ENV):
                time.sleep(float(os.environ[PAUSE_ENV]))
        frozen_map = rt.frozen_map()
        for key in frozen_map:
            name = f"rank{rank}.{key}.pt"
            files[name] = _save_tensors({"value": rt.read_frozen(key)}, os.path.join(tmp, name))
        _write_json({"shard_map": shard_map, "frozen_map": frozen_map, "files": files},
                    os.path.join(tmp, f"rank{rank}.json"))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state(engine.device)
    _save_tensors(rng, os.path.join(tmp, f"rank{rank}.rng.pt"))
    comm.barrier()
    if rank == 0:
        _finish(engine, tmp, path)
    comm.barrier()


def _finish(engine: "Engine", tmp: str, path: str) -> None:
    """Rank 0: the manifest (with every rank's checksums), then the atomic swap into `path`."""
    rt = engine.runtime
    files = {"model.pt": _save_tensors(_non_trainable(engine), os.path.join(tmp, "model.pt"))}
    writers = [0] if rt.replicated else list(range(comm.world_size()))
    for r in writers:
        with open(os.path.join(tmp, f"rank{r}.json")) as f:
            files.update(json.load(f)["files"])
    sd = rt.shard_optimizer.state_dict_scalars()
    manifest = {"format": FORMAT, "world": comm.world_size(), "stage": engine.config.stage,
                "precision": engine.config.precision.dtype, "writers": writers,
                "micro_step": engine.micro_step, "global_steps": engine.global_steps,
                "optimizer": sd, "param_shapes": {k: list(v) for k, v in rt.param_shapes().items()},
                "frozen_shapes": {k: list(v) for k, v in rt.frozen_shapes().items()},
                "files": files}
    _write_json(manifest, os.path.join(tmp, "manifest.json"))
    _fsync_file(tmp)
    old = path + ".old"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_file(os.path.dirname(path) or ".")
    shutil.rmtree(old, ignore_errors=True)


def _resolve(path: str) -> str:
    path = os.path.abspath(path)
    for cand in (path, path + ".old"):
        if os.path.isfile(os.path.join(cand, "manifest.json")):
            return cand
    raise CheckpointError(f"no checkpoint at {path}: manifest.json is missing")


class _Reader:
    """Reads tensor files of one checkpoint lazily, checking each against the manifest."""

    def __init__(self, root: str, manifest: dict[str, Any]) -> None:
        self.root, self.files, self._cache = root, manifest["files"], {}

    def get(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._cache:
            full = os.path.join(self.root, name)
            if name not in self.files:
                raise CheckpointError(f"checkpoint file {full} is not in the manifest")
            try:
                data = torch.load(full, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise CheckpointError(f"cannot read checkpoint file {full}: {exc}") from None
            for k, meta in self.files[name].items():
                if k not in data or _crc(data[k]) != meta["crc32"] or list(data[k].shape) != meta["shape"]:
                    raise CheckpointError(f"checkpoint file {full}: tensor {k!r} is missing or fails its checksum")
            self._cache = {name: data}  # one shard file in memory at a time
        return self._cache[name]


def load(engine: "Engine", path: str) -> None:
    """Restore `engine` from `path`, which may come from another world size or tier config."""
    rt, opt = engine.runtime, engine.runtime.shard_optimizer
    root = _resolve(path)
    with open(os.path.join(root, "manifest.json")) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {root} has format {manifest.get('format')}, expected {FORMAT}")
    shapes = {k: tuple(v) for k, v in rt.param_shapes().items()}
    saved = {k: tuple(v) for k, v in manifest["param_shapes"].items()}
    if shapes != saved:
        diff = sorted(set(shapes.items()) ^ set(saved.items()))[:3]
        raise CheckpointError(f"checkpoint {root} does not match the model's trainable parameters: {diff}")
    reader = _Reader(root, manifest)
    index = _old_pieces(root, manifest["writers"])
    for key, pieces in rt.shard_map().items():
        parts = {part: torch.zeros(opt.numel[key], dtype=torch.float32) for part in PARTS}
        for part, out in parts.items():
            for name, poff, soff, n in pieces:
                _fill(out, soff, name, poff, n, index, reader, part)
        opt.write_state(key, parts)
    _load_frozen(engine, root, manifest, reader)
    _load_non_trainable(engine, reader.get("model.pt"))
    same_world = manifest["world"] == comm.world_size()
    opt.load_scalars(manifest["optimizer"], same_layout=same_world)
    engine.micro_step, engine.global_steps = manifest["micro_step"], manifest["global_steps"]
    rng_file = os.path.join(root, f"rank{comm.rank()}.rng.pt")
    if same_world and os.path.exists(rng_file):
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"], engine.device)
    rt.refresh_params()
    comm.barrier()


def _load_frozen(engine: "Engine", root: str, manifest: dict[str, Any], reader: _Reader) -> None:
    """Stage-3 frozen groups: their shards, resharded like the optimizer's. A checkpoint written
    before frozen shards were saved has no frozen_shapes: their values stay as initialized."""
    rt = engine.runtime
    if "frozen_shapes" not in manifest:
        return
    shapes = {k: tuple(v) for k, v in rt.frozen_shapes().items()}
    saved = {k: tuple(v) for k, v in manifest["frozen_shapes"].items()}
    if shapes != saved:
        diff = sorted(set(shapes.items()) ^ set(saved.items()))[:3]
        raise CheckpointError(f"checkpoint {root} does not match the model's frozen parameters: {diff}")
    index = _old_pieces(root, manifest["writers"], "frozen_map")
    for key, pieces in rt.frozen_map().items():
        out = rt.read_frozen(key).clone()  # the shard's size, dtype and padding; every piece is overwritten
        for name, poff, soff, n in pieces:
            _fill(out, soff, name, poff, n, index, reader, "value")
        rt.write_frozen(key, out)


def _old_pieces(root: str, writers: list[int], which: str = "shard_map") -> dict[str, list[tuple[str, int, int, int]]]:
    """param name -> [(shard file, param_offset, shard_offset, numel)] over every saved shard."""
    index: dict[str, list[tuple[str, int, int, int]]] = {}
    for r in writers:
        with open(os.path.join(root, f"rank{r}.json")) as f:
            shard_map = json.load(f).get(which, {})
        for key, pieces in shard_map.items():
            for name, poff, soff, n in pieces:
                index.setdefault(name, []).append((f"rank{r}.{key}.pt", poff, soff, n))
    return index


def _fill(out: torch.Tensor, soff: int, name: str, poff: int, n: int,
          index: dict[str, list[tuple[str, int, int, int]]], reader: _Reader, part: str) -> None:
    """Copy elements [poff, poff+n) of parameter `name` from the saved shards into out[soff:]."""
    covered = 0
    for fname, opoff, osoff, on in index.get(name, []):
        lo, hi = max(poff, opoff), min(poff + n, opoff + on)
        if lo < hi:
            src = reader.get(fname)[part]
            out[soff + lo - poff: soff + hi - poff].copy_(src[osoff + lo - opoff: osoff + hi - opoff])
            covered += hi - lo
    if covered != n:
        raise CheckpointError(f"checkpoint holds {covered} of {n} elements of {name!r} ({part})")


def _load_non_trainable(engine: "Engine", tensors: dict[str, torch.Tensor]) -> None:
    current = _non_trainable(engine)
    with torch.no_grad():
        for k, t in current.items():
            if k in tensors:
                t.copy_(tensors[k])


def _trainable_names(engine: "Engine") -> set[str]:
    return {n for n, p in engine.module.named_parameters() if p.requires_grad}


def consolidated_state_dict(engine: "Engine") -> dict[str, torch.Tensor]:
    """Full fp32 weights on rank 0 (buffers in their original dtype); {} on other ranks."""
    rt, opt = engine.runtime, engine.runtime.shard_optimizer
    if engine.config.stage == 3:
        full = rt.consolidated_state_dict()  # a collective: every rank gathers
        if comm.rank() != 0:
            return {}
        trainable = _trainable_names(engine)
        return {k: v if k in trainable else v.to(engine.orig_dtypes.get(k, v.dtype)) for k, v in full.items()}
    shapes = rt.param_shapes()
    full = {name: torch.zeros(torch.Size(shape).numel(), dtype=torch.float32) for name, shape in shapes.items()}
    if comm.rank() == 0 or not rt.replicated:
        for key, pieces in rt.shard_map().items():
            master = opt.master(key)
            for name, poff, soff, n in pieces:
                full[name][poff:poff + n].copy_(master[soff:soff + n])
    if not rt.replicated:
        for t in full.values():
            comm.all_reduce_(t)
    if comm.rank() != 0:
        return {}
    by_id = {id(p): n for n, p in engine.module.named_parameters() if p.requires_grad}
    out = {}
    for k, v in engine.module.state_dict(keep_vars=True).items():
        if id(v) in by_id:
            out[k] = full[by_id[id(v)]].view(v.shape).clone()
        else:
            out[k] = v.detach().to("cpu", engine.orig_dtypes[k]).clone()
    return out
