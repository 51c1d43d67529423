"""AdamW (and Adam, its L2 variant) as an OptimizerSpec: fp32 master, m and v; lr, betas, eps, decay.

The hyperparameters are checked here once, for every reader: config.OptimizerConfig (and through
it each param group), the native binding's check_hyper (adam_step_flat, adam_step_runs) and
CPUAdam/CPUAdamW. Each caller words the error its own way (a config field, a class name) around
the same range text. Torch-free, like spec.py: config imports it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from zero_offload.optim.spec import Bound, Fail, Kernels, OptimizerSpec, StatePart, as_float, check_betas, check_number

# What torch.optim.Adam/AdamW accept, and so what drop-ins and the kernels must accept (eps = 0 too).
KERNEL_BOUNDS: Mapping[str, Bound] = {
    "lr": Bound(0.0), "betas": Bound(0.0, 1.0, open_high=True), "eps": Bound(0.0), "weight_decay": Bound(0.0),
}
# A training configuration also refuses eps = 0: with a moment of zero it divides 0 by 0.
CONFIG_BOUNDS: Mapping[str, Bound] = {**KERNEL_BOUNDS, "eps": Bound(0.0, open_low=True)}
GRAD_SCALE = Bound(0.0, open_low=True)  # a per-call factor (1/loss scale times the clip coefficient)


@dataclass(frozen=True)
class AdamWHyperparams:
    """One parameter group's AdamW hyperparameters (decoupled decay or L2 is the spec's user's flag)."""

    lr: Any = 1e-3
    betas: Any = (0.9, 0.999)
    eps: Any = 1e-8
    weight_decay: Any = 0.01

    def check(self, fail: Fail, *, bounds: Mapping[str, Bound] = KERNEL_BOUNDS,
              number: Callable[[str, Any], float] = as_float) -> None:
        """Refuse, through `fail`, the first value no AdamW accepts (NaN and infinity included: a
        NaN fails every comparison, an infinite lr or decay turns every weight into NaN)."""
        check_number("lr", self.lr, bounds["lr"], fail, number)
        check_betas(self.betas, bounds["betas"], fail, number)
        check_number("eps", self.eps, bounds["eps"], fail, number)
        check_number("weight_decay", self.weight_decay, bounds["weight_decay"], fail, number)


PARTS = ("master", "m", "v")  # a shard's state, back to back in its store key and its ring region

ADAMW = OptimizerSpec(
    name="adamw",
    parts=tuple(StatePart(name) for name in PARTS),  # fp32 each: 12 bytes per element
    hyperparams=AdamWHyperparams,
    kernels=Kernels(host="zero_offload.optim.adamw_kernels:HostAdam",
                    device="zero_offload.optim.adamw_kernels:DeviceAdam"),
    config_bounds=CONFIG_BOUNDS,
    label="Adam",  # adam and adamw alike: "the Adam update of optimizer shard ..."
)
