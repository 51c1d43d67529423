"""The block checksum the swap store writes with every block and verifies on every read.

With the native library it is CRC32C over three interleaved lanes (native/checksum.h), computed
on the I/O worker threads. Without it, zlib's CRC-32 (C speed, releases the GIL) stands in: the
two give different values, so a store records which one it uses and never mixes them.

`FileChecksum` builds a whole file's checksum from these block checksums, fed as the file is
written or read (checkpoints record one per file: headers included, not only tensor bytes).
"""
from __future__ import annotations

import ctypes
import threading
import zlib
from typing import Any

import numpy

from zero_offload import native

_U32 = ctypes.c_uint32


_lock = threading.Lock()
_loaded: list[Any] = []  # [the function] once its signature is declared


def _native_fn() -> Any:
    """zo_checksum, published only once its argument and result types are set. The aiofiles
    backend's threads make the first calls together: one that used the function before the
    types were set passed the address as a C int and read the result as a signed one, so a
    block written first recorded a checksum the read back could never match."""
    if not _loaded:
        with _lock:
            if not _loaded:
                lib = native.lib()
                fn = None if lib is None else lib.zo_checksum
                if fn is not None:
                    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64]
                    fn.restype = _U32
                _loaded.append(fn)
    return _loaded[0]


def algorithm() -> str:
    """Name of the checksum this process computes (recorded in the swap manifest)."""
    return "crc32c-x3" if _native_fn() is not None else "zlib-crc32"


def compute(address: int, nbytes: int) -> int:
    """Checksum of `nbytes` bytes at `address` (the caller keeps that memory alive)."""
    fn = _native_fn()
    if fn is not None:
        return int(fn(address, nbytes))
    return zlib.crc32((ctypes.c_char * nbytes).from_address(address)) if nbytes else 0


class ChecksumTable:
    """One uint32 per block of a slot, in a flat C array that the native workers fill in place."""

    def __init__(self, count: int) -> None:
        self.array = (_U32 * max(count, 1))()
        self.count = count

    def address(self, index: int) -> int:
        """Where block `index`'s checksum lives, for the native engine."""
        return ctypes.addressof(self.array) + index * ctypes.sizeof(_U32)

    def view(self, index: int) -> "ChecksumView":
        return ChecksumView(self, index)


class ChecksumView:
    """The checksums of one request: the table's entries from `start` on, one per chunk."""

    def __init__(self, table: ChecksumTable, start: int = 0) -> None:
        self.table = table
        self.start = start

    def address(self) -> int:
        return self.table.address(self.start)

    @property
    def count(self) -> int:
        """Entries from `start` to the table's end: the most chunks one request may have."""
        return max(self.table.count - self.start, 0)

    def get(self, i: int) -> int:
        return int(self.table.array[self.start + i])

    def set(self, i: int, value: int) -> None:
        self.table.array[self.start + i] = value


FILE_CHUNK = 4 << 20  # bytes per block of a whole-file checksum


def file_algorithm() -> str:
    """Name of the whole-file checksum this process computes (recorded in a checkpoint's manifest)."""
    return f"{algorithm()}/{FILE_CHUNK}"


class FileChecksum:
    """A whole file's checksum, fed in pieces of any size: the block checksum (`compute`) of each
    FILE_CHUNK bytes, then of those values and the length. Fixed blocks keep the value independent
    of how the bytes arrived (torch's writer hands over records of any size; a reader reads whole
    blocks), and each block runs at the native kernel's speed."""

    def __init__(self) -> None:
        self._sums: list[int] = []
        self._pending = bytearray()
        self.length = 0

    def update(self, data: Any) -> None:
        """Feed the next bytes (any buffer: bytes, bytearray, memoryview)."""
        view = memoryview(data).cast("B")
        self.length += len(view)
        if self._pending:
            take = min(FILE_CHUNK - len(self._pending), len(view))
            self._pending += view[:take]
            view = view[take:]
            if len(self._pending) < FILE_CHUNK:
                return
            self._sums.append(_buffer_sum(self._pending))
            self._pending = bytearray()
        whole = len(view) - len(view) % FILE_CHUNK
        if whole:
            array = numpy.frombuffer(view[:whole], dtype=numpy.uint8)  # read in place, even a read-only view
            base = array.ctypes.data
            self._sums.extend(compute(base + at, FILE_CHUNK) for at in range(0, whole, FILE_CHUNK))
        self._pending += view[whole:]

    def digest(self) -> int:
        sums = [*self._sums, *([_buffer_sum(self._pending)] if self._pending else [])]
        table = numpy.array([*sums, self.length & 0xFFFFFFFF, self.length >> 32], dtype=numpy.uint32)
        return compute(table.ctypes.data, table.nbytes)


def _buffer_sum(buf: bytearray) -> int:
    array = numpy.frombuffer(buf, dtype=numpy.uint8)
    return compute(array.ctypes.data, array.nbytes) if array.nbytes else 0


def file_checksum(path: str) -> int:
    """`path`'s whole-file checksum, read in FILE_CHUNK blocks into one reused buffer."""
    total, buf = FileChecksum(), bytearray(FILE_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            total.update(view[:n])
    return total.digest()
