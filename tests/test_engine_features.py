"""Clipping, accumulation, fp16 overflow, bit-identical resume and resharded checkpoints (D = 2).

One spawned D=2 job runs every check that needs ranks; the checkpoint it saves is then loaded by
spawned D=1 and D=3 jobs under other tier configs.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from _dist import run_ranks
from test_engine_matrix import LR, TOL, compare, make_config, nvme_available

GLOBAL_ROWS = 6  # divisible by 1, 2 and 3, so every D sees the same global batch


def _train_steps(engine, world: int, rank: int, steps: range, *, micro: int = 1, poison: int = -1) -> tuple[list[float], list[bool]]:
    """Steps over the fixed global batches; returns the global-mean losses and step() results."""
    from zero_offload import comm
    from _engine_model import batch

    losses, applied = [], []
    rows = GLOBAL_ROWS // world
    for step in steps:
        x, y = batch(step, GLOBAL_ROWS * micro)
        total = 0.0
        for k in range(micro):
            sl = slice((k * world + rank) * rows, (k * world + rank + 1) * rows)
            loss = engine(x[sl], y[sl])
            engine.backward(loss * math.inf if step == poison and rank == 1 else loss)
            applied.append(engine.step())
            total += float(comm.all_reduce_(loss.detach().float().reshape(1))[0]) / world
        losses.append(total / micro)
    return losses, applied


def _engine(cfg: dict):
    import zero_offload
    from _engine_model import make_model

    return zero_offload.initialize(make_model(), cfg)


def _check_clip_and_accumulation(rank: int, world: int, nvme_dir: str) -> None:
    from _engine_model import reference_run

    norms: list[float] = []
    ref_losses, ref_w = reference_run(8, GLOBAL_ROWS, torch.float32, lr=LR, clip=0.05, norms=norms)
    for stage, tier in ((1, "device"), (2, "cpu")):
        engine = _engine(make_config(stage, tier, "fp32", nvme_dir, clip_grad_norm=0.05))
        losses, _ = _train_steps(engine, world, rank, range(8))
        assert engine.grad_norm > 0.05, "the clip never engaged"
        assert abs(engine.grad_norm - norms[-1]) <= 1e-5 * norms[-1], (engine.grad_norm, norms[-1])
        weights = engine.consolidated_state_dict()
        if rank == 0:
            compare(f"clip stage {stage} {tier}", losses, weights, ref_losses, ref_w, TOL["fp32"])
        engine.close()
    ref_losses, ref_w = reference_run(6, 2 * GLOBAL_ROWS, torch.float32, lr=LR)
    for stage in (1, 2):
        engine = _engine(make_config(stage, "cpu", "fp32", nvme_dir, gradient_accumulation_steps=2))
        losses, applied = _train_steps(engine, world, rank, range(6), micro=2)
        assert applied == [False, True] * 6, applied
        weights = engine.consolidated_state_dict()
        if rank == 0:
            compare(f"accumulation stage {stage}", losses, weights, ref_losses, ref_w, TOL["fp32"])
        engine.close()


def _check_fp16_overflow(rank: int, world: int, nvme_dir: str) -> None:
    cfg = make_config(2, "cpu", "fp16", nvme_dir, )
    cfg["precision"]["initial_scale_power"] = 8
    engine = _engine(cfg)
    before = {}
    _, applied = _train_steps(engine, world, rank, range(3))
    before = engine.consolidated_state_dict()
    scale = engine.runtime.shard_optimizer.scaler.scale
    _, poisoned = _train_steps(engine, world, rank, range(3, 4), poison=3)
    after = engine.consolidated_state_dict()
    _, rest = _train_steps(engine, world, rank, range(4, 7))
    assert applied + poisoned + rest == [True] * 3 + [False] + [True] * 3
    assert engine.skipped_steps == 1
    if rank == 0:
        assert all(torch.equal(before[k], after[k]) for k in before), "the skipped step changed weights"
    engine.close()
    del scale


def _check_resume(rank: int, world: int, nvme_dir: str, ckpt: str) -> None:
    tier = "nvme" if nvme_available() else "cpu"
    cfg = make_config(2, tier, "bf16", nvme_dir, clip_grad_norm=0.05)
    full = _engine(cfg)
    losses_a, _ = _train_steps(full, world, rank, range(6))
    rand_a = torch.rand(3)
    weights_a = full.consolidated_state_dict()
    full.close()
    first = _engine(cfg)
    _train_steps(first, world, rank, range(3))
    first.save_checkpoint(ckpt)
    first.close()
    torch.manual_seed(999)  # must be undone by the checkpoint's RNG state
    resumed = _engine(cfg)
    resumed.load_checkpoint(ckpt)
    losses_b, _ = _train_steps(resumed, world, rank, range(3, 6))
    rand_b = torch.rand(3)
    weights_b = resumed.consolidated_state_dict()
    assert losses_a[3:] == losses_b and torch.equal(rand_a, rand_b)
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a), "resume is not bit-identical"
    resumed.close()


def _check_reshard_save(rank: int, world: int, nvme_dir: str, ckpt: str) -> None:
    engine = _engine(make_config(2, "cpu", "fp32", nvme_dir))
    _train_steps(engine, world, rank, range(5))
    engine.save_checkpoint(ckpt)
    weights = engine.consolidated_state_dict()
    if rank == 0:
        torch.save(weights, os.path.join(ckpt + ".expected.pt"))
    engine.close()


def _features_rank(rank: int, world: int, tmp: str) -> None:
    nvme_dir = os.path.join(tmp, f"nvme{rank}")
    os.makedirs(nvme_dir, exist_ok=True)
    _check_clip_and_accumulation(rank, world, nvme_dir)
    _check_fp16_overflow(rank, world, nvme_dir)
    _check_resume(rank, world, nvme_dir, os.path.join(tmp, "resume"))
    _check_reshard_save(rank, world, nvme_dir, os.path.join(tmp, "d2"))


def _reshard_load_rank(rank: int, world: int, tmp: str, tier: str) -> None:
    from _engine_model import reference_run

    nvme_dir = os.path.join(tmp, f"nvme-load{world}-{rank}")
    os.makedirs(nvme_dir, exist_ok=True)
    engine = _engine(make_config(1 if world == 3 else 0, tier, "fp32", nvme_dir))
    engine.load_checkpoint(os.path.join(tmp, "d2"))
    weights = engine.consolidated_state_dict()
    if rank == 0:
        expected = torch.load(os.path.join(tmp, "d2.expected.pt"), weights_only=True)
        assert all(torch.equal(weights[k], expected[k]) for k in expected), "loaded weights differ"
    assert engine.global_steps == 5
    losses, _ = _train_steps(engine, world, rank, range(5, 10))
    ref_losses, ref_w = reference_run(10, GLOBAL_ROWS, torch.float32, lr=LR)
    weights = engine.consolidated_state_dict()
    if rank == 0:  # moments resharded correctly: the continuation matches the reference
        compare(f"D=2 checkpoint continued at D={world} on {tier}", losses, weights, ref_losses[5:], ref_w, TOL["fp32"])
    engine.close()


@pytest.fixture(scope="module")
def d2_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = str(tmp_path_factory.mktemp("engine_d2"))
    run_ranks(_features_rank, 2, timeout=240, tmp=tmp)
    return tmp


def test_clip_accumulation_fp16_resume_at_d2(d2_run: str) -> None:
    assert os.path.isfile(os.path.join(d2_run, "d2", "manifest.json"))


@pytest.mark.parametrize("world,tier", [(1, "device"), (3, "nvme")])
def test_checkpoint_from_d2_loads_at_other_world_and_tier(d2_run: str, world: int, tier: str) -> None:
    if tier == "nvme" and not nvme_available():
        tier = "cpu"
    run_ranks(_reshard_load_rank, world, timeout=120, tmp=d2_run, tier=tier)
