"""The nvme tier: each key is an NVMe slot of the swap store (zero_offload/io/swap.py).

Nothing is addressable (`view` is None): the step reads a shard into a staging buffer, steps it
and writes it back. The swap store takes any contiguous CPU tensor of the slot's exact size;
page-aligned ones (`staging_buffer`) go straight to the drive, others bounce through its pool,
and a device tensor is first copied to the host here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zero_offload.io.buffers import round_up
from zero_offload.store.base import Handle, Store, check_tensor

if TYPE_CHECKING:
    from zero_offload.config import IOConfig


class NvmeStore(Store):
    """Keys → NVMe slots in files under `paths`, sized up front by `capacity_bytes` (grows if needed)."""

    tier = "nvme"

    def __init__(self, paths: tuple[str, ...], name: str, rank: int, *, capacity_bytes: int,
                 io: IOConfig | None = None) -> None:
        from zero_offload.io.swap import SwapStore

        self._swap = SwapStore(list(paths), name, rank, capacity_bytes=capacity_bytes, io=io)
        self._meta: dict[str, tuple[int, torch.dtype]] = {}
        self._read_bytes = 0
        self._written_bytes = 0
        self._peak = 0

    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> None:
        if key in self._meta:
            raise KeyError(f"store nvme: key {key!r} is already allocated")
        self._swap.register(key, numel * torch.empty((), dtype=dtype).element_size())
        self._meta[key] = (numel, dtype)
        self._peak = max(self._peak, self.bytes_retained())

    def staging_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A page-aligned (pinned where CUDA is) 1-D buffer: the swap store's fast path."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self._swap.alloc_buffer(round_up(max(nbytes, 1)))[:nbytes].view(dtype)

    def _host(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """`t` as a flat host tensor, once its size and dtype are checked: the slot holds raw
        bytes, so another dtype of the same byte count would be reinterpreted, not converted."""
        if key not in self._meta:
            raise KeyError(f"store nvme: no key {key!r} (allocate it first)")
        check_tensor(self.tier, key, t, *self._meta[key])
        return t.reshape(-1) if t.device.type == "cpu" else t.detach().to("cpu").reshape(-1)

    def write(self, key: str, src: torch.Tensor) -> Handle:
        host = self._host(key, src).contiguous()
        fut = self._swap.write(key, host)
        self._written_bytes += host.numel() * host.element_size()
        return Handle(fut.wait, src)

    def read(self, key: str, dst: torch.Tensor) -> Handle:
        if dst.device.type == "cpu" and dst.is_contiguous():
            fut = self._swap.read(key, self._host(key, dst))
            self._read_bytes += dst.numel() * dst.element_size()
            return Handle(fut.wait, dst)
        if key not in self._meta:
            raise KeyError(f"store nvme: no key {key!r} (allocate it first)")
        check_tensor(self.tier, key, dst, *self._meta[key])
        bounce = self.staging_buffer(*self._meta[key])
        fut = self._swap.read(key, bounce)
        self._read_bytes += bounce.numel() * bounce.element_size()

        def finish() -> None:
            fut.wait()
            dst.view(-1).copy_(bounce)
        return Handle(finish, dst)

    def free(self, key: str) -> None:
        # The swap store reuses a released slot for the next key of the same rounded size.
        if self._meta.pop(key, None) is not None:
            self._swap.release(key)

    def keys(self) -> list[str]:
        return list(self._meta)

    def bytes_retained(self) -> int:
        return int(self._swap.bytes_retained())

    def peak_bytes(self) -> int:
        """High-water mark of bytes_retained (a slot freed after a failed add still counted)."""
        return self._peak

    @property
    def bounced_transfers(self) -> int:
        """Transfers copied through the swap store's bounce buffers (their tensor was not page-aligned)."""
        return self._swap.bounced

    def drive_traffic(self) -> tuple[int, int]:
        return self._read_bytes, self._written_bytes

    def close(self) -> None:
        self._swap.close()
