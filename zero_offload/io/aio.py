"""Choosing an async I/O backend: `open_backend("auto" | "native" | "aiofiles")`.

"auto" takes the native thread-pool engine when the library loaded and aiofiles otherwise; both
honour the same interface (base.py), and the test suite runs the same tests against each.
io_uring is probed and reported in `zero_offload.native.info()` but not used: the thread pool
matched DeepSpeed's libaio engine and beat fio's libaio and io_uring engines in the interleaved
comparison of docs/perf_io.md, so a second engine would add code without adding speed.
"""
from __future__ import annotations

from typing import Any

from zero_offload import native
from zero_offload.config import IO_BACKENDS
from zero_offload.io.aiofiles_aio import AiofilesAIO
from zero_offload.io.base import AIOBackend, ChecksumError, IOFuture
from zero_offload.io.native_aio import NativeAIO, native_lib

__all__ = ["AIOBackend", "AiofilesAIO", "ChecksumError", "IOFuture", "NativeAIO", "open_backend",
           "resolve_kind"]


def resolve_kind(kind: str) -> str:
    """The backend "auto" stands for on this installation; other kinds are checked and returned."""
    if kind not in IO_BACKENDS:
        raise ValueError(f"unknown async I/O backend {kind!r}: expected one of {', '.join(IO_BACKENDS)}")
    if kind == "auto":
        return "native" if native_lib() is not None else "aiofiles"
    return kind


def open_backend(kind: str = "auto", *, threads: int = 4, queue_depth: int = 8,
                 block_size: int = 8 << 20) -> AIOBackend:
    """A started backend; close it (or use `with`) to stop its threads."""
    cls = NativeAIO if resolve_kind(kind) == "native" else AiofilesAIO
    return cls(threads=threads, queue_depth=queue_depth, block_size=block_size)


def _info() -> dict[str, Any]:
    from zero_offload.io import checksum

    lib = native_lib()
    out: dict[str, Any] = {"auto_backend": resolve_kind("auto"), "checksum": checksum.algorithm()}
    if lib is not None:
        out["checksum_impl"] = lib.zo_checksum_impl().decode()
        out["io_uring_available"] = bool(lib.zo_aio_uring_available())
    return out


native.register_info("aio", _info)
