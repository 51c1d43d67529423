"""Loss scaling for fp16, the global-norm clip coefficient, and which dtypes precision changes.

Only floating-point tensors take the compute dtype (`place`); integer, bool and complex ones keep
their own, as eager torch has them. A trainable complex64 parameter is held as float32
(real, imag) pairs (partition.FlatLayout's `pairs`), stepped as torch's AdamW steps it (through
torch.view_as_real), so it trains only where the compute dtype is float32; any other trainable
parameter that is not floating point is refused at initialize (`refuse_unheld`), never cast.

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


def refuse_unheld(model: nn.Module, dtype: torch.dtype) -> None:
    """A trainable parameter the flat buffers of compute dtype `dtype` cannot hold, in one line
    naming it: complex64 pairs need float32 (no bf16 complex exists, and fp16's would change the
    parameter's dtype), and nothing holds another complex dtype without a cast, nor a meta one
    (the meta build fills floats). An uninitialized (lazy) parameter or buffer has no shape yet."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if nn.parameter.is_lazy(t):
            raise ConfigError(f"initialize: '{name}' is uninitialized (a lazy module's, which takes its shape in its "
                              "first forward): run one forward with a dummy batch before initialize")
    for name, p in model.named_parameters():
        if not p.requires_grad or p.is_floating_point():
            continue
        if p.dtype == torch.complex64 and dtype == torch.float32 and not p.is_meta:
            continue
        why = ("a meta complex parameter has no value the meta build fills" if p.is_meta and p.is_complex() else
               f"complex64 parameters train with precision fp32 only (as float32 pairs), not {dtype}"
               if p.dtype == torch.complex64 else "zero_offload trains floating-point and complex64 parameters only")
        raise ConfigError(f"initialize: trainable parameter '{name}' is {p.dtype}; {why}: register its "
                          "torch.view_as_real pair as a float parameter (torch.view_as_complex in forward), or freeze it")


def place(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Stages 0-2's model on `device`, its floating-point tensors in `dtype` and every other one
    in its own (nn.Module.to(dtype) would cast complex tensors too, dropping the imaginary part)."""
    refuse_unheld(model, dtype)
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
