"""The swap store: round trips, striping, checksums, and every fault with its message."""
from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from zero_offload.io import swap, swap_files
from zero_offload.io.aio import open_backend
from zero_offload.io.native_aio import native_lib
from zero_offload.io.swap import SwapError, SwapStore

BACKENDS = [pytest.param("native", marks=pytest.mark.skipif(native_lib() is None, reason="native library not built")),
            "aiofiles"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class IO:  # the fields of zero_offload.config.IOConfig
    block_size: int = 64 << 10
    queue_depth: int = 4
    threads: int = 2
    backend: str = "auto"
    direct: bool = True


@pytest.fixture(params=BACKENDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def _store(paths: Sequence[Path | str], kind: str = "auto", capacity: int = 8 << 20, name: str = "t",
           **kw: Any) -> SwapStore:
    return SwapStore([str(p) for p in paths], name, 0, capacity_bytes=capacity, io=IO(backend=kind), **kw)


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """A child Python (own process: rlimits, uid changes, crashes) that cannot hang the suite."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


SIZES = [1, 100, 4095, 4096, 4097, 65536, 65537, 3 * 65536 + 4096, 200_000, 1_000_003]


def test_round_trip_odd_sizes_aligned_and_unaligned(kind: str, tmp_path: Path) -> None:
    with _store([tmp_path], kind) as st:
        data = {}
        for i, n in enumerate(SIZES):
            st.register(f"s{i}", n)
            data[i] = torch.randint(0, 256, (n,), dtype=torch.uint8)
        # write half from aligned buffers, half from unaligned tensors (bounced)
        srcs = [st.alloc_buffer(n).copy_(data[i]) if i % 2 else torch.empty(n + 1, dtype=torch.uint8)[1:].copy_(data[i])
                for i, n in enumerate(SIZES)]
        for f in [st.write(f"s{i}", s) for i, s in enumerate(srcs)]:
            f.wait()
        for i, n in enumerate(SIZES):
            for dst in (st.alloc_buffer(n), torch.empty(n + 3, dtype=torch.uint8)[3:]):
                st.read(f"s{i}", dst.fill_(7)).wait()
                assert torch.equal(dst, data[i]), (i, n, dst.data_ptr() % 4096)
        assert st.bytes_retained() == sum((n + 4095) // 4096 * 4096 for n in SIZES)


def test_other_dtypes_and_shapes(kind: str, tmp_path: Path) -> None:
    with _store([tmp_path], kind) as st:
        x = torch.randn(33, 17)
        y = torch.randn(1000).to(torch.bfloat16)
        st.register("x", x.numel() * 4)
        st.register("y", y.numel() * 2)
        st.write("x", x).wait()
        st.write("y", y).wait()
        x2, y2 = torch.empty_like(x), torch.empty_like(y)
        st.read("x", x2).wait()
        st.read("y", y2).wait()
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_striping_round_robin_and_file_modes(kind: str, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    with _store([a, b], kind, capacity=1 << 20) as st:
        slots = [st.register(f"k{i}", 100_000) for i in range(6)]
        assert [s.path for s in slots] == [slots[0].path, slots[1].path] * 3 and slots[0].path != slots[1].path
        assert all(s.offset % 4096 == 0 for s in slots)
        d = os.path.dirname(slots[0].path)
        assert d == str(a / "zero_offload-t-rank0")
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(slots[0].path).st_mode) == 0o600
        assert os.path.getsize(slots[0].path) >= 512 << 10  # preallocated up front
        src = [torch.randint(0, 256, (100_000,), dtype=torch.uint8) for _ in slots]
        futs = [st.write(f"k{i}", t) for i, t in enumerate(src)]
        for f in futs:
            f.wait()
        for i, t in enumerate(src):
            out = st.alloc_buffer(100_000)
            st.read(f"k{i}", out).wait()
            assert torch.equal(out, t)
    assert os.listdir(a) == [] and os.listdir(b) == []  # close removes files and directories


def test_many_concurrent_transfers(kind: str, tmp_path: Path) -> None:
    with _store([tmp_path], kind, capacity=16 << 20) as st:
        srcs = []
        for i in range(64):
            n = 4096 * (1 + i % 7) + (i % 3) * 123
            st.register(str(i), n)
            srcs.append(torch.randint(0, 256, (n,), dtype=torch.uint8))
        for f in [st.write(str(i), s) for i, s in enumerate(srcs)]:
            f.wait()
        outs = [torch.empty_like(s) for s in srcs]
        futs = [st.read(str(i), o) for i, o in enumerate(outs)]
        for f in futs[::-1]:
            f.wait()
        assert all(torch.equal(s, o) for s, o in zip(srcs, outs))


@pytest.mark.parametrize("where", ["body", "tail", "bounced"])
def test_corruption_is_an_error_naming_file_offset_and_shard(kind: str, tmp_path: Path, where: str) -> None:
    with _store([tmp_path], kind) as st:
        st.register("pad", 4096)
        slot = st.register("shard-7", 3 * 65536 + 100)
        src = torch.randint(0, 256, (slot.nbytes,), dtype=torch.uint8)
        st.write("shard-7", src).wait()
        block = {"body": 65536, "tail": 3 * 65536, "bounced": 2 * 65536}[where]
        _flip_byte(slot.path, slot.offset + block + 50)
        dst = st.alloc_buffer(slot.nbytes) if where != "bounced" else torch.empty(slot.nbytes + 1, dtype=torch.uint8)[1:]
        with pytest.raises(SwapError, match=rf"checksum mismatch in {slot.path} at offset {slot.offset + block} "
                                            r"\(shard 'shard-7'\): expected 0x[0-9a-f]{8}, found 0x[0-9a-f]{8}"):
            st.read("shard-7", dst).wait()


@pytest.mark.parametrize("where", ["tail page", "bounced block"])
def test_a_write_that_fails_part_way_leaves_nothing_readable(kind: str, tmp_path: Path, where: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The first blocks of a write land, a later one is never submitted: every block's checksum
    matches whichever version is on the drive, so a read would return old and new bytes mixed
    without a word (a review's finding). The slot now reads as failed until it is written again."""
    with _store([tmp_path], kind) as st:
        slot = st.register("k", 3 * 65536 + 100)
        st.write("k", torch.full((slot.nbytes,), 1, dtype=torch.uint8)).wait()
        new = torch.full((slot.nbytes + 1,), 2, dtype=torch.uint8)
        if where == "tail page":
            src = st.alloc_buffer(slot.nbytes).copy_(new[1:])  # aligned: the body goes straight out

            def no_page(nbytes: int, **kw: Any) -> torch.Tensor:
                raise MemoryError("no page for the tail")
            monkeypatch.setattr(swap, "aligned_empty", no_page)
        else:  # unaligned: bounced block by block; the third submission fails
            real, calls = st._submit, [0]

            def third_fails(*args: Any) -> Any:
                calls[0] += 1
                if calls[0] == 3:
                    raise OSError(5, "the drive refused a block")
                return real(*args)
            monkeypatch.setattr(st, "_submit", third_fails)
            src = new[1:]
        with pytest.raises((MemoryError, SwapError)):
            st.write("k", src).wait()
        monkeypatch.undo()
        out = st.alloc_buffer(slot.nbytes)
        with pytest.raises(SwapError, match="shard 'k': its last write failed .*nothing valid to read"):
            st.read("k", out).wait()
        st.write("k", torch.full((slot.nbytes,), 3, dtype=torch.uint8)).wait()  # a whole write makes it good
        st.read("k", out).wait()
        assert bool((out == 3).all())


def test_missing_path_file_path_and_space_errors(tmp_path: Path) -> None:
    with pytest.raises(SwapError, match=rf"nvme path '{tmp_path}/nope' does not exist"):
        _store([tmp_path / "nope"])
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SwapError, match=rf"nvme path '{tmp_path}/afile' is not a directory"):
        _store([tmp_path / "afile"])
    with pytest.raises(SwapError, match=rf"not enough free space on {tmp_path}: swap store needs 1125899906842624 "
                                        r"bytes \(1048576.00 GiB\), only \d+ bytes \([\d.]+ GiB\) free"):
        _store([tmp_path], capacity=1 << 50)
    assert os.listdir(tmp_path) == ["afile"]  # nothing left behind by the failures


def test_unwritable_path_for_an_unprivileged_user() -> None:
    # pytest's tmp_path sits under a 0700 directory that user nobody cannot even traverse
    with tempfile.TemporaryDirectory(prefix="zo-swap-perm-") as top:
        os.chmod(top, 0o755)
        out = _run(f"""
            import os
            from zero_offload.io.swap import SwapStore, SwapError   # import while still root
            os.setgid(65534); os.setuid(65534)   # root passes every permission check; nobody does not
            try:
                SwapStore([{top!r}], "t", 0, capacity_bytes=1 << 20)
            except SwapError as e:
                print("ERR", e)
        """)
        assert out.returncode == 0, out.stderr
        assert f"ERR [Errno 13] nvme path '{top}' is not writable: cannot create {top}/zero_offload-t-rank0: " \
               "Permission denied" in out.stdout
        assert os.listdir(top) == []


def test_disk_full_mid_run_surfaces_the_os_error(tmp_path: Path) -> None:
    kinds = ["native", "aiofiles"] if native_lib() is not None else ["aiofiles"]
    out = _run(f"""
        import resource, signal
        from zero_offload.io.swap import SwapStore, SwapError
        from tests.test_swap import IO
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so write() returns EFBIG instead of killing us
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        for kind in {kinds!r}:
            st = SwapStore([{str(tmp_path)!r}], "t", 0, capacity_bytes=1 << 20, io=IO(backend=kind))
            st.register("a", 65536); st.register("b", 65536)
            resource.setrlimit(resource.RLIMIT_FSIZE, (65536, hard))  # no byte past slot a
            st.write("a", st.alloc_buffer(65536)).wait()
            fut = st.write("b", st.alloc_buffer(65536))
            try:
                fut.wait()
            except SwapError as e:
                print(kind, "ERR", e.errno, e)
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            st.close()
    """)
    assert out.returncode == 0, out.stderr
    for kind in kinds:
        assert f"{kind} ERR 27 [Errno 27] shard 'b': write of {tmp_path}/zero_offload-t-rank0/swap.bin at " \
               "offset 65536 failed: File too large" in out.stdout, out.stdout
    assert os.listdir(tmp_path) == []


def test_filesystem_without_o_direct_goes_buffered_with_one_warning(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refuse(path: str) -> int:
        raise OSError(22, "Invalid argument")  # what tmpfs answered before Linux 6.6

    monkeypatch.setattr(swap_files, "open_direct", refuse)
    monkeypatch.setattr(swap_files, "_warned_buffered", set())
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    with caplog.at_level(logging.WARNING, logger="zero_offload.io"):
        with _store([a, b], kind) as st:
            assert not st.direct
            st.register("k", 70_001)
            src = torch.randint(0, 256, (70_001,), dtype=torch.uint8)
            st.write("k", torch.empty(70_002, dtype=torch.uint8)[1:].copy_(src)).wait()
            out = torch.empty(70_001, dtype=torch.uint8)
            st.read("k", out).wait()
            assert torch.equal(out, src)
    lines = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert lines == [f"{a}/zero_offload-t-rank0 does not support O_DIRECT (tmpfs?): swap files there use buffered I/O"]


def test_leftovers_of_a_crashed_run_are_reused_or_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = _run(f"""
        import os
        from zero_offload.io.swap import SwapStore
        st = SwapStore([{str(tmp_path)!r}], "t", 0, capacity_bytes=1 << 20)
        os._exit(0)   # a crash: no close, no finalizer
    """)
    assert out.returncode == 0, out.stderr
    d = tmp_path / "zero_offload-t-rank0"
    assert (d / "swap.bin").exists()
    with caplog.at_level(logging.WARNING, logger="zero_offload.io"):
        with _store([tmp_path], capacity=1 << 20) as st:
            st.register("k", 5000)
            st.write("k", torch.ones(5000, dtype=torch.uint8)).wait()
    assert any(r.getMessage().startswith(f"reusing swap file {d}/swap.bin left by a crashed run (pid ")
               for r in caplog.records)
    d.mkdir()
    (d / "manifest.json").write_text("{not json")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zero_offload.io"):
        _store([tmp_path], capacity=1 << 20).close()
    assert [r.getMessage() for r in caplog.records] == [
        f"removing swap dir {d} left by a crashed run: no readable manifest"]
    assert os.listdir(tmp_path) == []


def test_directory_of_a_live_store_is_refused(tmp_path: Path) -> None:
    with _store([tmp_path]):
        with pytest.raises(SwapError, match=rf"swap dir {tmp_path}/zero_offload-t-rank0 is in use by another engine of this process "
                                            rf"\(pid {os.getpid()}\): close\(\) it first"):
            _store([tmp_path])


def test_a_live_store_whose_owner_is_not_in_this_process_table_is_refused(tmp_path: Path) -> None:
    """A process in another container (or on another host over NFS) sharing the path: its pid
    means nothing here, so the live store looked like a crashed run's and was taken over (or
    removed) under it. The owner's lock on swap.bin refuses it; its files stay as they were."""
    import json

    with _store([tmp_path]) as live:
        live.register("k", 5000)
        live.write("k", torch.ones(5000, dtype=torch.uint8)).wait()
        d = tmp_path / "zero_offload-t-rank0"
        manifest = json.loads((d / "manifest.json").read_text())
        (d / "manifest.json").write_text(json.dumps({**manifest, "pid": 2**22 + 7}))  # "not running here"
        before = sorted(os.listdir(d)), (d / "swap.bin").stat().st_size
        with pytest.raises(SwapError, match=rf"swap dir {d} is in use by a process that holds its lock \(pid "
                                            rf"{2**22 + 7} in its manifest is not running here"):
            _store([tmp_path])
        with pytest.raises(SwapError, match="is in use by a process that holds its lock"):  # nor removed with a new size
            _store([tmp_path], capacity=1 << 20)
        assert (sorted(os.listdir(d)), (d / "swap.bin").stat().st_size) == before
        back = torch.zeros(5000, dtype=torch.uint8)
        live.read("k", back).wait()
        assert torch.equal(back, torch.ones(5000, dtype=torch.uint8))


def test_misuse_is_a_one_line_error(tmp_path: Path) -> None:
    with _store([tmp_path], capacity=1 << 20) as st:
        st.register("k", 100)
        with pytest.raises(ValueError, match="slot 'k' is already registered"):
            st.register("k", 100)
        with pytest.raises(KeyError, match="no swap slot registered under key 'x'"):
            st.write("x", torch.empty(100, dtype=torch.uint8))
        with pytest.raises(ValueError, match="swap write of 'k': tensor has 400 bytes, slot has 100"):
            st.write("k", torch.empty(100))
        with pytest.raises(ValueError, match="swap read of 'k' needs a contiguous tensor"):
            st.read("k", torch.empty(10, 20, dtype=torch.uint8)[:, :10])
        with pytest.raises(ValueError, match="shard 'k' was never written to the swap store"):
            st.read("k", torch.empty(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="swap store is closed"):
        st.register("z", 1)
    with pytest.raises(ValueError, match="swap store name 'a/b' must be letters"):
        _store([tmp_path], name="a/b")


@pytest.mark.parametrize("capacity", [0, 64 << 10])
def test_more_slots_than_planned_grow_the_file(tmp_path: Path, capacity: int) -> None:
    with _store([tmp_path], capacity=capacity) as st:
        slots = [st.register(str(i), 40_000) for i in range(4)]  # 160 KiB into a 64 KiB plan
        assert os.path.getsize(slots[0].path) >= slots[-1].offset + slots[-1].length
        src = torch.randint(0, 256, (40_000,), dtype=torch.uint8)
        st.write("3", src).wait()
        out = torch.empty_like(src)
        st.read("3", out).wait()
        assert torch.equal(out, src)


def test_released_slots_are_reused_by_same_size_registrations(tmp_path: Path) -> None:
    with _store([tmp_path], capacity=1 << 20) as st:
        a = st.register("a", 10_000)
        st.register("b", 10_000)
        st.write("a", torch.ones(10_000, dtype=torch.uint8)).wait()
        st.release("a")
        with pytest.raises(KeyError, match="no swap slot registered under key 'a'"):
            st.read("a", torch.empty(10_000, dtype=torch.uint8))
        c = st.register("a", 9_000)  # same rounded size: a's place on disk, and a fresh checksum table
        assert (c.path, c.offset) == (a.path, a.offset)
        with pytest.raises(ValueError, match="shard 'a' was never written"):
            st.read("a", torch.empty(9_000, dtype=torch.uint8))
        assert st.bytes_retained() == 2 * 12288


def test_bounce_budget_below_one_block_is_refused(tmp_path: Path) -> None:
    # a bounced block takes one block-sized buffer: a smaller pool could never serve a transfer
    with pytest.raises(ValueError, match=r"bounce_budget_bytes=32768 is smaller than io.block_size=65536"):
        _store([tmp_path], bounce_budget_bytes=32 << 10)
    assert os.listdir(tmp_path) == []
    with _store([tmp_path], bounce_budget_bytes=64 << 10) as st:  # exactly one block is enough
        st.register("k", 200_000)
        src = torch.randint(0, 256, (200_000,), dtype=torch.uint8)
        st.write("k", torch.empty(200_001, dtype=torch.uint8)[1:].copy_(src)).wait()
        out = torch.empty(200_001, dtype=torch.uint8)[1:]
        st.read("k", out).wait()
        assert torch.equal(out, src)


@pytest.mark.parametrize("failing", ["BufferPool", "DaemonPool"])
def test_failed_construction_removes_files_and_closes_its_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 failing: str) -> None:
    opened: list = []
    real_open, real_executor = swap.open_backend, swap.DaemonPool

    def open_backend(*a: Any, **kw: Any) -> Any:
        opened.append(real_open(*a, **kw))
        return opened[-1]

    def executor(*a: Any, **kw: Any) -> Any:
        if "zo-swap-bounce" in a:
            raise RuntimeError("can't start new thread")
        return real_executor(*a, **kw)

    def pool(*a: Any, **kw: Any) -> Any:
        raise MemoryError("no pinned memory")

    monkeypatch.setattr(swap, "open_backend", open_backend)
    if failing == "BufferPool":
        monkeypatch.setattr(swap, "BufferPool", pool)
    else:
        monkeypatch.setattr(swap, "DaemonPool", executor)
    with pytest.raises((MemoryError, RuntimeError)):
        _store([tmp_path])
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="backend is closed"):
        opened[0].read("/dev/null", 0, bytearray(1))


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_failed_chmod_of_a_new_swap_file_leaks_no_fd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(fd: int, mode: int) -> None:
        raise OSError(1, "Operation not permitted")

    with open_backend("aiofiles", threads=1, queue_depth=1) as io:  # opened first: its own fds stay
        before = _open_fds()
        monkeypatch.setattr(os, "fchmod", refuse)
        with pytest.raises(SwapError, match=rf"cannot create swap file {tmp_path}/zero_offload-t-rank0/swap.bin: "
                                            "Operation not permitted"):
            SwapStore([str(tmp_path)], "t", 0, capacity_bytes=1 << 20, io=IO(), backend=io)
        monkeypatch.undo()
        assert _open_fds() == before
    assert os.listdir(tmp_path) == []
