"""Optimizers that step a shard where it lives, and their specs (spec.py, adamw.py).

The torch-using names are imported when first used, so that config.py can read the specs
(torch-free) and `import zero_offload` stays cheap."""
from __future__ import annotations

from typing import Any

__all__ = ["CPUAdam", "CPUAdamW", "adam_step_flat"]
_LAZY = {"CPUAdam": "zero_offload.optim.cpu_adam", "CPUAdamW": "zero_offload.optim.cpu_adam",
         "adam_step_flat": "zero_offload.optim.flat"}


def __getattr__(name: str) -> Any:
    """CPUAdam, CPUAdamW and adam_step_flat, imported (with torch) when first named."""
    if name not in _LAZY:
        raise AttributeError(f"module 'zero_offload.optim' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
