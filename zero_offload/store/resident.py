"""Stores whose bytes are addressable memory (device memory or host RAM): the resident tiers.

Both resident tiers keep one 1-D tensor per key and hand it out through `view`, so the step works
in place. Transfers between the store and a tensor on another device (a device gradient into
pinned host RAM, say) run on a side CUDA stream and complete on an event, never a device-wide
synchronization; between tensors on the CPU they are plain copies.
"""
from __future__ import annotations

import threading

import torch

from zero_offload.store.base import Handle, Store, check_tensor


def copy_async(dst: torch.Tensor, src: torch.Tensor) -> Handle:
    """Start dst.copy_(src); on CUDA it runs on a side stream and the handle waits on its event."""
    if not (dst.is_cuda or src.is_cuda):
        dst.copy_(src)
        return Handle(result=dst)
    device = dst.device if dst.is_cuda else src.device
    stream = _side_stream(device, _direction(dst, src))
    stream.wait_stream(torch.cuda.current_stream(device))  # src must be fully produced first
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(stream)
    for t in (dst, src):  # keep the caching allocator from reusing either before the copy ends
        if t.is_cuda:
            t.record_stream(stream)
    return Handle(done.synchronize, dst)


_STREAMS: dict[tuple[torch.device, str], "torch.cuda.Stream"] = {}
_STREAMS_LOCK = threading.Lock()  # the step worker and the prefetch thread copy too


def _direction(dst: torch.Tensor, src: torch.Tensor) -> str:
    if dst.is_cuda and src.is_cuda:
        return "d2d"
    return "h2d" if dst.is_cuda else "d2h"


def _side_stream(device: torch.device, direction: str) -> "torch.cuda.Stream":
    """One copy stream per device and direction, shared by every store: uploads (parameter
    fetches, updated shards) and downloads (gradients) use both directions of the link at once,
    and copies in one direction stay in issue order."""
    with _STREAMS_LOCK:
        if (device, direction) not in _STREAMS:
            _STREAMS[device, direction] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return _STREAMS[device, direction]


class ResidentStore(Store):
    """One tensor per key on `device`; `pin` allocates page-locked host memory (CUDA only)."""

    addressable = True

    def __init__(self, device: torch.device, *, pin: bool = False) -> None:
        self.device = torch.device(device)
        self.pin = bool(pin) and self.device.type == "cpu" and torch.cuda.is_available()
        self._tensors: dict[str, torch.Tensor] = {}
        self._peak = 0

    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> None:
        if key in self._tensors:
            raise KeyError(f"store {self.tier}: key {key!r} is already allocated")
        self._tensors[key] = torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pin)
        self._peak = max(self._peak, self.bytes_retained())

    def _get(self, key: str) -> torch.Tensor:
        try:
            return self._tensors[key]
        except KeyError:
            raise KeyError(f"store {self.tier}: no key {key!r} (allocate it first)") from None

    def write(self, key: str, src: torch.Tensor) -> Handle:
        held = self._get(key)
        check_tensor(self.tier, key, src, held.numel(), held.dtype)
        return copy_async(held, src.reshape(-1))

    def read(self, key: str, dst: torch.Tensor) -> Handle:
        held = self._get(key)
        check_tensor(self.tier, key, dst, held.numel(), held.dtype)
        return copy_async(dst.view(-1), held)

    def adopt(self, key: str, t: torch.Tensor) -> bool:
        """Keep `t` as key's tensor: no copy (a gradient held until step(), a partial sum between
        micro-batches). Only a tensor that is its whole storage, so that bytes_retained stays the
        bytes really held, on this store's device and pinned where this store pins; any other
        is refused and the caller writes it."""
        flat = t.reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        if (flat.device != self.device or flat.storage_offset() != 0 or not flat.is_contiguous()
                or flat.untyped_storage().nbytes() != nbytes or (self.pin and not flat.is_pinned())):
            return False
        old = self._tensors.get(key)
        if old is not None and (old.numel(), old.dtype) != (flat.numel(), flat.dtype):
            raise ValueError(f"store {self.tier}: key {key!r} holds {old.numel()} x {old.dtype}, "
                             f"cannot adopt {flat.numel()} x {flat.dtype}")
        self._tensors[key] = flat
        self._peak = max(self._peak, self.bytes_retained())
        return True

    def staging_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer for transfers with this store (pinned host memory when pinning applies)."""
        return torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pin)

    def view(self, key: str) -> torch.Tensor:
        return self._get(key)

    def free(self, key: str) -> None:
        self._tensors.pop(key, None)

    def keys(self) -> list[str]:
        return list(self._tensors)

    def bytes_retained(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def peak_bytes(self) -> int:
        """High-water mark of bytes_retained since the store was made."""
        return self._peak

    def close(self) -> None:
        self._tensors.clear()

