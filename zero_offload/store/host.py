"""The cpu tier: state in host RAM, page-locked when CUDA is present so copies can be asynchronous."""
from __future__ import annotations

import torch

from zero_offload.store.resident import ResidentStore


class HostStore(ResidentStore):
    """One host tensor per key; pinned (when CUDA exists and `pin`) so device copies are DMA."""

    tier = "cpu"

    def __init__(self, *, pin: bool = True) -> None:
        super().__init__(torch.device("cpu"), pin=pin)
