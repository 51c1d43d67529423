"""Which spec each `config.optimizer.name` means: the one list a new optimizer's file joins."""
from __future__ import annotations

from zero_offload.optim.adamw import ADAMW
from zero_offload.optim.spec import OptimizerSpec

SPECS: dict[str, OptimizerSpec] = {"adamw": ADAMW, "adam": ADAMW}  # adam and adamw differ by a hyperparameter


def spec_for(name: str) -> OptimizerSpec:
    """The spec of config.optimizer.name."""
    if name not in SPECS:
        raise ValueError(f"optimizer {name!r} is not one of {', '.join(SPECS)}")
    return SPECS[name]
