"""Async I/O backends: the same tests against the native engine and the aiofiles fallback."""
from __future__ import annotations

import ctypes
import gc
import errno
import os
import random
import zlib
from pathlib import Path
from typing import Iterator

import pytest
import torch

from zero_offload.io import checksum
from zero_offload.io.aio import AIOBackend, ChecksumError, open_backend, resolve_kind
from zero_offload.io.buffers import aligned_empty
from zero_offload.io.checksum import ChecksumTable
from zero_offload.io.native_aio import native_lib

NATIVE = native_lib() is not None
BACKENDS = [pytest.param("native", marks=pytest.mark.skipif(not NATIVE, reason="native library not built")),
            "aiofiles"]


@pytest.fixture(params=BACKENDS)
def io(request: pytest.FixtureRequest) -> Iterator[AIOBackend]:
    with open_backend(request.param, threads=2, queue_depth=4, block_size=64 << 10) as backend:
        yield backend


def _fd(path: Path, direct: bool) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
    os.posix_fallocate(fd, 0, 8 << 20)
    return fd


def test_round_trip_direct_many_offsets_and_sizes(io: AIOBackend, tmp_path: Path) -> None:
    fd = _fd(tmp_path / "f", direct=True)
    rng = random.Random(1)
    cases = [(rng.randrange(0, 1024) * 4096, rng.randrange(1, 64) * 4096) for _ in range(40)]
    cases += [(0, 4096), (4096 * 7, 200 * 4096 + 0)]  # one page; several chunks of 64 KiB
    try:
        for off, n in cases:
            src = aligned_empty(n).random_(0, 256)
            io.write(fd, off, src).wait()
            dst = aligned_empty(n).zero_()
            io.read(fd, off, dst).wait()
            assert torch.equal(src, dst), (off, n)
    finally:
        os.close(fd)


def test_round_trip_buffered_odd_sizes_and_offsets(io: AIOBackend, tmp_path: Path) -> None:
    fd = _fd(tmp_path / "f", direct=False)
    rng = random.Random(2)
    try:
        for _ in range(40):
            off, n = rng.randrange(0, 1 << 20), rng.randrange(1, 300_000)
            src = torch.randint(0, 256, (n,), dtype=torch.uint8)
            io.write(fd, off, src).wait()
            dst = bytearray(n)
            io.read(fd, off, dst).wait()
            assert bytes(dst) == src.numpy().tobytes(), (off, n)
    finally:
        os.close(fd)


def test_partial_length_and_path_argument(io: AIOBackend, tmp_path: Path) -> None:
    path = str(tmp_path / "p")
    src = aligned_empty(3 * 4096).random_(0, 256)
    io.write(path, 8192, src, 2 * 4096).wait()  # the path form opens (O_DIRECT) per request
    dst = aligned_empty(2 * 4096)
    io.read(path, 8192, dst).wait()
    assert torch.equal(dst, src[:8192])
    with pytest.raises(ValueError, match="does not fit a 12288-byte buffer"):
        io.write(path, 0, src, 4 * 4096)


def test_many_concurrent_requests(io: AIOBackend, tmp_path: Path) -> None:
    fd = _fd(tmp_path / "f", direct=True)
    n, count = 16384, 256
    srcs = [aligned_empty(n).random_(0, 256) for _ in range(count)]
    try:
        futs = [io.write(fd, i * n, s) for i, s in enumerate(srcs)]
        for f in futs:
            f.wait()
        assert all(f.done() for f in futs)
        dsts = [aligned_empty(n) for _ in range(count)]
        futs = [io.read(fd, i * n, d) for i, d in enumerate(dsts)]
        for f in reversed(futs):  # waiting out of order is fine
            f.wait()
        assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))
    finally:
        os.close(fd)


def test_checksums_detect_one_flipped_byte(io: AIOBackend, tmp_path: Path) -> None:
    path = tmp_path / "f"
    fd = _fd(path, direct=True)
    n = 256 << 10  # four 64 KiB chunks, four checksums
    table = ChecksumTable(4)
    src = aligned_empty(n).random_(0, 256)
    try:
        io.write(fd, 4096, src, checksums=table.view(0)).wait()
        assert table.array[2] == checksum.compute(src.data_ptr() + 2 * (64 << 10), 64 << 10)
        dst = aligned_empty(n)
        io.read(fd, 4096, dst, checksums=table.view(0)).wait()  # intact: verifies fine
        with open(path, "r+b") as f:
            f.seek(4096 + 2 * (64 << 10) + 12345)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))
        with pytest.raises(ChecksumError, match=rf"checksum mismatch in {path} at offset {4096 + 2 * (64 << 10)}:"):
            io.read(fd, 4096, dst, checksums=table.view(0)).wait()
    finally:
        os.close(fd)


def test_requests_that_do_not_fit_their_checksum_table_or_chunk_are_refused(io: AIOBackend, tmp_path: Path) -> None:
    """Six 64 KiB chunks against a two-entry table: the native workers would write four checksums
    past its end (a review crashed the process that way); a negative chunk moved no bytes on one
    backend and was taken as 'whole request' on the other. Both are one-line errors now."""
    fd = _fd(tmp_path / "f", direct=True)
    buf = aligned_empty(6 * (64 << 10))
    table = ChecksumTable(3)
    try:
        with pytest.raises(ValueError, match="needs 6 checksums; the checksum table has 2 from entry 1"):
            io.write(fd, 0, buf, checksums=table.view(1))
        for chunk in (-4096, 1.5):
            with pytest.raises(ValueError, match="I/O chunk must be a whole number of bytes > 0"):
                io.write(fd, 0, buf, chunk=chunk)  # type: ignore[arg-type]
        io.write(fd, 0, buf[:2 * (64 << 10)], checksums=table.view(1)).wait()  # two chunks: they fit
    finally:
        os.close(fd)


def test_os_errors_surface_on_the_waiting_side(io: AIOBackend, tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        fut = io.read(fd, 4096, aligned_empty(3 * 4096))  # submitting succeeds; the error comes at wait()
        with pytest.raises(OSError, match=rf"read of {path} hit end of file at offset 8192"):
            fut.wait()
        fut = io.write(fd, 0, aligned_empty(4096))
        with pytest.raises(OSError, match=rf"write of {path} at offset 0 failed: Bad file descriptor") as info:
            fut.wait()
        assert info.value.errno == errno.EBADF
        with pytest.raises(OSError):  # the error sticks: waiting again raises again
            fut.wait()
    finally:
        os.close(fd)


def test_closed_backend_refuses_and_unknown_kind() -> None:
    io = open_backend("aiofiles", threads=1, queue_depth=1)
    io.close()
    with pytest.raises(RuntimeError, match="backend is closed"):
        io.read("/dev/null", 0, bytearray(1))
    with pytest.raises(ValueError, match="unknown async I/O backend 'spdk': expected one of auto, native, aiofiles"):
        open_backend("spdk", threads=1, queue_depth=1)
    assert resolve_kind("auto") == ("native" if NATIVE else "aiofiles")


@pytest.mark.skipif(not NATIVE, reason="native library not built")
def test_native_checksum_is_crc32c_and_matches_scalar() -> None:
    lib = native_lib()
    for fn in (lib.zo_checksum, lib.zo_checksum_scalar):
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_uint32
    assert lib.zo_checksum(b"123456789", 9) == 0xE3069283  # the CRC32C check value
    rng = random.Random(3)
    for n in (0, 1, 7, 12287, 12288, 12289, 100_003, 1 << 20):
        data = rng.randbytes(n)
        assert lib.zo_checksum(data, n) == lib.zo_checksum_scalar(data, n), n
    data = bytearray(rng.randbytes(1 << 16))
    before = lib.zo_checksum(bytes(data), len(data))
    data[40000] ^= 1
    assert lib.zo_checksum(bytes(data), len(data)) != before


def test_python_checksum_fallback_without_native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum, "_native_fn", lambda: None)
    buf = bytearray(b"zero offload" * 1000)
    addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    assert checksum.algorithm() == "zlib-crc32"
    assert checksum.compute(addr, len(buf)) == zlib.crc32(buf)


def test_aiofiles_backend_dropped_without_close_stops_its_threads() -> None:
    io = open_backend("aiofiles", threads=1, queue_depth=2)
    io.read("/dev/zero", 0, bytearray(10)).wait()  # the executor has started a thread
    threads = [io._thread, *io._pool._threads]
    del io
    gc.collect()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads)
    io = open_backend("aiofiles", threads=1, queue_depth=1)
    io.close()
    io.close()  # idempotent, and the finalizer does not run a second time either
    del io
    gc.collect()


@pytest.mark.skipif(not NATIVE, reason="native library not built")
def test_native_engine_starts_threads_times_queue_depth_workers() -> None:
    io = open_backend("native", threads=3, queue_depth=5)
    assert io.workers == 15
    io.close()
    assert io.workers == 0


def test_a_path_that_cannot_be_opened_fails_at_wait_with_the_same_message(io: AIOBackend, tmp_path: Path) -> None:
    """The native backend raised the bare FileNotFoundError from read() itself; both now report
    it from wait(), naming the operation, the file and the offset."""
    missing = str(tmp_path / "no" / "such")
    fut = io.read(missing, 0, aligned_empty(4096))
    with pytest.raises(OSError, match=r"read of .*no/such at offset 0 failed: No such file or directory"):
        fut.wait()


@pytest.mark.skipif(not NATIVE, reason="native library not built")
def test_native_engine_refuses_worker_counts_whose_product_overflows() -> None:
    """65537 x 65535 overflows int to a small number: the engine was made with no worker at all,
    and every request waited for ever."""
    from zero_offload.io.native_aio import NativeAIO

    with pytest.raises(ValueError, match="native async I/O refused threads=65537 queue_depth=65535"):
        NativeAIO(threads=65537, queue_depth=65535, block_size=1 << 20)
