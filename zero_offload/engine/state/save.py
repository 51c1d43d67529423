"""Saving a checkpoint (the layout and the atomic swap: checkpoint.py's docstring): every rank
checks, then writes its own files into rank 0's `<path>.tmp`; rank 0 writes model.pt and the
manifest (with every file's checksum) and swaps the directory into place. Files are written
through files.py's durable writer; the phases are agreed on by every rank (common.agree)."""
from __future__ import annotations

import io
import json
import os
import secrets
import shutil
import time
from typing import Any

import torch
from torch import nn

from zero_offload import comm
from zero_offload.config import Config
from zero_offload.engine.runtime import ModelView, Runtime, TrainingState
from zero_offload.engine.state import files, manifest_checks
from zero_offload.engine.state.common import agree, attempt, non_trainable
from zero_offload.engine.state.files import CLIENT_FILE, FORMAT, MARKER, CheckpointError, Kind
from zero_offload.io import checksum

PAUSE_ENV = "ZERO_OFFLOAD_TEST_SAVE_PAUSE"  # tests: seconds to sleep after the first shard file


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
    agree(attempt(_check_steps, rt, state) or _attempt(_check_target, path, path)
          or (attempt(_serialize_client, client_state, client) if rank == 0 else None), "will not save there")
    try:
        token = secrets.token_hex(8) if rank == 0 else None
        agree(_attempt(_make_tmp, tmp, tmp, token) if rank == 0 else None, "could not start the checkpoint")
        token = comm.gather_objects(token)[0]
        agree(_attempt(_write_rank, tmp, rt, model, tmp, token), "could not write its part of the checkpoint")
        agree(_attempt(_finish, tmp, rt, model, state, config, tmp, path, client[0]) if rank == 0 else None,
              "could not finish the checkpoint")
    except BaseException:
        # Every rank has agreed on the failure (or this one was interrupted): the half-written
        # save goes, so it neither fills the disk nor is mistaken for a checkpoint. The
        # previous checkpoint is `path` or, if the swap failed half way, `path.old`.
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _attempt(fn: Any, where: str, *args: Any) -> Exception | None:
    """attempt(fn, *args), a bare OSError (a read-only or full drive, outside the durable
    writer: making `<path>.tmp`, the swap's renames) made the CheckpointError that names its
    file and drive (`where` when the error names none)."""
    err = attempt(fn, *args)
    return files.os_failure(err, where) if isinstance(err, OSError) else err


# ---- before anything is written ---------------------------------------------------------------

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


def _checked_path(path: Any) -> str:
    """The absolute path to save to (every rank is given the same argument, so every rank
    refuses a non-path alike, before any collective)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise CheckpointError(f"save_checkpoint: the path must be a non-empty str or os.PathLike, got {path!r}")
    return os.path.abspath(os.fspath(path))


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


# ---- every rank's files -----------------------------------------------------------------------

def _write_rank(rt: Runtime, model: ModelView, tmp: str, token: str) -> None:
    """This rank's shard files and shard map (one rank at stage 0: the shards are replicated),
    and its RNG states."""
    _check_shared(tmp, token)
    opt, rank = rt.shard_optimizer, comm.rank()
    described: dict[str, dict[str, Any]] = {}
    sums: dict[str, int] = {}
    if rank == 0 or not rt.replicated:
        shard_map = rt.shard_map()
        for i, key in enumerate(shard_map):
            name = f"rank{rank}.{key}.pt"
            described[name], sums[name] = files.save_tensors(opt.read_state(key), os.path.join(tmp, name))
            if i == 0 and os.environ.get(PAUSE_ENV):
                time.sleep(float(os.environ[PAUSE_ENV]))
        frozen_map = rt.frozen_map()
        for key in frozen_map:
            name = f"rank{rank}.{key}.pt"
            described[name], sums[name] = files.save_tensors({"value": rt.read_frozen(key)}, os.path.join(tmp, name))
        _write_json({"shard_map": shard_map, "frozen_map": frozen_map, "files": described,
                     "checksums": {"algorithm": checksum.file_algorithm(), "files": sums},
                     "lagging": opt.lagging(shard_map)}, os.path.join(tmp, f"rank{rank}.json"))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state(model.device)
    files.save_tensors(rng, os.path.join(tmp, f"rank{rank}.rng.pt"))
    if comm.world_size() > 1:
        files.save_tensors(_buffers(rt, model.module), os.path.join(tmp, f"rank{rank}.buffers.pt"))


def _buffers(rt: Runtime, module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers by state_dict name (persistent ones, as model.pt holds them)."""
    ids = {id(b) for b in module.buffers()}
    return {k: v for k, v in non_trainable(rt, module).items() if id(v) in ids}


def _write_json(obj: Any, path: str) -> None:
    with files.durable(path, "w") as f:
        json.dump(obj, f, indent=1)


# ---- rank 0: the manifest and the swap --------------------------------------------------------

def _finish(rt: Runtime, view: ModelView, state: TrainingState, config: Config, tmp: str, path: str,
            client: bytes | None = None) -> None:
    """Rank 0: the manifest (with every rank's checksums), then the atomic swap into `path`."""
    model = files.save_tensors(non_trainable(rt, view.module), os.path.join(tmp, "model.pt"))
    described, sums = {"model.pt": model.tensors}, {"model.pt": model.checksum}
    extra = {} if client is None else {"client_state": _write_client(client, tmp)}
    writers = [0] if rt.replicated else list(range(comm.world_size()))
    maps = _gather_maps(tmp, writers, described, sums)
    _gather_rank_files(tmp, described, sums)
    manifest = {"format": FORMAT, "world": comm.world_size(), "stage": config.stage,
                "precision": config.precision.dtype, "writers": writers,
                "micro_step": state.micro_step, "global_steps": state.global_steps,
                "optimizer": rt.shard_optimizer.state_dict_scalars(),
                "optimizer_parts": list(rt.shard_optimizer.spec.part_names),  # whose state the shards hold
                "param_shapes": {k: list(v) for k, v in rt.param_shapes().items()},
                "frozen_shapes": {k: list(v) for k, v in rt.frozen_shapes().items()},
                "maps": maps, "files": described,
                "checksums": {"algorithm": checksum.file_algorithm(), "files": sums},
                "sizes": {name: os.path.getsize(os.path.join(tmp, name)) for name in described}, **extra}
    _write_json(manifest, os.path.join(tmp, "manifest.json"))
    with open(os.path.join(tmp, "manifest.json"), "rb") as f, files.writing(os.path.join(tmp, manifest_checks.CRC_FILE)):
        raw = f.read()
    manifest_checks.write_crc(tmp, raw)
    files.swap_into_place(tmp, path)


def _gather_maps(tmp: str, writers: list[int], described: dict[str, Any], sums: dict[str, int]) -> dict[str, int]:
    """Every writer's shard map's CRC-32 (the manifest's "maps"), its files' descriptions and its
    whole-file checksums (if computed as rank 0 computes them) added to the manifest's."""
    maps = {}
    for r in writers:
        name = f"rank{r}.json"
        with open(os.path.join(tmp, name), "rb") as f:
            raw = f.read()
        maps[name] = files.checksum_of(Kind.JSON, data=raw)
        described.update(json.loads(raw)["files"])
        sums.update(files.whole_file_sums(json.loads(raw).get("checksums", {})))
    return maps


def _gather_rank_files(tmp: str, described: dict[str, Any], sums: dict[str, int]) -> None:
    """Every rank wrote its RNG states (and with D > 1 its buffers): described and checksummed
    for the manifest."""
    for r in range(comm.world_size()):
        for name in (f"rank{r}.rng.pt", *([f"rank{r}.buffers.pt"] if comm.world_size() > 1 else [])):
            if not os.path.exists(os.path.join(tmp, name)):
                raise CheckpointError(f"save_checkpoint: rank {r}'s {name} is not in {tmp}: is the path on a file "
                                      "system shared by every rank?")
            saved = torch.load(os.path.join(tmp, name), map_location="cpu", weights_only=True)
            described[name] = {k: files.describe(v) for k, v in saved.items()}
            sums[name] = files.checksum_of(Kind.TENSORS, os.path.join(tmp, name))  # a small file, just written


def _write_client(data: bytes, tmp: str) -> dict[str, int]:
    with files.durable(os.path.join(tmp, CLIENT_FILE)) as f:
        f.write(data)
    return {"size": len(data), "crc32": files.checksum_of(Kind.CLIENT, data=data)}
