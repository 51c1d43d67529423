"""The device tier: state in accelerator memory (or, on a CPU-only run, in ordinary RAM)."""
from __future__ import annotations

import torch

from zero_offload.store.resident import ResidentStore


class DeviceStore(ResidentStore):
    """One tensor per key on the compute device; the optimizer steps it there with fused Adam."""

    tier = "device"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, pin=False)
