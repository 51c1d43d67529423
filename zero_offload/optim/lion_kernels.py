"""Lion's kernels as the step pipeline calls them: one shard's (master, grad, m) per call.

Plain torch in fp32, the same arithmetic on either side: `HostLion` steps state in host memory
(the cpu and nvme tiers, on the pipeline's worker thread), `DeviceLion` on the accelerator. The
scalars are the engine's per-shard record (adamw_kernels.Scalars); Lion reads lr, beta1, beta2,
weight_decay and grad_scale of it (no eps, no bias correction, the step count unused).
"""
from __future__ import annotations

import torch

from zero_offload.optim.adamw_kernels import Scalars
from zero_offload.optim.flat import NonFiniteUpdate


def lion_update(master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, s: Scalars) -> None:
    """One Lion step of `master` and `m` in place (decoupled decay, as the paper's)."""
    g = grad.float()
    if s.grad_scale != 1.0:
        g = g * s.grad_scale
    c = m.mul(s.beta1).add_(g, alpha=1.0 - s.beta1)
    if s.weight_decay:
        master.mul_(1.0 - s.lr * s.weight_decay)
    master.add_(c.sign_(), alpha=-s.lr)
    m.mul_(s.beta2).add_(g, alpha=1.0 - s.beta2)


def _finish(master: torch.Tensor, m: torch.Tensor, lowp_out: torch.Tensor | None) -> None:
    """The check the pipeline expects (NonFiniteUpdate), then the updated weights in the compute
    dtype. torch.sign(NaN) is 0, so a NaN gradient leaves the weights finite and the moment NaN
    (every later step then moves nothing): the moment is checked too. `lowp_out` may share the
    gradient's bytes: it is written only once every read of the gradient is done."""
    if not (bool(torch.isfinite(master).all()) and bool(torch.isfinite(m).all())):
        raise NonFiniteUpdate("the Lion update left an Inf or NaN parameter or moment")
    if lowp_out is not None:
        lowp_out.copy_(master)


class HostLion:
    """Lion on a shard in host memory (torch's own CPU threads)."""

    host = True

    def __init__(self, threads: int = 0) -> None:
        """`threads`: the CPU Adam's setting, taken so every kernel is made alike; torch's
        intra-op threads run these ops."""
        self.threads = threads

    def __call__(self, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor,
                 s: Scalars, lowp_out: torch.Tensor | None) -> None:
        lion_update(master, grad, m, s)
        _finish(master, m, lowp_out)

    def segments(self, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor,
                 segments: list[tuple[int, int, Scalars]], lowp_out: torch.Tensor | None) -> None:
        """Each run (a parameter group, a step count) with its own scalars; elements in no run
        (parameters without a gradient) are not stepped, and `lowp_out` takes the master's
        values there."""
        for lo, hi, s in segments:
            lion_update(master[lo:hi], grad[lo:hi], m[lo:hi], s)
        _finish(master, m, lowp_out)


class DeviceLion(HostLion):
    """The same Lion on the state's own device (run inline: the device queues it)."""

    host = False
