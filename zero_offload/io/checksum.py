"""The block checksum the swap store writes with every block and verifies on every read.

With the native library it is CRC32C over three interleaved lanes (native/checksum.h), computed
on the I/O worker threads. Without it, zlib's CRC-32 (C speed, releases the GIL) stands in: the
two give different values, so a store records which one it uses and never mixes them.
"""
from __future__ import annotations

import ctypes
import threading
import zlib

from zero_offload import native

_U32 = ctypes.c_uint32


_lock = threading.Lock()
_loaded: list[ctypes._CFuncPtr | None] = []  # [the function] once its signature is declared


def _native_fn() -> ctypes._CFuncPtr | None:
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
