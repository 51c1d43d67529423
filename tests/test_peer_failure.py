"""When one of two ranks raises or dies inside backward's or the step's collectives, the
surviving rank's error is ours: which collective, which step, that a peer went away and that its
own log has the cause (gloo's words alone were "Connection reset by peer", or a timeout)."""
from __future__ import annotations

import os
import re
import sys
import time

import pytest
import torch

from _dist import run_ranks

OURS = (r"rank 0: the (all-reduce|reduce-scatter|all-gather) of [\d,]+ \w+ (gradient )?elements in {where} failed: "
        r"a peer rank went away or raised \(its own log has the cause\); gloo said: .+")


class _FailOnRankOne(torch.autograd.Function):
    """Identity forward; its backward raises on rank 1, before any of that rank's reductions."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise RuntimeError("simulated failure in rank 1's backward")
        return grad


def _engine(stage: int, overlap: bool = True) -> object:
    import zero_offload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    tiers = {"optimizer": "cpu", "grads": "cpu"} if stage else {}
    return zero_offload.initialize(model, {"stage": stage, "tiers": tiers, "overlap_step": overlap})


def _train_one(engine: object, fail: bool = False) -> None:
    x = torch.randn(4, 16)
    out = engine(x)
    engine.backward((_FailOnRankOne.apply(out) if fail else out).pow(2).mean())
    engine.step()


def _leave() -> None:
    """Exit now: the helper's closing barrier would wait for the rank that went away."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _expect_ours(fn: object, where: str) -> None:
    with pytest.raises(RuntimeError) as err:
        fn()
    msg = str(err.value)
    assert re.fullmatch(OURS.format(where=where), msg), msg
    assert "\n" not in msg


def _dies_in_backward(rank: int, world: int, stage: int, stay: float) -> None:
    engine = _engine(stage)
    _train_one(engine)  # step 1 runs on both ranks
    if rank == 1:
        with pytest.raises(RuntimeError, match="simulated failure"):
            _train_one(engine, fail=True)
        time.sleep(stay)  # 0: the process goes away (as an uncaught error would end it); > 0: it stays, silent
        _leave()
    _expect_ours(lambda: _train_one(engine, fail=True), r"the backward of step 2")
    _leave()


@pytest.mark.parametrize("stage", [0, 2])
def test_peer_that_raises_and_exits_in_backward(stage: int) -> None:
    run_ranks(_dies_in_backward, 2, timeout=120, stage=stage, stay=0.0)


def test_peer_that_raises_and_stays_silent_in_backward_times_out_in_our_words() -> None:
    run_ranks(_dies_in_backward, 2, timeout=120, pg_timeout=3, stage=0, stay=8.0)


def _dies_in_step(rank: int, world: int) -> None:
    from zero_offload.engine.step import pipeline as step_mod

    engine = _engine(1, overlap=False)  # the kernel runs in engine.step(), not during backward
    _train_one(engine)
    if rank == 1:
        step_mod.HostAdam.__call__ = lambda *args, **kwargs: _leave()  # dies inside its optimizer step
        _train_one(engine)
    _expect_ours(lambda: _train_one(engine), r"optimizer step 2")
    _leave()


def test_peer_that_dies_in_the_step() -> None:
    run_ranks(_dies_in_step, 2, timeout=120)
