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

# Group flags with no native implementation: refused when true, never silently ignored.
_UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")
# torch.optim.Adam's group keys and their defaults, for state dicts written by older torch.
_GROUP_DEFAULTS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False,
                       differentiable=False, fused=None, decoupled_weight_decay=False)
Items = list[tuple[torch.Tensor, torch.Tensor, dict]]  # (param, grad, its state)
Live = list[tuple[int, torch.Tensor]]  # (index in its group, param) for params with a gradient


class CPUAdam(torch.optim.Optimizer):
    """Adam (L2 weight decay) or, with decoupled_weight_decay=True, AdamW, on the native kernel.

    `isa` (scalar|avx2|avx512) and `threads` override the process defaults. torch's
    `foreach` and `fused` are accepted and change nothing (every step is one fused native call);
    amsgrad, maximize, capturable and differentiable are not implemented and are refused
    rather than ignored.
    """

    _torch_class = "torch.optim.Adam"  # named in the refusal of what only torch implements

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: bool | None = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False,
                 isa: str | None = None, threads: int | None = None) -> None:
        # The keys torch.optim.Adam/AdamW keep, so state dicts load in either direction.
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        self._check_group(defaults)
        super().__init__(params, defaults)
        self._requested = (isa, threads)  # pickled, so a copy resolves the same request
        self._resolve(isa, threads)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, then our check of the completed group: a bad group is refused when added."""
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    def _resolve(self, isa: str | None, threads: int | None) -> None:
        # None only when the native library is missing and no ISA was asked for (torch path).
        self._isa = _native_adam.resolve_isa(isa) if isa is not None or _native_adam.available() else None
        self._threads = _native_adam.resolve_threads(threads)

    def _check_group(self, group: dict[str, Any]) -> None:
        name = type(self).__name__
        for key in _UNSUPPORTED:
            if group.get(key):
                raise ValueError(f"{name}: {key}=True is not implemented; use {self._torch_class}")
        _native_adam.check_hyper(name, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                 weight_decay=group["weight_decay"])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam step over every parameter that has a gradient.

        Every group and parameter is checked before any is stepped, so a refused call changes
        no weight, moment or step count (torch's own Adam refuses the same way)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        live = [self._check_live(index, group) for index, group in enumerate(self.param_groups)]
        for group, params in zip(self.param_groups, live):
            self._step_group(group, params)
        return loss

    def __getstate__(self) -> dict[str, Any]:
        """torch pickles defaults, state and groups only; the ISA and thread request travel too."""
        return {**super().__getstate__(), "_requested": self._requested}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling and load_state_dict both land here: fill in what older torch releases (and
        older pickles of this class) did not write, as torch.optim.Adam does, and take old
        state dicts whose step is a number."""
        super().__setstate__(state)
        if "_isa" not in self.__dict__:  # a copy or unpickle, not load_state_dict
            self._requested = self.__dict__.get("_requested", (None, None))
            self._resolve(*self._requested)
        for group in self.param_groups:
            for key, value in _GROUP_DEFAULTS.items():
                group.setdefault(key, value)
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
        if p.grad.numel() != p.numel():
            raise ValueError(f"{name}: group {index} param {i} has {p.numel()} elements, its gradient {p.grad.numel()}")
        self._check_state(index, i, p)

    def _check_state(self, index: int, i: int, p: torch.Tensor) -> None:
        """Moments the kernel may read p.numel() float32s from (a loaded state dict can hold others)."""
        state = self.state.get(p)
        if not state:
            return  # made on first use, with the right size
        for key in ("exp_avg", "exp_avg_sq"):
            t = state.get(key)
            if not torch.is_tensor(t) or t.numel() != p.numel() or t.dtype != torch.float32 or t.device.type != "cpu":
                what = f"{t.numel()} {t.dtype} on {t.device}" if torch.is_tensor(t) else "none"
                raise ValueError(f"{type(self).__name__}: group {index} param {i} ({p.numel()} elements) has "
                                 f"{key} of {what} (a state dict of another model?)")

    def _check_live(self, index: int, group: dict[str, Any]) -> Live:
        """The group's parameters with a gradient, each checked; nothing is created or moved."""
        self._check_group(group)
        live = [(i, p) for i, p in enumerate(group["params"]) if p.grad is not None]
        for i, p in live:
            self._check_param(index, i, p)
        return live

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

    def _step_group(self, group: dict[str, Any], live: Live) -> None:
        """Step a group's checked parameters: their states made, step counts advanced, one call."""
        if not live:
            return
        items = [(p, p.grad, self._state_of(p)) for _, p in live]
        torch._foreach_add_([s["step"] for _, _, s in items], 1.0)  # one call, not one per tensor
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
    """AdamW (decoupled weight decay, default 0.01), as torch.optim.AdamW: it stays AdamW
    whatever state dict it loads (torch.optim.AdamW.__setstate__ forces the flag the same way)."""

    _torch_class = "torch.optim.AdamW"

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, foreach: bool | None = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, isa: str | None = None, threads: int | None = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True, isa=isa, threads=threads)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True


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
