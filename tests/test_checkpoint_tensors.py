"""Checkpoints round-trip parameters and buffers of every shape and dtype a module may hold: any
model with a BatchNorm failed to save at every stage, as its 0-dim int64 num_batches_tracked
could not be viewed as bytes for its checksum (issue 20)."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import zero_offload
from zero_offload.engine.state import checkpoint
from zero_offload.engine.state.checkpoint import CheckpointError


class Odd(nn.Module):
    """A BatchNorm, and parameters and buffers of shape () and (0,), integer, bool, float64
    and non-contiguous, each of which the forward reads and most of which it changes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim, trainable
        self.nothing = nn.Parameter(torch.zeros(0))  # empty, trainable
        self.gain = nn.Parameter(torch.tensor(0.75), requires_grad=False)  # 0-dim, frozen
        self.register_buffer("calls", torch.tensor(0))  # 0-dim int64
        self.register_buffer("empty", torch.zeros(0, 3))
        self.register_buffer("mask", torch.tensor([True, False, True, True, False, True]))
        self.register_buffer("ids", torch.arange(6, dtype=torch.int32))
        self.register_buffer("wide", torch.linspace(0.5, 1.5, 6, dtype=torch.float64))
        self.register_buffer("proj", torch.randn(6, 6).t())  # non-contiguous
        self.register_buffer("step_sum", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.bn(self.lin(x) @ self.proj) * self.scale * self.gain
        h = h * self.mask + self.nothing.sum() + self.empty.sum() + self.wide.to(h.dtype)
        with torch.no_grad():
            self.step_sum += h.detach().mean()
            self.ids.add_(self.calls.to(torch.int32))
        return h.pow(2).mean() + self.ids.sum().to(h.dtype) * 0


def _model() -> Odd:
    torch.manual_seed(0)
    return Odd()


def _config(stage: int, tier: str, tmp: str) -> dict:
    tiers = {"optimizer": tier, "grads": "cpu", **({"params": tier} if stage == 3 else {})}
    cfg: dict = {"stage": stage, "tiers": tiers, "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}
    if tier == "nvme":
        os.makedirs(os.path.join(tmp, "nvme"), exist_ok=True)
        cfg["nvme_paths"] = [os.path.join(tmp, "nvme")]
    if stage == 3:
        cfg["stage3"] = {"unit_modules": ["Linear", "BatchNorm1d"]}
    return cfg


def _train(engine: object, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _state(engine: object) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.consolidated_state_dict().items()}


CASES = [(0, "cpu"), (2, "cpu"), (3, "cpu"), (3, "nvme")]


@pytest.mark.parametrize("stage,tier", CASES, ids=[f"stage{s}-{t}" for s, t in CASES])
def test_odd_tensors_save_load_and_resume_bit_for_bit(tmp_path: object, stage: int, tier: str) -> None:
    tmp = str(tmp_path)
    cfg = _config(stage, tier, tmp)
    straight = zero_offload.initialize(_model(), cfg)
    want = _train(straight, range(5))
    want_sd = _state(straight)
    straight.close()

    first = zero_offload.initialize(_model(), cfg)
    got = _train(first, range(3))
    saved_sd = _state(first)
    first.save_checkpoint(os.path.join(tmp, "ck"))
    first.close()

    resumed = zero_offload.initialize(_model(), cfg)
    resumed.load_checkpoint(os.path.join(tmp, "ck"))
    loaded_sd = _state(resumed)
    assert loaded_sd.keys() == saved_sd.keys()
    for k, v in saved_sd.items():
        assert loaded_sd[k].dtype == v.dtype and loaded_sd[k].shape == v.shape and torch.equal(loaded_sd[k], v), k
    assert int(loaded_sd["bn.num_batches_tracked"]) == 3 and int(loaded_sd["calls"]) == 3
    assert not resumed.module.proj.is_contiguous()  # the module's own layout is kept
    got += _train(resumed, range(3, 5))
    got_sd = _state(resumed)
    resumed.close()

    assert got == want
    for k, v in want_sd.items():
        assert torch.equal(got_sd[k], v), k


def test_checksum_covers_the_bytes_of_every_shape_and_layout() -> None:
    base = torch.arange(12, dtype=torch.int64).view(3, 4)
    assert checkpoint._crc(torch.tensor(7)) == checkpoint._crc(torch.tensor([7]))
    assert checkpoint._crc(torch.tensor(True)) != checkpoint._crc(torch.tensor(False))
    assert checkpoint._crc(torch.zeros(0, 5)) == checkpoint._crc(torch.zeros(0, dtype=torch.bool)) == 0
    assert checkpoint._crc(base.t()) == checkpoint._crc(base.t().contiguous())  # as saved: in element order
    assert checkpoint._crc(base.t()) != checkpoint._crc(base)
    ones = torch.ones(3, dtype=torch.bfloat16)
    assert checkpoint._crc(ones) == checkpoint._crc(ones.view(torch.int16))


def test_a_sparse_buffer_is_refused_in_one_line(tmp_path: object) -> None:
    model = nn.Linear(4, 4)
    model.register_buffer("table", torch.eye(4).to_sparse())
    engine = zero_offload.initialize(model, {"stage": 1, "tiers": {"optimizer": "cpu", "grads": "cpu"}})
    with pytest.raises(CheckpointError, match=r"'table' has layout torch.sparse_coo; checkpoints hold dense") as info:
        engine.save_checkpoint(str(tmp_path / "ck"))
    assert "\n" not in str(info.value)
    engine.close()


def _ranks_save_and_resume(rank: int, world: int, tmp: str) -> None:
    """Each rank's BatchNorm statistics and counters (its own micro-batches') go through its
    rank{r}.buffers.pt, 0-dim ones included."""
    def train(engine: object, steps: range) -> list[float]:
        out = []
        for step in steps:
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step * world + rank))
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    cfg = _config(2, "cpu", tmp)
    first = zero_offload.initialize(_model(), cfg)
    train(first, range(2))
    first.save_checkpoint(os.path.join(tmp, "ck"))
    buffers = {k: v.clone() for k, v in first.module.named_buffers()}
    want = train(first, range(2, 4))
    first.close()
    resumed = zero_offload.initialize(_model(), cfg)
    resumed.load_checkpoint(os.path.join(tmp, "ck"))
    for k, v in resumed.module.named_buffers():
        assert v.dtype == buffers[k].dtype and torch.equal(v, buffers[k]), (rank, k)
    assert train(resumed, range(2, 4)) == want
    resumed.close()


def test_each_ranks_odd_buffers_resume_at_d2(tmp_path: object) -> None:
    from _dist import run_ranks

    run_ranks(_ranks_save_and_resume, 2, timeout=120, tmp=str(tmp_path))
