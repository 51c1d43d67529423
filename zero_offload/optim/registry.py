"""Which spec each `config.optimizer.name` means: the one list a new optimizer's file joins."""
from __future__ import annotations

from zero_offload.optim.adamw import ADAMW
from zero_offload.optim.lion import LION
from zero_offload.optim.spec import OptimizerSpec

# adam and adamw differ by a hyperparameter (L2 or decoupled decay)
SPECS: dict[str, OptimizerSpec] = {"adamw": ADAMW, "adam": ADAMW, "lion": LION}


def spec_for(name: str) -> OptimizerSpec:
    """The spec of config.optimizer.name."""
    if name not in SPECS:
        raise ValueError(f"optimizer {name!r} is not one of {', '.join(SPECS)}")
    return SPECS[name]
