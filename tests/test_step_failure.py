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


def test_staging_ring_never_reuses_the_set_being_stepped(tmp_path: object) -> None:
    """A shard found in the ring from an earlier step can sit in the very set the round-robin
    would take next; prefetching while it is stepped must pick another set, or the read would
    overwrite the state under the kernel."""
    from zero_offload.store import make_store

    cfg = Config(stage=1, tiers={"optimizer": "nvme", "grads": "cpu"}, nvme_paths=(str(tmp_path),))
    store = make_store("nvme", "optimizer", cfg, device=torch.device("cpu"), rank=0, capacity_bytes=1 << 20)
    access = step_mod.StateAccess(store, budget_bytes=0)  # the minimum ring: three sets
    values = {}
    for i, key in enumerate(["a", "b", "c", "d"]):
        for part in step_mod.PARTS:
            store.allocate(f"{key}.{part}", 256, torch.float32)
            values[key, part] = torch.full((256,), float(10 * i + step_mod.PARTS.index(part)))
            store.write(f"{key}.{part}", values[key, part]).wait()
        access.shards += 1
    access.max_numel = 256
    for key in ["a", "b", "c"]:  # fill the ring; the turn comes back to the set holding "a"
        access.prefetch(key, 256)
    (master, m, v), staged = access.acquire("a", 256)
    assert staged is access._sets[access._turn % access.depth]  # the next set in turn is the one in use
    access.prefetch("d", 256)  # must not take the set that holds "a"
    for s in access._sets:
        s.settle()  # let the read of "d" land wherever it went
    assert torch.equal(master, values["a", "master"]) and torch.equal(v, values["a", "v"])
    access.release("a", 256, staged)
    got, staged_d = access.acquire("d", 256)
    assert torch.equal(got[1], values["d", "m"])
    access.release("d", 256, staged_d)
    access.flush()
    store.close()
