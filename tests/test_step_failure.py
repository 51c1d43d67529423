"""A failed optimizer step is reported once, and the next step starts clean."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from zero_offload.config import Config
from zero_offload.engine.step import pipeline as step_mod
from zero_offload.engine.step.shard_optimizer import ShardOptimizer


def _fail_kernel_call(monkeypatch: pytest.MonkeyPatch, which: int) -> None:
    """The CPU Adam's `which`-th call (from 1) raises; every other call steps as usual."""
    real, calls = step_mod.HostAdam.__call__, {"n": 0}

    def flaky(self: object, *args: object) -> None:
        calls["n"] += 1
        if calls["n"] == which:
            raise OSError("simulated kernel failure")
        real(self, *args)
    monkeypatch.setattr(step_mod.HostAdam, "__call__", flaky)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_failed_step_raises_then_next_step_runs(tier: str, tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = Config(stage=1, tiers={"optimizer": tier, "grads": tier}, nvme_paths=(str(tmp_path),),
                 optimizer={"lr": 0.1, "weight_decay": 0.0})
    opt = ShardOptimizer(cfg, torch.device("cpu"), capacity_bytes=1 << 20)
    opt.add_shard("s", torch.zeros(64))
    _fail_kernel_call(monkeypatch, 1)
    opt.grad_ready("s", torch.ones(64))
    with pytest.raises(RuntimeError, match="the optimizer step failed: simulated kernel failure"):
        opt.finish_step()
    opt.grad_ready("s", torch.ones(64))  # not "called twice in one step"
    assert opt.finish_step() is True
    assert torch.allclose(opt.master("s"), torch.full((64,), -0.1), atol=1e-5)  # one Adam step: -lr*sign(g)
    opt.close()


def test_close_after_a_failed_write_back_reports_it_and_frees_the_drive(tmp_path: object) -> None:
    """A write-back that fails on an I/O thread surfaces at close(), and close() still removes
    the stores' files, so a new engine can use the same nvme path (it used to stay locked)."""
    import os

    cfg = Config(stage=1, tiers={"optimizer": "nvme", "grads": "cpu"}, nvme_paths=(str(tmp_path),),
                 optimizer={"lr": 0.1, "weight_decay": 0.0})
    opt = ShardOptimizer(cfg, torch.device("cpu"), capacity_bytes=1 << 20)
    opt.add_shard("s", torch.zeros(64))
    swap = opt.store._swap
    read_only = os.open(swap.slot("s").path, os.O_RDONLY)
    real_submit = swap._submit

    def submit(entry: object, write: bool, pos: int, buf: torch.Tensor, length: int, index: int) -> object:
        if write:  # the drive refuses the write (EBADF on the worker thread), after it was queued
            return swap.backend.write(read_only, entry.slot.offset + pos, buf, length, chunk=swap.block_size,
                                      checksums=entry.sums.view(index))
        return real_submit(entry, write, pos, buf, length, index)
    swap._submit = submit
    try:
        opt.grad_ready("s", torch.ones(64))
        opt.finish_step()
        with pytest.raises(Exception, match="Bad file descriptor"):
            opt.close()
    finally:
        os.close(read_only)
    again = ShardOptimizer(cfg, torch.device("cpu"), capacity_bytes=1 << 20)  # the path is free
    again.add_shard("s", torch.zeros(64))
    again.close()


def test_a_step_that_fails_part_way_keeps_each_step_count_with_its_state(tmp_path: object,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """What a failed step stepped before the failure stays stepped, and counts: a shard split into
    sub-shards whose second part failed goes on from each part's own count (its first part had
    moved on while the next step bias-corrected the second for step 2 on unmoved moments), and a
    hand-over that fails still records the shards the worker had stepped (they were dropped)."""
    cfg = Config(stage=1, tiers={"optimizer": "nvme", "grads": "cpu"}, nvme_paths=(str(tmp_path),),
                 pinned_budget_bytes=36 * 1024 * 4, optimizer={"lr": 0.1, "weight_decay": 0.0})
    opt = ShardOptimizer(cfg, torch.device("cpu"), capacity_bytes=1 << 22)
    opt.add_shard("s", torch.zeros(8192))
    assert [p.key for p in opt.subshards["s"]] == ["s#0", "s#1"]
    _fail_kernel_call(monkeypatch, 2)
    opt.grad_ready("s", torch.ones(8192))
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        opt.finish_step()
    assert opt.steps == {"s": 0} and opt.sub_steps == {"s#0": 1, "s#1": 0}
    opt.grad_ready("s", torch.ones(8192))
    assert opt.finish_step() is True
    master = opt.master("s")  # every Adam step here moves by -lr exactly (the gradient's sign)
    assert torch.allclose(master[:4096], torch.full((4096,), -0.2), atol=1e-5)
    assert torch.allclose(master[4096:], torch.full((4096,), -0.1), atol=1e-5)
    assert opt.steps == {"s": 1} and opt.sub_steps == {"s#0": 2, "s#1": 1}
    opt.close()

    failed = {"n": 1}

    def install(key: str, shard: torch.Tensor, owned: bool) -> None:
        if failed["n"]:
            failed["n"] -= 1
            raise MemoryError(f"no room to install {key}")
    cfg = Config(stage=1, tiers={"optimizer": "cpu", "grads": "cpu"}, optimizer={"lr": 0.1, "weight_decay": 0.0})
    for stream in (False, True):  # installed by step() on the caller's thread, or by the worker (stage 3)
        failed["n"] = 1
        opt = ShardOptimizer(cfg, torch.device("cpu"), on_updated=install, capacity_bytes=1 << 22,
                             stream_updates=stream)
        keys = [f"k{i}" for i in range(4)]
        for k in keys:
            opt.add_shard(k, torch.zeros(4096))
            opt.grad_ready(k, torch.ones(4096))
        with pytest.raises(RuntimeError, match="the optimizer step failed: no room to install k0"):
            opt.finish_step()
        for k in keys:  # stepped or not, each shard's count says which
            assert torch.allclose(opt.master(k), torch.full((4096,), -0.1 * opt.steps[k]), atol=1e-5), (stream, k, opt.steps)
        assert opt.steps["k0"] == 1
        opt.close()


def test_a_shard_whose_slot_cannot_be_written_is_not_added(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full drive while a split shard's second slot is written: add_shard used to leave the key
    registered ('already added' on a retry, a KeyError at the first step)."""
    cfg = Config(stage=1, tiers={"optimizer": "nvme", "grads": "cpu"}, nvme_paths=(str(tmp_path),),
                 pinned_budget_bytes=36 * 1024 * 4, optimizer={"lr": 0.1, "weight_decay": 0.0})
    opt = ShardOptimizer(cfg, torch.device("cpu"), capacity_bytes=1 << 22)
    real = opt.store.write

    def full_drive(key: str, src: torch.Tensor) -> object:
        if key == "s#1":
            raise OSError(28, "No space left on device")
        return real(key, src)
    monkeypatch.setattr(opt.store, "write", full_drive)
    with pytest.raises(OSError, match="No space left"):
        opt.add_shard("s", torch.zeros(8192))
    assert "s" not in opt.numel and opt.store.keys() == []
    monkeypatch.undo()
    opt.add_shard("s", torch.zeros(8192))  # the retry works
    opt.grad_ready("s", torch.ones(8192))
    assert opt.finish_step() is True
    assert torch.allclose(opt.master("s"), torch.full((8192,), -0.1), atol=1e-5)
    opt.close()


def _trained_and_saved(rank: int, world: int, stage: int, tmp: str) -> tuple[Any, Callable[[int], bool]]:
    """A rank's engine on cpu tiers after one step, checkpointed at `tmp`/ckpt, and its step."""
    import os

    import zero_offload
    from _engine_model import batch, make_model

    tiers = {"optimizer": "cpu", "grads": "cpu", **({"params": "cpu"} if stage == 3 else {})}
    engine = zero_offload.initialize(make_model(), dict(stage=stage, tiers=tiers, bucket_bytes=4096))

    def train(step: int) -> bool:
        x, y = batch(step, 2 * world)
        engine.backward(engine(x[rank::world], y[rank::world]))
        return engine.step()
    assert train(0)
    engine.save_checkpoint(os.path.join(tmp, "ckpt"))
    return engine, train


def _fails_on_rank_one(rank: int, world: int, stage: int, tmp: str) -> None:
    import os

    from zero_offload import comm
    from zero_offload.engine.engine import EngineStateError

    engine, train = _trained_and_saved(rank, world, stage, tmp)
    patch = pytest.MonkeyPatch()
    if rank == 1:
        _fail_kernel_call(patch, 2)
    expected = "failed: simulated" if rank == 1 else "failed on rank 1: simulated"
    with pytest.raises(RuntimeError, match=f"the optimizer step {expected} kernel failure"):
        train(1)
    patch.undo()
    if stage in (1, 2):  # the shards stepped before the failure are in every rank's compute copy
        masters = engine.consolidated_state_dict()
        if rank == 0:
            moved = [n for n, p in engine.module.named_parameters() if p.requires_grad and not torch.equal(p, masters[n])]
            assert not moved, f"compute copy behind the masters: {moved}"
        sums = comm.gather_objects(float(sum(p.double().sum() for p in engine.module.parameters())))
        assert sums[0] == sums[-1], sums
    # Rank 1 stepped its first shard only: the model's shards stand at two steps, so every rank
    # stops (at stage 0 every rank steps every shard: rank 0's replica moved on, rank 1's in part).
    why = "left the stage-0 replicas different" if stage == 0 else "shards at different steps .*on rank 1"
    with pytest.raises(EngineStateError, match=f"{why}.*load a checkpoint"):
        train(2)
    engine.load_checkpoint(os.path.join(tmp, "ckpt"))
    assert train(2)  # every rank goes on together: no rank was left waiting in a collective
    if stage < 3:  # every rank's compute copy: one model, not two replicas that drifted apart
        sums = comm.gather_objects(float(sum(p.double().sum() for p in engine.module.parameters())))
        assert sums[0] == sums[-1], sums
    engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_that_fails_on_one_rank_fails_on_every_rank(stage: int, tmp_path: object) -> None:
    """Rank 1's CPU Adam fails part way: rank 0 used to go on into the step's all-gathers (or
    the next forward's) and wait there for ever; now every rank raises, naming the rank. At
    stages 1-2 the compute copy then holds what was stepped (it kept the old weights of every
    bucket, so the next forward ran on weights behind the masters). The shards stand at two
    steps then: every rank stops until a load (training used to go on from the mixture), and
    after it the next step runs on both."""
    from _dist import run_ranks

    run_ranks(_fails_on_rank_one, 2, timeout=90, stage=stage, tmp=str(tmp_path))


def _hand_over_fails_on_last_rank(rank: int, world: int, stage: int, tmp: str) -> None:
    import os

    from zero_offload import comm
    from zero_offload.engine.engine import EngineStateError

    engine, train = _trained_and_saved(rank, world, stage, tmp)
    patch = pytest.MonkeyPatch()
    if rank == world - 1:  # the second shard handed over: its state moved on, its count does not follow
        real, calls = ShardOptimizer._completed, {"n": 0}

        def completed(self: ShardOptimizer, job: object) -> None:
            calls["n"] += 1
            if calls["n"] == 2:
                raise MemoryError("simulated hand-over failure")
            real(self, job)
        patch.setattr(ShardOptimizer, "_completed", completed)
    with pytest.raises(RuntimeError, match="simulated hand-over failure.*while handing over shard"):
        train(1)
    patch.undo()
    with pytest.raises(EngineStateError, match="while handing over a stepped shard"):
        train(2)  # on every rank: none goes on alone into the collectives
    engine.load_checkpoint(os.path.join(tmp, "ckpt"))
    assert train(1) and train(2)
    sums = comm.gather_objects(float(sum(p.detach().double().sum() for p in engine.module.parameters())))
    assert sums[0] == sums[-1], sums
    engine.close()


@pytest.mark.parametrize("world,stage", [(1, 1), (2, 1), (2, 2), (2, 3)])
def test_a_failed_hand_over_stops_every_rank_until_a_load(world: int, stage: int, tmp_path: object) -> None:
    """A stepped shard whose hand-over fails (its step count and compute copy not updated) used
    to be left so: the next steps bias-corrected it for the wrong step on weights behind its
    master. Now every rank raises, naming the shard, and stops until a checkpoint is loaded."""
    from _dist import run_ranks

    run_ranks(_hand_over_fails_on_last_rank, world, timeout=90, stage=stage, tmp=str(tmp_path))


def _stage0_failures_on_every_rank(rank: int, world: int) -> None:
    from test_failed_passes import _batch, _engine, _train
    from zero_offload.engine.engine import EngineStateError

    engine = _engine(0, "")
    _train(engine, range(2))
    patch = pytest.MonkeyPatch()
    _fail_kernel_call(patch, 1)  # every rank's first Adam call: nothing stepped anywhere
    with pytest.raises(RuntimeError, match="the optimizer step failed"):
        _train(engine, range(2, 3))
    patch.undo()
    assert engine.stopped is None  # the replicas still agree: no reason to stop
    _train(engine, range(3, 4))
    engine.module.b.fail_backward = True  # after the last layer's shards were handed to the step
    with pytest.raises(RuntimeError, match="simulated backward failure"):
        engine.backward(engine(_batch(4)))
    engine.module.b.fail_backward = False
    with pytest.raises(EngineStateError, match="a backward failed on this rank .* with D > 1 the other ranks"):
        engine(_batch(5))
    engine.close()


def test_stage0_stops_only_when_its_replicas_may_differ() -> None:
    """A step that failed the same way everywhere, before anything was stepped, stopped the
    engine for nothing; a backward that failed did not stop it, and the replicas could drift
    apart, or a rank whose backward alone failed went on into mismatched collectives and hung
    (reviews of the fixes)."""
    from _dist import run_ranks

    run_ranks(_stage0_failures_on_every_rank, 2, timeout=90)


class _FailsInBackward(torch.nn.Module):
    """Two layers; backward raises at the first layer's output, after the second layer's
    gradients were handed to the step."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.a(x)
        hidden.register_hook(_raise_in_backward)
        return self.b(hidden).pow(2).mean()


def _raise_in_backward(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("simulated backward failure")


def test_a_hand_over_failing_after_a_failed_backward_stops_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finishing the shard the failed backward had handed to the step (abandon_step) fails to
    hand it over: its master moved on, its count and compute copy did not, and training went on
    from there at D = 1."""
    import zero_offload
    from zero_offload.engine.engine import EngineStateError

    torch.manual_seed(0)
    engine = zero_offload.initialize(_FailsInBackward(), dict(stage=1, tiers={"optimizer": "cpu", "grads": "cpu"},
                                                             bucket_bytes=8 * 8 * 4))
    x = torch.randn(4, 8)

    def completed(self: ShardOptimizer, job: object) -> None:
        raise MemoryError("simulated hand-over failure")
    monkeypatch.setattr(ShardOptimizer, "_completed", completed)
    with pytest.raises(RuntimeError, match="simulated hand-over failure"):
        engine.backward(engine(x))
    monkeypatch.undo()
    assert engine.stopped and "hand-over failed" in engine.stopped
    with pytest.raises(EngineStateError, match="load a checkpoint"):
        engine(x)
    engine.close()
