"""An Adam update that leaves Inf/NaN weights is an error naming the step, on every kernel path.

lr = 1e308 used to train on: the second loss was NaN and the weights non-finite, with no error.
The native kernels see it in the pass that writes the update (an OR of one compare per vector);
torch's paths (the fallback, the device tier's fused Adam) check the updated shard after it."""
from __future__ import annotations

import pytest
import torch

from adam_reference import isa_params
from zero_offload.config import Config
from zero_offload.engine.step.shard_optimizer import ShardOptimizer
from zero_offload.optim import _native_adam
from zero_offload.optim.flat import NonFiniteUpdate, adam_step_flat, adam_step_runs

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)


def _state(n: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(n)
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)


def _paths() -> list:
    """Every native ISA path (skipped where this CPU lacks it) and the torch fallback."""
    return [*isa_params(), "torch"]


def _step(path: str, monkeypatch: pytest.MonkeyPatch, *args: torch.Tensor, **kw: object) -> bool:
    if path == "torch":
        monkeypatch.setattr(_native_adam, "available", lambda: False)
        monkeypatch.setattr(_native_adam, "warn_fallback_once", lambda what: None)
        return adam_step_flat(*args, **kw)
    return adam_step_flat(*args, isa=path, **kw)


@pytest.mark.parametrize("path", _paths())
def test_lr_too_large_for_fp32_raises(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    p, g, m, v = _state(1000)
    with pytest.raises(NonFiniteUpdate, match="Inf or NaN parameter"):
        _step(path, monkeypatch, p, g, m, v, step=1, check_params=True, **{**HYPER, "lr": 1e308})


@pytest.mark.parametrize("n, at", [(5, 4), (8, 0), (1003, 1000), (1003, 1002), (70001, 33333), (70001, 70000)])
@pytest.mark.parametrize("path", _paths())
def test_one_nonfinite_weight_anywhere_is_seen(path: str, n: int, at: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a vector body, a vector tail (< 8 or 16 lanes) and another thread's block."""
    for bad in (float("inf"), float("nan")):
        p, g, m, v = _state(n)
        p[at] = bad
        with pytest.raises(NonFiniteUpdate):
            _step(path, monkeypatch, p, g, m, v, step=1, check_params=True, threads=2, **HYPER)


@pytest.mark.parametrize("n", [3, 8, 1003])
@pytest.mark.parametrize("path", _paths())
def test_finite_update_with_eps_zero_is_not_reported(path: str, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A vector tail's padding lanes compute 0/0 with eps = 0: only the real lanes count."""
    p, g, m, v = _state(n)
    g[g == 0] = 1.0
    assert _step(path, monkeypatch, p, g, m, v, step=1, check_params=True, **{**HYPER, "eps": 0.0}) is False
    assert bool(torch.isfinite(p).all())


@pytest.mark.parametrize("path", _paths())
def test_without_check_params_nothing_is_raised(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's semantics for direct callers (CPUAdam): the update is written, nothing raised."""
    p, g, m, v = _state(100)
    assert _step(path, monkeypatch, p, g, m, v, step=1, **{**HYPER, "lr": 1e308}) is False
    assert not bool(torch.isfinite(p).all())


def test_runs_raise_once_every_run_is_stepped() -> None:
    p, g, m, v = _state(200)
    runs = [(0, 100, {**HYPER, "grad_scale": 1.0}), (100, 200, {**HYPER, "lr": 1e308, "grad_scale": 1.0})]
    with pytest.raises(NonFiniteUpdate, match="adam_step_runs"):
        adam_step_runs(p, g, m, v, runs, step=1, check_params=True)
    assert bool(torch.isfinite(p[:100]).all()) and not bool(torch.isfinite(p[100:]).all())


@pytest.mark.parametrize("tier", ["device", "cpu", "nvme"])
def test_engine_step_names_the_step_and_hands_nothing_over(tier: str, tmp_path: object) -> None:
    """fp32 too (there is no loss scaler to catch it). The first step is finite; the second's lr
    overflows fp32: its error names step 2 and the shard, the step count stays 1; on the nvme
    tier the drive keeps step 1's state."""
    grads = "device" if tier == "device" else "cpu"
    cfg = Config(stage=1, tiers={"optimizer": tier, "grads": grads}, nvme_paths=(str(tmp_path),),
                 optimizer={"lr": 1e-3, "weight_decay": 0.0})
    opt = ShardOptimizer(cfg, torch.device("cpu"), capacity_bytes=1 << 20)
    opt.add_shard("s", torch.ones(64))
    opt.grad_ready("s", torch.ones(64))
    assert opt.finish_step() is True
    after_one = opt.master("s").clone()
    for group in opt.optimizer.param_groups:
        group["lr"] = 1e308
    with pytest.raises((RuntimeError, NonFiniteUpdate), match=r"step 2: the Adam update of optimizer shard 's' "
                                                              r"left Inf or NaN weights \(lr 1e\+308"):
        try:  # the device tier steps inline, as the gradient arrives (in backward)
            opt.grad_ready("s", torch.ones(64))
        except NonFiniteUpdate:
            opt.abandon_step()
            raise
        opt.finish_step()
    assert opt.steps["s"] == 1
    if tier == "nvme":
        assert torch.equal(opt.master("s"), after_one)
    opt.close()


@pytest.mark.parametrize("tier", ["device", "cpu"])
def test_engine_with_an_lr_of_1e308_fails_at_step_one(tier: str) -> None:
    """The reproduction: before, both steps ran and the second loss was NaN."""
    import zero_offload

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    cfg = {"stage": 0, "tiers": {"optimizer": tier, "grads": "device" if tier == "device" else "cpu"},
           "optimizer": {"lr": 1e308}}
    engine = zero_offload.initialize(model, cfg)
    x = torch.randn(4, 8)
    with pytest.raises(Exception, match=r"step 1: the Adam update of optimizer shard .* left Inf or NaN weights"):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    engine.close()
