"""A forward or backward that raises part way leaves an engine that can go on (or says why not).

A backward that fails used to reduce every gradient it had not reached as zeros and step them
(momentum and weight decay with no gradient), and at stage 3 to bury the real error under a "units
still gathered" one; a forward that fails left its units gathered, holding the live budget for
good. Review findings, each reproduced before the fix.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import zero_offload
from zero_offload.engine.engine import Engine, EngineStateError, Phase

D = 16


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("simulated backward failure")


class Layer(nn.Module):
    """tanh(Linear(x)); `fail_forward` / `fail_backward` make it raise inside its own forward
    (inside its stage-3 unit) or in the backward of its output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.fail_forward = self.fail_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        if self.fail_forward:
            raise RuntimeError("simulated forward failure")
        return _Boom.apply(y) if self.fail_backward else y


class Net(nn.Module):
    """Three layers; the middle one fails on request (its backward failure comes after the
    last layer's gradients, before its own and the first layer's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = Layer(), Layer(), Layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x))).pow(2).mean()


LAYER_BYTES = 4 * (D * D + D)


def _engine(stage: int, tmp: str, **cfg: object) -> Engine:
    tiers = {"optimizer": "cpu", "grads": "cpu", **({"params": "cpu"} if stage == 3 else {})}
    base: dict = dict(stage=stage, tiers=tiers, bucket_bytes=D * D * 4, optimizer={"lr": 1e-2},
                      **({"stage3": {"unit_modules": ["Layer"], "live_budget_bytes": 3 * LAYER_BYTES}}
                         if stage == 3 else {}))
    base.update(cfg)
    return zero_offload.initialize(Net(), base)


def _batch(i: int) -> torch.Tensor:
    return torch.randn(4, D, generator=torch.Generator().manual_seed(i))


def _train(engine: Engine, steps: range) -> None:
    for i in steps:
        engine.backward(engine(_batch(i)))
        engine.step()


def _weights(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.consolidated_state_dict().items()}


@pytest.mark.parametrize("stage", [1, 3])
def test_a_loss_without_a_graph_is_refused_before_anything_moves(stage: int, tmp_path: object) -> None:
    engine = _engine(stage, str(tmp_path))
    _train(engine, range(2))
    before = _weights(engine)
    engine(_batch(2))
    with torch.no_grad():
        loss = engine(_batch(2))
    with pytest.raises(ValueError, match="the loss does not require grad"):
        engine.backward(loss)
    after = _weights(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)
    _train(engine, range(2, 3))  # the engine goes on
    engine.close()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_failed_backward_with_a_deferred_step_is_as_if_it_never_ran(stage: int, tmp_path: object) -> None:
    """With clipping every gradient waits for the step: a backward that fails part way steps
    nothing, so training on equals training without the failed micro-batch (bit for bit)."""
    failing, clean = (_engine(stage, str(tmp_path), clip_grad_norm=1.0) for _ in range(2))
    _train(failing, range(2))
    failing.module.b.fail_backward = True
    with pytest.raises(RuntimeError, match="simulated backward failure"):
        failing.backward(failing(_batch(99)))
    assert failing.phase.phase is Phase.IDLE
    assert all(p.grad is None for p in failing.module.parameters())
    failing.module.b.fail_backward = False
    _train(failing, range(2, 4))
    _train(clean, range(4))
    got, want = _weights(failing), _weights(clean)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    failing.close()
    clean.close()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_failed_backward_with_an_overlapped_step_keeps_only_what_it_stepped(stage: int, tmp_path: object) -> None:
    """Without clipping, the gradients computed before the failure were stepped at once (their
    shards move on, as after a failed step); the layer it never reached is left as it was,
    where it used to take a step of momentum and weight decay from a zero gradient. The shards
    then stand at two steps, so the engine stops until a load (it used to train on from the mix)."""
    engine = _engine(stage, str(tmp_path))
    _train(engine, range(2))
    engine.save_checkpoint(os.path.join(str(tmp_path), "ckpt"))
    before = _weights(engine)
    engine.module.b.fail_backward = True
    with pytest.raises(RuntimeError, match="simulated backward failure"):
        engine.backward(engine(_batch(99)))
    after = _weights(engine)
    assert torch.equal(after["a.fc.weight"], before["a.fc.weight"]) and torch.equal(after["a.fc.bias"], before["a.fc.bias"])
    assert not torch.equal(after["c.fc.weight"], before["c.fc.weight"])  # stepped before the failure
    engine.module.b.fail_backward = False
    with pytest.raises(EngineStateError, match="after the overlapped step had updated some shards .* at step 3"):
        engine(_batch(2))
    engine.load_checkpoint(os.path.join(str(tmp_path), "ckpt"))
    _train(engine, range(2, 4))
    assert all(torch.isfinite(v).all() for v in _weights(engine).values())
    engine.close()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_backward_failing_inside_an_accumulation_cycle_stops_the_engine_until_a_load(stage: int,
                                                                                       tmp_path: object) -> None:
    engine = _engine(stage, str(tmp_path), gradient_accumulation_steps=2)
    _train(engine, range(2))
    engine.save_checkpoint(os.path.join(str(tmp_path), "ckpt"))
    engine.module.b.fail_backward = True
    with pytest.raises(RuntimeError, match="simulated backward failure"):
        engine.backward(engine(_batch(99)))
    engine.module.b.fail_backward = False
    with pytest.raises(EngineStateError, match="a backward failed part way through a gradient-accumulation cycle"):
        engine(_batch(2))
    engine.load_checkpoint(os.path.join(str(tmp_path), "ckpt"))
    _train(engine, range(2, 4))
    engine.close()


def test_stage3_forward_that_raises_releases_its_units(tmp_path: object) -> None:
    """A budget of one layer: the unit a failed forward left gathered used to hold it for good
    ("live_budget_bytes ... is too small" on every later forward)."""
    engine, clean = (_engine(3, str(tmp_path), stage3={"unit_modules": ["Layer"], "live_budget_bytes": LAYER_BYTES})
                     for _ in range(2))
    _train(engine, range(2))
    engine.module.b.fail_forward = True
    with pytest.raises(RuntimeError, match="simulated forward failure"):
        engine(_batch(99))
    engine.module.b.fail_forward = False
    _train(engine, range(2, 4))
    _train(clean, range(4))
    got, want = _weights(engine), _weights(clean)
    assert all(torch.equal(got[k], want[k]) for k in want)
    engine.close()
    clean.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_stage3_load_into_a_trained_engine_drops_the_units_read_ahead(tier: str, tmp_path: object) -> None:
    """After a step the first units of the next pass are read ahead; a load used to leave them
    with the old values, so the first forward after it computed with the weights before the load."""
    def cfg(name: str) -> dict:
        os.makedirs(os.path.join(str(tmp_path), name))
        return dict(tiers={"optimizer": tier, "grads": "cpu", "params": tier},
                    nvme_paths=[os.path.join(str(tmp_path), name)] if tier == "nvme" else [])
    trained, fresh = _engine(3, str(tmp_path), **cfg("a")), _engine(3, str(tmp_path), **cfg("b"))
    path = os.path.join(str(tmp_path), "ckpt")
    _train(trained, range(3))
    trained.save_checkpoint(path)
    _train(trained, range(3, 6))
    trained.load_checkpoint(path)
    fresh.load_checkpoint(path)
    with torch.no_grad():
        losses = [float(e(_batch(6))) for e in (trained, fresh)]
    assert losses[0] == losses[1], losses
    trained.close()
    fresh.close()


@pytest.mark.parametrize("stage", [1, 3])
def test_an_accumulation_cycle_stops_even_when_the_step_worker_failed_too(stage: int, tmp_path: object,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's Adam failed on the boundary micro-batch and then the backward raised: the
    cleanup re-raised the worker's error before the engine could stop, and it trained on with
    partial sums holding half a micro-batch (a review of the fix)."""
    from test_step_failure import _fail_kernel_call

    engine = _engine(stage, str(tmp_path), gradient_accumulation_steps=2)
    _train(engine, range(2))
    engine.backward(engine(_batch(2)))  # micro-batch 0 of a cycle: partial sums
    engine.step()
    _fail_kernel_call(monkeypatch, 1)
    engine.module.b.fail_backward = True
    with pytest.raises(RuntimeError):
        engine.backward(engine(_batch(3)))
    monkeypatch.undo()
    engine.module.b.fail_backward = False
    with pytest.raises(EngineStateError, match="a backward failed part way through a gradient-accumulation cycle"):
        engine(_batch(4))
    engine.close()


def test_a_bucket_whose_hand_over_failed_counts_as_reduced(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its launch had taken the bucket's partial sum before the hand-over to the step raised;
    the reducer said nothing was reduced yet, and the retried boundary stepped that bucket with
    one micro-batch of two."""
    from zero_offload.engine.step.shard_optimizer import ShardOptimizer

    engine = _engine(1, str(tmp_path), gradient_accumulation_steps=2, clip_grad_norm=1.0)
    _train(engine, range(2))
    engine.backward(engine(_batch(2)))
    engine.step()
    real, calls = ShardOptimizer.grad_ready, []

    def full_drive(self: ShardOptimizer, key: str, grad: torch.Tensor, **kw: object) -> None:
        calls.append(key)
        if len(calls) == 1:
            raise OSError(28, "No space left on device (simulated)")
        real(self, key, grad, **kw)
    monkeypatch.setattr(ShardOptimizer, "grad_ready", full_drive)
    with pytest.raises(OSError, match="No space left"):
        engine.backward(engine(_batch(3)))
    monkeypatch.undo()
    with pytest.raises(EngineStateError, match="a backward failed part way"):
        engine(_batch(3))
    engine.close()


def _backward_failing_beside_a_failed_read_ahead(engine: Engine, layer: Layer, step: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`layer`'s backward raises while every read ahead of the prefetch thread fails too."""
    import threading

    from zero_offload.engine.stage3 import unit as unit_mod

    real, armed = unit_mod.Unit.fetch_local, []

    def flaky(self: unit_mod.Unit) -> None:
        if armed and threading.current_thread().name.startswith("zo-prefetch"):
            raise OSError("simulated read error on a read-ahead")
        real(self)
    monkeypatch.setattr(unit_mod.Unit, "fetch_local", flaky)
    layer.fail_backward = True
    loss = engine(_batch(step))
    armed.append(True)
    with pytest.raises((RuntimeError, OSError)):
        engine.backward(loss)
    armed.clear()
    layer.fail_backward = False
    monkeypatch.undo()


def test_stage3_cleanup_after_a_failed_backward_survives_a_failed_read_ahead(tmp_path: object,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Letting go of a unit whose read ahead failed re-raised that error before the pass was
    reset: the runtime stayed in backward, and the next training step failed with a misleading
    'needed for backward again' error (a review of the fix). overlap_step=False, so the failed
    backward stepped no shard (an overlapped one stops the engine: shards at two steps)."""
    engine = _engine(3, str(tmp_path), overlap_step=False)
    _train(engine, range(3))
    _backward_failing_beside_a_failed_read_ahead(engine, engine.module.b, 3, monkeypatch)
    assert engine.runtime.phase.value == "idle" and not engine.runtime.shard_optimizer._arrived
    _train(engine, range(4, 6))  # trains on
    assert engine.runtime.prefetcher.budget.live <= engine.runtime.prefetcher.budget.limit
    engine.close()


class _WithUnused(nn.Module):
    """Registered last, so its bucket comes first in backward order and is never ready: every
    bucket is reduced by end_backward, after autograd."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.z = nn.Module()
        self.z.unused = nn.Parameter(torch.randn(D * D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


def test_a_failure_while_the_leftover_buckets_are_reduced_is_a_failed_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """end_backward() reduces what got no gradient outside autograd: a failure there left the
    engine in BACKWARD, not stopped, and step() went on with partial sums holding part of the
    micro-batch (a review of the fix)."""
    from zero_offload.engine.step.accumulate import Accumulator

    engine = zero_offload.initialize(_WithUnused(), dict(stage=1, tiers={"optimizer": "cpu", "grads": "cpu"},
                                                         bucket_bytes=D * D * 4, gradient_accumulation_steps=2))
    real, third = Accumulator.add, engine.runtime.buckets[2].key

    def add(self: Accumulator, key: str, t: torch.Tensor, boundary: bool) -> torch.Tensor | None:
        if key == third:
            raise OSError(28, "No space left on device (simulated)")
        return real(self, key, t, boundary)
    monkeypatch.setattr(Accumulator, "add", add)
    with pytest.raises(OSError, match="No space left"):
        engine.backward(engine(_batch(0)))
    monkeypatch.undo()
    assert engine.phase.phase is Phase.IDLE
    with pytest.raises(EngineStateError, match="a backward failed part way through a gradient-accumulation cycle"):
        engine(_batch(1))
    engine.close()


def test_a_failed_boundary_step_inside_accumulation_stops_the_engine(tmp_path: object,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The failed step had taken the cycle's partial sums; the retried boundary stepped one
    micro-batch alone at half scale (a review of the fix)."""
    from test_step_failure import _fail_kernel_call

    engine = _engine(1, str(tmp_path), gradient_accumulation_steps=2, clip_grad_norm=100.0)
    _train(engine, range(2))
    engine.backward(engine(_batch(2)))
    engine.step()
    engine.backward(engine(_batch(3)))
    _fail_kernel_call(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="the optimizer step failed"):
        engine.step()
    monkeypatch.undo()
    with pytest.raises(EngineStateError, match="after taking the gradient-accumulation cycle's partial sums"):
        engine(_batch(3))
    engine.close()


def test_stage3_clean_backward_failure_with_a_failed_read_ahead_does_not_stop(tmp_path: object,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing was reduced (the last layer's backward raised first), but a read ahead that failed
    during the cleanup hid that, and the engine stopped for nothing (a review of the fix)."""
    engine = _engine(3, str(tmp_path), gradient_accumulation_steps=2)
    _train(engine, range(2))
    _backward_failing_beside_a_failed_read_ahead(engine, engine.module.c, 2, monkeypatch)
    assert engine.stopped is None
    _train(engine, range(3, 5))
    engine.close()


def test_an_interrupted_boundary_step_inside_accumulation_stops_the_engine(tmp_path: object,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Only an Exception stopped it: after a Ctrl-C in step() the next micro-batch was the
    boundary again and stepped alone at half scale (a review of the fix)."""
    from zero_offload.engine.step import pipeline as step_mod

    engine = _engine(1, str(tmp_path), gradient_accumulation_steps=2, clip_grad_norm=100.0)
    _train(engine, range(2))
    engine.backward(engine(_batch(2)))
    engine.step()
    engine.backward(engine(_batch(3)))

    def interrupted(self: object, *args: object) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(step_mod.HostAdam, "__call__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()
    with pytest.raises(EngineStateError, match="after taking the gradient-accumulation cycle's partial sums"):
        engine(_batch(3))
    engine.close()
