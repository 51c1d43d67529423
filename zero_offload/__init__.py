"""zero_offload: train PyTorch models larger than GPU memory and host RAM on one workstation.

ZeRO partitions training state across data-parallel ranks (stage 1: optimizer state, 2: also
gradients, 3: also parameters); separately, each state group lives on a tier (device, pinned CPU
RAM, or NVMe). See docs/architecture.md for the vocabulary and the layers.
"""
from zero_offload.config import Config, ConfigError

__all__ = ["Config", "ConfigError", "initialize"]


def initialize(model, config=None, **kwargs):  # noqa: ANN001, ANN201 - typed in engine.engine
    """Wrap `model` in an Engine that trains it under `config` (see zero_offload.engine)."""
    from zero_offload.engine.engine import initialize as _initialize

    return _initialize(model, config, **kwargs)
