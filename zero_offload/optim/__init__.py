"""Optimizers that step a shard where it lives."""
from zero_offload.optim.cpu_adam import CPUAdam, CPUAdamW
from zero_offload.optim.flat import adam_step_flat

__all__ = ["CPUAdam", "CPUAdamW", "adam_step_flat"]
