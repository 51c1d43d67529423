"""Loss scaling for fp16, the global-norm clip coefficient, and which dtypes precision changes.

Only floating-point tensors take the compute dtype (`place`); integer, bool and complex ones keep
their own, as eager torch has them. A trainable parameter the flat buffers cannot hold (complex:
its master and moments would need the real/imaginary pairs torch's AdamW steps) is refused at
initialize (`refuse_unheld`), never cast.

The dynamic loss scaler multiplies the loss by `scale` before backward so small fp16 gradients do
not flush to zero; the step divides it back out (as part of `grad_scale`, never as a separate pass
over the gradients). A step whose gradients hold an inf or NaN is skipped; after `hysteresis`
such steps the scale halves (not necessarily in a row: clean steps in between do not restore the
count, which only resets when the scale changes, as DeepSpeed's default
consecutive_hysteresis=False does), and after `scale_window` clean steps in a row it doubles.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from zero_offload.config import ConfigError, PrecisionConfig


def refuse_unheld(model: nn.Module) -> None:
    """A trainable parameter that is not floating point, in one line naming it (a cast to the
    compute dtype would drop a complex parameter's imaginary part)."""
    for name, p in model.named_parameters():
        if p.requires_grad and not p.is_floating_point():
            raise ConfigError(f"initialize: trainable parameter '{name}' is {p.dtype}; zero_offload trains floating-point "
                              "parameters only: register its torch.view_as_real pair as a float parameter and "
                              "take torch.view_as_complex of it in forward, or freeze it")


def place(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Stages 0-2's model on `device`, its floating-point tensors in `dtype` and every other one
    in its own (nn.Module.to(dtype) would cast complex tensors too, dropping the imaginary part)."""
    refuse_unheld(model)
    return model._apply(lambda t: t.to(device, dtype) if t.is_floating_point() else t.to(device))


class LossScaler:
    """Dynamic (or static) loss scale; a no-op scale of 1 unless precision is fp16."""

    def __init__(self, cfg: PrecisionConfig) -> None:
        self.enabled = cfg.dtype == "fp16"
        self.dynamic = self.enabled and cfg.static_scale == 0.0
        self._cfg = cfg
        self.scale = (cfg.static_scale or 2.0 ** cfg.initial_scale_power) if self.enabled else 1.0
        self.good_steps = 0
        self.hysteresis_left = cfg.hysteresis

    def update(self, overflow: bool) -> None:
        """Record one step's outcome and move the scale."""
        if not self.dynamic:
            return
        if overflow:
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self._cfg.min_scale)
                self.hysteresis_left = self._cfg.hysteresis
            return
        self.good_steps += 1
        if self.good_steps % self._cfg.scale_window == 0:
            self.scale *= 2.0
            self.hysteresis_left = self._cfg.hysteresis

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, sd: dict[str, float | int]) -> None:
        self.scale = float(sd["scale"])
        self.good_steps = int(sd["good_steps"])
        self.hysteresis_left = int(sd["hysteresis_left"])


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), never above 1."""
    if max_norm <= 0.0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
