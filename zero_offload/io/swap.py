"""The swap store: NVMe slots for shards, in preallocated files, checksummed block by block.

Each of the `paths` gets one file (swap_files.py); slots go to the file with the most room, so
equal shards stripe round-robin across drives without RAID. A slot of n bytes takes n rounded up
to 4096 on disk. Its blocks are the whole-page body cut into `block_size` pieces plus, when n is
not a page multiple, one padded tail page; every block's checksum is recorded when it is written
and verified when it is read, whichever path (direct or bounced) moved it.

Fast path: a page-aligned tensor (see `alloc_buffer`) goes straight to the drive; only a ragged
tail passes through a private 4 KiB page. Any other tensor is bounced block by block through a
budgeted pool of aligned buffers on a helper thread, so the call still returns at once.
"""
from __future__ import annotations

import concurrent.futures
import errno
import os
import re
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from zero_offload.config import IOConfig
from zero_offload.io.aio import open_backend
from zero_offload.io.base import AIOBackend, ChainedFuture, ChecksumError, DoneFuture, IOFuture, ThreadFuture
from zero_offload.io.buffers import ALIGN_BYTES, BufferPool, aligned_empty, round_up
from zero_offload.io.checksum import ChecksumTable
from zero_offload.io.swap_files import SwapError, SwapFile, check_paths, check_space, log, remove_files
from zero_offload.io.threads import DaemonPool

__all__ = ["Slot", "SwapError", "SwapStore"]

_BOUNCE_DEPTH = 4  # blocks of one bounced transfer in flight at once


@dataclass(frozen=True)
class Slot:
    """Where one shard lives: `nbytes` at `offset` of file `path`, `length` bytes reserved."""

    key: str
    path: str
    offset: int
    nbytes: int
    length: int


class _Entry:
    """A slot plus what reading it back needs: its file, block layout and checksums."""

    def __init__(self, slot: Slot, file: SwapFile, block: int) -> None:
        self.slot, self.file, self.block = slot, file, block
        self.body = slot.nbytes - slot.nbytes % ALIGN_BYTES
        self.tail = slot.nbytes - self.body
        self.body_blocks = -(-self.body // block)
        self.sums = ChecksumTable(self.body_blocks + (1 if self.tail else 0))
        self.written = False
        # Why the last write failed, if it did: some blocks may hold the new bytes and some the
        # old, each with a matching checksum, so reading the slot back would pass unnoticed.
        self.write_error: str | None = None

    def blocks(self) -> Iterator[tuple[int, int, int]]:
        """(offset in slot, bytes of data, index) per block; every block but a tail is whole pages."""
        for i, pos in enumerate(range(0, self.body, self.block)):
            yield pos, min(self.block, self.body - pos), i
        if self.tail:
            yield self.body, self.tail, self.body_blocks


class SwapStore:
    """Per rank and state group: NVMe slots in files under each path (see the module docstring)."""

    def __init__(self, paths: Sequence[str], name: str, rank: int, *, capacity_bytes: int,
                 io: IOConfig | None = None, backend: AIOBackend | None = None,
                 bounce_budget_bytes: int | None = None) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name or ""):
            raise ValueError(f"swap store name {name!r} must be letters, digits, '_', '.' or '-'")
        if not isinstance(rank, int) or rank < 0 or capacity_bytes < 0:
            raise ValueError(f"swap store needs rank >= 0 and capacity_bytes >= 0, got {rank}, {capacity_bytes}")
        io = io or IOConfig()
        self.block_size = io.block_size
        self.bounced = 0  # transfers that went through the bounce pool (their tensor was not page-aligned)
        budget = _bounce_budget(bounce_budget_bytes, self.block_size)
        roots = check_paths(paths)
        per_file = round_up(-(-capacity_bytes // len(roots)))
        self._files: list[SwapFile] = []
        self._closed = True
        self._own_backend = backend is None
        self.backend = backend or open_backend(io.backend, threads=io.threads, queue_depth=io.queue_depth,
                                               block_size=io.block_size)
        try:
            for root in roots:
                self._files.append(SwapFile(root, name, rank))
            check_space({os.path.dirname(f.dir): max(per_file - f.existing_bytes, 0) for f in self._files})
            for f in self._files:
                f.create(per_file, direct=io.direct)
            # inside the try: a failure here must not leave the files or the backend behind
            self._pool = BufferPool(budget, pin=torch.cuda.is_available())
            self._bouncer = DaemonPool(2, "zo-swap-bounce")  # usable at exit too (io/threads.py)
        except BaseException:
            _quiet_remove(self._files)  # the error that stopped the constructor is the one to see
            if self._own_backend:
                self.backend.close()
            raise
        self._entries: dict[str, _Entry] = {}
        self._released: dict[int, list[_Entry]] = {}  # rounded length -> slots free for reuse
        self._used = [0] * len(self._files)
        self._next = 0
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._files, self.backend if self._own_backend else None,
                                           self._bouncer)

    # ---- slots -------------------------------------------------------------------------------
    def register(self, key: str, nbytes: int) -> Slot:
        """Reserve a slot for `nbytes` under a new `key`."""
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"slot {key!r}: nbytes must be an int >= 0, got {nbytes!r}")
        with self._lock:
            self._check_open()
            if key in self._entries:
                raise ValueError(f"slot {key!r} is already registered")
            length = round_up(nbytes)
            f, offset = self._reuse(length) or self._place(length)
            slot = Slot(key, f.path, offset, nbytes, length)
            self._entries[key] = _Entry(slot, f, self.block_size)
            return slot

    def _reuse(self, length: int) -> tuple[SwapFile, int] | None:
        """Where a released slot of exactly `length` bytes was, if there is one."""
        free = self._released.get(length)
        if not free:
            return None
        old = free.pop()
        return old.file, old.slot.offset

    def _place(self, length: int) -> tuple[SwapFile, int]:
        """New space at the end of the chosen file."""
        i = self._pick_file(length)
        offset = self._used[i]
        self._used[i] += length
        return self._files[i], offset

    def release(self, key: str) -> None:
        """Forget slot `key`; a later `register` of the same rounded size takes its place on disk.
        No transfer of `key` may still be in flight."""
        with self._lock:
            entry = self._entry(key)
            del self._entries[key]
            self._released.setdefault(entry.slot.length, []).append(entry)

    def _pick_file(self, length: int) -> int:
        """The file with the most room, trying them in round-robin order; grows one if none fits."""
        n = len(self._files)
        order = [(self._next + k) % n for k in range(n)]
        best = max(order, key=lambda i: self._files[i].size - self._used[i])
        self._next = (best + 1) % n
        room = self._files[best].size - self._used[best]
        if room < length:  # more than the ledger planned for: take it from the disk if it is there
            f = self._files[best]
            check_space({os.path.dirname(f.dir): length - room})
            f.grow(self._used[best] + length)
            f.write_manifest()
        return best

    def slot(self, key: str) -> Slot:
        return self._entry(key).slot

    def bytes_retained(self) -> int:
        """Bytes the registered slots occupy on disk (each rounded up to 4096)."""
        with self._lock:
            return sum(e.slot.length for e in self._entries.values())

    @property
    def direct(self) -> bool:
        """Whether every file uses O_DIRECT (False where a filesystem refused it)."""
        return all(f.direct for f in self._files)

    # ---- transfers ---------------------------------------------------------------------------
    def alloc_buffer(self, nbytes: int) -> torch.Tensor:
        """A page-aligned uint8 tensor (pinned where CUDA is): the fast path for read and write."""
        return aligned_empty(nbytes, pin=torch.cuda.is_available())

    def write(self, key: str, src: torch.Tensor) -> IOFuture:
        """Start writing `src` (exactly the slot's bytes) into slot `key`; keep `src` alive until wait()."""
        e = self._entry(key)
        data = _byte_view(src, e.slot, "write")
        e.written, e.write_error = True, None
        try:
            return self._transfer(e, data, write=True)
        except BaseException as exc:
            e.write_error = str(exc) or type(exc).__name__
            raise

    def read(self, key: str, dst: torch.Tensor) -> IOFuture:
        """Start reading slot `key` into `dst`; wait() returns once every block's checksum matched."""
        e = self._entry(key)
        data = _byte_view(dst, e.slot, "read")
        if not e.written:
            raise ValueError(f"shard {key!r} was never written to the swap store, nothing to read")
        if e.write_error is not None:
            raise SwapError(errno.EIO, f"shard {key!r}: its last write failed ({e.write_error}); "
                                       "nothing valid to read until it is written again")
        return self._transfer(e, data, write=False)

    def _transfer(self, e: _Entry, data: torch.Tensor, *, write: bool) -> IOFuture:
        if e.slot.nbytes == 0:
            return DoneFuture()
        if data.data_ptr() % ALIGN_BYTES == 0 or not e.file.direct:
            return self._direct(e, data, write)
        with self._lock:
            self.bounced += 1
        fut = self._bouncer.submit(self._bounced, e, data, write)
        return ThreadFuture(fut)

    def _submit(self, e: _Entry, write: bool, pos: int, buf: torch.Tensor, length: int, index: int) -> IOFuture:
        op = self.backend.write if write else self.backend.read
        return op(e.file.fd, e.slot.offset + pos, buf, length, chunk=self.block_size, checksums=e.sums.view(index))

    def _direct(self, e: _Entry, data: torch.Tensor, write: bool) -> IOFuture:
        """Body straight from/to `data`; a ragged tail through a private padded page."""
        parts: list[IOFuture] = []
        then = None
        try:
            if e.body:
                parts.append(self._submit(e, write, 0, data[:e.body], e.body, 0))
            if e.tail:
                page = aligned_empty(ALIGN_BYTES)
                if write:
                    page.zero_()[:e.tail].copy_(data[e.body:])
                else:
                    then = _copier(data[e.body:], page[:e.tail])
                parts.append(self._submit(e, write, e.body, page, ALIGN_BYTES, e.body_blocks))
        except BaseException:
            for part in parts:  # submitted parts still run: let them end before the caller reuses `data`
                _quiet_wait(part)
            raise

        def translate(exc: BaseException) -> BaseException:
            err = _translate(e.slot, exc)
            if write:
                e.write_error = str(err)
            return err
        return ChainedFuture(parts, then, translate=translate)

    def _bounced(self, e: _Entry, data: torch.Tensor, write: bool) -> None:
        """Runs on a helper thread: each block through a pooled aligned buffer, a few in flight."""
        inflight: deque[Any] = deque()
        try:
            for pos, n, index in e.blocks():
                disk = round_up(n)
                buf = self._acquire(disk, inflight, data, write)
                try:
                    if write:
                        buf[:n].copy_(data[pos:pos + n])
                        buf[n:disk].zero_()
                    fut = self._submit(e, write, pos, buf, disk, index)
                except BaseException:
                    self._pool.release(buf)  # not yet in flight: give its bytes back to the budget
                    raise
                inflight.append((fut, buf, pos, n))
                if len(inflight) >= _BOUNCE_DEPTH:
                    self._retire(inflight.popleft(), data, write)
            while inflight:
                self._retire(inflight.popleft(), data, write)
        except Exception as exc:
            err = _translate(e.slot, exc)
            if write:
                e.write_error = str(err)
            raise err from None
        finally:
            for fut, buf, _, _ in inflight:  # after a failure: buffers are reusable once I/O ends
                _quiet_wait(fut)
                self._pool.release(buf)

    def _acquire(self, nbytes: int, inflight: deque[Any], data: torch.Tensor, write: bool) -> torch.Tensor:
        """A bounce buffer; when the pool is exhausted, finish our own oldest block first, so a
        transfer never waits on buffers that only its own progress would free."""
        while inflight:
            try:
                return self._pool.acquire(nbytes, timeout=0)
            except TimeoutError:
                self._retire(inflight.popleft(), data, write)
        return self._pool.acquire(nbytes)

    def _retire(self, item: tuple[Any, ...], data: torch.Tensor, write: bool) -> None:
        fut, buf, pos, n = item
        try:
            fut.wait()
            if not write:
                data[pos:pos + n].copy_(buf[:n])
        finally:
            self._pool.release(buf)

    # ---- lifetime ----------------------------------------------------------------------------
    def _entry(self, key: str) -> _Entry:
        self._check_open()
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"no swap slot registered under key {key!r}") from None

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("swap store is closed")

    def close(self) -> None:
        """Finish in-flight I/O, stop the workers and delete the files. A file that cannot be
        deleted raises FilesLeft naming it; calling close() again tries again."""
        if not self._closed:
            self._closed = True
            self._finalizer()
        else:
            remove_files(self._files)

    def __enter__(self) -> "SwapStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bounce_budget(budget: int | None, block_size: int) -> int:
    """The bounce pool's byte budget. A bounced block takes one buffer of up to `block_size`
    bytes, so a smaller budget could never serve one: refuse it here, not mid-transfer."""
    if budget is None:
        return _BOUNCE_DEPTH * 2 * block_size
    if budget < block_size:
        raise ValueError(f"swap store bounce_budget_bytes={budget!r} is smaller than io.block_size={block_size}: "
                         "a bounced block needs one whole block buffer")
    return budget


def _byte_view(t: torch.Tensor, slot: Slot, op: str) -> torch.Tensor:
    """`t` as flat bytes, after checking it can take part in the transfer at all."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"swap {op} of {slot.key!r} needs a CPU tensor, got {where}")
    if not t.is_contiguous():
        raise ValueError(f"swap {op} of {slot.key!r} needs a contiguous tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes != slot.nbytes:
        raise ValueError(f"swap {op} of {slot.key!r}: tensor has {nbytes} bytes, slot has {slot.nbytes}")
    return t.reshape(-1).view(torch.uint8)


def _copier(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    def copy() -> None:
        dst.copy_(src)
    return copy


def _translate(slot: Slot, exc: BaseException) -> BaseException:
    """Name the shard in the error the waiting side sees; keep the OS error code and text."""
    if isinstance(exc, SwapError):
        return exc
    if isinstance(exc, ChecksumError):
        return SwapError(errno.EIO, f"checksum mismatch in {exc.file} at offset {exc.offset} (shard {slot.key!r}): "
                                    f"expected {exc.expected:#010x}, found {exc.actual:#010x}")
    if isinstance(exc, OSError):
        return SwapError(exc.errno, f"shard {slot.key!r}: {exc.strerror}")
    return exc


def _quiet_wait(fut: IOFuture) -> None:
    try:
        fut.wait()
    except Exception:
        pass


def _quiet_remove(files: list[SwapFile]) -> None:
    try:
        remove_files(files)
    except SwapError as exc:
        log.warning("%s", exc)


def _shutdown(files: list[SwapFile], backend: AIOBackend | None,
              bouncer: concurrent.futures.Executor) -> None:
    """Order matters: bounced transfers submit I/O, the backend drains it, then files go."""
    bouncer.shutdown(wait=True)
    if backend is not None:
        backend.close()
    remove_files(files)
