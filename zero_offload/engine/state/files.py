"""A checkpoint's files: the one durable writer, the one checksum verifier, tensor files, paths.

Every file a save writes goes through `durable` (write, flush, fsync, close; a failure is one line
naming the file and the OS cause), and the finished directory through `swap_into_place` (the
directory fsynced, renamed over the old checkpoint, the parent fsynced). Every checksum a save
records and a load verifies is `checksum_of` one `Kind` of file, and every verification is
`verify` / `read_verified`, whose messages the Kind holds: tensor files (rank shards, model.pt,
the RNG and buffer files) carry io/checksum.py's whole-file checksum (format 2; the algorithm is
recorded beside it) and their size, JSON files (the shard maps, the manifest against its
manifest.crc32) zlib's CRC-32, client_state.pt its size and CRC-32. Format 1 checkpoints record
each tensor's CRC-32 instead (`describe`).
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import zlib
from dataclasses import dataclass
from enum import Enum
from typing import IO, Any, Iterator, NamedTuple

import torch

from zero_offload.engine.model.weights_files import refused_pickle
from zero_offload.interrupts import held_interrupts
from zero_offload.io import checksum

FORMAT = 2  # 2: whole-file checksums (manifest "checksums"); 1 is still read, verified per tensor
READABLE = (1, 2)
MARKER = ".zero_offload_checkpoint"  # written first into every save's directory: a save's own leftovers
CLIENT_FILE = "client_state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


def why(exc: BaseException) -> str:
    """An error in one line that says something even when its message is empty."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# ---- the one durable writer -------------------------------------------------------------------

@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """A failed write of `path` raises one line naming the file and the OS cause (a full disk
    otherwise surfaces as torch's "unexpected pos" or an OSError without a file name)."""
    try:
        yield
    except Exception as exc:
        cause = _os_error(exc)
        if cause is None:
            raise
        raise os_failure(cause, path) from exc


def os_failure(exc: OSError, path: str, doing: str = "write") -> CheckpointError:
    """One line for a save's OSError: the file (the error's own, else `path`), the OS cause, and
    the drive it is on (its mount point and free bytes), as a full or read-only drive is the
    usual cause."""
    target = exc.filename if isinstance(exc.filename, str) else path
    text = os.strerror(exc.errno) if exc.errno else (str(exc) or type(exc).__name__)
    return CheckpointError(f"could not {doing} {target}: {text} ({drive_of(target)})")


def drive_of(path: str) -> str:
    """'on the drive mounted at M, N bytes free' for the file system holding `path` (or the
    nearest folder above it that exists)."""
    at = os.path.abspath(path)
    while not os.path.exists(at) and os.path.dirname(at) != at:
        at = os.path.dirname(at)
    mount = at
    while not os.path.ismount(mount) and os.path.dirname(mount) != mount:
        mount = os.path.dirname(mount)
    try:
        free = f", {shutil.disk_usage(at).free:,} bytes free"
    except OSError:
        free = ""
    return f"on the drive mounted at {mount}{free}"


def _os_error(exc: BaseException | None) -> OSError | None:
    """The first OSError in `exc`'s chain of causes and contexts, if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def durable(path: str, mode: str = "wb") -> Iterator[IO[Any]]:
    """`path` opened for writing; once the body has written it, flushed and fsynced before it
    is closed, so a checkpoint renamed into place holds every byte even after a power loss."""
    with writing(path), open(path, mode) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path: str) -> None:
    """fsync a file or directory by name (a directory: the names of the entries in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_into_place(tmp: str, path: str) -> None:
    """Move a finished `<path>.tmp` to `path`: the old checkpoint aside to `<path>.old` first, so
    a crash at any point leaves one of them complete; the parent fsynced before the old goes."""
    fsync_path(tmp)
    old = path + ".old"  # a checkpoint, or absent (save's target check): the new one supersedes it
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_path(os.path.dirname(path) or ".")
    shutil.rmtree(old, ignore_errors=True)


def resolve(path: str) -> str:
    """The checkpoint directory to load: `path`, or `<path>.old` where a swap was cut short."""
    path = os.path.abspath(path)
    for cand in (path, path + ".old"):
        if os.path.isfile(os.path.join(cand, "manifest.json")):
            return cand
    raise CheckpointError(f"no checkpoint at {path}: manifest.json is missing")


# ---- the one checksum verifier ----------------------------------------------------------------

@dataclass(frozen=True)
class _Told:
    """How a kind of file is checksummed, and the one line each mismatch raises."""

    whole_file: bool  # io/checksum.py's whole-file checksum, else zlib's CRC-32 of the bytes
    resized: str
    damaged: str
    unreadable: str


class Kind(Enum):
    """The kinds of checkpoint file, by how they are checksummed and how a mismatch is told."""

    TENSORS = _Told(True, "checkpoint file {full} has {seen} bytes, the manifest says {want} (truncated or replaced)",
                    "checkpoint file {full} fails its checksum (damaged or replaced): load another checkpoint",
                    "checkpoint file {full} cannot be read: {why}")
    JSON = _Told(False, "checkpoint file {full} fails its checksum", "checkpoint file {full} fails its checksum",
                 "cannot read checkpoint file {full}: {why}")
    CLIENT = _Told(False, "checkpoint file {full}: its size or checksum differs from the manifest",
                   "checkpoint file {full}: its size or checksum differs from the manifest",
                   "checkpoint file {full}: {why}")


def checksum_of(kind: Kind, full: str | None = None, data: Any = None) -> int:
    """The checksum a checkpoint records for a file of `kind`: of `data` where given (the bytes
    in hand), else of the file `full` read whole."""
    if kind.value.whole_file:
        if data is None:
            return checksum.file_checksum(full)
        total = checksum.FileChecksum()
        total.update(data)
        return total.digest()
    if data is None:
        with open(full, "rb") as f:
            data = f.read()
    return zlib.crc32(data)


def verify(full: str, kind: Kind, size: int | None = None, value: int | None = None, data: Any = None) -> None:
    """Raise the kind's one line if the file (or `data`, its bytes already read) differs from
    what the manifest recorded: its size, then its checksum (None: not recorded)."""
    told = kind.value
    try:
        seen = None if size is None else len(data) if data is not None else os.path.getsize(full)
        if seen is not None and seen != size:
            raise CheckpointError(told.resized.format(full=full, seen=seen, want=size))
        if value is not None and checksum_of(kind, full, data) != value:
            raise CheckpointError(told.damaged.format(full=full))
    except OSError as exc:
        raise CheckpointError(told.unreadable.format(full=full, why=why(exc))) from None


def read_verified(full: str, kind: Kind, size: int | None = None, value: int | None = None) -> bytes:
    """A small file's bytes, read once and verified (`verify`)."""
    try:
        with open(full, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointError(kind.value.unreadable.format(full=full, why=why(exc))) from None
    verify(full, kind, size, value, data)
    return data


def whole_file_sums(entry: dict[str, Any]) -> dict[str, int]:
    """A "checksums" entry's values by file, if computed as this process computes them (a rank
    without the native library computes another kind: its files are then verified per tensor)."""
    return entry.get("files", {}) if entry.get("algorithm") == checksum.file_algorithm() else {}


# ---- tensor files -----------------------------------------------------------------------------

def saved_form(name: str, t: torch.Tensor) -> torch.Tensor:
    """What torch.save writes for `t` and what its checksum covers: a dense CPU tensor with its
    elements in order (a non-contiguous one as its contiguous copy; a CPU contiguous one as is)."""
    if t.layout != torch.strided:
        raise CheckpointError(f"save_checkpoint: {name!r} has layout {t.layout}; checkpoints hold dense (strided) "
                              "tensors only: keep it dense (.to_dense()) in the module")
    return t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()


def tensor_crc(t: torch.Tensor) -> int:
    """CRC32 of `t`'s bytes, read in place: flattened first, since a 0-dim tensor has no
    dimension to view as bytes (every BatchNorm's num_batches_tracked)."""
    flat = saved_form("a tensor", t).reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy()) if flat.numel() else 0


def kind_of(t: torch.Tensor) -> dict[str, Any]:
    """A tensor's shape and dtype as the manifest records them (its bytes are the file checksum's)."""
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}


def describe(t: torch.Tensor) -> dict[str, Any]:
    """A tensor's manifest entry: shape, dtype and its own CRC-32 (what format 1 verifies)."""
    return {**kind_of(t), "crc32": tensor_crc(t)}


class Written(NamedTuple):
    """What a load checks a written tensor file against."""

    tensors: dict[str, dict[str, Any]]  # each tensor's shape, dtype and CRC32
    checksum: int  # the whole file's (Kind.TENSORS), headers included


class _Summing:
    """The file torch.save writes to, checksumming every byte on its way (no second read)."""

    def __init__(self, f: Any, total: checksum.FileChecksum) -> None:
        self.f, self.total = f, total
        self.interrupt: BaseException | None = None  # torch's writer turns it into "unexpected pos"

    def write(self, data: Any) -> int:
        try:
            self.total.update(data)
            return self.f.write(data)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self.interrupt = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def save_tensors(tensors: dict[str, torch.Tensor], path: str) -> Written:
    """One tensor file, written durably and checksummed as written. Through our own file object:
    torch's writer then fails with the OS error (ENOSPC) as its context, instead of only
    "unexpected pos" when it writes to a path itself."""
    saved = {k: saved_form(k, v) for k, v in tensors.items()}  # described as written
    total = checksum.FileChecksum()
    with durable(path) as f:
        out = _Summing(f, total)
        try:
            with held_interrupts():  # a Ctrl-C raised inside torch's writer became "unexpected pos"
                torch.save(saved, out)
        except Exception:
            if out.interrupt is not None:  # raised by a second Ctrl-C there: it stays a Ctrl-C
                raise out.interrupt from None
            raise
    return Written({k: describe(v) for k, v in saved.items()}, total.digest())


def load_tensors(full: str, data: bytes | None = None) -> Any:
    """A checkpoint's tensor file (or `data`, its bytes already read and verified), memory-mapped
    (its bytes are read where they are copied) and weights-only; a refused pickle is our one
    line, never torch's advice to disable weights_only."""
    try:
        if data is not None:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return torch.load(full, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"checkpoint file {full}: {refused_pickle(exc)}") from None
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint file {full}: {why(exc)}") from None
