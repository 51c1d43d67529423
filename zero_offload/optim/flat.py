"""Adam/AdamW on one flat shard: the step the engine runs where the optimizer state lives.

A flat shard is a contiguous run of fp32 master weights with its two moments. The engine calls
`adam_step_flat` once per shard per step; `CPUAdam` (cpu_adam.py) calls it once per tensor.
This reference path is plain torch so that it runs everywhere; the native kernels replace it.
"""
from __future__ import annotations

import math

import torch


def adam_step_flat(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    grad_scale: float = 1.0,
    lowp_out: torch.Tensor | None = None,
    check_finite: bool = False,
) -> bool:
    """Update `param`, `exp_avg`, `exp_avg_sq` in place; return True if a gradient was non-finite."""
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if check_finite and not bool(torch.isfinite(g).all()):
        return True
    if weight_decay != 0.0:
        if decoupled:
            param.mul_(1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * param
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bc1 = 1.0 - beta1**step
    bc2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bc1)
    if lowp_out is not None:
        lowp_out.copy_(param)
    return False
