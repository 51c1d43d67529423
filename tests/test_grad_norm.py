"""engine.grad_norm with the overlapped step (config.track_grad_norm), against torch.

Trainer logs the global gradient norm every step, clipping or not; the overlapped step never
formed it, so the Trainer ran without clipping on the deferred step (Adam after backward). The
overlapped step now forms it as each shard arrives: the same norm torch's clip_grad_norm_ gives.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zero_offload
from _dist import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _torch_norms(steps: int) -> list[float]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for i in range(steps):
        x, y = _batch(i)
        (model(x) - y).pow(2).mean().backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        opt.step()
        opt.zero_grad()
    return norms


def _engine_norms(stage: int, tier: str, nvme: str, rank: int = 0, world: int = 1) -> list[float]:
    tiers = {"optimizer": tier, "grads": "cpu", **({"params": tier} if stage == 3 else {})}
    engine = zero_offload.initialize(_model(), {"stage": stage, "tiers": tiers, "nvme_paths": [nvme],
                                                "optimizer": {"lr": 1e-2}, "track_grad_norm": True})
    norms = []
    for i in range(3):
        x, y = _batch(i)
        rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
        engine.backward((engine(x[rows]) - y[rows]).pow(2).mean())
        engine.step()
        assert engine.runtime.shard_optimizer.eager  # the overlapped step formed it
        norms.append(engine.grad_norm)
    engine.close()
    return norms


@pytest.mark.parametrize("stage,tier", [(1, "cpu"), (2, "nvme"), (3, "cpu"), (3, "nvme")])
def test_the_overlapped_step_forms_the_norm_torch_does(stage: int, tier: str, tmp_path: Path) -> None:
    assert _engine_norms(stage, tier, str(tmp_path)) == pytest.approx(_torch_norms(3), rel=1e-6)


def _two_ranks(rank: int, world: int, nvme: str) -> None:
    norms = _engine_norms(2, "cpu", nvme, rank, world)
    assert norms == pytest.approx(_torch_norms(3), rel=1e-6), f"rank {rank}"


def test_the_norm_is_global_at_two_ranks(tmp_path: Path) -> None:
    run_ranks(_two_ranks, 2, timeout=90, nvme=str(tmp_path))


def test_without_tracking_the_overlapped_step_has_no_norm(tmp_path: Path) -> None:
    engine = zero_offload.initialize(_model(), {"stage": 2, "tiers": {"optimizer": "cpu", "grads": "cpu"}})
    x, y = _batch(0)
    engine.backward((engine(x) - y).pow(2).mean())
    engine.step()
    assert engine.grad_norm is None
    engine.close()
