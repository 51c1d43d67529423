"""Aligned host buffers and the budgeted pool (backpressure instead of running out of RAM)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from zero_offload.io.buffers import BufferPool, aligned_empty


@pytest.mark.parametrize("nbytes", [1, 100, 4095, 4096, 4097, 1 << 20, (1 << 20) + 3])
def test_aligned_empty_is_page_aligned_uint8(nbytes: int) -> None:
    t = aligned_empty(nbytes, pin=True)  # pin is honoured only where CUDA is
    assert t.dtype == torch.uint8 and t.numel() == nbytes and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0
    assert t.is_pinned() == torch.cuda.is_available()
    big = aligned_empty(nbytes, alignment=1 << 16)
    assert big.data_ptr() % (1 << 16) == 0


def test_large_buffers_sit_on_huge_page_boundaries_unless_asked_not_to() -> None:
    assert aligned_empty(4 << 20).data_ptr() % (2 << 20) == 0
    small = [aligned_empty(4 << 20, huge_pages=False) for _ in range(4)]
    assert all(t.data_ptr() % 4096 == 0 for t in small)


def test_aligned_empty_rejects_bad_alignment() -> None:
    with pytest.raises(ValueError, match="alignment must be a power of two, got 3000"):
        aligned_empty(10, alignment=3000)


def test_pool_reuses_released_buffers_and_counts_bytes() -> None:
    pool = BufferPool(1 << 20)
    a = pool.acquire(5000)
    assert a.numel() == 5000 and a.data_ptr() % 4096 == 0
    assert pool.in_use_bytes == 8192
    pool.release(a)
    assert (pool.in_use_bytes, pool.cached_bytes) == (0, 8192)
    b = pool.acquire(6000)  # same rounded size: the cached buffer comes back
    assert b.data_ptr() == a.data_ptr()
    pool.release(b)


def test_pool_blocks_until_release_then_serves() -> None:
    pool = BufferPool(3 * 4096)
    held = [pool.acquire(4096) for _ in range(3)]
    got: list[torch.Tensor] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(4096)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and not got  # over budget: it waits, it does not fail
    pool.release(held.pop())
    waiter.join(timeout=5)
    assert not waiter.is_alive() and got[0].numel() == 4096
    assert pool.in_use_bytes == 3 * 4096


def test_pool_evicts_cached_buffers_of_other_sizes_before_waiting() -> None:
    pool = BufferPool(4 * 4096)
    small = [pool.acquire(4096) for _ in range(4)]
    for t in small:
        pool.release(t)
    big = pool.acquire(3 * 4096)  # needs the cache's room, not a wait
    assert pool.in_use_bytes == 3 * 4096 and pool.cached_bytes == 4096
    pool.release(big)


def test_pool_errors_are_one_line() -> None:
    pool = BufferPool(8192)
    with pytest.raises(ValueError, match="buffer of 9000 bytes exceeds the pool budget of 8192 bytes"):
        pool.acquire(9000)
    a = pool.acquire(8192)
    with pytest.raises(TimeoutError, match="no 4096-byte buffer within the 8192-byte pool budget: 8192 bytes still held"):
        pool.acquire(4096, timeout=0.05)
    with pytest.raises(ValueError, match="did not hand out"):
        pool.release(torch.empty(10, dtype=torch.uint8))
    pool.release(a)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(a)
    with pytest.raises(ValueError, match="below one 4096-byte page"):
        BufferPool(100)


def test_pool_under_contention_never_exceeds_budget() -> None:
    pool = BufferPool(64 << 10)
    peak = [0]
    lock = threading.Lock()

    def worker(seed: int) -> None:
        for i in range(50):
            t = pool.acquire(4096 * (1 + (seed + i) % 5))
            with lock:
                peak[0] = max(peak[0], pool.in_use_bytes + pool.cached_bytes)
            pool.release(t)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads)
    assert peak[0] <= 64 << 10 and pool.in_use_bytes == 0


def test_negative_sizes_are_refused() -> None:
    """A negative size sliced from the end: BufferPool.acquire(-5) returned 4091 bytes."""
    with pytest.raises(ValueError, match="aligned_empty: nbytes must be >= 0, got -5"):
        aligned_empty(-5)
    with pytest.raises(ValueError, match="BufferPool.acquire: nbytes must be >= 0, got -5"):
        BufferPool(1 << 20).acquire(-5)
