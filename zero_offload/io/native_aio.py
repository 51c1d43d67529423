"""`NativeAIO`: the C++ thread-pool engine (native/aio.h) behind the `AIOBackend` interface.

ctypes drops the GIL for every foreign call, so `wait()` blocks without holding it and Python
threads (the prefetcher, the optimizer) keep running while the drive works.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
from typing import Any

from zero_offload import native
from zero_offload.io.base import (AIOBackend, ChecksumError, DoneFuture, FileRef, IOFuture, eof_error,
                                  file_label, io_error, open_path)
from zero_offload.io.checksum import ChecksumView

_P = ctypes.c_void_p
_SIGNATURES = {
    "zo_aio_create": ([ctypes.c_int, ctypes.c_int], _P),
    "zo_aio_destroy": ([_P], None),
    "zo_aio_workers": ([_P], ctypes.c_int),
    "zo_aio_submit": ([_P, ctypes.c_int, ctypes.c_int, ctypes.c_int64, _P, ctypes.c_int64,
                       ctypes.c_int64, _P], _P),
    "zo_aio_wait": ([_P], ctypes.c_int),
    "zo_aio_done": ([_P], ctypes.c_int),
    "zo_aio_error": ([_P, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_uint32),
                      ctypes.POINTER(ctypes.c_uint32)], ctypes.c_int),
    "zo_aio_free": ([_P], None),
    "zo_aio_uring_available": ([], ctypes.c_int),
    "zo_checksum_impl": ([], ctypes.c_char_p),
}
ECHECKSUM, ESHORT = -1, -2  # native/aio.h


def native_lib() -> ctypes.CDLL | None:
    """The native library with the I/O signatures declared, or None when it is not loaded."""
    lib = native.lib()
    if lib is None or getattr(lib, "_zo_aio_ready", False):
        return lib
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    setattr(lib, "_zo_aio_ready", True)  # its signatures are set (a CDLL takes any attribute)
    return lib


class _NativeFuture(IOFuture):
    """One native request; the request memory is freed by the first wait."""

    def __init__(self, lib: ctypes.CDLL, req: int, write: bool, file: FileRef, keep: Any,
                 owned_fd: int | None) -> None:
        self._lib, self._write, self._file = lib, write, file
        self._req: int | None = req  # None once waited for (and freed)
        self._keep, self._owned_fd = keep, owned_fd  # the buffer must live until the I/O is done
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def wait(self) -> None:
        """An interrupt (KeyboardInterrupt, raised between two Python calls here) leaves the
        request either still owned (a later wait() finishes it) or already released: each
        resource is detached from the future before it is freed, so none is freed twice."""
        with self._lock:
            if self._req is not None:
                self._lib.zo_aio_wait(self._req)  # GIL released here by ctypes
                if self._error is None:
                    self._error = self._collect()
                req, self._req = self._req, None
                self._lib.zo_aio_free(req)
                self._keep = None  # the buffer is free once the request is done
            if self._owned_fd is not None:
                fd, self._owned_fd = self._owned_fd, None
                os.close(fd)
        if self._error is not None:
            raise self._error

    def _collect(self) -> BaseException | None:
        off, exp, got = ctypes.c_int64(), ctypes.c_uint32(), ctypes.c_uint32()
        status = self._lib.zo_aio_error(self._req, ctypes.byref(off), ctypes.byref(exp), ctypes.byref(got))
        if status == 0:
            return None
        if status == ECHECKSUM:
            return ChecksumError(file_label(self._file), off.value, exp.value, got.value)
        if status == ESHORT:
            return eof_error(self._file, off.value)
        return io_error("write" if self._write else "read", self._file, off.value, status)

    def done(self) -> bool:
        with self._lock:
            return self._req is None or bool(self._lib.zo_aio_done(self._req))

    def __del__(self) -> None:
        # A dropped future must not free the request while workers still use it.
        try:
            self.wait()
        except Exception:
            pass


class NativeAIO(AIOBackend):
    """pread/pwrite on `threads * queue_depth` native worker threads."""

    name = "native"

    def __init__(self, *, threads: int = 4, queue_depth: int = 8, block_size: int = 8 << 20) -> None:
        self._eng = None
        super().__init__(threads=threads, queue_depth=queue_depth, block_size=block_size)
        lib = native_lib()
        if lib is None:
            raise RuntimeError(f"native async I/O unavailable: {native.load_error()}")
        self._lib = lib
        self._eng = lib.zo_aio_create(threads, queue_depth)
        if not self._eng:
            raise ValueError(f"native async I/O refused threads={threads} queue_depth={queue_depth} "
                             "(at most 4096 workers)")

    def _start(self, write: bool, file: FileRef, offset: int, addr: int, length: int, chunk: int,
               checksums: ChecksumView | None, keep: Any) -> IOFuture:
        if self._eng is None:
            raise RuntimeError("native async I/O backend is closed")
        owned = None
        if isinstance(file, str):
            try:
                owned, _ = open_path(file, write=write)
            except OSError as exc:  # reported by wait(), as the aiofiles backend does
                return DoneFuture(io_error("write" if write else "read", file, offset, exc.errno or errno.EIO))
        fd = owned if owned is not None else file
        sums = checksums.address() if checksums is not None else None
        req = self._lib.zo_aio_submit(self._eng, 1 if write else 0, fd, offset, addr, length, chunk, sums)
        if not req:
            if owned is not None:
                os.close(owned)
            raise ValueError(f"native async I/O refused a request of {length} bytes at offset {offset}")
        return _NativeFuture(self._lib, req, write, file, (keep, checksums), owned)

    @property
    def workers(self) -> int:
        """Worker threads the engine really started (`threads * queue_depth`); 0 once closed."""
        return self._lib.zo_aio_workers(self._eng) if self._eng is not None else 0

    def close(self) -> None:
        if self._eng is not None:
            self._lib.zo_aio_destroy(self._eng)
            self._eng = None

    def __del__(self) -> None:
        self.close()
