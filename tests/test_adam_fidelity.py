"""Fidelity of the CPU Adam's fp32 state: no further from a float64 AdamW than torch's fused one.

25 steps of a step-LR schedule with gradients spanning three decades and weight decay 0.1. The
first moment used to be m*beta1 + g*(1-beta1), three roundings, where torch's lerp rounds once:
m came out ~2.7x further from float64 than torch's fused AdamW, on every ISA path.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from adam_reference import isa_params
from zero_offload.optim import CPUAdam, CPUAdamW, _native_adam, adam_step_flat

# A multiple of 16, so torch's fused kernel runs its vector body on every element: its scalar
# tail (n % 8 or 16 elements) rounds v as fma(v, beta2, (1-beta2)*g*g), a contraction of its
# compiler, where the body rounds v*beta2 first. Our tails run the body's arithmetic (the ISA
# paths are compared bit for bit in test_flat_adam.py).
N = 1 << 14
STEPS, LR, WEIGHT_DECAY = 25, 1e-2, 0.1
QUANTITIES = ("param", "exp_avg", "exp_avg_sq")
State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # param, exp_avg, exp_avg_sq


def _grads() -> list[torch.Tensor]:
    """Per-element magnitudes log-uniform in [1e-3, 1], random signs, new every step."""
    gen = torch.Generator().manual_seed(20)
    out = []
    for _ in range(STEPS):
        magnitude = 10.0 ** (-3.0 * torch.rand(N, generator=gen))
        out.append(torch.where(torch.rand(N, generator=gen) < 0.5, -magnitude, magnitude))
    return out


def _start() -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(21))


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)


def _lrs() -> list[float]:
    """The lr of each step under the schedule, for the calls that take an lr per step."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    sched, lrs = _schedule(opt), []
    for _ in range(STEPS):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def _run_optimizer(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                   dtype: torch.dtype) -> State:
    p = torch.nn.Parameter(_start().to(dtype))
    opt = make([p])
    sched = _schedule(opt)
    for g in _grads():
        p.grad = g.to(dtype)
        opt.step()
        sched.step()
    state = opt.state[p]
    return p.detach(), state["exp_avg"], state["exp_avg_sq"]


def _run_flat(decoupled: bool) -> State:
    p, m, v = _start(), torch.zeros(N), torch.zeros(N)
    for step, (g, lr) in enumerate(zip(_grads(), _lrs()), start=1):
        adam_step_flat(p, g, m, v, step=step, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=WEIGHT_DECAY, decoupled=decoupled)
    return p, m, v


def _torch(decoupled: bool, **kwargs) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return lambda params: cls(params, lr=LR, weight_decay=WEIGHT_DECAY, **kwargs)


def _distances(state: State, reference: State) -> dict[str, tuple[float, float]]:
    """(max, mean) of |ours - float64| per quantity."""
    out = {}
    for name, x, r in zip(QUANTITIES, state, reference):
        d = (x.double() - r).abs()
        out[name] = (d.max().item(), d.mean().item())
    return out


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("path", [*isa_params(), "torch-flat", "torch-cpuadam"])
def test_state_is_no_further_from_float64_than_torch_fused(path: str, adamw: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """No slack: the kernels round as torch's fused CPU AdamW does (native/adam.h), so for fp32
    gradients the two are bit-identical on an FMA host and their distances equal."""
    reference = _run_optimizer(_torch(adamw, foreach=False), torch.float64)
    fused = _distances(_run_optimizer(_torch(adamw, fused=True), torch.float32), reference)
    if path.startswith("torch-"):  # the fallbacks that run without the native library
        monkeypatch.setattr(_native_adam, "available", lambda: False)
        monkeypatch.setattr(_native_adam, "_warned", {"adam_step_flat", "CPUAdam", "CPUAdamW"})
    if path == "torch-flat":
        ours = _distances(_run_flat(adamw), reference)
    else:
        isa = None if path.startswith("torch-") else path
        cls = CPUAdamW if adamw else CPUAdam
        ours = _distances(_run_optimizer(lambda ps: cls(ps, lr=LR, weight_decay=WEIGHT_DECAY, isa=isa),
                                         torch.float32), reference)
    ratios = {name: (ours[name][0] / fused[name][0], ours[name][1] / fused[name][1]) for name in QUANTITIES}
    worse = {name: f"max {r[0]:.4f}x, mean {r[1]:.4f}x" for name, r in ratios.items() if max(r) > 1.0}
    assert not worse, f"{path}: further from float64 than torch fused AdamW: {worse}"
