"""What users do to the model and the optimizer between steps, at stages 0-2, against torch.

A torch optimizer steps whatever the parameter holds and reads lr when step() runs; the engine
keeps its own master shards and steps them during backward. These tests pin the places where
the two could silently part: weights loaded or edited after initialize, a stale .grad, the set of
trainable parameters changed after initialize, hyperparameters changed after backward.
"""
from __future__ import annotations

import gc
import os
import threading
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

import zero_offload
from _edit_reference import adamw_reference
from zero_offload.engine.engine import EngineStateError

LR, WD = 1e-2, 0.01


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.b(torch.tanh(self.a(x))) - y).pow(2).mean()


def _net(seed: int = 0) -> _Net:
    torch.manual_seed(seed)
    return _Net()


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _reference(model: nn.Module, steps: int, edit: Callable[[int, nn.Module], None]) -> dict[str, torch.Tensor]:
    return adamw_reference(model, steps, edit, _batch, LR, WD)


def _engine_run(engine: zero_offload.engine.engine.Engine, steps: int,
                edit: Callable[[int, nn.Module], None]) -> dict[str, torch.Tensor]:
    for i in range(steps):
        edit(i, engine.module)
        engine.backward(engine(*_batch(i)))
        engine.step()
    if engine.config.stage == 3:
        return engine.consolidated_state_dict()
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=k)


def _config(stage: int, tier: str, tmp_path: Path) -> dict:
    tiers = {"optimizer": tier, "grads": "cpu" if tier == "nvme" else tier}
    if stage == 3:
        return dict(stage=3, tiers={**tiers, "params": tier}, nvme_paths=[str(tmp_path)],
                    optimizer={"lr": LR, "weight_decay": WD}, stage3={"unit_modules": ["Linear"]})
    return dict(stage=stage, tiers=tiers, nvme_paths=[str(tmp_path)], bucket_bytes=256,
                optimizer={"lr": LR, "weight_decay": WD})


CASES = [(0, "device"), (1, "cpu"), (2, "nvme")]


def _pretrained() -> dict[str, torch.Tensor]:
    return _net(seed=7).state_dict()


def _load_at_start(i: int, m: nn.Module) -> None:
    if i == 0:
        m.load_state_dict(_pretrained())


def _halve_at_two(i: int, m: nn.Module) -> None:
    if i == 2:
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(0.5)


def _replace_at_one(i: int, m: nn.Module) -> None:
    if i == 1:
        m.b.weight.data = torch.full_like(m.b.weight, 0.1)


@pytest.mark.parametrize("edit", [_load_at_start, _halve_at_two, _replace_at_one], ids=["load", "mul_", "data="])
@pytest.mark.parametrize("stage,tier", CASES, ids=[f"stage{s}-{t}" for s, t in CASES])
def test_weights_changed_after_initialize_are_trained_from(stage: int, tier: str,
                                                          edit: Callable[[int, nn.Module], None],
                                                          tmp_path: Path) -> None:
    """Pretrained weights loaded after initialize (or an in-place edit, or `p.data = ...`) were
    used by the forward, but the step updated the old master and wrote it back: training went
    on from the random init without a word (a review)."""
    engine = zero_offload.initialize(_net(), _config(stage, tier, tmp_path))
    got = _engine_run(engine, 4, edit)
    engine.close()
    _assert_close(got, _reference(_net(), 4, edit))


def _stale_grad(engine: zero_offload.engine.engine.Engine) -> None:
    loss = engine(*_batch(0))
    with pytest.raises(RuntimeError, match="call engine.backward"):
        loss.backward()  # refused by the first gradient hook: that gradient stayed in .grad


ALL_STAGES = CASES + [(3, "cpu"), (3, "nvme")]


@pytest.mark.parametrize("stage,tier", ALL_STAGES, ids=[f"stage{s}-{t}" for s, t in ALL_STAGES])
def test_a_stale_grad_is_not_added_to_the_next_step(stage: int, tier: str, tmp_path: Path) -> None:
    """A refused loss.backward() left one gradient in .grad, and a model that held .grad before
    initialize kept it: both were summed into the next engine.backward's gradient. At stage 3
    loss.backward() was not even refused (the next engine.backward then failed)."""
    model = _net()
    model(*_batch(5)).backward()  # a sanity check before initialize leaves .grad behind
    engine = zero_offload.initialize(model, _config(stage, tier, tmp_path))
    engine.backward(engine(*_batch(0)))
    engine.step()
    _stale_grad(engine)
    got = _engine_run(engine, 2, lambda i, m: None)
    engine.close()
    ref = _net()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for i in (0, 0, 1):
        ref(*_batch(i)).backward()
        opt.step()
        opt.zero_grad()
    _assert_close(got, {k: v.detach() for k, v in ref.state_dict().items()})


@pytest.mark.parametrize("stage", [2, 3])
def test_freezing_or_unfreezing_after_initialize_is_refused(stage: int, tmp_path: Path) -> None:
    """Frozen after initialize, a layer kept moving (its zero gradient is stepped and Adam's
    moments carry it); unfrozen, it would gather .grad nothing steps. Both are refused in one
    line before backward reduces anything, and the engine goes on once it is undone."""
    model = _net()
    model.b.bias.requires_grad_(False)
    engine = zero_offload.initialize(model, _config(stage, "cpu", tmp_path))
    engine.backward(engine(*_batch(0)))
    engine.step()
    model.a.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"parameter 'a.weight' was frozen \(requires_grad=False\) after initialize; the trainable parameters are fixed"):
        engine.backward(engine(*_batch(1)))
    model.a.weight.requires_grad_(True)
    model.b.bias.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"parameter 'b.bias' was unfrozen \(requires_grad=True\) after initialize"):
        engine.backward(engine(*_batch(1)))
    model.b.bias.requires_grad_(False)
    engine.backward(engine(*_batch(1)))
    engine.step()
    engine.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
def test_lr_set_after_backward_warns_when_the_step_already_ran(overlap: bool, tmp_path: Path) -> None:
    """The overlapped step reads lr as backward begins; one set between backward and step()
    (a hand-written warmup) applied a step late without a word."""
    cfg = {**_config(1, "cpu", tmp_path), "overlap_step": overlap}
    engine = zero_offload.initialize(_net(), cfg)
    engine.backward(engine(*_batch(0)))
    engine.optimizer.param_groups[0]["lr"] = LR / 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.step()
    engine.close()
    late = [w for w in caught if "changed after engine.backward()" in str(w.message)]
    assert len(late) == (1 if overlap else 0)


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("zero-offload")}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_dropped_engine_releases_its_threads_and_files(stage: int, tmp_path: Path) -> None:
    """Without close(), an engine's threads held its runtime, so nothing was freed: the nvme
    path stayed locked (a second initialize was refused naming our own pid), memory and threads
    grew with each engine a notebook cell made."""
    gc.collect()  # engines other tests dropped
    before = _threads()
    cfg = {**_config(stage, "nvme", tmp_path), "tiers": {"optimizer": "nvme", "grads": "cpu",
                                                         "params": "nvme" if stage == 3 else "device"}}
    engine = zero_offload.initialize(_net(), cfg)
    engine.backward(engine(*_batch(0)))
    engine.step()
    del engine
    gc.collect()
    assert _threads() == before
    assert os.listdir(tmp_path) == []
    zero_offload.initialize(_net(), cfg).close()


def test_a_failed_initialize_releases_what_it_made(tmp_path: Path) -> None:
    """An init_fn that raises (stage 3) left the stores open: the retry was refused ('in use')."""
    def bad_init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear) and module.out_features == 4:
            raise ValueError("bad init")

    cfg = dict(stage=3, tiers={"params": "nvme", "optimizer": "nvme", "grads": "cpu"}, nvme_paths=[str(tmp_path)],
               stage3={"unit_modules": ["Linear"]})
    with torch.device("meta"):
        meta = _Net()
    with pytest.raises(ValueError, match="bad init"):
        zero_offload.initialize(meta, cfg, init_fn=bad_init)
    assert os.listdir(tmp_path) == []
    with torch.device("meta"):
        meta = _Net()
    zero_offload.initialize(meta, cfg, init_fn=lambda m: None).close()


def test_a_closed_engine_says_so(tmp_path: Path) -> None:
    engine = zero_offload.initialize(_net(), _config(3, "cpu", tmp_path) | {"tiers": {"params": "cpu", "optimizer": "cpu"}})
    engine.close()
    engine.close()  # twice is fine
    for call in (lambda: engine(*_batch(0)), engine.consolidated_state_dict, engine.memory_report,
                 lambda: engine.save_checkpoint(str(tmp_path / "ck"))):
        with pytest.raises(EngineStateError, match=r"engine\.\w+: the engine was closed"):
            call()


def test_the_optimizer_state_is_not_saved_through_engine_optimizer(tmp_path: Path) -> None:
    """engine.optimizer.state_dict() returned {'state': {}, ...}: a loop saving it the torch way
    kept nothing of the master or the moments (a review)."""
    engine = zero_offload.initialize(_net(), _config(1, "cpu", tmp_path))
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    engine.backward(engine(*_batch(0)))
    engine.step()
    sched.step()  # schedulers still drive the hyperparameters
    assert engine.optimizer.param_groups[0]["lr"] == LR / 2
    assert sched.state_dict()["last_epoch"] == 1
    with pytest.raises(RuntimeError, match=r"saved by engine.save_checkpoint\(dir\)"):
        engine.optimizer.state_dict()
    with pytest.raises(RuntimeError, match=r"restored by engine.load_checkpoint\(dir\)"):
        engine.optimizer.load_state_dict({})
    engine.close()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_parameter_object_replaced_after_initialize_is_refused(stage: int, tmp_path: Path) -> None:
    """load_state_dict(assign=True) put new Parameter objects in the model: they had no hooks,
    the originals were stepped with zero gradients, and the loss never moved (a review)."""
    engine = zero_offload.initialize(_net(), _config(stage, "cpu", tmp_path))
    engine.backward(engine(*_batch(0)))
    engine.step()
    original = engine.module.a.weight
    engine.module.a.weight = nn.Parameter(torch.zeros(16, 8))
    with pytest.raises(RuntimeError, match=r"parameter 'a.weight' was replaced by another object after initialize"):
        engine.backward(engine(*_batch(1)))
    engine.module.a.weight = original
    engine.backward(engine(*_batch(1)))
    engine.step()
    engine.close()


class _SharedBase(nn.Module):
    """Two parameters that are views of one base tensor (they share its version counter)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        base = torch.randn(2, 64)
        self.w1, self.w2 = nn.Parameter(base[0]), nn.Parameter(base[1])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((x[:, :1] * self.w1[:4] + self.w2[:4]) - y).pow(2).mean()


@pytest.mark.parametrize("tier", ["device", "cpu"])
def test_parameters_sharing_a_base_are_not_taken_for_edited(tier: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """One bucket's install (a copy into a view) bumped the version counter the other bucket's
    parameters share after that bucket was stamped: both were re-seeded every step, a state
    read and write each (a review)."""
    from zero_offload.engine.buckets.runtime import BucketRuntime

    reseeds = []
    real = BucketRuntime._reseed
    monkeypatch.setattr(BucketRuntime, "_reseed", lambda self, b: (reseeds.append(b.key), real(self, b))[1])
    cfg = {**_config(0, tier, tmp_path), "bucket_bytes": 64}  # one parameter per bucket
    engine = zero_offload.initialize(_SharedBase(), cfg)
    for i in range(4):
        engine.backward(engine(*_batch(i)))
        engine.step()
    engine.close()
    assert len(engine.runtime.buckets) == 2 and reseeds == []


def test_a_parameter_given_another_shape_is_refused(tmp_path: Path) -> None:
    """`p.data = t` of another shape cannot become the bucket's master: one line naming both."""
    engine = zero_offload.initialize(_net(), _config(1, "cpu", tmp_path))
    loss = engine(*_batch(0))  # (a forward after the change would fail in torch first)
    engine.module.b.weight.data = torch.zeros(2, 2)
    with pytest.raises(RuntimeError, match=r"parameter 'b.weight' was replaced by a tensor of shape \(2, 2\), "
                                           r"torch.float32 on cpu after initialize; the engine holds \(4, 16\)"):
        engine.backward(loss)
    engine.close()
