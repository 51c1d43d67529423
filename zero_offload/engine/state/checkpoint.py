"""Checkpoints: atomic, every tier's state, resharded on load, never unpickling objects.

Layout of a checkpoint directory:
  manifest.json          world size, stage, precision, step counters, hyperparameters, loss
                         scaler, parameter shapes, for every tensor file its tensors' shape, dtype
                         and CRC32, and (format 2) every tensor file's whole-file checksum and size
  rank{r}.json           rank r's shard map: for each shard key, which element ranges of which
                         parameters it holds (this is what lets a different D or bucketing load it),
                         and "lagging": the element ranges of its shards whose step count is below
                         their sub-shard's (parameters that had no gradient in some steps), by
                         parameter, with their own counts (absent in checkpoints saved before
                         per-parameter counts: every element then takes its shard's count, as the
                         engine that saved them had stepped every parameter)
  rank{r}.{key}.pt       master, m, v of one shard (one file per shard, so saving an NVMe-tier
                         state needs one shard in RAM at a time; read through the store); for a
                         frozen group inside a stage-3 unit, its compute-copy shard ("value"),
                         listed in rank{r}.json's frozen_map and resharded the same way
  rank{r}.rng.pt         that rank's RNG states (restored only when the world size is unchanged)
  rank{r}.buffers.pt     with D > 1, that rank's module buffers: ranks update them from their own
                         micro-batches (BatchNorm statistics), so they differ; restored over
                         model.pt's (rank 0's) only when the world size is unchanged
  model.pt               buffers and frozen parameters that live in the module itself
  manifest.crc32         the manifest's own CRC32 (manifest_checks.py)
  client_state.pt        what the caller passed as save_checkpoint's client_state (rank 0's: an
                         LR scheduler's state_dict, a data loader's position), if anything; its
                         size and CRC32 are in the manifest
All .pt files except client_state.pt hold plain tensors only and are read with torch.load(weights_only=True); the
manifest also holds the CRC32 of every rank{r}.json, and each rank{r}.json the whole-file checksums
of that rank's shard files ("checksums"), which the manifest gathers.

Saving happens only at a gradient-accumulation boundary (partial gradient sums are not part of a
checkpoint), so a load starts a fresh cycle and may change gradient_accumulation_steps.

Loading verifies the whole checkpoint before it changes anything: the manifest (its checksum,
every field's kind, one step count for every shard) and shard maps, the shapes of trainable and
frozen parameters, model.pt's names, shapes and dtypes, that the saved pieces cover every element,
and every file (its size and whole-file checksum, or for format 1 each tensor's CRC32, and its
tensors' shapes and dtypes): each rank the files it will read, its own rank{r}.* files and a share
of the rest, and all refuse if one does, leaving every engine as it was. Nothing is staged: the
apply pass reads each shard file again (checked again). What can only be found while the state is
being written (a file changed since it was verified, an I/O error of the engine's own store)
leaves every rank's engine refusing to train or save until a load succeeds (its state is partly
overwritten), rather than going on with a mixture.

Atomicity: everything is written into `<path>.tmp`, each file fsynced; rank 0 then moves an old
`<path>` aside to `<path>.old`, renames the new one into place, fsyncs the parent and deletes the
old one. A crash at any point leaves either `<path>` or `<path>.old` complete, and a load takes
`<path>.old` when `<path>` is missing. A save refuses a `<path>`, `<path>.tmp` or `<path>.old` that
holds anything but a checkpoint or a save's leftovers (each save marks its directory first), and a
path that is or holds the current directory. Multi-node saving needs `path` on a file system shared by
every rank: rank 0's marker holds a token every rank checks before writing, and a load checks that
every rank read the same manifest.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import secrets
import shutil
import time
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import torch
from torch import nn

from zero_offload import comm
from zero_offload.config import Config
from zero_offload.engine.runtime import ModelView, Runtime, TrainingState
from zero_offload.engine.state import manifest_checks
from zero_offload.optim.adamw import PARTS  # the saved parts are AdamW's (its spec's part names)
from zero_offload.engine.model.weights_files import refused_pickle
from zero_offload.io import checksum

FORMAT = 2  # 2: whole-file checksums (manifest "checksums"); 1 is still read, verified per tensor
READABLE = (1, 2)
MARKER = ".zero_offload_checkpoint"  # written first into every save's directory: a save's own leftovers
CLIENT_FILE = "client_state.pt"
PAUSE_ENV = "ZERO_OFFLOAD_TEST_SAVE_PAUSE"  # tests: seconds to sleep after the first shard file


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


def _saved_form(name: str, t: torch.Tensor) -> torch.Tensor:
    """What torch.save writes for `t` and what its checksum covers: a dense CPU tensor with its
    elements in order (a non-contiguous one as its contiguous copy; a CPU contiguous one as is)."""
    if t.layout != torch.strided:
        raise CheckpointError(f"save_checkpoint: {name!r} has layout {t.layout}; checkpoints hold dense (strided) "
                              "tensors only: keep it dense (.to_dense()) in the module")
    return t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()


def _crc(t: torch.Tensor) -> int:
    """CRC32 of `t`'s bytes, read in place: flattened first, since a 0-dim tensor has no
    dimension to view as bytes (every BatchNorm's num_batches_tracked)."""
    flat = _saved_form("a tensor", t).reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy()) if flat.numel() else 0


def _describe(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "crc32": _crc(t)}


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Written(NamedTuple):
    """What a load checks a written tensor file against."""

    tensors: dict[str, dict[str, Any]]  # each tensor's shape, dtype and CRC32
    checksum: int  # the whole file's (io.checksum.FileChecksum), headers included


class _Summing:
    """The file torch.save writes to, checksumming every byte on its way (no second read)."""

    def __init__(self, f: Any, total: checksum.FileChecksum) -> None:
        self.f, self.total = f, total

    def write(self, data: Any) -> int:
        self.total.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _save_tensors(tensors: dict[str, torch.Tensor], path: str) -> _Written:
    saved = {k: _saved_form(k, v) for k, v in tensors.items()}  # described as written
    total = checksum.FileChecksum()
    with _writing(path):
        # Through our own file object: torch's writer then fails with the OS error (ENOSPC) as
        # its context, instead of only "unexpected pos" when it writes to a path itself.
        with open(path, "wb") as f:
            torch.save(saved, _Summing(f, total))
            f.flush()
            os.fsync(f.fileno())
    return _Written({k: _describe(v) for k, v in saved.items()}, total.digest())


def _write_json(obj: Any, path: str) -> None:
    with _writing(path), open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
    """A failed write of `path` raises one line naming the file and the OS cause (a full disk
    otherwise surfaces as torch's "unexpected pos" or an OSError without a file name)."""
    try:
        yield
    except Exception as exc:
        cause = _os_error(exc)
        if cause is None:
            raise
        why = os.strerror(cause.errno) if cause.errno else str(cause)
        raise CheckpointError(f"could not write {path}: {why}") from exc


def _os_error(exc: BaseException | None) -> OSError | None:
    """The first OSError in `exc`'s chain of causes and contexts, if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _non_trainable(rt: Runtime, module: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers and frozen parameters that live in the module itself.

    At stage 3 frozen parameters inside units are sharded and released between uses (their tensor
    is empty here); they are saved shard by shard instead (the runtime's frozen_map).
    """
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    in_units = rt.held_params()
    return {k: v for k, v in module.state_dict(keep_vars=True).items()
            if id(v) not in trainable and id(v) not in in_units}


def save(rt: Runtime, model: ModelView, state: TrainingState, config: Config, path: str,
         client_state: dict[Any, Any] | None = None) -> None:
    """Write the engine's whole training state (its runtime's shards, `model`'s module-held
    tensors, `state`'s counters) to `path` atomically (a collective). The ranks agree
    after each phase (rank 0 making `<path>.tmp`, every rank writing its files, rank 0's manifest
    and swap), so a failure on any rank raises on all of them instead of leaving the others
    waiting; the previous checkpoint stays in place. Rank 0's `client_state` is saved beside."""
    path = _checked_path(path)
    tmp, rank = path + ".tmp", comm.rank()
    client: list[bytes | None] = [None]
    _agree(_attempt(_check_steps, rt, state) or _attempt(_check_target, path)
           or (_attempt(_serialize_client, client_state, client) if rank == 0 else None), "will not save there")
    try:
        token = secrets.token_hex(8) if rank == 0 else None
        _agree(_attempt(_make_tmp, tmp, token) if rank == 0 else None, "could not start the checkpoint")
        token = comm.gather_objects(token)[0]
        _agree(_attempt(_write_rank, rt, model, tmp, token), "could not write its part of the checkpoint")
        _agree(_attempt(_finish, rt, model, state, config, tmp, path, client[0]) if rank == 0 else None,
               "could not finish the checkpoint")
    except BaseException:
        # Every rank has agreed on the failure (or this one was interrupted): the half-written
        # save goes, so it neither fills the disk nor is mistaken for a checkpoint. The
        # previous checkpoint is `path` or, if the swap failed half way, `path.old`.
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_steps(rt: Runtime, state: TrainingState) -> None:
    """Every shard of this rank must stand at the engine's step (its steps less the skipped
    ones): a checkpoint mixing shards of two steps would resume with some weights and Adam's
    bias correction a step apart. Checked by every rank before anything is written."""
    so = rt.shard_optimizer
    want = state.global_steps - so.skipped_steps
    apart = so.mixed_steps()
    if apart is None:
        off = sorted({n for n in so.sub_steps.values() if n != want})
        if not off:
            return
        apart = f"every shard at step {off[0]}"
    raise CheckpointError(f"save_checkpoint: the optimizer shards do not all stand at the engine's step {want} "
                          f"({apart}): a step failed or was interrupted part way; load a checkpoint to go on")


def _serialize_client(state: Any, out: list[bytes | None]) -> None:
    """`state`'s bytes, checked to load back without unpickling objects (as every load reads
    it: weights_only=True), before anything is written: a scheduler holding a lambda fails
    here, in one line, not at the resume."""
    if state is None:
        return
    if not isinstance(state, dict):
        raise CheckpointError(f"save_checkpoint: client_state must be a dict, got {type(state).__name__}")
    buf = io.BytesIO()
    try:
        torch.save(state, buf)
        torch.load(io.BytesIO(buf.getvalue()), map_location="cpu", weights_only=True)
    except Exception as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [repr(exc)]
        why = next((ln for ln in lines if "Unsupported global" in ln), lines[0])  # torch names the type there
        raise CheckpointError("save_checkpoint: client_state holds something a weights-only load refuses "
                              f"(plain containers, numbers, strings and tensors only): {why}") from None
    out[0] = buf.getvalue()


def _attempt(fn: Any, *args: Any) -> Exception | None:
    """fn(*args)'s error, if any (to be agreed on by every rank), else None."""
    try:
        fn(*args)
    except Exception as exc:
        return exc
    return None


def _checked_path(path: Any) -> str:
    """The absolute path to save to (every rank is given the same argument, so every rank
    refuses a non-path alike, before any collective)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise CheckpointError(f"save_checkpoint: the path must be a non-empty str or os.PathLike, got {path!r}")
    return os.path.abspath(os.fspath(path))


def _make_tmp(tmp: str, token: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed save's, or absent (_check_target checked it)
    os.makedirs(tmp)
    with open(os.path.join(tmp, MARKER), "w") as f:
        f.write(token)


def _check_shared(tmp: str, token: str) -> None:
    """Every rank writes into rank 0's `<path>.tmp`: on a path that is not on a file system shared
    by all ranks (a node-local disk, a relative path under another working directory), a rank
    would write into a directory of its own, or a crashed save's leftover, and the checkpoint
    would lack its files. Rank 0's token in the marker says it is the same directory."""
    try:
        with open(os.path.join(tmp, MARKER)) as f:
            seen = f.read()
    except OSError:
        seen = None
    if seen != token:
        raise CheckpointError(f"save_checkpoint: {tmp} is not the directory rank 0 made: a checkpoint path must be "
                              "on a file system shared by every rank (the same absolute path on every node)")


def _write_rank(rt: Runtime, model: ModelView, tmp: str, token: str) -> None:
    """This rank's shard files and shard map (one rank at stage 0: the shards are replicated),
    and its RNG states."""
    _check_shared(tmp, token)
    opt, rank = rt.shard_optimizer, comm.rank()
    files: dict[str, dict[str, Any]] = {}
    sums: dict[str, int] = {}
    if rank == 0 or not rt.replicated:
        shard_map = rt.shard_map()
        for i, key in enumerate(shard_map):
            name = f"rank{rank}.{key}.pt"
            files[name], sums[name] = _save_tensors(opt.read_state(key), os.path.join(tmp, name))
            if i == 0 and os.environ.get(PAUSE_ENV):
                time.sleep(float(os.environ[PAUSE_ENV]))
        frozen_map = rt.frozen_map()
        for key in frozen_map:
            name = f"rank{rank}.{key}.pt"
            files[name], sums[name] = _save_tensors({"value": rt.read_frozen(key)}, os.path.join(tmp, name))
        _write_json({"shard_map": shard_map, "frozen_map": frozen_map, "files": files,
                     "checksums": {"algorithm": checksum.file_algorithm(), "files": sums},
                     "lagging": opt.lagging(shard_map)}, os.path.join(tmp, f"rank{rank}.json"))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state(model.device)
    _save_tensors(rng, os.path.join(tmp, f"rank{rank}.rng.pt"))
    if comm.world_size() > 1:
        _save_tensors(_buffers(rt, model.module), os.path.join(tmp, f"rank{rank}.buffers.pt"))


def _buffers(rt: Runtime, module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers by state_dict name (persistent ones, as model.pt holds them)."""
    ids = {id(b) for b in module.buffers()}
    return {k: v for k, v in _non_trainable(rt, module).items() if id(v) in ids}


def _check_target(path: str) -> None:
    """Saving replaces `path` as a whole, and removes `<path>.tmp` (a crashed save's) and
    `<path>.old` (the previous checkpoint, moved aside): refuse when any of them holds anything
    but a checkpoint or a save's leftovers, and a path that is or holds this rank's current
    directory (it would be renamed away from under the process; agreed, as ranks' directories
    may differ)."""
    if os.path.commonpath([path, os.getcwd()]) == path:
        raise CheckpointError(f"cannot save a checkpoint to {path}: it is or holds the current directory; "
                              "name a directory of its own")
    for target in (path, path + ".tmp", path + ".old"):
        if os.path.isfile(target) or os.path.islink(target):
            raise CheckpointError(f"cannot save a checkpoint to {path}: {target} is a file or a link")
        if os.path.isdir(target) and os.listdir(target) and not any(
                os.path.isfile(os.path.join(target, mark)) for mark in ("manifest.json", MARKER)):
            raise CheckpointError(f"cannot save a checkpoint to {path}: {target} holds files and is not a "
                                  "checkpoint (no manifest.json); saving would remove it")


def _finish(rt: Runtime, view: ModelView, state: TrainingState, config: Config, tmp: str, path: str,
            client: bytes | None = None) -> None:
    """Rank 0: the manifest (with every rank's checksums), then the atomic swap into `path`."""
    model = _save_tensors(_non_trainable(rt, view.module), os.path.join(tmp, "model.pt"))
    files, sums = {"model.pt": model.tensors}, {"model.pt": model.checksum}
    extra = {} if client is None else {"client_state": _write_client(client, tmp)}
    writers = [0] if rt.replicated else list(range(comm.world_size()))
    maps = {}
    for r in writers:
        name = f"rank{r}.json"
        with open(os.path.join(tmp, name), "rb") as f:
            raw = f.read()
        maps[name] = zlib.crc32(raw)
        files.update(json.loads(raw)["files"])
        sums.update(_same_algorithm(json.loads(raw)))
    for r in range(comm.world_size()):  # every rank wrote its RNG states (and with D > 1 its buffers)
        for name in (f"rank{r}.rng.pt", *([f"rank{r}.buffers.pt"] if comm.world_size() > 1 else [])):
            if not os.path.exists(os.path.join(tmp, name)):
                raise CheckpointError(f"save_checkpoint: rank {r}'s {name} is not in {tmp}: is the path on a file "
                                      "system shared by every rank?")
            saved = torch.load(os.path.join(tmp, name), map_location="cpu", weights_only=True)
            files[name] = {k: _describe(v) for k, v in saved.items()}
            sums[name] = checksum.file_checksum(os.path.join(tmp, name))  # a small file, just written
    sd = rt.shard_optimizer.state_dict_scalars()
    manifest = {"format": FORMAT, "world": comm.world_size(), "stage": config.stage,
                "precision": config.precision.dtype, "writers": writers,
                "micro_step": state.micro_step, "global_steps": state.global_steps,
                "optimizer": sd, "param_shapes": {k: list(v) for k, v in rt.param_shapes().items()},
                "frozen_shapes": {k: list(v) for k, v in rt.frozen_shapes().items()},
                "maps": maps, "files": files,
                "checksums": {"algorithm": checksum.file_algorithm(), "files": sums},
                "sizes": {name: os.path.getsize(os.path.join(tmp, name)) for name in files}, **extra}
    _write_json(manifest, os.path.join(tmp, "manifest.json"))
    with open(os.path.join(tmp, "manifest.json"), "rb") as f, _writing(os.path.join(tmp, manifest_checks.CRC_FILE)):
        manifest_checks.write_crc(tmp, f.read())
    _fsync_file(tmp)
    old = path + ".old"  # a checkpoint, or absent (_check_target): the new one supersedes it
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_file(os.path.dirname(path) or ".")
    shutil.rmtree(old, ignore_errors=True)


def _same_algorithm(shard_map: dict[str, Any]) -> dict[str, int]:
    """A rank's whole-file checksums, if it computed them as rank 0 does (a rank without the
    native library computes another kind: its files are then verified per tensor on load)."""
    sums = shard_map.get("checksums", {})
    return sums.get("files", {}) if sums.get("algorithm") == checksum.file_algorithm() else {}


def _write_client(data: bytes, tmp: str) -> dict[str, int]:
    path = os.path.join(tmp, CLIENT_FILE)
    with _writing(path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "crc32": zlib.crc32(data)}


def _read_client(root: str, manifest: dict[str, Any]) -> dict[Any, Any] | None:
    """The saved client_state, checked against the manifest's size and CRC32; None if none was saved."""
    entry = manifest.get("client_state")
    if entry is None:
        return None
    full = os.path.join(root, CLIENT_FILE)
    try:
        with open(full, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {full}: {_why(exc)}") from None
    if len(data) != entry["size"] or zlib.crc32(data) != entry["crc32"]:
        raise CheckpointError(f"checkpoint file {full}: its size or checksum differs from the manifest")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"checkpoint file {full}: {refused_pickle(exc)}") from None
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint file {full}: {_why(exc)}") from None


def _resolve(path: str) -> str:
    path = os.path.abspath(path)
    for cand in (path, path + ".old"):
        if os.path.isfile(os.path.join(cand, "manifest.json")):
            return cand
    raise CheckpointError(f"no checkpoint at {path}: manifest.json is missing")


def _read_json(path: str, crc32: int | None = None) -> Any:
    """A checkpoint's JSON file, its checksum checked when the manifest holds one."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if crc32 is not None and zlib.crc32(raw) != crc32:
            raise CheckpointError(f"checkpoint file {path} fails its checksum")
        return json.loads(raw)
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {_why(exc)}") from None


def _why(exc: BaseException) -> str:
    """An error in one line that says something even when its message is empty."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class _Reader:
    """Reads the tensor files of one checkpoint, each checked against the manifest whenever it is
    read: its size, its whole-file checksum where the manifest holds one of this process's kind
    (else, as format 1, every tensor's CRC32), and every tensor's shape and dtype. The verify
    pass reads a file and keeps nothing; the apply pass reads it again, checked again (a file
    that changed in between fails then)."""

    def __init__(self, root: str, manifest: dict[str, Any]) -> None:
        self.root, self.files, self._cache = root, manifest["files"], {}
        self.sizes: dict[str, int] = manifest.get("sizes", {})
        sums = manifest.get("checksums", {})
        self.sums: dict[str, int] = sums.get("files", {}) if sums.get("algorithm") == checksum.file_algorithm() else {}

    def verify(self, name: str) -> None:
        self._read(name)

    def get(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._cache:
            self._cache = {}  # one shard file mapped at a time
            self._cache[name] = self._read(name)
        return self._cache[name]

    def _read(self, name: str) -> dict[str, torch.Tensor]:
        full = os.path.join(self.root, name)
        if name not in self.files:
            raise CheckpointError(f"checkpoint file {full} is not in the manifest")
        try:
            if name in self.sizes and os.path.getsize(full) != self.sizes[name]:
                raise CheckpointError(f"checkpoint file {full} has {os.path.getsize(full)} bytes, the manifest says "
                                      f"{self.sizes[name]} (truncated or replaced)")
            if name in self.sums and checksum.file_checksum(full) != self.sums[name]:
                raise CheckpointError(f"checkpoint file {full} fails its checksum (damaged or replaced): load "
                                      "another checkpoint")
        except OSError as exc:
            raise CheckpointError(f"checkpoint file {full} cannot be read: {_why(exc)}") from None
        data = _load_tensors(full)
        for k, meta in self.files[name].items():
            t = data.get(k) if isinstance(data, dict) else None
            seen = None if not isinstance(t, torch.Tensor) else _describe(t) if name not in self.sums else _kind(t)
            if seen is None or any(seen[f] != meta.get(f) for f in seen):
                raise CheckpointError(f"checkpoint file {full}: tensor {k!r} is missing, or its shape, dtype or "
                                      "checksum differs from the manifest")
        return data


def _kind(t: torch.Tensor) -> dict[str, Any]:
    """A tensor's shape and dtype as the manifest records them (its bytes are the file checksum's)."""
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}


def _load_tensors(full: str) -> Any:
    """A checkpoint's tensor file, memory-mapped (its bytes are read where they are copied) and
    weights-only; a refused pickle is our one line, never torch's advice to disable weights_only."""
    try:
        return torch.load(full, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"checkpoint file {full}: {refused_pickle(exc)}") from None
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint file {full}: {_why(exc)}") from None


def _check_shapes(root: str, what: str, current: dict[str, Any], saved: dict[str, Any]) -> None:
    now = {k: tuple(v) for k, v in current.items()}
    then = {k: tuple(v) for k, v in saved.items()}
    if now != then:
        diff = sorted(set(now.items()) ^ set(then.items()))[:3]
        raise CheckpointError(f"checkpoint {root} does not match the model's {what}: {diff}")


@dataclass
class _Load:
    """Everything a load writes, read and checked before it writes anything."""

    root: str
    manifest: dict[str, Any]
    reader: "_Reader"
    shards: dict[str, list[tuple[str, int, int, int]]]
    frozen: dict[str, list[tuple[str, int, int, int]]]
    non_trainable: list[tuple[torch.Tensor, torch.Tensor]]
    rng: dict[str, torch.Tensor] | None
    same_world: bool
    client_state: dict[Any, Any] | None = None
    lagging: dict[str, list[list[int]]] | None = None  # every writer's, by parameter name


def prepare_load(rt: Runtime, model: ModelView, config: Config, path: str) -> "_Load":
    """Read and verify the checkpoint at `path`, which may come from another world size or tier
    config, for this engine. Every rank verifies everything before any rank changes anything, and
    the ranks agree on the outcome, so a checkpoint one rank refuses is refused by all (none is
    left waiting in a collective) and leaves every engine as it was; see the module docstring.
    Nothing is written: apply_load does that, once the facade has marked the load in progress."""
    plan, refused = None, None
    try:
        plan = _prepare(rt, model, config, path)
    except Exception as exc:
        refused = exc if isinstance(exc, CheckpointError) else CheckpointError(f"checkpoint {path}: {exc!r}")
    _agree(refused, "refused the checkpoint")
    assert plan is not None
    _same_checkpoint(plan.root)
    return plan


def apply_load(rt: Runtime, model: ModelView, config: Config, plan: "_Load") -> TrainingState:
    """Write the verified checkpoint into the runtime and the module (the ranks agree on the
    outcome) and rebuild the compute copy; returns the counters the Engine takes. A failure from
    here on leaves a mixture: the facade refuses to train until a load succeeds."""
    _agree(_attempt(_apply, rt, model, plan), "failed part way through loading the checkpoint")
    rt.refresh_params()
    steps = plan.manifest["global_steps"]
    return TrainingState(global_steps=steps, micro_step=steps * config.gradient_accumulation_steps)  # a fresh cycle


def _same_checkpoint(root: str) -> None:
    """Every rank resolved `path` on its own: node-local copies that differ (another step's), or
    `path` on one rank and `path.old` on another, would load a mixture. The manifests' bytes
    must be equal on every rank (they name every file's checksum)."""
    try:
        with open(os.path.join(root, "manifest.json"), "rb") as f:
            mine: int | None = zlib.crc32(f.read())
    except OSError:  # still agreed: every rank reaches the gather
        mine = None
    seen = comm.gather_objects((mine, root))
    if any(crc != seen[0][0] for crc, _ in seen):
        where = ", ".join(f"rank {r}: {d} (manifest crc32 {c})" for r, (c, d) in enumerate(seen))
        raise CheckpointError(f"the ranks found different checkpoints ({where}): load from a path on a file "
                              "system shared by every rank, or identical copies")


def _agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank has an error: its own, or the first other rank's."""
    errors = comm.gather_objects(None if error is None else str(error))
    if error is not None:
        raise error
    for r, message in enumerate(errors):
        if message is not None:
            raise CheckpointError(f"rank {r} {what}: {message}")


def _prepare(rt: Runtime, model: ModelView, config: Config, path: str) -> _Load:
    root = _resolve(path)
    try:
        crc = manifest_checks.saved_crc(root)
    except (OSError, UnicodeDecodeError, manifest_checks.ManifestError) as exc:
        raise CheckpointError(f"checkpoint {root}: cannot read {manifest_checks.CRC_FILE}: {_why(exc)}") from None
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
    _check_frozen_home(rt, model.module, config.stage, root, manifest["stage"])
    _check_shapes(root, "trainable parameters", rt.param_shapes(), manifest["param_shapes"])
    if "frozen_shapes" in manifest:  # older checkpoints: stage-3 frozen shards stay as initialized
        _check_shapes(root, "frozen parameters", rt.frozen_shapes(), manifest["frozen_shapes"])
    sd = manifest["optimizer"]
    if not all(isinstance(sd.get(k), t) for k, t in (("steps", dict), ("param_groups", list), ("scaler", dict))):
        raise CheckpointError(f"checkpoint {root}: the manifest's optimizer entry is malformed")
    groups = len(rt.shard_optimizer.optimizer.param_groups)
    if len(sd["param_groups"]) != groups:
        raise CheckpointError(f"checkpoint {root} has {len(sd['param_groups'])} parameter group(s), this engine "
                              f"{groups}: pass initialize the param_groups of the run that saved it")
    reader = _Reader(root, manifest)
    maps = _read_maps(root, manifest)
    same_world = manifest["world"] == comm.world_size()
    shards = _plan(maps, "shard_map", rt.shard_map())
    frozen = _plan(maps, "frozen_map", rt.frozen_map()) if "frozen_shapes" in manifest else {}
    read = {f for copies in (*shards.values(), *frozen.values()) for f, *_ in copies}
    _check_files(root, manifest, read)
    _verify(reader, manifest, read)
    module_held = dict(reader.get("model.pt"))
    own = f"rank{comm.rank()}.buffers.pt"
    if same_world and own in manifest["files"]:  # this rank's own buffers, as it left them
        module_held.update(_own_buffers(reader.get(own), module_held, os.path.join(root, own)))
    return _Load(root, manifest, reader, shards, frozen, _checked_non_trainable(rt, model.module, module_held, root),
                 _rng(reader, manifest) if same_world else None, same_world, _read_client(root, manifest),
                 _lagging(root, maps))


def _verify(reader: _Reader, manifest: dict[str, Any], read: set[str]) -> None:
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


def _own_buffers(saved: dict[str, torch.Tensor], model_pt: dict[str, torch.Tensor], full: str) -> dict[str, torch.Tensor]:
    """A rank's buffers file: names that model.pt holds too, each of the same shape and dtype."""
    for k, v in saved.items():
        ref = model_pt.get(k)
        if ref is None or ref.shape != v.shape or ref.dtype != v.dtype:
            raise CheckpointError(f"checkpoint file {full}: buffer {k!r} is not in model.pt as {v.dtype} {tuple(v.shape)}")
    return dict(saved)


def _check_frozen_home(rt: Runtime, module: nn.Module, stage: int, root: str, saved_stage: int) -> None:
    """Stages 0-2 keep frozen parameters in the module (model.pt), stage 3 shards them inside
    their units (frozen_map): a checkpoint crosses between the two only without any. `stage` is
    this engine's, for the message; the runtime says where its frozen parameters live."""
    if (saved_stage == 3) == rt.shards_frozen():
        return
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    if frozen:
        raise CheckpointError(f"checkpoint {root} was saved at stage {saved_stage}, which keeps frozen parameters "
                              f"{'sharded in their units' if saved_stage == 3 else 'in model.pt'}; loading it at stage "
                              f"{stage} with frozen parameters ({frozen[:3]}) is not supported: load it "
                              f"at stage {'3' if saved_stage == 3 else '0, 1 or 2'}")


def _check_files(root: str, manifest: dict[str, Any], names: set[str]) -> None:
    """Every shard file the load will read is there, a file, and (where the manifest records
    sizes) of its saved size: named plainly before the verify pass reads any of them."""
    sizes = manifest.get("sizes", {})
    for name in sorted(names):
        full = os.path.join(root, name)
        if name not in manifest["files"]:
            raise CheckpointError(f"checkpoint file {full} is named by a shard map but not in the manifest")
        try:
            st = os.stat(full)
        except OSError as exc:
            raise CheckpointError(f"checkpoint file {full} cannot be read: {_why(exc)}") from None
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint file {full} is not a regular file")
        if name in sizes and st.st_size != sizes[name]:
            raise CheckpointError(f"checkpoint file {full} has {st.st_size} bytes, the manifest says {sizes[name]} "
                                  "(truncated or replaced)")


def _apply(rt: Runtime, model: ModelView, plan: _Load) -> None:
    """Write the checked checkpoint into the engine (no collective: the ranks agree afterwards)."""
    opt, manifest = rt.shard_optimizer, plan.manifest
    for key, pieces in plan.shards.items():
        parts = {part: torch.zeros(opt.numel[key], dtype=torch.float32) for part in PARTS}
        _fill(parts, pieces, plan.reader)
        opt.write_state(key, parts)
    for key, pieces in plan.frozen.items():
        out = rt.read_frozen(key).clone()  # the shard's size, dtype and padding; every piece is overwritten
        _fill({"value": out}, pieces, plan.reader)
        rt.write_frozen(key, out)
    with torch.no_grad():
        for t, saved in plan.non_trainable:
            t.copy_(saved)
    # fp16's loss scaler state means nothing to another precision, nor to a static scale
    opt.load_scalars(manifest["optimizer"], same_layout=plan.same_world,
                     scaler=manifest["precision"] == "fp16" and opt.scaler.dynamic,
                     lagging=plan.lagging, pieces=rt.shard_map())
    rt.accumulator.reset()  # saved at a boundary: this engine's partial sums are not the checkpoint's
    if plan.rng is not None:
        torch.set_rng_state(plan.rng["cpu"])
        if "cuda" in plan.rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(plan.rng["cuda"], model.device)


def _lagging(root: str, maps: dict[int, dict[str, Any]]) -> dict[str, list[list[int]]]:
    """Every writer's lagging step counts, by parameter (see the module docstring), checked."""
    out: dict[str, list[list[int]]] = {}
    for r, m in maps.items():
        saved = m.get("lagging", {})
        if not manifest_checks.lagging_table(saved):
            raise CheckpointError(f"checkpoint {root}: rank{r}.json: lagging is {str(saved)[:40]!r}, expected "
                                  "parameter names to lists of [offset, numel, step count]")
        for name, runs in saved.items():
            out.setdefault(name, []).extend(runs)
    return out


def _read_maps(root: str, manifest: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Every writer's rank{r}.json (checksummed by the manifest since it recorded them)."""
    crcs = manifest.get("maps", {})
    return {r: _read_json(os.path.join(root, f"rank{r}.json"), crcs.get(f"rank{r}.json")) for r in manifest["writers"]}


def _plan(maps: dict[int, dict[str, Any]], which: str,
          current: dict[str, list[tuple[str, int, int, int]]]) -> dict[str, list[tuple[str, int, int, int]]]:
    """For each of this engine's shard keys, the (file, source offset, shard offset, numel) copies
    that fill it, checked to cover every element of every piece before anything is read."""
    index: dict[str, list[tuple[str, int, int, int]]] = {}  # param name -> saved (file, param off, shard off, n)
    for r, m in maps.items():
        for key, pieces in m.get(which, {}).items():
            for name, poff, soff, n in pieces:
                index.setdefault(name, []).append((f"rank{r}.{key}.pt", poff, soff, n))
    plan: dict[str, list[tuple[str, int, int, int]]] = {}
    for key, pieces in current.items():
        copies = plan.setdefault(key, [])
        for name, poff, soff, n in pieces:
            covered = 0
            for fname, opoff, osoff, on in index.get(name, []):
                lo, hi = max(poff, opoff), min(poff + n, opoff + on)
                if lo < hi:
                    copies.append((fname, osoff + lo - opoff, soff + lo - poff, hi - lo))
                    covered += hi - lo
            if covered != n:
                raise CheckpointError(f"checkpoint holds {covered} of {n} elements of {name!r} ({which})")
    return plan


def _fill(outs: dict[str, torch.Tensor], copies: list[tuple[str, int, int, int]], reader: _Reader) -> None:
    """Every part of one shard from its copies, each saved file read once per run of copies."""
    for fname, src_off, dst_off, n in copies:
        data = reader.get(fname)
        for part, out in outs.items():
            src = data[part]
            if src_off + n > src.numel():
                raise CheckpointError(f"checkpoint file {os.path.join(reader.root, fname)}: tensor {part!r} holds "
                                      f"{src.numel()} elements, the shard map reads up to {src_off + n}")
            out[dst_off:dst_off + n].copy_(src[src_off:src_off + n])


def _checked_non_trainable(rt: Runtime, module: nn.Module, saved: dict[str, torch.Tensor],
                           root: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(module tensor, saved value) for every buffer and module-held frozen parameter, after
    checking that model.pt holds exactly these names with the same shapes, and the same dtype
    (a floating-point one may come from another float precision)."""
    current = _non_trainable(rt, module)
    if set(saved) != set(current):
        diff = sorted(set(saved) ^ set(current))[:3]
        raise CheckpointError(f"checkpoint {root}: model.pt's buffers and frozen parameters differ from the model's: {diff}")
    pairs = []
    for k, t in current.items():
        v = saved[k]
        same_kind = v.dtype == t.dtype or (v.dtype.is_floating_point and t.dtype.is_floating_point)
        if v.shape != t.shape or not same_kind:
            raise CheckpointError(f"checkpoint {root}: model.pt's {k!r} is {v.dtype} {tuple(v.shape)}, "
                                  f"the model's is {t.dtype} {tuple(t.shape)}")
        pairs.append((t, v))
    return pairs


def _rng(reader: _Reader, manifest: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """This rank's RNG states, checked against the manifest; from a checkpoint written before the
    manifest listed them, the file as it is (None if absent)."""
    name = f"rank{comm.rank()}.rng.pt"
    if name in manifest["files"]:
        return reader.get(name)
    full = os.path.join(reader.root, name)
    if not os.path.exists(full):
        return None
    return _load_tensors(full)
