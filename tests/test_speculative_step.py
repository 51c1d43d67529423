"""The CPU step under clipping, run during backward as if unclipped (speculative_step_bytes).

Global-norm clipping needs every gradient before any shard can be stepped, so the CPU step
waited for the end of backward. With a snapshot budget each shard is stepped as its gradient
arrives with the clip coefficient taken as 1, its state copied first; at the step the norm is
known: with coefficient 1 those updates are the step, else every shard goes back to its snapshot
and the deferred step runs. Either way the result must be the deferred step's, bit for bit, and
torch's AdamW after clip_grad_norm_.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zero_offload
from _dist import run_ranks

LR, WD, STEPS = 1e-2, 0.01, 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    scale = 3.0 if i % 2 else 0.3  # large and small gradients by turns: clipping on some steps only
    return torch.randn(8, 8, generator=g) * scale, torch.randn(8, 4, generator=g) * scale


def _torch(max_norm: float) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for i in range(STEPS):
        x, y = _batch(i)
        (model(x) - y).pow(2).mean().backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


MAX_NORM = 1.0


def test_the_batches_clip_on_some_steps_only() -> None:
    _, norms = _torch(MAX_NORM)
    assert 0 < sum(n > MAX_NORM for n in norms) < STEPS, norms


def _config(stage: int, tier: str, nvme: str, speculate: int, **extra: Any) -> dict[str, Any]:
    tiers = {"optimizer": tier, "grads": "device" if tier == "device" else "cpu", **({"params": tier} if stage == 3 else {})}
    return {"stage": stage, "tiers": tiers, "nvme_paths": [nvme], "clip_grad_norm": MAX_NORM,
            "optimizer": {"lr": LR, "weight_decay": WD}, "speculative_step_bytes": speculate, **extra}


def _train(cfg: dict[str, Any], rank: int = 0, world: int = 1) -> tuple[dict[str, torch.Tensor], Any]:
    engine = zero_offload.initialize(_model(), cfg)
    for i in range(STEPS):
        x, y = _batch(i)
        rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
        engine.backward((engine(x[rows]) - y[rows]).pow(2).mean())
        engine.step()
    so = engine.runtime.shard_optimizer
    stats = (so.speculated_steps, so.rollbacks)
    state = engine.consolidated_state_dict() if engine.config.stage == 3 else \
        {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    return state, stats


@pytest.mark.parametrize("stage,tier", [(0, "device"), (1, "cpu"), (2, "cpu"), (2, "nvme"), (3, "cpu"), (3, "nvme")])
def test_speculation_is_the_deferred_step_bit_for_bit(stage: int, tier: str, tmp_path: Path) -> None:
    deferred, none = _train(_config(stage, tier, str(tmp_path), 0))
    ahead, (kept, redone) = _train(_config(stage, tier, str(tmp_path), 1 << 30))
    assert none == (0, 0) and kept > 0 and redone > 0 and kept + redone == STEPS
    for k in deferred:
        assert torch.equal(ahead[k], deferred[k]), k
    want, _ = _torch(MAX_NORM)
    for k in want:
        torch.testing.assert_close(ahead[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_a_budget_for_some_shards_speculates_those_and_defers_the_rest(tmp_path: Path) -> None:
    """Split shards (a small pinned budget makes sub-shards) and a snapshot budget for only part
    of the state: the shards that fit speculate, the others wait, and the result is the same."""
    extra = {"bucket_bytes": 1024, "pinned_budget_bytes": 1 << 16}
    deferred, _ = _train(_config(2, "nvme", str(tmp_path), 0, **extra))
    ahead, (kept, redone) = _train(_config(2, "nvme", str(tmp_path), 6000, **extra))
    assert kept + redone == STEPS
    for k in deferred:
        assert torch.equal(ahead[k], deferred[k]), k


def _two_ranks(rank: int, world: int, nvme: str) -> None:
    deferred, _ = _train(_config(3, "cpu", nvme, 0), rank, world)
    ahead, (kept, redone) = _train(_config(3, "cpu", nvme, 1 << 30), rank, world)
    assert kept > 0 and redone > 0
    for k in deferred:
        assert torch.equal(ahead[k], deferred[k]), f"rank {rank}: {k}"


def test_speculation_at_two_ranks(tmp_path: Path) -> None:
    run_ranks(_two_ranks, 2, timeout=120, nvme=str(tmp_path))


def test_the_memory_report_names_the_snapshots(tmp_path: Path) -> None:
    engine = zero_offload.initialize(_model(), _config(2, "cpu", str(tmp_path), 1 << 30))
    x, y = _batch(0)
    engine.backward((engine(x) - y).pow(2).mean())
    engine.step()
    held = engine.memory_report()["other"]["speculative step snapshots"]
    assert held == engine.runtime.shard_optimizer.snapshot_bytes > 0
    engine.close()
