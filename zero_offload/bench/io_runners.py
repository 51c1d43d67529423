"""The engines `zero-offload bench-io` times: ours (native, aiofiles) and fio.

Each runner moves the whole test file once, sequentially, with O_DIRECT, in `block_size` requests
of which `threads * queue_depth` are in flight, and returns bytes per second. Reads are cold:
O_DIRECT bypasses the page cache, and the cache is dropped for the file before each pass anyway.
Runners are plain objects with a `name` and `run(pattern)`, so a comparison script can add one
(scripts/compare_io.py adds DeepSpeed's ds_io) without this package knowing about it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass

import torch

from zero_offload.io.aio import AIOBackend, open_backend
from zero_offload.io.buffers import aligned_empty
from zero_offload.io.checksum import ChecksumTable


@dataclass(frozen=True)
class Pattern:
    """One timed pass: `op` ("read" | "write") over `size` bytes of `path`."""

    op: str
    path: str
    size: int
    block_size: int
    queue_depth: int
    threads: int

    @property
    def in_flight(self) -> int:
        return self.queue_depth * self.threads


def drop_cache(path: str) -> None:
    """Evict the file from the page cache so a read pass measures the drive, not RAM."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class OurRunner:
    """Our backend as the swap store drives it: each request is a shard-sized run of blocks that
    the engine splits into `block_size` chunks, one per worker; two requests are outstanding, so
    the workers always have queued chunks while Python waits on the older request.

    With `checksums`, every block's checksum is recorded on write and verified on read, as the
    swap store does; its read pass therefore needs its own write pass to be the file's last one.
    """

    def __init__(self, kind: str, *, huge_pages: bool = True, checksums: bool = False) -> None:
        self.kind, self.huge_pages, self.checksums = kind, huge_pages, checksums
        self.name = kind + ("" if huge_pages else "-4k") + ("+crc" if checksums else "")
        self._table: ChecksumTable | None = None

    def run(self, p: Pattern) -> float:
        request = p.block_size * p.in_flight
        bufs = [aligned_empty(request, huge_pages=self.huge_pages).random_(0, 256) for _ in range(2)]
        if self.checksums and (p.op == "write" or self._table is None):
            self._table = ChecksumTable(-(-p.size // p.block_size))
        fd = os.open(p.path, os.O_RDWR | os.O_DIRECT)
        try:
            drop_cache(p.path)
            with open_backend(self.kind, threads=p.threads, queue_depth=p.queue_depth,
                              block_size=p.block_size) as io:
                return self._pass(io, fd, p, bufs)
        finally:
            os.close(fd)

    def _pass(self, io: AIOBackend, fd: int, p: Pattern, bufs: list[torch.Tensor]) -> float:
        submit = io.write if p.op == "write" else io.read
        request = bufs[0].numel()
        futures: list = [None] * len(bufs)
        start = time.perf_counter()
        for i, offset in enumerate(range(0, p.size, request)):
            slot = i % len(bufs)
            if futures[slot] is not None:
                futures[slot].wait()  # this buffer's previous request must finish before reuse
            sums = self._table.view(offset // p.block_size) if self.checksums else None
            futures[slot] = submit(fd, offset, bufs[slot], min(request, p.size - offset), checksums=sums)
        for f in futures:
            if f is not None:
                f.wait()
        return p.size / (time.perf_counter() - start)


class FioRunner:
    """fio with the same pattern: one job, iodepth = threads * queue_depth, direct=1."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.name = f"fio-{engine}"

    @staticmethod
    def available() -> bool:
        return shutil.which("fio") is not None

    def command(self, p: Pattern) -> list[str]:
        return ["fio", "--name=zo-bench", f"--filename={p.path}", f"--rw={p.op}", f"--bs={p.block_size}",
                f"--iodepth={p.in_flight}", "--numjobs=1", "--direct=1", f"--ioengine={self.engine}",
                f"--size={p.size}", "--output-format=json"]

    def run(self, p: Pattern) -> float:
        drop_cache(p.path)
        out = subprocess.run(self.command(p), capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            last = (out.stderr.strip() or out.stdout.strip()).splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"fio --ioengine={self.engine} failed: {last[0]}")
        job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]  # skip any notice lines
        return float(job[p.op]["bw_bytes"])
