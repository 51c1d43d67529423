"""Tiers behind one interface; `make_store` is the one place that maps a tier to its store class."""
from __future__ import annotations

from typing import Callable

import torch

from zero_offload import tiers
from zero_offload.config import Config
from zero_offload.store.base import Handle, Store

__all__ = ["Handle", "Store", "make_store"]


def _device_store(group: str, config: Config, device: torch.device, rank: int, capacity_bytes: int) -> Store:
    from zero_offload.store.device import DeviceStore

    return DeviceStore(device)


def _host_store(group: str, config: Config, device: torch.device, rank: int, capacity_bytes: int) -> Store:
    from zero_offload.store.host import HostStore

    return HostStore(pin=config.pin_memory)


def _nvme_store(group: str, config: Config, device: torch.device, rank: int, capacity_bytes: int) -> Store:
    from zero_offload.store.nvme import NvmeStore

    return NvmeStore(config.nvme_paths, group, rank, capacity_bytes=capacity_bytes, io=config.io)


# Each tier's store class, imported only when a store of that tier is made (the nvme store pulls
# in the async I/O backends). Keyed by the registry's records, so a new tier needs one here.
OPENERS: dict[tiers.Tier, Callable[[str, Config, torch.device, int, int], Store]] = {
    tiers.DEVICE: _device_store, tiers.CPU: _host_store, tiers.NVME: _nvme_store}


def make_store(tier: str, group: str, config: Config, *, device: torch.device, rank: int = 0,
               capacity_bytes: int = 0) -> Store:
    """A store for state `group` ('optimizer', 'gradients', ...) on `tier` for this rank.

    `capacity_bytes` sizes the NVMe files up front (ignored by the resident tiers).
    """
    if not tiers.known(tier):
        raise ValueError(f"unknown tier {tier!r} for {group}: expected {tiers.spelled(tiers.TIERS)}")
    record = tiers.tier(tier)
    if record.needs_nvme_paths and not config.nvme_paths:
        raise ValueError(f"tier '{record.name}' for {group} needs config.nvme_paths")
    return OPENERS[record](group, config, device, rank, capacity_bytes)
