"""One interface for every tier: the engine asks a store, never "which tier?".

A store owns the bytes of one state group on one tier (device memory, pinned host RAM, or NVMe
slots) under string keys. Transfers are asynchronous: `read`/`write` return a Handle whose
`wait()` completes them. Resident tiers (device, cpu) also expose the tensor itself through
`view`, so the step can work in place with no copy; the NVMe tier returns None there and the
caller reads into a staging buffer.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch


class Handle:
    """A pending transfer; `wait()` finishes it (re-raising its error) and returns its tensor."""

    def __init__(self, wait_fn: Callable[[], None] | None = None, result: torch.Tensor | None = None) -> None:
        self._wait_fn = wait_fn
        self._result = result

    def wait(self) -> torch.Tensor | None:
        """Finished once `wait_fn` returned or raised an error; an interrupt (KeyboardInterrupt)
        leaves it pending, since the transfer may still be running into or out of its buffer:
        a later wait() waits again instead of letting the caller reuse the buffer under it."""
        fn = self._wait_fn
        if fn is not None:
            try:
                fn()
            except Exception:
                self._wait_fn = None
                raise
            self._wait_fn = None
        return self._result


def check_tensor(tier: str, key: str, t: torch.Tensor, numel: int, dtype: torch.dtype) -> None:
    """One rule for every tier: a transfer moves exactly the key's elements in the key's dtype.
    A resident copy would broadcast a smaller tensor or convert another dtype, while the nvme
    tier would reinterpret bytes: refused alike, naming the key."""
    if t.numel() != numel or t.dtype != dtype:
        raise ValueError(f"store {tier}: key {key!r} holds {numel} x {dtype}, got a tensor of "
                         f"{t.numel()} x {t.dtype}")


class Store(ABC):
    """Bytes of one state group on one tier, by key."""

    tier: str = ""
    addressable: bool = False  # view() returns the stored tensor itself (the resident tiers)

    @abstractmethod
    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> None:
        """Reserve room for a 1-D tensor under `key` (contents undefined until written)."""

    @abstractmethod
    def write(self, key: str, src: torch.Tensor) -> Handle:
        """Start copying `src` into the store; `src` must stay alive and unchanged until wait()."""

    @abstractmethod
    def read(self, key: str, dst: torch.Tensor) -> Handle:
        """Start copying the stored tensor into `dst`; wait() returns `dst`."""

    def view(self, key: str) -> torch.Tensor | None:
        """The stored tensor itself when the tier is addressable memory, else None."""
        return None

    def adopt(self, key: str, t: torch.Tensor) -> bool:
        """Hold `t` itself under `key` (allocating it if new) instead of copying it: the caller
        hands `t` over and never touches it again. False where this tier cannot hold a tensor it
        was handed (the caller then writes); only resident tiers can."""
        return False

    @abstractmethod
    def free(self, key: str) -> None:
        """Release `key`'s bytes."""

    @abstractmethod
    def keys(self) -> list[str]:
        """Every allocated key."""

    @abstractmethod
    def staging_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host-side buffer this store transfers fastest from and to (page-aligned for
        NVMe, pinned where CUDA is): what the step pipeline stages non-addressable state in."""

    @abstractmethod
    def bytes_retained(self) -> int:
        """Bytes this store holds now, padding included (the memory report's 'retained')."""

    @abstractmethod
    def peak_bytes(self) -> int:
        """The high-water mark of bytes_retained()."""

    def drive_traffic(self) -> tuple[int, int]:
        """(bytes read from, bytes written to) the drive since the store opened: 0 for memory
        tiers. Benchmarks print it to show that offloaded state really moved."""
        return 0, 0

    def close(self) -> None:
        """Release everything (NVMe files are removed)."""
