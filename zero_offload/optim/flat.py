"""Adam/AdamW on one flat shard: the step the engine runs where the optimizer state lives.

A flat shard is a contiguous run of fp32 master weights with its two moments. The engine calls
`adam_step_flat` once per shard per step; `CPUAdam` (cpu_adam.py) steps its tensors through the
same native kernel, many per call. Without the native library torch's fused CPU Adam runs
instead (and says so once), so everything works everywhere, with the same results.
"""
from __future__ import annotations

from typing import Sequence

import torch

from zero_offload.optim import _native_adam

_FLOAT_STATE = ("param", "exp_avg", "exp_avg_sq")


class NonFiniteUpdate(FloatingPointError):
    """With `check_params`: the update was written and left an Inf or NaN parameter (an lr or
    gradient too large for fp32). The kernels see it in the pass that writes the update."""


def _refuse_nonfinite(owner: str, status: int, check_params: bool) -> None:
    if check_params and status == _native_adam.NONFINITE_PARAM:
        raise NonFiniteUpdate(f"{owner}: the update left an Inf or NaN parameter")


def _check_cpu_contiguous(name: str, t: torch.Tensor, numel: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"adam_step_flat: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"adam_step_flat: {name} must be on the CPU, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"adam_step_flat: {name} must be contiguous")
    if t.numel() != numel:
        raise ValueError(f"adam_step_flat: {name} has {t.numel()} elements, param has {numel}")


def _check_args(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, lowp_out: torch.Tensor | None, step: int) -> None:
    """One-line errors for anything the kernel would otherwise read or write out of bounds."""
    n = param.numel() if isinstance(param, torch.Tensor) else -1
    for name, t in zip(_FLOAT_STATE, (param, exp_avg, exp_avg_sq)):
        _check_cpu_contiguous(name, t, n)
        if t.dtype != torch.float32:
            raise ValueError(f"adam_step_flat: {name} must be float32, got {t.dtype}")
    _check_cpu_contiguous("grad", grad, n)
    if grad.dtype not in _native_adam.GRAD_DTYPES:
        raise ValueError(f"adam_step_flat: grad must be float32, bfloat16 or float16, got {grad.dtype}")
    if lowp_out is not None:
        _check_cpu_contiguous("lowp_out", lowp_out, n)
        if lowp_out.dtype not in _native_adam.OUT_DTYPES:
            raise ValueError(f"adam_step_flat: lowp_out must be float32, bfloat16 or float16, got {lowp_out.dtype}")
    _check_disjoint(param, grad, exp_avg, exp_avg_sq, lowp_out)
    _check_step(step)


def _check_step(step: int) -> None:
    if isinstance(step, bool) or int(step) != step or not 1 <= step < 2**63:
        raise ValueError(f"adam_step_flat: step must be a whole number in [1, 2**63), got {step!r}")


def _check_disjoint(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    lowp_out: torch.Tensor | None) -> None:
    """No two tensors may share bytes (the same tensor passed as exp_avg and exp_avg_sq would
    be updated twice over): compared by byte range, since the staging ring hands out master, m
    and v as adjacent views of one buffer. A gradient read at the index lowp_out then writes is
    the one overlap every path allows."""
    spans = [(name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
                             ("lowp_out", lowp_out), ("grad", grad)) if t is not None and t.numel()]
    for i, (a, lo_a, hi_a) in enumerate(spans):
        for b, lo_b, hi_b in spans[i + 1:]:
            if lo_a < hi_b and lo_b < hi_a and (a, b) != ("lowp_out", "grad"):
                raise ValueError(f"adam_step_flat: {a} and {b} overlap in memory")


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
    check_params: bool = False,
    isa: str | None = None,
    threads: int | None = None,
) -> bool:
    """Update `param`, `exp_avg`, `exp_avg_sq` in place; return True if a gradient was non-finite.

    `step` is the 1-based step count after this update (bias correction uses it). `grad_scale`
    multiplies the gradient first (1/loss-scale times the clip coefficient). With `check_finite`
    the scaled gradient is scanned before anything is written; if any element is Inf/NaN the
    call returns True and param, both moments and `lowp_out` are left exactly as they were, so
    the caller can skip the step (the scan reads the gradient once more: 2 or 4 bytes/element,
    never the state). Without it a non-finite gradient propagates into the state as torch would.
    `lowp_out`, if given, receives the updated weights rounded to nearest even in its own dtype
    (the upload copy; float32: an exact copy, for a caller that needs the weights apart from
    the master), written in the same pass. `isa` (scalar|avx2|avx512) and `threads` override
    the process defaults (see _native_adam). With `check_params` an update that leaves an Inf
    or NaN parameter raises NonFiniteUpdate (after writing it: the kernel sees it in the same
    pass, an OR of one compare per vector).
    """
    _check_args(param, grad, exp_avg, exp_avg_sq, lowp_out, step)
    _native_adam.check_hyper("adam_step_flat", lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                             grad_scale=grad_scale)
    threads = _native_adam.resolve_threads(threads)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                 decoupled=decoupled, grad_scale=grad_scale, check_finite=check_finite)
    if not _native_adam.available():
        if isa is not None:
            _native_adam.check_isa(isa, "isa")  # raises: a named ISA needs the native kernels
        _native_adam.warn_fallback_once("adam_step_flat")
        status = _adam_step_flat_torch(param, grad, exp_avg, exp_avg_sq, step=step, lowp_out=lowp_out,
                                       check_params=check_params, **hyper)
    else:
        item = _native_adam.make_tensor(param, grad, exp_avg, exp_avg_sq, step, lowp_out)
        status = _native_adam.step([item], _native_adam.make_hyper(**hyper), isa=_native_adam.resolve_isa(isa),
                                   threads=threads)
    _refuse_nonfinite("adam_step_flat", status, check_params)
    return status == _native_adam.NONFINITE_GRAD


def adam_step_runs(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    runs: list[tuple[int, int, dict]],
    *,
    step: int | Sequence[int],
    lowp_out: torch.Tensor | None = None,
    threads: int | None = None,
    check_params: bool = False,
) -> None:
    """`adam_step_flat` over runs of one flat shard, each `(start, end, hyper)` with its own
    hyperparameters (lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale: a parameter
    group's) and `step` (one count for all runs, or one per run: a parameter skipped in a step
    for want of a gradient has its own). Elements in no run are not touched, `lowp_out`'s
    neither. The whole tensors are checked once, and the runs that share hyperparameters go to
    the kernel in one call (each with its own step count): a block's weights, biases and norms
    alternate between two groups, and a call per run (with its checks) cost as much as the
    arithmetic of a small unit. `check_params` as in adam_step_flat (raised once every run is
    stepped)."""
    steps = [step] * len(runs) if isinstance(step, int) else list(step)
    if len(steps) != len(runs):
        raise ValueError(f"adam_step_runs: {len(steps)} step counts for {len(runs)} runs")
    _check_args(param, grad, exp_avg, exp_avg_sq, lowp_out, steps[0] if steps else 1)
    for s in steps[1:]:
        _check_step(s)
    status = _native_adam.OK
    by_hyper: dict[tuple, list[tuple[int, int, int]]] = {}
    for (lo, hi, hyper), s in zip(runs, steps):
        by_hyper.setdefault(tuple(sorted(hyper.items())), []).append((lo, hi, s))
    for key, spans in by_hyper.items():
        hyper = dict(key)
        _native_adam.check_hyper("adam_step_runs", lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]),
                                 eps=hyper["eps"], weight_decay=hyper["weight_decay"], grad_scale=hyper["grad_scale"])
        parts = [(*(t[lo:hi] if t is not None else None for t in (param, grad, exp_avg, exp_avg_sq, lowp_out)), s)
                 for lo, hi, s in spans]
        if not _native_adam.available():
            _native_adam.warn_fallback_once("adam_step_runs")
            for p, g, m, v, out, s in parts:
                status = max(status, _adam_step_flat_torch(p, g, m, v, step=s, lowp_out=out, check_finite=False,
                                                           check_params=check_params, **hyper))
            continue
        items = [_native_adam.make_tensor(p, g, m, v, s, out) for p, g, m, v, out, s in parts]
        status = max(status, _native_adam.step(items, _native_adam.make_hyper(**hyper),
                                               isa=_native_adam.resolve_isa(None),
                                               threads=_native_adam.resolve_threads(threads)))
    _refuse_nonfinite("adam_step_runs", status, check_params)


def _adam_step_flat_torch(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
    step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    decoupled: bool, grad_scale: float, lowp_out: torch.Tensor | None, check_finite: bool,
    check_params: bool = False,
) -> int:
    """The same step through torch's fused CPU Adam: the fallback when the native library is
    missing. The kernels round as that one does (native/adam.h), so both paths give the same
    bits; torch's unfused ops differ (torch.sqrt on fp32 is not always correctly rounded).
    Returns the kernel's status (_native_adam.OK / NONFINITE_GRAD / NONFINITE_PARAM); the
    parameter check is a second pass here, made only when asked for."""
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if check_finite and not bool(torch.isfinite(g).all()):
        return _native_adam.NONFINITE_GRAD
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    fused([param], [g], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step))], lr=lr, beta1=beta1,
          beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    if lowp_out is not None:
        lowp_out.copy_(param)
    if check_params and not bool(torch.isfinite(param).all()):
        return _native_adam.NONFINITE_PARAM
    return _native_adam.OK
