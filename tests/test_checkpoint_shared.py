"""A checkpoint path must be on a file system every rank shares: a review simulated two nodes with
their own disks (a different directory per rank) and found a stage-0 save that reported success
without rank 1's files, and loads that took a different checkpoint on each rank."""
from __future__ import annotations

import os

import pytest

from _dist import run_ranks


def _engine(stage: int) -> object:
    import zero_offload
    from _engine_model import make_model

    return zero_offload.initialize(make_model(), dict(stage=stage, tiers={"optimizer": "cpu", "grads": "cpu"},
                                                      bucket_bytes=4096))


def _train(engine: object, rank: int, world: int, steps: range) -> None:
    from _engine_model import batch

    for s in steps:
        x, y = batch(s, 2 * world)
        engine.backward(engine(x[rank::world], y[rank::world]))
        engine.step()


def _save_to_node_local_dirs(rank: int, world: int, stage: int, tmp: str) -> None:
    from zero_offload.engine.state.checkpoint import CheckpointError

    engine = _engine(stage)
    _train(engine, rank, world, range(1))
    local = os.path.join(tmp, f"node{rank}", "ckpt")  # "the same path" on two nodes' own disks
    os.makedirs(local + ".tmp")  # node 1's leftover of a crashed save, marked as a save's
    open(os.path.join(local + ".tmp", ".zero_offload_checkpoint"), "w").close()
    with pytest.raises(CheckpointError, match="file system shared by every rank"):
        engine.save_checkpoint(local)
    assert not os.path.exists(local)  # nothing claims to be a checkpoint
    _train(engine, rank, world, range(1, 2))  # and training goes on
    engine.close()


@pytest.mark.parametrize("stage", [0, 1])
def test_a_save_to_node_local_paths_is_refused_on_every_rank(stage: int, tmp_path: object) -> None:
    run_ranks(_save_to_node_local_dirs, 2, timeout=90, stage=stage, tmp=str(tmp_path))


def _load_different_copies(rank: int, world: int, tmp: str) -> None:
    import torch

    from zero_offload import comm
    from zero_offload.engine.state.checkpoint import CheckpointError

    engine = _engine(1)
    shared = os.path.join(tmp, "shared")
    _train(engine, rank, world, range(1))
    engine.save_checkpoint(os.path.join(shared, "step1"))
    _train(engine, rank, world, range(1, 2))
    engine.save_checkpoint(os.path.join(shared, "step2"))
    before = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
    mine = os.path.join(shared, "step1" if rank == 0 else "step2")  # node-local copies of different steps
    with pytest.raises(CheckpointError, match="the ranks found different checkpoints"):
        engine.load_checkpoint(mine)
    after = engine.consolidated_state_dict()
    if rank == 0:
        assert all(torch.equal(before[k], after[k]) for k in before)  # refused before anything changed
    engine.load_checkpoint(os.path.join(shared, "step1"))  # the same on every rank: loads
    sums = comm.gather_objects(engine.global_steps)
    assert sums == [1, 1], sums
    engine.close()


def test_a_load_of_different_checkpoints_on_different_ranks_is_refused(tmp_path: object) -> None:
    run_ranks(_load_different_copies, 2, timeout=90, tmp=str(tmp_path))
