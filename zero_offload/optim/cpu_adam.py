"""CPUAdam / CPUAdamW: drop-ins for torch.optim.Adam / AdamW on CPU fp32 parameters.

Each param group is stepped by ONE native call over all its tensors, so a hundred small
tensors cost about what one large tensor of the same total size costs. The state layout and
the param_group keys are torch's own (state[i] = {step: 0-dim float32 tensor, exp_avg,
exp_avg_sq}), so state dicts move both ways between these and torch.optim.Adam/AdamW, and
torch's LR schedulers drive them unchanged. Without the native library the step runs through
torch's fused Adam kernel, and says so once.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from zero_offload.optim import _native_adam

_UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")
Items = list[tuple[torch.Tensor, torch.Tensor, dict]]  # (param, grad, its state)


def _check_hyper(lr: Any, betas: Any, eps: float, weight_decay: float) -> None:
    """One-line errors for values torch would also refuse."""
    _native_adam.check_hyper("CPUAdam", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class CPUAdam(torch.optim.Optimizer):
    """Adam (L2 weight decay) or, with decoupled_weight_decay=True, AdamW, on the native kernel.

    `isa` (scalar|avx2|avx512) and `threads` override the process defaults; amsgrad and
    maximize are not implemented and are refused rather than ignored.
    """

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 decoupled_weight_decay: bool = False, isa: str | None = None,
                 threads: int | None = None) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        # The keys torch.optim.Adam/AdamW keep, so state dicts load in either direction.
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=None, capturable=False, differentiable=False,
                        fused=None, decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)
        # None only when the native library is missing and no ISA was asked for (torch path).
        self._isa = _native_adam.resolve_isa(isa) if isa is not None or _native_adam.available() else None
        self._threads = _native_adam.resolve_threads(threads)
        for group in self.param_groups:
            self._check_group(group)

    def _check_group(self, group: dict[str, Any]) -> None:
        for key in _UNSUPPORTED:
            if group.get(key):
                raise ValueError(f"{type(self).__name__}: {key}=True is not implemented; use torch.optim.AdamW")
        _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            self._check_group(group)
            self._step_group(index, group)
        return loss

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Also accept old state dicts whose step is a number, as torch's Adam does."""
        super().__setstate__(state)
        for value in self.state.values():
            if "step" in value and not torch.is_tensor(value["step"]):
                value["step"] = torch.tensor(float(value["step"]), dtype=torch.float32)

    def _check_param(self, index: int, i: int, p: torch.Tensor) -> None:
        name = type(self).__name__
        if p.grad.is_sparse:
            raise ValueError(f"{name}: sparse gradient at group {index} param {i}")
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise ValueError(f"{name}: steps float32 CPU parameters, group {index} "
                             f"param {i} is {p.dtype} on {p.device}")
        if p.grad.dtype not in _native_adam.GRAD_DTYPES or p.grad.device.type != "cpu":
            raise ValueError(f"{name}: group {index} param {i} has a {p.grad.dtype} gradient on "
                             f"{p.grad.device}; expected float32, bfloat16 or float16 on the CPU")

    def _state_of(self, p: torch.Tensor) -> dict[str, Any]:
        """The parameter's state in torch's layout, created on first use."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            if not state[key].is_contiguous():  # e.g. loaded from a channels-last run
                state[key] = state[key].contiguous()
        return state

    def _gather(self, index: int, group: dict[str, Any]) -> Items:
        """(param, grad, state) for each parameter with a gradient, its step count advanced.

        Everything is checked before any step count moves, so a refused call changes nothing.
        """
        live = [(i, p) for i, p in enumerate(group["params"]) if p.grad is not None]
        for i, p in live:
            self._check_param(index, i, p)
        items = [(p, p.grad, self._state_of(p)) for _, p in live]
        for (i, p), (_, g, s) in zip(live, items):
            if g.numel() != p.numel():
                raise ValueError(f"{type(self).__name__}: group {index} param {i} has {p.numel()} elements, its gradient {g.numel()}")
            for key in ("exp_avg", "exp_avg_sq"):
                if s[key].numel() != p.numel() or s[key].dtype != torch.float32 or s[key].device.type != "cpu":
                    raise ValueError(f"{type(self).__name__}: group {index} param {i} ({p.numel()} elements) has "
                                     f"{key} of {s[key].numel()} {s[key].dtype} on {s[key].device} (a state dict of another model?)")
        if items:
            torch._foreach_add_([s["step"] for _, _, s in items], 1.0)  # one call, not one per tensor
        return items

    def _step_group(self, index: int, group: dict[str, Any]) -> None:
        items = self._gather(index, group)
        if not items:
            return
        beta1, beta2 = (float(b) for b in group["betas"])
        hyper = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                     weight_decay=float(group["weight_decay"]),
                     decoupled=bool(group["decoupled_weight_decay"]))
        if _native_adam.available():
            _step_native(items, hyper, self._isa, self._threads)
        else:
            _native_adam.warn_fallback_once(type(self).__name__)
            _step_torch_fused(items, hyper)


class CPUAdamW(CPUAdam):
    """AdamW (decoupled weight decay, default 0.01), as torch.optim.AdamW."""

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 isa: str | None = None, threads: int | None = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=True, isa=isa, threads=threads)


def _dense(items: Items) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Contiguous (param, grad) per item; a non-contiguous param is stepped in a copy, copied back."""
    targets, grads, copy_back = [], [], []
    for p, g, _ in items:
        target = p if p.is_contiguous() else p.contiguous()
        if target is not p:
            copy_back.append((p, target))
        targets.append(target)
        grads.append(g.contiguous())
    return targets, grads, copy_back


def _step_native(items: Items, hyper: dict[str, Any], isa: str, threads: int) -> None:
    """One native call for the whole group."""
    targets, grads, copy_back = _dense(items)  # keeps the temporaries alive through the call
    steps = torch.stack([s["step"] for _, _, s in items]).tolist()
    descriptors = [_native_adam.make_tensor(t, g, s["exp_avg"], s["exp_avg_sq"], int(step), None)
                   for t, g, (_, _, s), step in zip(targets, grads, items, steps)]
    _native_adam.step(descriptors, _native_adam.make_hyper(**hyper), isa=isa, threads=threads)
    for p, target in copy_back:
        p.copy_(target)


def _step_torch_fused(items: Items, hyper: dict[str, Any]) -> None:
    """torch's own fused CPU kernel; the steps were already incremented, as torch expects."""
    fn = torch._fused_adamw_ if hyper["decoupled"] else torch._fused_adam_
    targets, grads, copy_back = _dense(items)
    fn(targets, [g.to(torch.float32) for g in grads], [s["exp_avg"] for _, _, s in items],
       [s["exp_avg_sq"] for _, _, s in items], [], [s["step"] for _, _, s in items], lr=hyper["lr"],
       beta1=hyper["beta1"], beta2=hyper["beta2"], weight_decay=hyper["weight_decay"],
       eps=hyper["eps"], amsgrad=False, maximize=False)
    for p, target in copy_back:
        p.copy_(target)
