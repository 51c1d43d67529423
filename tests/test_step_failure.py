"""A failed optimizer step is reported once, and the next step starts clean."""
from __future__ import annotations

import pytest
import torch

from zero_offload.config import Config
from zero_offload.engine import step as step_mod
from zero_offload.engine.shard_optimizer import ShardOptimizer


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_failed_step_raises_then_next_step_runs(tier: str, tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = Config(stage=1, tiers={"optimizer": tier, "grads": tier}, nvme_paths=(str(tmp_path),),
                 optimizer={"lr": 0.1, "weight_decay": 0.0})
    opt = ShardOptimizer(cfg, torch.device("cpu"), capacity_bytes=1 << 20)
    opt.add_shard("s", torch.zeros(64))
    real = step_mod.HostAdam.__call__
    calls = {"n": 0}

    def flaky(self: object, *args: object) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("simulated kernel failure")
        real(self, *args)
    monkeypatch.setattr(step_mod.HostAdam, "__call__", flaky)
    opt.grad_ready("s", torch.ones(64))
    with pytest.raises(RuntimeError, match="the optimizer step failed: simulated kernel failure"):
        opt.finish_step()
    opt.grad_ready("s", torch.ones(64))  # not "called twice in one step"
    assert opt.finish_step() is True
    assert torch.allclose(opt.master("s"), torch.full((64,), -0.1), atol=1e-5)  # one Adam step: -lr*sign(g)
    opt.close()
