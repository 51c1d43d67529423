"""Page-aligned host buffers and the pool that bounds how many bytes of them exist.

O_DIRECT moves data straight between the drive and the buffer, which therefore has to start on
a page boundary; CUDA copies from such a buffer at full speed only when it is pinned. The pool
caps the bytes held (live plus cached for reuse): when the cap is reached `acquire` waits until
someone releases, so a burst of requests slows down instead of exhausting host RAM.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import threading
import time
from collections import defaultdict

import torch

from zero_offload.config import ALIGN_BYTES as ALIGN_BYTES  # re-exported: the O_DIRECT page

HUGE_PAGE = 2 << 20


def round_up(n: int, alignment: int = ALIGN_BYTES) -> int:
    return (n + alignment - 1) // alignment * alignment


def _pinned_exact(size: int, alignment: int) -> torch.Tensor | None:
    """`size` pinned bytes without the alignment slack, when they come aligned (cudaHostAlloc's
    memory is page-aligned): torch's pinned allocator rounds each request up to a power of two
    by default, so a 2 GiB staging ring asked for as 2 GiB + 4 KiB would pin 4 GiB. None if the
    block is not aligned (then the slack is needed)."""
    raw = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    return raw if raw.data_ptr() % alignment == 0 else None


def aligned_empty(nbytes: int, *, alignment: int = ALIGN_BYTES, pin: bool = False,
                  huge_pages: bool = True) -> torch.Tensor:
    """A uint8 tensor of `nbytes` starting on an `alignment` boundary, pinned when asked and
    CUDA is available. The allocation behind it is rounded up to `alignment`, so reading or
    writing the whole rounded length (an O_DIRECT tail) stays inside memory this tensor owns.

    Unpinned buffers of 2 MiB and more are placed on 2 MiB boundaries and offered to the kernel
    for transparent huge pages: reused small-page buffers read at about half speed on the
    virtual disk we measured, huge-page ones never did (docs/perf_io.md). `huge_pages=False`
    keeps small pages, so the benchmark can show the difference.
    """
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    if nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes must be >= 0, got {nbytes}")
    pin = pin and torch.cuda.is_available()
    size = round_up(max(nbytes, 1), alignment)
    huge = huge_pages and not pin and size >= HUGE_PAGE
    if huge:
        alignment = max(alignment, HUGE_PAGE)
    raw = _pinned_exact(size, alignment) if pin else None
    if raw is None:
        raw = torch.empty(size + alignment, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % alignment  # the view keeps `raw`'s storage (and its pinning) alive
    if huge:  # before the first touch, so that the pages are born huge
        _advise_huge(raw.data_ptr() + start, round_up(size, HUGE_PAGE))
    return raw[start:start + nbytes]


def aligned_tensor(numel: int, dtype: torch.dtype, *, pin: bool = False, huge_pages: bool = True) -> torch.Tensor:
    """`aligned_empty` as a 1-D tensor of `numel` elements of `dtype`: what the engine allocates
    for a host buffer that the drive reads or writes directly (no bounce copy)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return aligned_empty(nbytes, pin=pin, huge_pages=huge_pages).view(dtype)


def _advise_huge(address: int, length: int) -> None:
    """Best effort: a kernel without THP (or with it off) just keeps small pages."""
    madvise = getattr(_libc(), "madvise", None)
    if madvise is not None and hasattr(mmap, "MADV_HUGEPAGE"):
        madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), mmap.MADV_HUGEPAGE)


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class BufferPool:
    """Aligned buffers under a hard byte budget, reused by size.

    Sizes are rounded up to `alignment`; the budget counts buffers handed out plus those kept for
    reuse, and cached ones are dropped before anyone has to wait.
    """

    def __init__(self, budget_bytes: int, *, alignment: int = ALIGN_BYTES, pin: bool = False) -> None:
        if budget_bytes < alignment:
            raise ValueError(f"buffer pool budget {budget_bytes} bytes is below one {alignment}-byte page")
        self.budget, self.alignment, self.pin = budget_bytes, alignment, pin
        self._cond = threading.Condition()
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._out: dict[int, tuple[int, torch.Tensor]] = {}  # data_ptr -> (size, full buffer)
        self.in_use_bytes = 0
        self.cached_bytes = 0

    def acquire(self, nbytes: int, *, timeout: float | None = None) -> torch.Tensor:
        """An aligned uint8 tensor of `nbytes`; waits while the budget is used up.

        A request larger than the whole budget can never be served and raises at once;
        `timeout` (seconds) bounds the wait with a TimeoutError.
        """
        if nbytes < 0:
            raise ValueError(f"BufferPool.acquire: nbytes must be >= 0, got {nbytes}")
        size = round_up(max(nbytes, 1), self.alignment)
        if size > self.budget:
            raise ValueError(f"buffer of {nbytes} bytes exceeds the pool budget of {self.budget} bytes")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            buf = self._take(size, deadline, nbytes)
        if buf is None:  # reserved in the budget; allocate outside the lock
            try:
                buf = aligned_empty(size, alignment=self.alignment, pin=self.pin)
            except BaseException:
                with self._cond:  # undo the reservation, or the pool would starve for good
                    self.in_use_bytes -= size
                    self._cond.notify_all()
                raise
        with self._cond:
            self._out[buf.data_ptr()] = (size, buf)
        return buf[:nbytes]

    def _take(self, size: int, deadline: float | None, nbytes: int) -> torch.Tensor | None:
        """Under the lock: a cached buffer of `size`, or None after reserving `size` bytes."""
        while True:
            if self._free[size]:
                self.cached_bytes -= size
                self.in_use_bytes += size
                return self._free[size].pop()
            self._evict(self.in_use_bytes + self.cached_bytes + size - self.budget)
            if self.in_use_bytes + self.cached_bytes + size <= self.budget:
                self.in_use_bytes += size
                return None
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no {nbytes}-byte buffer within the {self.budget}-byte pool budget: "
                                   f"{self.in_use_bytes} bytes still held")
            self._cond.wait(left)

    def _evict(self, excess: int) -> None:
        """Drop cached buffers (largest first) until `excess` bytes are gone or none are left."""
        for size in sorted(self._free, reverse=True):
            while excess > 0 and self._free[size]:
                self._free[size].pop()
                self.cached_bytes -= size
                excess -= size

    def release(self, t: torch.Tensor) -> None:
        """Give back a tensor from `acquire` (or any view starting where it starts)."""
        with self._cond:
            entry = self._out.pop(t.data_ptr(), None)
            if entry is None:
                raise ValueError("release() of a tensor that this pool did not hand out (or released twice)")
            size, buf = entry
            self.in_use_bytes -= size
            self.cached_bytes += size
            self._free[size].append(buf)
            self._cond.notify_all()

    def clear(self) -> None:
        """Drop every cached buffer (the ones handed out stay valid)."""
        with self._cond:
            self._evict(self.cached_bytes)
            self._cond.notify_all()
