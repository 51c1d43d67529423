"""Optimizers that step a shard where it lives."""
from zero_offload.optim.flat import adam_step_flat

__all__ = ["adam_step_flat"]
