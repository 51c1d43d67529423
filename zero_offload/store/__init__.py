"""Tiers behind one interface; `make_store` is the one place that maps a tier name to a class."""
from __future__ import annotations

import torch

from zero_offload.config import Config
from zero_offload.store.base import Handle, Store

__all__ = ["Handle", "Store", "make_store"]


def make_store(tier: str, group: str, config: Config, *, device: torch.device, rank: int = 0,
               capacity_bytes: int = 0) -> Store:
    """A store for state `group` ('optimizer', 'gradients', ...) on `tier` for this rank.

    `capacity_bytes` sizes the NVMe files up front (ignored by the resident tiers).
    """
    if tier == "device":
        from zero_offload.store.device import DeviceStore

        return DeviceStore(device)
    if tier == "cpu":
        from zero_offload.store.host import HostStore

        return HostStore(pin=config.pin_memory)
    if tier == "nvme":
        from zero_offload.store.nvme import NvmeStore

        if not config.nvme_paths:
            raise ValueError(f"tier 'nvme' for {group} needs config.nvme_paths")
        return NvmeStore(config.nvme_paths, group, rank, capacity_bytes=capacity_bytes, io=config.io)
    raise ValueError(f"unknown tier {tier!r} for {group}: expected device, cpu or nvme")
