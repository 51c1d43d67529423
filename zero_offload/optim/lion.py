"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") as an OptimizerSpec.

Per element, with decoupled decay: c = b1*m + (1-b1)*g; p <- p*(1 - lr*wd) - lr*sign(c);
m <- b2*m + (1-b2)*g. State: the fp32 master and m (8 bytes per element); no eps, no bias
correction (the step count is kept by the engine as for any optimizer, unused here).
Torch-free, like spec.py: config imports it through the registry; the kernels are lion_kernels.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from zero_offload.optim.spec import Bound, Fail, Kernels, OptimizerSpec, StatePart, as_float, check_betas, check_number

# lr = 0 would step nothing: sign(c) has no scale, so only lr says how far each weight moves.
BOUNDS: Mapping[str, Bound] = {
    "lr": Bound(0.0, open_low=True), "betas": Bound(0.0, 1.0, open_high=True), "weight_decay": Bound(0.0),
}


@dataclass(frozen=True)
class LionHyperparams:
    """One parameter group's Lion hyperparameters (the paper's defaults: lr 1e-4, betas 0.9/0.99)."""

    lr: Any = 1e-4
    betas: Any = (0.9, 0.99)
    weight_decay: Any = 0.0

    def check(self, fail: Fail, *, bounds: Mapping[str, Bound] = BOUNDS,
              number: Callable[[str, Any], float] = as_float) -> None:
        """Refuse, through `fail`, the first value Lion cannot step with (NaN and infinity too)."""
        check_number("lr", self.lr, bounds["lr"], fail, number)
        check_betas(self.betas, bounds["betas"], fail, number)
        check_number("weight_decay", self.weight_decay, bounds["weight_decay"], fail, number)


LION = OptimizerSpec(
    name="lion",
    parts=(StatePart("master"), StatePart("m")),  # fp32 each: 8 bytes per element
    hyperparams=LionHyperparams,
    kernels=Kernels(host="zero_offload.optim.lion_kernels:HostLion",
                    device="zero_offload.optim.lion_kernels:DeviceLion"),
    label="Lion",
)
