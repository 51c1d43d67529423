"""What every async I/O backend offers: submit a read or write, get an `IOFuture` back.

A request is (file, offset, buffer, length). `file` is an open fd (the swap store's files) or a
path the backend opens for that request. The backend splits the request into `chunk`-byte pieces
served in parallel; with a `ChecksumView` each piece's checksum is filled by a write and checked by
a read before the future completes, so a corrupted block is an error, never data.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import os
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence, Union

import torch

from zero_offload.io.checksum import ChecksumView

Buffer = Union[torch.Tensor, bytearray, memoryview]
FileRef = Union[int, str]


class ChecksumError(OSError):
    """A block read back does not match the checksum written with it."""

    def __init__(self, file: str, offset: int, expected: int, actual: int) -> None:
        super().__init__(errno.EIO, f"checksum mismatch in {file} at offset {offset}: "
                                    f"expected {expected:#010x}, found {actual:#010x}")
        self.file, self.offset, self.expected, self.actual = file, offset, expected, actual


def buffer_address(buf: Buffer, *, writable: bool) -> tuple[int, int, Any]:
    """(address, nbytes, keepalive) of a contiguous CPU buffer; keepalive must outlive the I/O."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError(f"I/O buffer must be a contiguous CPU tensor, got {buf.device} "
                             f"{'contiguous' if buf.is_contiguous() else 'non-contiguous'}")
        return buf.data_ptr(), buf.numel() * buf.element_size(), buf
    view = memoryview(buf)
    if not view.contiguous or (writable and view.readonly):
        raise ValueError("I/O buffer must be a contiguous" + (" writable" if writable else "") + " buffer")
    view = view.cast("B")
    if view.readonly:  # ctypes cannot take the address of read-only memory; copy is the honest way
        view = memoryview(bytearray(view))
    holder = (ctypes.c_char * view.nbytes).from_buffer(view)
    return ctypes.addressof(holder), view.nbytes, (holder, view)


def file_label(file: FileRef) -> str:
    """A name for error messages: the path, or what /proc says the fd points at."""
    if isinstance(file, str):
        return file
    try:
        return os.readlink(f"/proc/self/fd/{file}")
    except OSError:
        return f"fd {file}"


def io_error(op: str, file: FileRef, offset: int, code: int) -> OSError:
    """The exception a failed request raises on the waiting side: the OS error and where."""
    return OSError(code, f"{op} of {file_label(file)} at offset {offset} failed: {os.strerror(code)}")


def eof_error(file: FileRef, offset: int) -> OSError:
    """A read that ran out of file at `offset`; one message whichever backend found it."""
    return OSError(errno.EIO, f"read of {file_label(file)} hit end of file at offset {offset}")


class IOFuture(ABC):
    """Completion of one request. `wait()` blocks (without the GIL) and raises its error."""

    @abstractmethod
    def wait(self) -> None: ...

    @abstractmethod
    def done(self) -> bool: ...


class ThreadFuture(IOFuture):
    """A request running on a concurrent.futures pool (the aiofiles backend, bounced transfers)."""

    def __init__(self, fut: "concurrent.futures.Future[Any]") -> None:
        self._fut = fut

    def wait(self) -> None:
        self._fut.result()

    def done(self) -> bool:
        return self._fut.done()


class DoneFuture(IOFuture):
    """An already-finished request (zero bytes, or an error found before submitting)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self._error = error

    def wait(self) -> None:
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        return True


class ChainedFuture(IOFuture):
    """Several futures as one, then a finishing step (copy out of a bounce buffer, say).

    `translate` maps a part's error to the one the caller should see (e.g. naming the shard).
    The finishing step runs once, in whichever thread waits first; later waits see its result.
    """

    def __init__(self, parts: Sequence[IOFuture], then: Callable[[], None] | None = None,
                 translate: Callable[[BaseException], BaseException] | None = None) -> None:
        self._parts, self._then, self._translate = list(parts), then, translate
        self._lock = threading.Lock()
        self._finished = False
        self._error: BaseException | None = None

    def wait(self) -> None:
        with self._lock:
            if not self._finished:
                self._error = self._finish()
                self._finished = True
        if self._error is not None:
            raise self._error

    def _finish(self) -> BaseException | None:
        first: BaseException | None = None
        for part in self._parts:  # wait for every part even after a failure: buffers are in use
            try:
                part.wait()
            except Exception as exc:
                first = first or exc
        if first is None and self._then is not None:
            try:
                self._then()
            except Exception as exc:
                first = exc
        if first is not None and self._translate is not None:
            first = self._translate(first)
        return first

    def done(self) -> bool:
        return self._finished or all(p.done() for p in self._parts)


class AIOBackend(ABC):
    """Async reads and writes; `threads * queue_depth` chunks may be in flight at once."""

    name: str = "?"

    def __init__(self, *, threads: int, queue_depth: int, block_size: int) -> None:
        if threads < 1 or queue_depth < 1 or block_size < 1:
            raise ValueError(f"async I/O needs threads, queue_depth and block_size >= 1, got "
                             f"{threads}, {queue_depth}, {block_size}")
        self.threads, self.queue_depth, self.block_size = threads, queue_depth, block_size

    def read(self, file: FileRef, offset: int, buf: Buffer, length: int | None = None, *,
             chunk: int | None = None, checksums: ChecksumView | None = None) -> IOFuture:
        """Fill `buf[:length]` from `file` at `offset`; with `checksums`, verify each chunk."""
        return self._submit(False, file, offset, buf, length, chunk, checksums)

    def write(self, file: FileRef, offset: int, buf: Buffer, length: int | None = None, *,
              chunk: int | None = None, checksums: ChecksumView | None = None) -> IOFuture:
        """Write `buf[:length]` to `file` at `offset`; with `checksums`, record each chunk's."""
        return self._submit(True, file, offset, buf, length, chunk, checksums)

    def _submit(self, write: bool, file: FileRef, offset: int, buf: Buffer, length: int | None,
                chunk: int | None, checksums: ChecksumView | None) -> IOFuture:
        addr, nbytes, keep = buffer_address(buf, writable=not write)
        length = nbytes if length is None else length
        if length < 0 or length > nbytes or offset < 0:
            raise ValueError(f"I/O request of {length} bytes at offset {offset} does not fit a "
                             f"{nbytes}-byte buffer")
        chunk = self.block_size if chunk is None or chunk == 0 else chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"I/O chunk must be a whole number of bytes > 0, got {chunk!r}")
        if length == 0:
            return DoneFuture()
        chunks = -(-length // chunk)
        if checksums is not None and chunks > checksums.count:
            # the native workers write one checksum per chunk: past the table's end is someone else's memory
            raise ValueError(f"I/O request of {length} bytes in {chunk}-byte chunks needs {chunks} checksums; "
                             f"the checksum table has {checksums.count} from entry {checksums.start}")
        return self._start(write, file, offset, addr, length, chunk, checksums, keep)

    @abstractmethod
    def _start(self, write: bool, file: FileRef, offset: int, addr: int, length: int, chunk: int,
               checksums: ChecksumView | None, keep: Any) -> IOFuture: ...

    @abstractmethod
    def close(self) -> None:
        """Finish what is in flight and stop the workers."""

    def __enter__(self) -> "AIOBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_path(path: str, *, write: bool, direct: bool = True) -> tuple[int, bool]:
    """Open `path` for one request; O_DIRECT when asked and the filesystem takes it (not tmpfs).

    Returns (fd, direct actually used). A write creates the file (0600) but never truncates it.
    """
    flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o600), False
