"""AdamW's kernels as the step pipeline calls them: one shard's (master, grad, m, v) per call.

`HostAdam` steps state in host memory through the native CPU Adam (optim/flat.py, torch's fused
CPU Adam without the native library); `DeviceAdam` runs torch's fused Adam/AdamW on the state's
own device. The spec (optim/adamw.py) names them per device kind; engine/step/pipeline.py runs
them (inline for a device kernel, on its worker thread for a host one).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_offload.optim.flat import NonFiniteUpdate, adam_step_flat, adam_step_runs


@dataclass
class Scalars:
    """The per-shard scalars of one update (fixed when the job is submitted)."""

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    grad_scale: float = 1.0


def gaps(segments: list[tuple[int, int, Scalars]], numel: int) -> list[tuple[int, int]]:
    """The element ranges of [0, numel) that no segment covers (segments in order)."""
    out, at = [], 0
    for lo, hi, _ in segments:
        if at < lo:
            out.append((at, lo))
        at = hi
    return out + ([(at, numel)] if at < numel else [])


class HostAdam:
    """The CPU Adam (native when built) stepping a shard in host memory."""

    host = True

    def __init__(self, threads: int = 0) -> None:
        self.threads = threads

    def __call__(self, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 s: Scalars, lowp_out: torch.Tensor | None) -> None:
        adam_step_flat(master, grad, m, v, step=s.step, lr=s.lr, beta1=s.beta1, beta2=s.beta2, eps=s.eps,
                       weight_decay=s.weight_decay, decoupled=s.decoupled, grad_scale=s.grad_scale,
                       lowp_out=lowp_out, check_params=True, threads=self.threads or None)

    def segments(self, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 segments: list[tuple[int, int, Scalars]], lowp_out: torch.Tensor | None) -> None:
        """The shard's runs (parameter groups, step counts), one kernel call per distinct group;
        `lowp_out` takes the master's values where no run steps (the kernel writes only runs)."""
        if segments:
            adam_step_runs(master, grad, m, v, [(lo, hi, _hyper(s)) for lo, hi, s in segments],
                           step=[s.step for _, _, s in segments], lowp_out=lowp_out, threads=self.threads or None,
                           check_params=True)
        if lowp_out is not None:
            for lo, hi in gaps(segments, master.numel()):
                lowp_out[lo:hi].copy_(master[lo:hi])


def _hyper(s: Scalars) -> dict:
    return dict(lr=s.lr, beta1=s.beta1, beta2=s.beta2, eps=s.eps, weight_decay=s.weight_decay,
                decoupled=s.decoupled, grad_scale=s.grad_scale)


class DeviceAdam:
    """torch's fused Adam/AdamW kernel on the tensors' own device."""

    host = False

    def __init__(self, threads: int = 0) -> None:
        """`threads` is the host kernels' setting, taken so every kernel is made alike; unused here."""
        del threads

    def __call__(self, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 s: Scalars, lowp_out: torch.Tensor | None) -> None:
        _fused([master], [grad.float()], [m], [v], [s.step], s)
        _check_finite_device(master)
        if lowp_out is not None:
            lowp_out.copy_(master)

    def segments(self, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 segments: list[tuple[int, int, Scalars]], lowp_out: torch.Tensor | None) -> None:
        """One fused launch per distinct group, over the slices of its runs (the fused kernels
        take lists of tensors, each with its own step count)."""
        g = grad.float()
        by_group: dict[tuple, tuple[Scalars, list[tuple[int, int, int]]]] = {}
        for lo, hi, sc in segments:
            by_group.setdefault(tuple(_hyper(sc).items()), (sc, []))[1].append((lo, hi, sc.step))
        for sc, spans in by_group.values():
            _fused(*([t[lo:hi] for lo, hi, _ in spans] for t in (master, g, m, v)), [st for *_, st in spans], sc)
        _check_finite_device(master)
        if lowp_out is not None:
            lowp_out.copy_(master)


def _check_finite_device(master: torch.Tensor) -> None:
    """torch's fused Adam reports nothing: one isfinite pass over the updated shard (on a GPU
    it waits for the step's kernels, once per shard)."""
    if not bool(torch.isfinite(master).all()):
        raise NonFiniteUpdate("torch's fused Adam left an Inf or NaN parameter")


def _fused(masters: list[torch.Tensor], grads: list[torch.Tensor], ms: list[torch.Tensor],
           vs: list[torch.Tensor], steps: list[int], s: Scalars) -> None:
    """torch's fused Adam/AdamW over tensors sharing the hyperparameters of `s`, each at its own
    step count (grads already float)."""
    if s.grad_scale != 1.0:
        grads = [g * s.grad_scale for g in grads]
    made = {n: torch.tensor(float(n), device=masters[0].device) for n in set(steps)}  # read, not advanced
    counts = [made[n] for n in steps]
    fused = torch._fused_adamw_ if s.decoupled else torch._fused_adam_
    fused(masters, grads, ms, vs, [], counts, lr=s.lr, beta1=s.beta1, beta2=s.beta2,
          weight_decay=s.weight_decay, eps=s.eps, amsgrad=False, maximize=False)
