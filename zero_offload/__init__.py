"""zero_offload: train PyTorch models larger than GPU memory and host RAM on one workstation.

ZeRO partitions training state across data-parallel ranks (stage 1: optimizer state, 2: also
gradients, 3: also parameters); separately, each state group lives on a tier (device, pinned CPU
RAM, or NVMe). See docs/architecture.md for the vocabulary and the layers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zero_offload.config import Config, ConfigError
from zero_offload.deepspeed_compat import IgnoredDeepSpeedKeys

if TYPE_CHECKING:
    import torch

    from zero_offload.engine.engine import Engine

__all__ = ["Config", "ConfigError", "FilesLeft", "IgnoredDeepSpeedKeys", "Preempted", "initialize"]


def initialize(model: "torch.nn.Module", config: Config | dict | str | None = None, **kwargs: Any) -> "Engine":
    """Wrap `model` in an Engine that trains it under `config` (see zero_offload/engine/engine.py).

    The engine is imported here, not at package import, so `import zero_offload` stays cheap and
    works for the CLI's info/estimate/config commands.
    """
    from zero_offload.engine.engine import initialize as _initialize

    return _initialize(model, config, **kwargs)


def __getattr__(name: str) -> Any:
    """The exceptions of the engine's lifecycle (docs/faults.md), imported when first named."""
    if name == "Preempted":
        from zero_offload.engine.preemption import Preempted

        return Preempted
    if name == "FilesLeft":
        from zero_offload.io.swap_files import FilesLeft

        return FilesLeft
    raise AttributeError(f"module 'zero_offload' has no attribute {name!r}")
