"""`AiofilesAIO`: the pure-Python backend, for when the native library is missing.

An asyncio loop on its own thread runs one task per chunk; aiofiles moves each blocking call to
an executor of `threads * queue_depth` threads, the same number of requests in flight as the
native engine. Every chunk opens its own file object: chunks share no file position, so
concurrent seek+read pairs cannot interleave. O_DIRECT is kept by opening through an `opener`
with the flags of the fd the caller gave.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import errno
import fcntl
import os
import threading
import weakref
from typing import Any, Callable

import aiofiles

from zero_offload.io import checksum
from zero_offload.io.base import (AIOBackend, ChecksumError, FileRef, IOFuture, ThreadFuture, eof_error, file_label,
                                  io_error)
from zero_offload.io.checksum import ChecksumView
from zero_offload.io.threads import DaemonPool


def _reopen_spec(file: FileRef, write: bool) -> tuple[str, int]:
    """Path and extra open flags for per-chunk opens of `file`. An fd is reopened through /proc,
    keeping its O_DIRECT; its access mode is enforced here, since a reopen would not inherit it."""
    if isinstance(file, str):
        return file, os.O_DIRECT | (os.O_CREAT if write else 0)
    flags = fcntl.fcntl(file, fcntl.F_GETFL)
    if (flags & os.O_ACCMODE) == (os.O_RDONLY if write else os.O_WRONLY):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))
    return f"/proc/self/fd/{file}", flags & os.O_DIRECT


def _opener(extra: int) -> Callable[[str, int], int]:
    def opener(path: str, flags: int) -> int:
        try:
            return os.open(path, flags | extra, 0o600)
        except OSError as exc:  # a filesystem without O_DIRECT: go buffered, as open_path does
            if not extra & os.O_DIRECT or exc.errno != errno.EINVAL:
                raise
            return os.open(path, flags | (extra & ~os.O_DIRECT), 0o600)
    return opener


class AiofilesAIO(AIOBackend):
    """Chunks as asyncio tasks on aiofiles, on a private loop thread."""

    name = "aiofiles"

    def __init__(self, *, threads: int = 4, queue_depth: int = 8, block_size: int = 8 << 20) -> None:
        super().__init__(threads=threads, queue_depth=queue_depth, block_size=block_size)
        # Not a ThreadPoolExecutor: those stop as the interpreter begins to exit, before the
        # finalizer that closes an engine left open runs its last transfers (io/threads.py).
        self._pool = DaemonPool(threads * queue_depth, "zo-aiofiles")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="zo-aiofiles-loop", daemon=True)
        self._thread.start()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        # Like NativeAIO.__del__: a backend dropped without close() still stops its threads. A
        # finalizer rather than __del__ also runs at interpreter exit, while the loop thread can
        # still be joined. Requests are static methods, so in flight they never hold self: the
        # last reference cannot drop on the loop thread, which could not join itself.
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._thread, self._pool, self._pending)

    def _start(self, write: bool, file: FileRef, offset: int, addr: int, length: int, chunk: int,
               checksums: ChecksumView | None, keep: Any) -> IOFuture:
        if self._loop.is_closed():
            raise RuntimeError("aiofiles async I/O backend is closed")
        coro = self._request(self._pool, write, file, offset, addr, length, chunk, checksums, keep)
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return ThreadFuture(fut)

    @staticmethod
    async def _request(pool: concurrent.futures.Executor, write: bool, file: FileRef, offset: int, addr: int,
                       length: int, chunk: int, checksums: ChecksumView | None, keep: Any) -> None:
        # `keep` holds the caller's buffer alive until this coroutine ends
        try:
            path, extra = _reopen_spec(file, write)
        except OSError as exc:
            raise io_error("write" if write else "read", file, offset, exc.errno or errno.EIO) from None
        tasks = [AiofilesAIO._chunk(pool, write, path, extra, file, offset + pos, addr + pos,
                                    min(chunk, length - pos), checksums, i)
                 for i, pos in enumerate(range(0, length, chunk))]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    @staticmethod
    async def _chunk(pool: concurrent.futures.Executor, write: bool, path: str, extra: int, file: FileRef,
                     offset: int, addr: int, nbytes: int, checksums: ChecksumView | None, index: int) -> None:
        loop = asyncio.get_running_loop()
        view = memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")
        if write and checksums is not None:
            checksums.set(index, await loop.run_in_executor(pool, checksum.compute, addr, nbytes))
        mode = "r+b" if write else "rb"
        try:
            # Not `async with`: its exit closes the file on the loop's default executor, a
            # ThreadPoolExecutor, which refuses work once the interpreter begins to exit.
            f = await aiofiles.open(path, mode, buffering=0, opener=_opener(extra), executor=pool)
            try:
                await f.seek(offset)
                done = await AiofilesAIO._transfer(f, write, view)
            finally:
                await f.close()
        except OSError as exc:
            raise io_error("write" if write else "read", file, offset, exc.errno or errno.EIO) from exc
        if done < nbytes and write:
            raise io_error("write", file, offset + done, errno.ENOSPC)
        if done < nbytes:
            raise eof_error(file, offset + done)
        if not write and checksums is not None:
            got = await loop.run_in_executor(pool, checksum.compute, addr, nbytes)
            if got != checksums.get(index):
                raise ChecksumError(file_label(file), offset, checksums.get(index), got)

    @staticmethod
    async def _transfer(f: Any, write: bool, view: memoryview) -> int:
        """Bytes moved; fewer than asked only at end of file (or a full disk)."""
        done = 0
        while done < len(view):  # a raw file may move fewer bytes than asked
            n = await (f.write(view[done:]) if write else f.readinto(view[done:]))
            if not n:
                break
            done += n
        return done

    def close(self) -> None:
        """Finish what is in flight, then stop the loop thread and the executor; idempotent."""
        self._finalizer()


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread, pool: concurrent.futures.Executor,
              pending: set[concurrent.futures.Future[Any]]) -> None:
    """close() or garbage collection, whichever comes first (weakref.finalize runs it once)."""
    concurrent.futures.wait(list(pending))  # never abandon a request mid-flight
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()
    pool.shutdown(wait=True)
