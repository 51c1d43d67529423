"""Shared by the CPU Adam tests: a float64 Adam/AdamW, the tolerance table, ISA parametrization.

Every comparison is elementwise: |ours - reference| <= atol + rtol * |reference| for each element.
"""
from __future__ import annotations

import math
from typing import Sequence

import pytest
import torch

from zero_offload.optim import _native_adam

# (rtol, atol) per compared dtype and quantity, for at most 20 steps with lr <= 1e-2, weights
# ~N(0,1) and gradients ~N(0,1). The fp32 figures are about 3x the worst seen against float64.
TOLERANCE = {
    # fp32 weights: each step rounds ~7 fp32 operations; the update is <= lr in size and the
    # weight itself carries ulp(4) = 4.8e-7; 20 steps accumulate ~3.5e-6 at worst.
    ("float32", "param"): (1e-5, 1e-5),
    # fp32 first moment: a convex mix of gradients of size ~1, rounded twice per step (~1e-7).
    ("float32", "exp_avg"): (1e-5, 1e-6),
    # fp32 second moment: a convex mix of g*g >= 0, so relative error stays ~1e-6.
    ("float32", "exp_avg_sq"): (1e-5, 1e-9),
    # bf16/fp16 copies out are a rounding of OUR fp32 weights, an exact function of them: they
    # must equal torch's `.to(dtype)` of those weights bit for bit (NaN compared as NaN).
    ("bfloat16", "lowp_out"): (0.0, 0.0),
    ("float16", "lowp_out"): (0.0, 0.0),
}

SIZES = (1, 7, 15, 16, 17, 31, 4097)  # 1 and the vector tails of 8 and 16 lanes, and a long run


def assert_close(ours: torch.Tensor, ref: torch.Tensor, quantity: str) -> None:
    """Elementwise check with the table's tolerance for ours' dtype; names the worst element."""
    rtol, atol = TOLERANCE[(str(ours.dtype).removeprefix("torch."), quantity)]
    o, r = ours.double().flatten(), ref.double().flatten()
    excess = (o - r).abs() - (atol + rtol * r.abs())
    if o.numel() and excess.max() > 0:
        i = int(excess.argmax())
        raise AssertionError(f"{quantity}[{i}]: ours {o[i].item()!r} vs reference {r[i].item()!r} "
                             f"(rtol {rtol}, atol {atol}; {int((excess > 0).sum())} elements out)")


def assert_bits_equal(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Bit-for-bit equality of two same-dtype tensors (so -0.0 != 0.0 and NaN payloads count)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, what
    view = {2: torch.int16, 4: torch.int32}[ours.element_size()]
    diff = ours.view(view) != ref.view(view)
    if diff.any():
        i = int(diff.flatten().nonzero()[0])
        raise AssertionError(f"{what}: {int(diff.sum())} elements differ, first at {i}: "
                             f"{ours.flatten()[i].item()!r} vs {ref.flatten()[i].item()!r}")


def lr_schedule(steps: int, peak: float = 1e-2) -> list[float]:
    """Linear warm-up over 5 steps then cosine decay: every step has a different lr."""
    return [peak * min(1.0, (s + 1) / 5) * 0.5 * (1 + math.cos(math.pi * s / steps)) for s in range(steps)]


def reference_adam(param: torch.Tensor, grads: Sequence[torch.Tensor], lrs: Sequence[float], *,
                   beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                   weight_decay: float = 0.0, decoupled: bool = False, grad_scale: float = 1.0,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adam (L2) or AdamW in float64, written from the paper and torch's documentation."""
    p = param.double().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step, (g_in, lr) in enumerate(zip(grads, lrs), start=1):
        g = g_in.double() * grad_scale
        if decoupled:
            p = p * (1 - lr * weight_decay)
        elif weight_decay:
            g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + g * (1 - beta2) * g  # torch's addcmul order (the kernels' too)
        denom = v.sqrt() / math.sqrt(1 - beta2**step) + eps
        p = p - lr / (1 - beta1**step) * m / denom
    return p, m, v


def isa_params(include_scalar: bool = True) -> list:
    """Every ISA path as a pytest parameter; those this CPU cannot run are skipped, not dropped."""
    supported = _native_adam.supported_isas()
    names = _native_adam.ISA_NAMES if include_scalar else _native_adam.ISA_NAMES[1:]
    reason = "native library not loaded" if not supported else "this CPU cannot run it"
    return [pytest.param(n, marks=pytest.mark.skipif(n not in supported, reason=f"{n}: {reason}"))
            for n in names]
