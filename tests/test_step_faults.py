"""A step that is interrupted or fails part way leaves every shard at one step, or stops the engine.

Ctrl-C inside step() used to leave some shards at the new step and the rest at the old one, and
save_checkpoint wrote that mixture without a word (the manifest held bucket0 at step 4 and bucket1
at step 3); engine.stopped stayed None. Now a Ctrl-C while step() waits for its shards finishes
the step on the shards that remain (their gradients are all there) and is raised once it is
complete; where the step cannot be finished (a shard's update failed, or was interrupted inside
its own pass) the engine stops and every later call and save refuse, in one line, until a load.

Faults are injected deterministically: the CPU Adam's k-th call raises, or the main thread's
wait for the step worker is interrupted while the worker is inside the k-th shard's update.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import zero_offload
from zero_offload.config import Config
from zero_offload.engine.step import pipeline as step_mod
from zero_offload.engine.engine import EngineStateError

WAIT_S = 5.0  # a bound on every wait: a broken fix fails instead of hanging
WIDTH = 32
MIDDLE = 3  # the kernel call of the shard the fault lands in (5 buckets at stages 0-2, 4 units at stage 3)


def _engine(tmp: Path, stage: int, **extra: Any) -> Any:
    """Four Linear layers, fp32, optimizer (and at stage 3 parameters) on nvme: a shard per weight."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    tiers = {"optimizer": "nvme", "grads": "cpu", **({"params": "nvme"} if stage == 3 else {})}
    shape = {"stage3": {"resident_bytes": 0}} if stage == 3 else {"bucket_bytes": WIDTH * WIDTH * 4}
    os.makedirs(tmp / "nvme", exist_ok=True)
    cfg = Config(stage=stage, precision={"dtype": "fp32"}, tiers=tiers, nvme_paths=(str(tmp / "nvme"),),
                 optimizer={"lr": 0.01, "weight_decay": 0.01}, **shape, **extra)
    return zero_offload.initialize(model, cfg)


def _step(eng: Any, i: int) -> None:
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(i))
    eng.backward(eng(x).pow(2).mean())
    eng.step()


def _weights(eng: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in eng.consolidated_state_dict().items()}


def _reference(tmp: Path, stage: int, steps: int, **extra: Any) -> dict[str, torch.Tensor]:
    """An uninterrupted engine's weights after `steps` steps."""
    ref = _engine(tmp, stage, **extra)
    for i in range(1, steps + 1):
        _step(ref, i)
    out = _weights(ref)
    ref.close()
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"weights differ from an uninterrupted run: {differ}"


def _manifest_steps(path: Path) -> dict[str, int]:
    with open(path / "manifest.json") as f:
        return json.load(f)["optimizer"]["steps"]


class _InterruptedWait(threading.Condition):
    """The step pipeline's lock: the main thread's first wait once `when()` holds raises
    KeyboardInterrupt, as Ctrl-C does to a thread blocked in engine.step()."""

    def __init__(self, when: Callable[[], bool], times: int = 1) -> None:
        super().__init__()
        self.when, self.times, self.count = when, times, 0

    @property
    def fired(self) -> bool:
        return self.count == self.times

    def wait(self, timeout: float | None = None) -> bool:
        if self.fired or threading.current_thread() is not threading.main_thread():
            return super().wait(timeout)
        if self.when():
            self.count += 1
            raise KeyboardInterrupt
        return super().wait(0.002)  # not yet: look again soon (callers wait in a loop)


def _kernel_call(monkeypatch: pytest.MonkeyPatch, which: int, action: Callable[[], None]) -> None:
    """The CPU Adam's `which`-th call (from 1) runs `action` first; every call steps as usual."""
    real, calls = step_mod.HostAdam.__call__, {"n": 0}

    def kernel(self: object, *args: object) -> None:
        calls["n"] += 1
        if calls["n"] == which:
            action()
        real(self, *args)
    monkeypatch.setattr(step_mod.HostAdam, "__call__", kernel)


def _interrupt_main_thread_during(monkeypatch: pytest.MonkeyPatch, eng: Any, which: int,
                                  times: int = 1) -> _InterruptedWait:
    """Ctrl-C reaches the main thread (waiting in step()) `times` times while the worker is inside
    the kernel of the `which`-th shard, which goes on only once the interrupts have landed."""
    entered = threading.Event()
    cond = _InterruptedWait(entered.is_set, times)

    def inside() -> None:
        entered.set()
        deadline = time.monotonic() + WAIT_S
        while not cond.fired and time.monotonic() < deadline:
            time.sleep(0.001)
    _kernel_call(monkeypatch, which, inside)
    monkeypatch.setattr(eng.runtime.shard_optimizer.pipeline, "_idle", cond)
    return cond


@pytest.mark.parametrize("stage,extra", [(0, {}), (2, {}), (3, {}), (2, {"clip_grad_norm": 1.0})],
                         ids=["stage0", "stage2", "stage3", "stage2-deferred"])
def test_ctrl_c_while_step_waits_finishes_the_step_on_every_shard(stage: int, extra: dict, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The interrupt reaches the user, after the step has run on the shards that remained: every
    shard is at step 2, the step is counted, a save holds one step, and training goes on exactly
    as an uninterrupted run (it used to leave the last shards at step 1, unsaid)."""
    eng = _engine(tmp_path / "run", stage, **extra)
    _step(eng, 1)
    cond = _interrupt_main_thread_during(monkeypatch, eng, MIDDLE)
    with pytest.raises(KeyboardInterrupt):
        _step(eng, 2)
    monkeypatch.undo()
    assert cond.fired
    so = eng.runtime.shard_optimizer
    assert eng.stopped is None
    assert set(so.steps.values()) == {2} and eng.global_steps == 2, so.steps
    eng.save_checkpoint(str(tmp_path / "ck"))
    assert set(_manifest_steps(tmp_path / "ck").values()) == {2}
    _step(eng, 3)
    _assert_same(_weights(eng), _reference(tmp_path / "ref", stage, 3, **extra))
    eng.close()


def test_a_second_ctrl_c_while_the_step_is_finished_stops_the_engine(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C twice: the second stops the worker, so the shards after the middle one keep the old
    step while the first ones took the new one; the engine stops instead of going on from that."""
    eng = _engine(tmp_path / "run", 2)
    _step(eng, 1)
    eng.save_checkpoint(str(tmp_path / "ck1"))
    cond = _interrupt_main_thread_during(monkeypatch, eng, MIDDLE, times=2)
    with pytest.raises(KeyboardInterrupt):
        _step(eng, 2)
    monkeypatch.undo()
    assert cond.fired
    _refuses_until_a_load(eng, tmp_path, 2, "KeyboardInterrupt")
    eng.close()


def _refuses_until_a_load(eng: Any, tmp_path: Path, stage: int, what: str) -> None:
    """The engine is stopped: save and step refuse in one line naming what happened and that a
    load is needed; the checkpoint from before the step resumes as an uninterrupted run."""
    assert eng.stopped is not None and "different steps" in eng.stopped, eng.stopped
    with pytest.raises(EngineStateError) as refused:
        eng.save_checkpoint(str(tmp_path / "mixed"))
    message = str(refused.value)
    assert "\n" not in message and what in message and "load a checkpoint" in message, message
    assert not os.path.exists(tmp_path / "mixed")
    with pytest.raises(EngineStateError, match="different steps.*load a checkpoint"):
        _step(eng, 3)
    eng.load_checkpoint(str(tmp_path / "ck1"))
    assert eng.stopped is None
    _step(eng, 2)
    _step(eng, 3)
    _assert_same(_weights(eng), _reference(tmp_path / "ref", stage, 3))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_failed_update_of_a_middle_shard_stops_the_engine(stage: int, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The middle shard's Adam fails: the shards before it took the step, it and the rest did
    not. That step can be neither finished (the failed shard's state is not to be trusted for a
    retry) nor undone (no copy of the old state is kept), so the engine stops; it used to train
    on, and save, the two steps mixed."""
    eng = _engine(tmp_path / "run", stage)
    _step(eng, 1)
    eng.save_checkpoint(str(tmp_path / "ck1"))

    def fail() -> None:
        raise OSError("simulated kernel failure")
    _kernel_call(monkeypatch, MIDDLE, fail)
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        _step(eng, 2)
    monkeypatch.undo()
    _refuses_until_a_load(eng, tmp_path, stage, "simulated kernel failure")
    eng.close()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_an_interrupt_inside_a_middle_shards_update_stops_the_engine(stage: int, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """KeyboardInterrupt from inside the middle shard's update (its state may or may not have
    moved on): the interrupt reaches the user and the engine stops (it used to go on)."""
    eng = _engine(tmp_path / "run", stage)
    _step(eng, 1)
    eng.save_checkpoint(str(tmp_path / "ck1"))

    def interrupt() -> None:
        raise KeyboardInterrupt
    _kernel_call(monkeypatch, MIDDLE, interrupt)
    with pytest.raises(KeyboardInterrupt):
        _step(eng, 2)
    monkeypatch.undo()
    _refuses_until_a_load(eng, tmp_path, stage, "KeyboardInterrupt")
    eng.close()


def test_a_failure_before_any_shard_was_stepped_leaves_the_engine_going(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The first shard's update fails: no shard took the step, so all stand at the old one; the
    engine goes on (and saves) without a load."""
    eng = _engine(tmp_path / "run", 2)
    _step(eng, 1)

    def fail() -> None:
        raise OSError("simulated kernel failure")
    _kernel_call(monkeypatch, 1, fail)
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        _step(eng, 2)
    monkeypatch.undo()
    assert eng.stopped is None and set(eng.runtime.shard_optimizer.steps.values()) == {1}
    eng.save_checkpoint(str(tmp_path / "ck"))
    _step(eng, 2)
    _step(eng, 3)
    _assert_same(_weights(eng), _reference(tmp_path / "ref", 2, 3))
    eng.close()


class _FailsInBackward(nn.Module):
    """Two layers; backward raises at the first layer's output, after the second layer's
    gradient was handed to the (overlapped) step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.a(x)
        if self.fail:
            hidden.register_hook(_raise_in_backward)
        return self.b(hidden).pow(2).mean()


def _raise_in_backward(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("simulated backward failure")


def test_save_refuses_shards_that_stand_at_different_steps(tmp_path: Path) -> None:
    """Defence in depth: a backward that fails after the overlapped step took the last layer's
    shard leaves that shard a step ahead of the other, and the engine going (as designed). The
    save used to write that mixture; it refuses, in one line naming the shards and their steps."""
    from zero_offload.engine.state.checkpoint import CheckpointError

    eng = zero_offload.initialize(_FailsInBackward(), dict(stage=2, tiers={"optimizer": "cpu", "grads": "cpu"},
                                                          precision={"dtype": "fp32"}, bucket_bytes=WIDTH * WIDTH * 4))
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0))
    eng.backward(eng(x))
    eng.step()
    eng.module.fail = True
    with pytest.raises(RuntimeError, match="simulated backward failure"):
        eng.backward(eng(x))
    eng.module.fail = False
    steps = eng.runtime.shard_optimizer.steps
    assert len(set(steps.values())) == 2, steps  # the failed backward's overlapped step took some shards only
    assert "after the overlapped step had updated some shards" in eng.stopped
    eng.stopped = None  # as if a path left the mix without stopping: the save's own check refuses it
    with pytest.raises(CheckpointError) as refused:
        eng.save_checkpoint(str(tmp_path / "ck"))
    message = str(refused.value)
    assert "\n" not in message and "at step 2" in message and "at step 1" in message, message
    assert "load a checkpoint" in message
    assert not os.path.exists(tmp_path / "ck") and not os.path.exists(tmp_path / "ck.tmp")
    eng.close()


def _ctrl_c_on_rank_zero(rank: int, world: int, tmp: str) -> None:
    from zero_offload import comm

    patch = pytest.MonkeyPatch()
    eng = _engine(Path(tmp) / f"rank{rank}", 2)
    _step(eng, 1)
    if rank == 0:
        cond = _interrupt_main_thread_during(patch, eng, MIDDLE)
        with pytest.raises(KeyboardInterrupt):
            _step(eng, 2)
        patch.undo()
        assert cond.fired
    else:
        _step(eng, 2)
    so = eng.runtime.shard_optimizer
    assert eng.stopped is None and set(so.steps.values()) == {2}, (eng.stopped, so.steps)
    _step(eng, 3)  # every rank goes on together, from one model
    sums = comm.gather_objects(float(sum(p.detach().double().sum() for p in eng.module.parameters())))
    assert sums[0] == sums[-1], sums
    eng.close()


def test_ctrl_c_on_one_rank_finishes_the_step_there_and_every_rank_goes_on(tmp_path: Path) -> None:
    """Stage 2, D = 2, Ctrl-C on rank 0 only while its step waits: rank 0 finishes the step (and
    takes part in its all-gathers) before the interrupt reaches the user, so the ranks' compute
    copies stay one model (it used to skip rank 0's last shards and stop the engine there)."""
    from _dist import run_ranks

    run_ranks(_ctrl_c_on_rank_zero, 2, timeout=90, tmp=str(tmp_path))
